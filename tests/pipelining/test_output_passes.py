"""Output passes (vocabulary parallelism) are placed so that no rank waits forever, for the
sliced schedule over many shapes and for torch's schedules; a misplaced pass is caught."""

from __future__ import annotations

import itertools

import pytest

from pipekit.pipelining._torch_runtime import insert_after_compute
from pipekit.pipelining.actions import FORWARD, Action, ComputationType
from pipekit.pipelining.features.output_passes import (
    OUTPUT_PASS,
    check_output_passes,
    output_pass_positions,
    with_output_passes,
)
from pipekit.pipelining.schedules.simulate import ScheduleDeadlockError
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions


def _passes_in_order(placed: dict[int, list[Action]], num_units: int) -> None:
    for actions in placed.values():
        units = [a.microbatch_index for a in actions if a.computation_type == OUTPUT_PASS]
        assert units == list(range(num_units))


@pytest.mark.parametrize(
    ("p", "n", "m", "v"),
    [
        (p, n, m, v)
        for p, m, v in itertools.product((2, 3, 4), (1, 2, 3), (1, 2))
        for n in (p, 2 * p, 4 * p)
    ],
)
def test_sliced_schedules_get_deadlock_free_passes_in_unit_order(p, n, m, v) -> None:
    placed = with_output_passes(sliced_pipeline_actions(p, m, n, v), n)
    _passes_in_order(placed, m * n)
    last_stage = p * v - 1
    for actions in placed.values():  # each pass follows the last stage's forward of its unit
        seen_forward = set()
        for action in actions:
            if action.stage_index == last_stage and action.computation_type == FORWARD:
                seen_forward.add(action.microbatch_index)
            if action.computation_type == OUTPUT_PASS and actions is placed[last_stage % p]:
                assert action.microbatch_index in seen_forward


@pytest.mark.parametrize(
    ("name", "v"),
    [
        ("1F1B", 1),
        ("GPipe", 1),
        ("Interleaved1F1B", 2),
        ("LoopedBFS", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
        ("DualPipeV", 2),
    ],
)
@pytest.mark.parametrize("p", [2, 4])
def test_torch_schedules_get_deadlock_free_passes(name: str, v: int, p: int) -> None:
    placed = with_output_passes(torch_schedule_actions(name, p, 8, v))
    _passes_in_order(placed, 8)


def test_last_rank_joins_right_after_its_forward() -> None:
    actions = sliced_pipeline_actions(2, 1, 4, 1)
    positions = output_pass_positions(actions, 4)
    # rank 1 (last stage) runs F0..F3 first: pass u follows its (u+1)-th action
    assert positions[1] == [1, 2, 3, 4]
    # rank 0 is one slice ahead: F0, F1 before the first pass
    assert positions[0][0] == 2


def test_a_pass_placed_after_a_backward_that_needs_it_deadlocks() -> None:
    placed = with_output_passes(sliced_pipeline_actions(2, 1, 2, 1), 2)
    first_pass = Action(1, OUTPUT_PASS, 0)
    rank0 = [a for a in placed[0] if a != first_pass]
    rank0.append(first_pass)  # rank 0 would join pass 0 only after B of unit 0
    broken = {0: rank0, 1: placed[1]}
    with pytest.raises(ScheduleDeadlockError, match="rank"):
        check_output_passes(broken, 2)


def test_overlapped_actions_are_refused_with_a_fix() -> None:
    lists = torch_schedule_actions("1F1B", 2, 2)
    overlapped = Action(0, ComputationType.OVERLAP_F_B, None, tuple(lists[0][1:3]))
    lists[0] = [lists[0][0], overlapped, *lists[0][3:]]
    with pytest.raises(ValueError, match="choose another pipeline_schedule"):
        with_output_passes(lists)


def test_a_pass_is_inserted_after_the_sends_of_the_compute_before_it() -> None:
    forward, send, receive = ComputationType.FORWARD, ComputationType.SEND_F, ComputationType.RECV_B
    f0, f1 = Action(0, forward, 0), Action(0, forward, 1)
    s0, s1 = Action(0, send, 0), Action(0, send, 1)
    r1, b1 = Action(0, receive, 1), Action(0, ComputationType.FULL_BACKWARD, 1)
    pass0, pass1 = Action(1, OUTPUT_PASS, 0), Action(1, OUTPUT_PASS, 1)
    lowered = [f0, s0, f1, s1, r1, b1]
    placed = insert_after_compute(lowered, [(1, pass0), (2, pass1)])
    assert placed == [f0, s0, pass0, f1, s1, pass1, r1, b1]
    assert insert_after_compute(lowered, [(0, pass0)])[0] == pass0
    assert insert_after_compute(lowered, [(3, pass0)])[-1] == pass0
