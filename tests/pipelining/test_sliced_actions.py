"""SlimPipe's sliced action lists (§4.1) as a pure function: every unit once per stage,
forwards in order, each microbatch's slices backward in reverse, the warm-up of
`v*n + 2*(p-1-r)` forwards, the activation peak of SlimPipe Eq. 1 / Table 2, and deadlock-free
lowering to sends and receives by torch. Broken lists must be caught by the same checks.

Letters only inside formulas quoted from the paper: p ranks, m microbatches, n slices, v stages
per rank, r rank.
"""

from __future__ import annotations

import copy
import csv
import itertools
from collections.abc import Sequence
from fractions import Fraction

import pytest

from pipekit.pipelining._torch_runtime import lower_to_comms
from pipekit.pipelining.actions import BACKWARD, FORWARD, Action
from pipekit.pipelining.schedules.sliced import (
    peak_units_in_flight,
    sliced_pipeline_actions,
    sliced_warmup_forwards,
)
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice
from pipekit.pipelining.schedules.user import read_actions_csv, write_actions_csv

CONFIGS = [
    (num_ranks, num_microbatches, num_slices, stages_per_rank)
    for num_ranks, num_microbatches, stages_per_rank in itertools.product(
        (1, 2, 3, 4), (1, 2, 3), (1, 2, 3)
    )
    for num_slices in (num_ranks, 2 * num_ranks, 4 * num_ranks)
]


def _expected_warmup(rank: int, p: int, m: int, n: int, v: int) -> int:
    return min(v * n + 2 * (p - 1 - rank), v * m * n)


def _check_each_unit_once_forward_before_backward(
    rank: int, actions: Sequence[Action], p: int, m: int, n: int, v: int
) -> None:
    owned = [chunk * p + rank for chunk in range(v)]
    expected = {(s, u) for s in owned for u in range(m * n)}
    for kind in (FORWARD, BACKWARD):
        done = [(a.stage_index, a.microbatch_index) for a in actions if a.computation_type == kind]
        assert len(done) == len(set(done)) == len(expected), f"rank {rank}: {kind} repeated"
        assert set(done) == expected, f"rank {rank}: {kind} on stages it does not own"
    position = {
        (a.stage_index, a.computation_type, a.microbatch_index): i for i, a in enumerate(actions)
    }
    for stage, unit in expected:
        assert position[stage, FORWARD, unit] < position[stage, BACKWARD, unit], (
            f"rank {rank}: backward of unit {unit} on stage {stage} before its forward"
        )


def _check_unit_order(rank: int, actions: Sequence[Action], n: int) -> None:
    """Forwards in unit order; backwards by microbatch, each one's slices last to first."""
    for stage in {a.stage_index for a in actions}:
        forwards = [
            a.microbatch_index
            for a in actions
            if a.stage_index == stage and a.computation_type == FORWARD
        ]
        assert forwards == sorted(forwards), f"rank {rank} stage {stage}: forwards {forwards}"
        backwards = [
            unit_microbatch_and_slice(a.microbatch_index, n)
            for a in actions
            if a.stage_index == stage and a.computation_type == BACKWARD
        ]
        for (mb, slice_index), (next_mb, next_slice) in itertools.pairwise(backwards):
            in_order = next_slice < slice_index if next_mb == mb else next_mb > mb
            assert in_order, f"rank {rank} stage {stage}: backwards {backwards}"


def _check_warmup_then_alternation(
    rank: int, actions: Sequence[Action], p: int, m: int, n: int, v: int
) -> None:
    warmup, forwards = _expected_warmup(rank, p, m, n, v), v * m * n
    kinds = "".join("F" if a.computation_type == FORWARD else "B" for a in actions)
    steady = forwards - warmup
    assert kinds == "F" * warmup + "BF" * steady + "B" * (forwards - steady), f"rank {rank}"


def _check_all(actions_by_rank: dict[int, list[Action]], p: int, m: int, n: int, v: int) -> None:
    assert sorted(actions_by_rank) == list(range(p))
    for rank, actions in actions_by_rank.items():
        _check_each_unit_once_forward_before_backward(rank, actions, p, m, n, v)
        _check_unit_order(rank, actions, n)
        _check_warmup_then_alternation(rank, actions, p, m, n, v)


def _lower(actions_by_rank: dict[int, list[Action]], p: int, v: int) -> dict[int, list[Action]]:
    # torch pops from the lists it is given
    return lower_to_comms(copy.deepcopy(actions_by_rank), lambda stage: stage % p, p * v)


@pytest.mark.parametrize(("p", "m", "n", "v"), CONFIGS)
def test_action_lists_satisfy_every_schedule_property_and_lower_without_deadlock(p, m, n, v):
    actions_by_rank = sliced_pipeline_actions(p, m, n, v)
    _check_all(actions_by_rank, p, m, n, v)
    lowered = _lower(actions_by_rank, p, v)
    for rank, actions in actions_by_rank.items():
        compute = [a for a in lowered[rank] if a.computation_type in (FORWARD, BACKWARD)]
        assert compute == actions, "lowering must keep each rank's compute order"


