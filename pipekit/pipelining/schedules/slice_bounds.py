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
"""

from __future__ import annotations

import math

__all__ = ["SLICINGS", "equal_cost_fractions", "slice_bounds"]

SLICINGS = ("equal_length", "equal_cost")
"""How `slice_bounds` cuts a sequence (the `[parallelism] slicing` setting)."""


def slice_bounds(
    seq_len: int,
    num_slices: int,
    slicing: str = "equal_length",
    attention_to_linear: float = 0.0,
    granularity: int = 1,
) -> tuple[int, ...]:
    """The `num_slices + 1` token offsets of a sequence's slices, from 0 to `seq_len`.

    "equal_length" cuts every `seq_len / num_slices` tokens; "equal_cost" cuts where every
    slice's linear plus attention work is the same (`attention_to_linear`: the whole sequence's
    causal-attention forward work over its linear work), rounded to multiples of
    `granularity`.
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
