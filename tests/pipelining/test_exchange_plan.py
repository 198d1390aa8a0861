"""The context-exchange planner balances every moment of the sliced schedule (within one slice
of the moment's mean work, counting a backward slice as two forward ones), moves only whole KV
slices a pass has (its earliest, never its own), and shortens the simulated step under causal
attention costs; Eq. 2 stays under its own bound."""

from __future__ import annotations

import itertools

import pytest

from pipekit.pipelining.actions import FORWARD
from pipekit.pipelining.features.exchange_plan import (
    balance_work,
    eq2_exchanged_slices,
    plan_context_exchange,
)
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

SHAPES = [(p, n, m) for p, m in itertools.product((2, 3, 4), (1, 2, 3)) for n in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize(("p", "n", "m"), SHAPES)
def test_every_moment_ends_within_one_backward_slice_of_its_mean(p: int, n: int, m: int) -> None:
    plan = plan_context_exchange(sliced_pipeline_actions(p, m, n, 1), n)
    scheduled = sum(len(moment.actions) for moment in plan.moments)
    assert scheduled == 2 * m * n * p  # every F and B of every rank, once
    for moment in plan.moments:
        assert sum(moment.work_after.values()) == pytest.approx(sum(moment.work_before.values()))
        kinds = {action.computation_type for action in moment.actions.values()}
        slice_work = 1.0 if kinds == {FORWARD} else 2.0  # a backward slice weighs two
        heaviest = max(moment.work_after, key=moment.work_after.get)
        assert moment.spread_after <= slice_work + 1e-9 or _gave_all(plan, moment.index, heaviest)


def _gave_all(plan, moment_index: int, rank: int) -> bool:
    moment = plan.moments[moment_index]
    _, slice_index = unit_microbatch_and_slice(
        moment.actions[rank].microbatch_index, plan.num_slices
    )
    given = sum(
        len(t.kv_slices)
        for t in plan.transfers
        if t.moment == moment_index and t.source_rank == rank
    )
    return given == slice_index


@pytest.mark.parametrize(("p", "n", "m"), [(4, 16, 2), (2, 8, 2), (3, 6, 3)])
def test_transfers_move_the_earliest_slices_a_pass_has(p: int, n: int, m: int) -> None:
    plan = plan_context_exchange(sliced_pipeline_actions(p, m, n, 1), n)
    by_source: dict[tuple[int, int], list[int]] = {}
    for transfer in plan.transfers:
        _, slice_index = unit_microbatch_and_slice(transfer.source_action.microbatch_index, n)
        assert all(0 <= kv < slice_index for kv in transfer.kv_slices)  # never the diagonal
        by_source.setdefault((transfer.moment, transfer.source_rank), []).extend(transfer.kv_slices)
        givers = {t.source_rank for t in plan.transfers if t.moment == transfer.moment}
        assert transfer.target_rank not in givers
    for slices in by_source.values():
        assert slices == list(range(len(slices)))  # earliest first, each once


def test_steady_state_forwards_pair_up() -> None:
    """p = 4, n = 16: ranks 0 and 2 run forwards while 1 and 3 run backwards; the spread of
    31 forward-slice units in the worst moment ends at most 2."""
    plan = plan_context_exchange(sliced_pipeline_actions(4, 2, 16, 1), 16)
    assert max(moment.spread_before for moment in plan.moments) == 31
    assert max(moment.spread_after for moment in plan.moments) <= 2


def test_balance_work_moves_nothing_when_balanced_and_respects_what_can_be_sent() -> None:
    assert balance_work({0: 3.0, 1: 3.0}, {0: 1.0, 1: 1.0}, {0: 2, 1: 2}) == []
    assert balance_work({0: 8.0, 1: 0.0}, {0: 1.0, 1: 1.0}, {0: 7, 1: 0}) == [(0, 1, 4)]
    assert balance_work({0: 8.0, 1: 0.0}, {0: 1.0, 1: 1.0}, {0: 1, 1: 0}) == [(0, 1, 1)]
    assert balance_work({0: 8.0, 1: 2.0, 2: 2.0}, {0: 2.0, 1: 1.0, 2: 1.0}, {0: 3, 1: 1, 2: 1}) == [
        (0, 1, 1),
        (0, 2, 1),
    ]


def test_exchange_shortens_the_simulated_step_under_causal_attention() -> None:
    p, m, n = 4, 4, 16
    actions = sliced_pipeline_actions(p, m, n, 1)
    plan = plan_context_exchange(actions, n)
    cost = CostModel(forward_linear=1.0, forward_attention=1.0)
    without = simulate(actions, num_slices=n, cost=cost).makespan
    with_exchange = simulate(
        actions, num_slices=n, cost=cost, attended_slices=plan.attended_slices()
    ).makespan
    assert with_exchange < 0.97 * without


def test_split_backward_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="full backwards"):
        plan_context_exchange(torch_schedule_actions("ZBVZeroBubble", 2, 4, 2), 1)


@pytest.mark.parametrize(("p", "n"), [(p, n) for p in (2, 3, 4, 8) for n in (p, 2 * p, 4 * p)])
def test_eq2_stays_under_its_bound(p: int, n: int) -> None:
    assert eq2_exchanged_slices(p, n) <= (2 - (p - 1) / n) * p * n
    assert eq2_exchanged_slices(4, 16) == 2 * 16 + 2 * 13 * 1 + 2 * 3 * 7


def test_each_rank_learns_what_it_lends_and_whom_it_serves() -> None:
    p, m, n = 4, 2, 8
    plan = plan_context_exchange(sliced_pipeline_actions(p, m, n, 1), n)
    lent = {rank: plan.lendings(rank) for rank in range(p)}
    served = {rank: plan.servings(rank) for rank in range(p)}
    for transfer in plan.transfers:
        assert (transfer.target_rank, transfer.kv_slices) in lent[transfer.source_rank][
            transfer.source_action
        ]
        assert (transfer.source_rank, transfer.source_action) in served[transfer.target_rank][
            transfer.target_action
        ]
    count = sum(len(parts) for lendings in lent.values() for parts in lendings.values())
    assert (
        count
        == len(plan.transfers)
        == sum(len(sources) for servings in served.values() for sources in servings.values())
    )
    for rank in range(p):  # a pass either lends or serves, never both
        assert not set(lent[rank]) & set(served[rank])
