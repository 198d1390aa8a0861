"""The compute-only action lists of torch's schedules, computed without a process group.

Every multi-stage torch schedule computes the lists of all ranks in its constructor
(`pipeline_order`), from nothing but its stages' counts and ranks; placeholder stages carrying
those counts let us read them on one process, to simulate, check or draw them. The single-stage
schedules (GPipe, 1F1B) run a hand-written loop (`_step_microbatches`) instead, and their
`pipeline_order` is only a description, which for 1F1B in torch 2.13 numbers the last rank's
forwards from 1 and fails torch's own validation; for those two we spell out the loop's order.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.pipelining._torch_runtime import get_schedule_class, is_single_stage_schedule
from pipekit.pipelining.actions import INPUT_BACKWARD, WEIGHT_BACKWARD, Action, ComputationType

__all__ = ["COMPUTE_TYPES", "compute_actions", "torch_schedule_actions"]

COMPUTE_TYPES = (
    ComputationType.FORWARD,
    ComputationType.FULL_BACKWARD,
    INPUT_BACKWARD,
    WEIGHT_BACKWARD,
)
"""F, B, I, W: the actions that run a stage (the rest move tensors or reduce gradients)."""


@dataclass
class _PlaceholderStage:
    """What a torch schedule's constructor reads of a stage; it runs nothing."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: None = None
    stage_index_to_group_rank: dict[int, int] | None = None


def compute_actions(actions: list[Action | None]) -> list[Action]:
    """One rank's F, B, I and W actions in order: idle steps (None), communication and
    gradient reduction dropped, overlapped F+B actions (DualPipeV) split into their parts."""
    computes = []
    for action in actions:
        if action is None:
            continue
        parts = action.sub_actions if action.sub_actions is not None else (action,)
        computes.extend(part for part in parts if part.computation_type in COMPUTE_TYPES)
    return computes


def torch_schedule_actions(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
) -> dict[int, list[Action]]:
    """Compute-only action lists, by rank, of torch's schedule class `name`, with stages placed
    as the schedule places them (its rules are in `schedules.registry`)."""
    if num_ranks < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_ranks={num_ranks} and num_microbatches={num_microbatches} must be at least 1"
        )
    schedule_class = get_schedule_class(name)
    if is_single_stage_schedule(schedule_class):
        return _single_stage_actions(name, num_ranks, num_microbatches)
    num_stages = num_ranks * stages_per_rank
    stages = [
        _PlaceholderStage(
            stage_index=chunk * num_ranks, num_stages=num_stages, group_size=num_ranks
        )
        for chunk in range(stages_per_rank)
    ]
    schedule = schedule_class(stages, num_microbatches)
    return {rank: compute_actions(schedule.pipeline_order[rank]) for rank in range(num_ranks)}


def _single_stage_actions(
    name: str, num_ranks: int, num_microbatches: int
) -> dict[int, list[Action]]:
    """The order in which `ScheduleGPipe` / `Schedule1F1B._step_microbatches` run their stage."""
    if name == "1F1B" and num_microbatches < num_ranks:
        raise ValueError(
            f"schedule='1F1B' needs num_microbatches={num_microbatches} >= num_ranks={num_ranks}"
        )
    by_rank = {}
    for rank in range(num_ranks):
        forwards = [Action(rank, ComputationType.FORWARD, mb) for mb in range(num_microbatches)]
        backwards = [
            Action(rank, ComputationType.FULL_BACKWARD, mb) for mb in range(num_microbatches)
        ]
        if name == "GPipe":
            by_rank[rank] = forwards + backwards
            continue
        warmup = min(num_microbatches, num_ranks - rank)  # rank r runs p - r forwards first
        actions = forwards[:warmup]
        for index, backward in enumerate(backwards):
            actions.append(backward)
            if warmup + index < num_microbatches:
                actions.append(forwards[warmup + index])
        by_rank[rank] = actions
    return by_rank
