"""Which units a rank offloads, where each comes back, and the ratio that evens the ranks out.

Pure: compute-only action lists in, decisions out, so the memory plan and the runtime agree.

A unit (a stage's microbatch or slice) whose forward runs at compute action f and whose backward
at b is offloaded right after its forward when at least one whole action runs while it is away
and one more hides its return: b - f >= 3. It comes back one action ahead of its backward
(a `RELOAD` action before action b - 1: on CUDA the copy overlaps that action). The unit whose
backward is next, and every unit of a stage whose backward follows its forward at once (the
last stage's last slice), stays.

`resident_peak` replays a list in units of one unit's movable activations: a forward adds 1,
an offload takes `ratio` of it away, a reload brings it back, a backward (or a split
backward's weight part) frees it. The earlier a rank's stages, the more units it holds at its
peak; "auto" gives each rank the smallest ratio that brings its peak down to the least loaded
rank's peak without offload (the last rank's, in the sliced and 1F1B schedules).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from pipekit.pipelining.actions import BACKWARD, FORWARD, INPUT_BACKWARD, WEIGHT_BACKWARD, Action

__all__ = [
    "RELOAD",
    "OffloadComputation",
    "RankOffload",
    "auto_offload_ratios",
    "plan_rank_offload",
    "resident_peak",
    "resolve_offload_ratios",
]


class OffloadComputation(str, Enum):
    """pipekit's action type for a prefetch: `Action(stage, RELOAD, unit)`."""

    RELOAD = "RLD"


RELOAD = OffloadComputation.RELOAD

_MIN_DISTANCE = 3  # b - f: one action runs while the unit is away, one hides its return


@dataclass(frozen=True)
class RankOffload:
    """One rank's offload decisions."""

    ratio: float
    """Share of each offloaded unit's movable activations moved off the device."""
    offloaded: frozenset[tuple[int, int]]
    """(stage, unit) of the units offloaded after their forward."""
    reloads: list[tuple[int, Action]]
    """`(k, Action(stage, RELOAD, unit))`: bring the unit back after k compute actions."""


def _compute(actions: Sequence[Action | None]) -> list[Action]:
    return [action for action in actions if action is not None]


def plan_rank_offload(actions: Sequence[Action | None], ratio: float) -> RankOffload:
    """The units of one rank's compute list to offload at `ratio`, and their reloads."""
    compute = _compute(actions)
    forward_at: dict[tuple[int, int], int] = {}
    reloads: list[tuple[int, Action]] = []
    for index, action in enumerate(compute):
        key = (action.stage_index, action.microbatch_index)
        if action.computation_type == FORWARD:
            forward_at[key] = index
        elif (
            action.computation_type in (BACKWARD, INPUT_BACKWARD)
            and ratio > 0
            and index - forward_at.get(key, index) >= _MIN_DISTANCE
        ):
            reloads.append((index - 1, Action(key[0], RELOAD, key[1])))
    reloads.sort(key=lambda entry: entry[0])  # stable: backward order within one position
    offloaded = frozenset((a.stage_index, a.microbatch_index) for _, a in reloads)
    return RankOffload(ratio, offloaded, reloads)


def resident_peak(actions: Sequence[Action | None], ratio: float) -> float:
    """Most units' worth of movable activations on the device at once, offloading at `ratio`."""
    compute = _compute(actions)
    plan = plan_rank_offload(compute, ratio)
    reload_before: dict[int, list[tuple[int, int]]] = {}
    for position, action in plan.reloads:
        reload_before.setdefault(position, []).append((action.stage_index, action.microbatch_index))
    resident: dict[tuple[int, int], float] = {}
    peak = 0.0
    for index, action in enumerate(compute):
        for key in reload_before.get(index, ()):
            resident[key] = 1.0
        key = (action.stage_index, action.microbatch_index)
        kind = action.computation_type
        if kind == FORWARD:
            resident[key] = 1.0
            peak = max(peak, sum(resident.values()))
            if key in plan.offloaded:
                resident[key] = 1.0 - ratio
        elif kind in (BACKWARD, INPUT_BACKWARD, WEIGHT_BACKWARD):
            peak = max(peak, sum(resident.values()))
            if kind != INPUT_BACKWARD:  # a split backward keeps them for its weight part
                resident.pop(key, None)
    return peak


def auto_offload_ratios(actions_by_rank: Mapping[int, Sequence[Action | None]]) -> list[float]:
    """Per rank, the smallest ratio whose peak is the least loaded rank's peak without offload
    (to 1e-3, rounded up); 1 where no ratio gets there (under 1F1B a rank always holds the
    unit it runs and the one coming back)."""
    target = min(resident_peak(actions, 0.0) for actions in actions_by_rank.values())
    ratios = []
    for rank in sorted(actions_by_rank):
        actions = actions_by_rank[rank]
        if resident_peak(actions, 0.0) <= target:
            ratios.append(0.0)
            continue
        low, high = 0.0, 1.0
        while high - low > 1e-3:
            middle = (low + high) / 2
            low, high = (middle, high) if resident_peak(actions, middle) > target else (low, middle)
        ratios.append(round(high, 3))
    return ratios


def resolve_offload_ratios(
    setting: float | list[float] | str, actions_by_rank: Mapping[int, Sequence[Action | None]]
) -> tuple[float, ...]:
    """One ratio per pipeline rank from `parallelism.activation_offload` (a number, one per
    rank, or "auto"); () when nothing is offloaded. ValueError names the fix."""
    num_ranks = len(actions_by_rank)
    if setting == "auto":
        ratios = auto_offload_ratios(actions_by_rank)
    elif isinstance(setting, str):
        raise ValueError(
            f"activation_offload={setting!r} must be a number in [0, 1], one per pipeline rank, "
            'or "auto"'
        )
    elif isinstance(setting, list):
        if len(setting) != num_ranks:
            raise ValueError(
                f"activation_offload has {len(setting)} ratios for {num_ranks} pipeline ranks; "
                "give one per rank, or one number for all"
            )
        ratios = list(setting)
    else:
        ratios = [float(setting)] * num_ranks
    for rank, ratio in enumerate(ratios):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(
                f"activation_offload={ratio} for pipeline rank {rank} must be in [0, 1] (the "
                "share of each offloaded unit's activations moved off the device)"
            )
    return tuple(ratios) if any(ratios) else ()
