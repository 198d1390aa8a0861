"""Every private API of `torch.distributed.pipelining` that pipekit uses (read from torch 2.13.0).

The sliced schedule is an action list run by torch's own `_PipelineScheduleRuntime`, which
lowers compute-only lists into lists with the sends and receives (so pairs cannot deadlock), adds
FSDP unshard/reshard and gradient-reduction actions, and executes them. A torch upgrade that moves
or changes one of these touches this file only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    FULL_BACKWARD,
    SEND_B,
    SEND_F,
    PipelineScheduleSingle,
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
    "INPUT_BACKWARD",
    "WEIGHT_BACKWARD",
    "Action",
    "ComputationType",
    "PipelineSchedule",
    "PipelineScheduleRuntime",
    "ReceiveBuffersHook",
    "get_schedule_class",
    "insert_after_compute",
    "is_single_stage_schedule",
    "lower_schedule",
    "lower_to_comms",
    "register_action_function",
    "resize_receive_buffers",
    "run_units",
    "stage_saved_inputs",
    "validate_actions",
]

Action = _Action
"""`(stage_index, computation_type, microbatch_index)`; prints as e.g. `2F5` (torch's CSV form)."""

ComputationType = _ComputationType
FORWARD = _ComputationType.FORWARD
BACKWARD = FULL_BACKWARD
INPUT_BACKWARD = _ComputationType.BACKWARD_INPUT
WEIGHT_BACKWARD = _ComputationType.BACKWARD_WEIGHT

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


def is_single_stage_schedule(schedule_class: type) -> bool:
    """Whether torch's schedule class runs one stage per rank (GPipe, 1F1B): its constructor
    takes one stage and its `pipeline_order` only describes its hand-written loop."""
    return issubclass(schedule_class, PipelineScheduleSingle)


def run_units(
    schedule: _PipelineSchedule,
    arg_units: list[tuple],
    kwarg_units: list[dict[str, Any]],
    targets: list | None,
    losses: list,
    loss_kwargs: dict[str, Any],
) -> None:
    """Run one step of `schedule` on pre-split units (torch's `step()` can only split along the
    batch dim, not into microbatches x slices); the last stage's losses land in `losses`."""
    schedule._step_microbatches(
        arg_units, kwarg_units, targets, losses, return_outputs=False, loss_kwargs=loss_kwargs
    )


def stage_saved_inputs(stage: PipelineStage, unit: int) -> list[Any]:
    """The inputs (received activations and kwargs) a stage keeps for a unit's backward."""
    if unit not in stage.fwd_cache:
        return []
    _, input_values = stage.fwd_cache[unit]
    return list(input_values)


def insert_after_compute(
    lowered: Sequence[Action], extra: Sequence[tuple[int, Action]]
) -> list[Action]:
    """`lowered` (one rank's list with sends and receives) with each `(k, action)` of `extra`
    placed after the rank's k-th compute action and the sends that follow it, so everything
    computed before `action` has been handed to its receivers. `extra` is in list order."""
    result: list[Action] = []
    pending = list(extra)
    computed = 0
    for index, action in enumerate(lowered):
        while pending and pending[0][0] == computed and _sends_done(lowered, index):
            result.append(pending.pop(0)[1])
        result.append(action)
        computed += action.is_compute_op
    result += [action for _, action in pending]
    return result


def _sends_done(lowered: Sequence[Action], index: int) -> bool:
    """Whether `lowered[index]` is not a send (torch's lowering puts a compute action's sends
    right after it, so the first non-send ends them)."""
    return lowered[index].computation_type not in (SEND_F, SEND_B)


def register_action_function(
    schedule: _PipelineScheduleRuntime,
    computation_type: Any,
    function: Callable[[Action, Any], None],
) -> None:
    """Run `function(action, context)` for actions of a pipekit-defined `computation_type`
    (torch's public `register_custom_function` accepts only torch's own types)."""
    schedule._comp_type_to_function_map[computation_type] = function


def resize_receive_buffers(stage: PipelineStage, tokens_of_unit: Callable[[int], int]) -> None:
    """Give every unit's activation and gradient receive buffers `tokens_of_unit(unit)` tokens
    along dim 1 (torch sizes them all from the stage's one set of metas). Call after torch
    prepared the stage's infrastructure (`_prepare_forward_infra`, `_prepare_backward_infra`);
    buffers are plain tensors, which is what `StageShapes` declares."""
    for infos_by_unit in (stage.args_recv_info, stage.grad_recv_info):
        for unit, infos in infos_by_unit.items():
            tokens = tokens_of_unit(unit)
            for info in infos:
                buffer = info.buffer
                if buffer is not None and buffer.shape[1] != tokens:
                    info.buffer = buffer.new_empty((buffer.shape[0], tokens, *buffer.shape[2:]))


def lower_schedule(
    schedule: _PipelineScheduleRuntime,
    actions: dict[int, list[Action]],
    extra: dict[int, list[tuple[int, Action]]],
) -> None:
    """Give `schedule` its compute lists `actions` lowered with sends, receives and FSDP actions
    (`_prepare_schedule_with_comms`), then each rank's `extra` actions placed in the lowered list
    (`insert_after_compute`; `pipeline_order_with_comms` is what the runtime executes)."""
    schedule._prepare_schedule_with_comms(actions)
    for rank, placed in extra.items():
        if placed:
            lowered = schedule.pipeline_order_with_comms[rank]
            schedule.pipeline_order_with_comms[rank] = insert_after_compute(lowered, placed)


class ReceiveBuffersHook(PipelineStage):
    """A `PipelineStage` told when torch has prepared its receive buffers (`_prepare_forward_infra`
    and `_prepare_backward_infra`), so a subclass can resize them (`after_receive_buffers`)."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_forward_infra(*args, **kwargs)
        self.after_receive_buffers()
        return prepared

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._prepare_backward_infra(*args, **kwargs)
        self.after_receive_buffers()
        return prepared

    def after_receive_buffers(self) -> None:
        """Called after each preparation; nothing by default."""
