"""Where a sequence is cut into slices: equal lengths (SlimPipe) or equal costs.

Under causal attention, the tokens `[a, b)` of a sequence of length L cost `(b - a) / L` of the
sequence's linear work (projections, MLP) and `(b² - a²) / L²` of its attention work, as the
simulator's `CostModel` counts them: token t attends to t earlier tokens. With equal-length
slices the last of n has `2n - 1` times the first one's attention, and in a pipeline the ranks
running the later slices make the others wait. Equal-cost slicing instead cuts where the
cumulative cost `x + r·x²` (x the fraction of the sequence, r attention over linear work)
reaches `j / n` of its total, so every slice costs the same: the early slices get more tokens,
the late ones fewer.

Bounds are rounded to `granularity` tokens (attention kernels' block size, the sequence-parallel
ranks' share), so each slice is within one granule of equal cost.

Packed documents break the single-sequence formula: a token's attention work is the keys its
document lets it see. `cost_slice_bounds` cuts any per-token cost instead (a batch's
`pipekit.attention.work.token_costs`, summed over the rows that share the slices), and
`minimax_slice_bounds` any cost of a whole slice, for a tiled kernel whose slice costs depend on
where the earlier slices start (`pipekit.attention.work.SlicedTileKeys`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "MEASURED_SLICINGS",
    "SLICINGS",
    "cost_slice_bounds",
    "equal_cost_fractions",
    "minimax_slice_bounds",
    "slice_bounds",
]

SLICINGS = ("equal_length", "equal_cost", "documents")
"""How a sequence is cut (the `[parallelism] slicing` setting). "documents" cuts each
microbatch by its own batch's attention work (`cost_slice_bounds`); for one causal sequence, the
planning shape, it is "equal_cost"."""

MEASURED_SLICINGS = ("equal_length", "equal_cost")
"""The cuts `slicing = "auto"` times."""


def slice_bounds(
    seq_len: int,
    num_slices: int,
    slicing: str = "equal_length",
    attention_to_linear: float = 0.0,
    granularity: int = 1,
) -> tuple[int, ...]:
    """The `num_slices + 1` token offsets of a sequence's slices, from 0 to `seq_len`.

    "equal_length" cuts every `seq_len / num_slices` tokens; "equal_cost" (and "documents",
    for one causal sequence) cuts where every slice's linear plus attention work is the same
    (`attention_to_linear`: the whole sequence's causal-attention forward work over its linear
    work), rounded to multiples of `granularity`.
    """
    if slicing not in SLICINGS:
        raise ValueError(f"slicing={slicing!r} is not one of {', '.join(SLICINGS)}")
    if num_slices < 1 or seq_len % num_slices:
        raise ValueError(
            f"seq_len={seq_len} does not split into num_slices={num_slices} slices; choose "
            "num_slices dividing seq_len"
        )
    if slicing == "equal_length":
        step = seq_len // num_slices
        return tuple(index * step for index in range(num_slices + 1))
    if granularity < 1 or (seq_len // num_slices) % granularity:
        raise ValueError(
            f"equal-cost slices of a {seq_len}-token sequence cut in {num_slices} round to "
            f"granularity={granularity} tokens, which must divide seq_len / num_slices"
        )
    if attention_to_linear < 0:
        raise ValueError(f"attention_to_linear={attention_to_linear} must be >= 0")
    granules = seq_len // granularity
    share = attention_to_linear / (1 + attention_to_linear)
    fractions = equal_cost_fractions(num_slices, share)
    bounds = [0]
    for index in range(1, num_slices):
        lowest = bounds[-1] + 1  # every slice keeps at least one granule
        highest = granules - (num_slices - index)
        bounds.append(min(max(round(fractions[index] * granules), lowest), highest))
    bounds.append(granules)
    return tuple(bound * granularity for bound in bounds)


def equal_cost_fractions(num_slices: int, attention_share: float) -> tuple[float, ...]:
    """Unrounded equal-cost bounds as fractions of the sequence, 0 to 1, when causal attention
    is `attention_share` (0 to 1) of the whole sequence's work: the x where the cost of the
    first x of the sequence, `(1 - a)·x + a·x²`, reaches j / n."""
    if not 0 <= attention_share <= 1:
        raise ValueError(f"attention_share={attention_share} must be between 0 and 1")
    a = attention_share
    fractions = []
    for index in range(num_slices + 1):
        cost = index / num_slices
        if a == 0:
            fractions.append(cost)
        else:  # the root in [0, 1] of a·x² + (1 - a)·x - cost
            fractions.append((math.sqrt((1 - a) ** 2 + 4 * a * cost) - (1 - a)) / (2 * a))
    return tuple(fractions)


def cost_slice_bounds(cost_S: Tensor, num_slices: int, granularity: int = 1) -> tuple[int, ...]:
    """The `num_slices + 1` token offsets that cut a sequence whose tokens cost `cost_S` into
    slices of equal total cost, each bound on a multiple of `granularity` tokens, each slice at
    least one granule: bound j is the granule edge whose cumulative cost is nearest j / n of the
    total."""
    if cost_S.dim() != 1:
        raise ValueError(f"cost_S must be one cost per token, got shape {tuple(cost_S.shape)}")
    length = cost_S.shape[0]
    if granularity < 1 or length % granularity or length // granularity < num_slices:
        raise ValueError(
            f"{length} tokens do not split into num_slices={num_slices} slices of whole "
            f"granules of {granularity} tokens; choose a granularity dividing the length and at "
            "most length / num_slices"
        )
    if (cost_S < 0).any():
        raise ValueError("token costs must be >= 0")
    granules = length // granularity
    cumulative_G = torch.cat(
        [cost_S.new_zeros(1), cost_S.to(torch.float64).view(granules, granularity).sum(1).cumsum(0)]
    )
    total = float(cumulative_G[-1])
    bounds = [0]
    for index in range(1, num_slices):
        target = total * index / num_slices
        above = int(torch.searchsorted(cumulative_G, torch.tensor([target], dtype=torch.float64)))
        nearest = min(
            (edge for edge in (above - 1, above) if 0 <= edge <= granules),
            key=lambda edge: abs(float(cumulative_G[edge]) - target),
        )
        lowest, highest = bounds[-1] + 1, granules - (num_slices - index)
        bounds.append(min(max(nearest, lowest), highest))
    bounds.append(granules)
    return tuple(bound * granularity for bound in bounds)


SliceCost = Callable[[int, int, Sequence[int]], float]
"""The cost of the slice `[start, end)` when the slices before it are cut at the given bounds
(0 up to `start`)."""


def _cut_at_budget(
    slice_cost: SliceCost, granules: int, num_slices: int, granularity: int, budget: float
) -> tuple[list[int], list[float]]:
    """Each slice but the last ends at the granule edge whose cost is nearest `budget` (at
    least one granule, leaving one for each later slice); the bounds, in granules, and every
    slice's cost."""
    bounds, costs = [0], []
    for index in range(1, num_slices):
        start, earlier = bounds[-1] * granularity, [bound * granularity for bound in bounds]
        low, high = bounds[-1] + 1, granules - (num_slices - index)
        while low < high:  # the longest slice within budget (cost rises with the end)
            middle = (low + high + 1) // 2
            if slice_cost(start, middle * granularity, earlier) <= budget:
                low = middle
            else:
                high = middle - 1
        candidates = [(slice_cost(start, end * granularity, earlier), end)
                      for end in {low, min(low + 1, high)}]  # fmt: skip
        cost, end = min(candidates, key=lambda pair: (abs(pair[0] - budget), pair[1]))
        bounds.append(end)
        costs.append(cost)
    earlier = [bound * granularity for bound in bounds]
    costs.append(slice_cost(bounds[-1] * granularity, granules * granularity, earlier))
    bounds.append(granules)
    return bounds, costs


