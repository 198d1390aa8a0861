"""Every private API of `torch.distributed.pipelining` that pipekit uses (read from torch 2.13.0).

The sliced schedule is an action list run by torch's own `_PipelineScheduleRuntime`, which
lowers compute-only lists into lists with the sends and receives (so pairs cannot deadlock), adds
FSDP unshard/reshard and gradient-reduction actions, and executes them. A torch upgrade that moves
or changes one of these touches this file only.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import (
    FULL_BACKWARD,
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    _validate_schedule,
    get_schedule_class,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "Action",
    "ComputationType",
    "PipelineSchedule",
    "PipelineScheduleRuntime",
    "get_schedule_class",
    "lower_to_comms",
    "validate_actions",
]

Action = _Action
"""`(stage_index, computation_type, microbatch_index)`; prints as e.g. `2F5` (torch's CSV form)."""

ComputationType = _ComputationType
FORWARD = _ComputationType.FORWARD
BACKWARD = FULL_BACKWARD

PipelineSchedule = _PipelineSchedule
"""Base of every torch schedule; pipekit drives its `_step_microbatches` with pre-split units."""

PipelineScheduleRuntime = _PipelineScheduleRuntime
"""Runs per-rank action lists; subclasses set `pipeline_order` and call
`_prepare_schedule_with_comms`, then drive `_step_microbatches` with pre-split inputs."""

lower_to_comms = _add_send_recv
"""`(actions_by_rank, stage_to_rank, num_stages) -> actions with SEND/RECV`; raises if the
compute lists cannot be ordered without a rank waiting forever."""

validate_actions = _validate_schedule
"""`(actions_by_rank, num_ranks, num_stages, num_microbatches) -> stage_to_rank`; torch's check
that every (stage, microbatch) has one F and one B (or I then W), raising `AssertionError`."""