@pytest.mark.parametrize(("p", "m", "n", "v"), CONFIGS)
def test_units_in_flight_match_slimpipe_eq1(p, m, n, v):
    actions_by_rank = sliced_pipeline_actions(p, m, n, v)
    for rank, actions in actions_by_rank.items():
        warmup = _expected_warmup(rank, p, m, n, v)
        assert sliced_warmup_forwards(rank, p, m, n, v) == warmup
        assert peak_units_in_flight(actions) == warmup
    # A unit is 1/n of a microbatch on one of the v*p stages: rank 0's peak, in microbatches of
    # the whole model, is SlimPipe Eq. 1 with Table 2's v, unless there are too few forwards.
    if v * n + 2 * (p - 1) <= v * m * n:
        peak = Fraction(peak_units_in_flight(actions_by_rank[0]), v * n * p)
        assert peak == Fraction(1, p) + Fraction(2 * (p - 1), n * v * p)  # SlimPipe Table 2


def test_golden_lists_worked_out_from_the_paper_rule():
    def parse(text: str) -> list[Action]:
        return [Action.from_str(cell) for cell in text.split()]

    # p=2, m=1, n=4: rank 0 would warm up with n + 2(p-1) = 6 > 4 forwards, so it runs all four,
    # then the backwards last slice first; rank 1 warms up with n = 4, the same shape.
    assert sliced_pipeline_actions(2, 1, 4) == {
        0: parse("0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0"),
        1: parse("1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0"),
    }
    # p=2, m=2, n=2 (units 0,1 = microbatch 0; 2,3 = microbatch 1): rank 0 warms up with 4,
    # rank 1 with 2 and then alternates backward and forward.
    assert sliced_pipeline_actions(2, 2, 2) == {
        0: parse("0F0 0F1 0F2 0F3 0B1 0B0 0B3 0B2"),
        1: parse("1F0 1F1 1B1 1F2 1B0 1F3 1B3 1B2"),
    }


def _swap(actions: list[Action], first: Action, second: Action) -> list[Action]:
    i, j = actions.index(first), actions.index(second)
    broken = list(actions)
    broken[i], broken[j] = broken[j], broken[i]
    return broken


def test_broken_lists_are_caught():
    p, m, n, v = 2, 2, 4, 1
    good = sliced_pipeline_actions(p, m, n, v)

    # One microbatch's slices backward in forward order: the KV-cache gradient would be missing.
    slices_in_forward_order = {
        **good,
        0: _swap(good[0], Action(0, BACKWARD, 3), Action(0, BACKWARD, 2)),
    }
    with pytest.raises(AssertionError, match="backwards"):
        _check_unit_order(0, slices_in_forward_order[0], n)
    _lower(slices_in_forward_order, p, v)  # torch cannot see this one: only our check does

    # Two forwards of one stage swapped.
    forwards_swapped = _swap(good[0], Action(0, FORWARD, 1), Action(0, FORWARD, 2))
    with pytest.raises(AssertionError, match="forwards"):
        _check_unit_order(0, forwards_swapped, n)

    # A backward moved before its own forward.
    backward_first = list(good[0])
    backward_first.insert(0, backward_first.pop(backward_first.index(Action(0, BACKWARD, 5))))
    with pytest.raises(AssertionError, match="before its forward"):
        _check_each_unit_once_forward_before_backward(0, backward_first, p, m, n, v)
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        _lower({**good, 0: backward_first}, p, v)

    # Rank 0 warms up with one forward fewer than rank 1: its first backward waits for rank 1's,
    # which waits for a forward that rank 0 runs only after that backward.
    short_warmup = list(good[0])
    short_warmup.insert(4, short_warmup.pop(short_warmup.index(Action(0, BACKWARD, 3))))
    long_warmup = _swap(good[1], Action(1, BACKWARD, 3), Action(1, FORWARD, 4))
    deadlocked = {0: short_warmup, 1: long_warmup}
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        _lower(deadlocked, p, v)
    with pytest.raises(AssertionError, match="rank 0"):
        _check_all(deadlocked, p, m, n, v)


@pytest.mark.parametrize(
    ("num_ranks", "num_slices", "suggestion"),
    [(4, 6, "try 4 or 8"), (4, 2, "try 4 or 8"), (3, 7, "try 6 or 9")],
)
def test_num_slices_not_a_multiple_of_ranks_is_rejected_with_a_fix(
    num_ranks, num_slices, suggestion
):
    with pytest.raises(ValueError, match=f"num_slices={num_slices}.*{suggestion}"):
        sliced_pipeline_actions(num_ranks, 2, num_slices)


@pytest.mark.parametrize("argument_index", range(4))
@pytest.mark.parametrize("value", [0, -1])
def test_values_below_one_are_rejected(argument_index, value):
    arguments = [2, 2, 4, 1]
    arguments[argument_index] = value
    with pytest.raises(ValueError, match=f"={value} must be at least 1"):
        sliced_pipeline_actions(*arguments)


@pytest.mark.parametrize(("p", "m", "n", "v"), [(1, 1, 1, 1), (2, 3, 4, 2), (4, 2, 8, 3)])
def test_csv_round_trip_in_torch_compute_only_format(tmp_path, p, m, n, v):
    actions_by_rank = sliced_pipeline_actions(p, m, n, v)
    path = tmp_path / "actions.csv"
    write_actions_csv(actions_by_rank, path)
    assert read_actions_csv(path) == actions_by_rank
    with open(path, newline="") as handle:  # what `_PipelineScheduleRuntime._load_csv` reads
        rows = list(csv.reader(handle))
    assert len(rows) == p
    for rank, row in enumerate(rows):
        assert [Action.from_str(cell) for cell in row] == actions_by_rank[rank]
        assert row == [str(action) for action in actions_by_rank[rank]]