def minimax_slice_bounds(
    slice_cost: SliceCost,
    seq_len: int,
    num_slices: int,
    granularity: int = 1,
    budgets: int = 64,
) -> tuple[int, ...]:
    """The `num_slices + 1` token offsets, on multiples of `granularity`, of slices of about
    equal cost: for each of `budgets` budgets from 0.95x to 1.25x the mean slice cost, every
    slice but the last ends nearest the budget, and the cut whose costliest slice is cheapest
    is kept. A scan, not a bisection: a slice's cost jumps with the tiles of the slices before
    it, so the last slice's cost is not monotone in the budget. For costs that are not sums
    over tokens; `slice_cost` must rise with a slice's end. Deterministic."""
    if granularity < 1 or seq_len % granularity or seq_len // granularity < num_slices:
        raise ValueError(
            f"{seq_len} tokens do not split into num_slices={num_slices} slices of whole "
            f"granules of {granularity} tokens; choose a granularity dividing the length and at "
            "most length / num_slices"
        )
    granules = seq_len // granularity
    unbounded, costs = _cut_at_budget(slice_cost, granules, num_slices, granularity, math.inf)
    mean, best = sum(costs) / num_slices, (max(costs), unbounded)
    for step in range(budgets):
        budget = mean * (0.95 + 0.3 * step / max(budgets - 1, 1))
        bounds, costs = _cut_at_budget(slice_cost, granules, num_slices, granularity, budget)
        best = min(best, (max(costs), bounds))
    return tuple(bound * granularity for bound in best[1])
