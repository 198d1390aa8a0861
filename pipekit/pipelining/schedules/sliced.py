"""SlimPipe's per-rank action lists (§4.1, Figs. 4 and 5), as a pure function.

The unit of work is one slice of one microbatch (`pipekit.pipelining.schedules.units`). On
every rank:

- forwards run in unit order: slice 0, 1, ... of microbatch 0, then microbatch 1, ...; with `v`
  stages per rank (interleaved form) they go in groups of `p` slices, each group through the
  rank's stages in turn, as interleaved 1F1B does with microbatches;
- a sequence's slices go backward in reverse order (last slice first; in the interleaved form,
  the last group first, each group through the stages from last to first), so a slice's KV-cache
  gradient is complete when its own backward runs and its chunk can be freed right after;
- rank r runs `v*n + 2*(p-1-r)` forwards before its first backward, then alternates backward and
  forward, then drains the backwards. The extra `2*(p-1-r)` forwards align the forward passes of
  all ranks with each other (and the backward passes with each other), which is what attention
  context exchange and vocabulary parallelism rely on.

Rank r then holds at most `v*n + 2*(p-1-r)` units of activations, each `1/(v*n)` of a
microbatch on that rank: `(1 + 2*(p-1)/(v*n)) / p` of 1F1B's peak on rank 0 (SlimPipe Eq. 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipekit.pipelining.actions import BACKWARD, FORWARD, Action
from pipekit.pipelining.schedules.units import unit_index

__all__ = [
    "check_sliced_shape",
    "peak_units_in_flight",
    "sliced_pipeline_actions",
    "sliced_warmup_forwards",
]


def check_sliced_shape(
    num_ranks: int, num_microbatches: int, num_slices: int, stages_per_rank: int = 1
) -> None:
    """ValueError (naming the fix) unless all counts are >= 1 and n is a multiple of p."""
    for name, value in (
        ("pipeline_parallel_degree", num_ranks),
        ("microbatches", num_microbatches),
        ("num_slices", num_slices),
        ("stages_per_rank", stages_per_rank),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if num_slices % num_ranks:
        lower = max(num_ranks, num_slices // num_ranks * num_ranks)
        raise ValueError(
            f"num_slices={num_slices} must be a multiple of pipeline_parallel_degree={num_ranks} "
            f"(SlimPipe §4.1.2); try {lower} or {lower + num_ranks}"
        )


def sliced_warmup_forwards(
    rank: int, num_ranks: int, num_microbatches: int, num_slices: int, stages_per_rank: int = 1
) -> int:
    """Forwards rank `rank` runs before its first backward: `v*n + 2*(p-1-rank)`, capped by the
    number of forwards it has."""
    check_sliced_shape(num_ranks, num_microbatches, num_slices, stages_per_rank)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank} is not in 0..{num_ranks - 1}")
    total = stages_per_rank * num_microbatches * num_slices
    return min(stages_per_rank * num_slices + 2 * (num_ranks - 1 - rank), total)


def _forward_order(
    rank: int, num_ranks: int, num_microbatches: int, num_slices: int, stages_per_rank: int
) -> list[Action]:
    actions = []
    for group_start in range(0, num_microbatches * num_slices, num_ranks):
        for chunk in range(stages_per_rank):
            stage = chunk * num_ranks + rank
            for unit in range(group_start, group_start + num_ranks):
                actions.append(Action(stage, FORWARD, unit))
    if stages_per_rank == 1:  # groups are only needed to interleave stages
        actions.sort(key=lambda action: action.microbatch_index)
    return actions


def _backward_order(
    rank: int, num_ranks: int, num_microbatches: int, num_slices: int, stages_per_rank: int
) -> list[Action]:
    actions = []
    for microbatch in range(num_microbatches):
        for group_end in range(num_slices, 0, -num_ranks):
            for chunk in reversed(range(stages_per_rank)):
                stage = chunk * num_ranks + rank
                for slice_index in reversed(range(group_end - num_ranks, group_end)):
                    unit = unit_index(microbatch, slice_index, num_slices)
                    actions.append(Action(stage, BACKWARD, unit))
    return actions


def sliced_pipeline_actions(
    num_ranks: int, num_microbatches: int, num_slices: int, stages_per_rank: int = 1
) -> dict[int, list[Action]]:
    """Compute-only action lists, by rank, of the sliced 1F1B schedule (interleaved if v > 1).

    Stages are placed looped: stage `chunk * num_ranks + rank` runs on `rank`. Action
    microbatch indices are units (`unit_index`).
    """
    check_sliced_shape(num_ranks, num_microbatches, num_slices, stages_per_rank)
    shape = (num_ranks, num_microbatches, num_slices, stages_per_rank)
    by_rank: dict[int, list[Action]] = {}
    for rank in range(num_ranks):
        forwards = _forward_order(rank, *shape)
        backwards = _backward_order(rank, *shape)
        warmup = sliced_warmup_forwards(rank, *shape)
        actions = forwards[:warmup]
        for index, backward in enumerate(backwards):
            actions.append(backward)
            if warmup + index < len(forwards):
                actions.append(forwards[warmup + index])
        by_rank[rank] = actions
    return by_rank


def peak_units_in_flight(actions: Sequence[Action | None]) -> int:
    """Most units whose forward has run and backward has not, over one rank's list."""
    in_flight = peak = 0
    for action in actions:
        if action is None:
            continue
        if action.computation_type == FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.computation_type == BACKWARD:
            in_flight -= 1
    return peak
