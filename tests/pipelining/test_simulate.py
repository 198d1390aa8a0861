"""The schedule simulator reproduces SlimPipe's Table 2 exactly under uniform costs, finds
deadlocks before anything runs, and models causal slices, transfers and memory categories."""

import itertools

import pytest

from pipekit.pipelining.actions import BACKWARD, FORWARD, Action
from pipekit.pipelining.schedules.simulate import CostModel, ScheduleDeadlockError, simulate
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions


def _first_rank_activations(result) -> float:
    return result.peak_memory[0]["activations"]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_uniform_costs_give_table_2_exactly(p: int, m: int) -> None:
    one_f_one_b = simulate(torch_schedule_actions("1F1B", p, m))
    reference = _first_rank_activations(one_f_one_b)
    assert one_f_one_b.max_bubble_fraction == pytest.approx((p - 1) / m)
    gpipe = simulate(torch_schedule_actions("GPipe", p, m))
    assert gpipe.max_bubble_fraction == pytest.approx((p - 1) / m)
    assert _first_rank_activations(gpipe) / reference == pytest.approx(m / p)
    interleaved = simulate(torch_schedule_actions("Interleaved1F1B", p, m, 2))
    assert interleaved.max_bubble_fraction == pytest.approx((p - 1) / (2 * m))
    if m >= 2 * p:  # Table 2 assumes the warm-up fills: (v-1)p + 2(p-1) chunks of v*m
        assert _first_rank_activations(interleaved) / reference == pytest.approx(
            1 + (p - 1) / (2 * p)
        )
    for v, k in itertools.product((1, 2), (1, 2, 4)):
        n = k * p
        sliced = simulate(sliced_pipeline_actions(p, m, n, v), num_slices=n)
        assert sliced.max_bubble_fraction == pytest.approx((p - 1) / (n * v * m))
        first_rank = _first_rank_activations(sliced) / reference
        assert first_rank == pytest.approx(1 / p + 2 * (p - 1) / (n * v * p))  # SlimPipe Eq. 1


def test_zero_bubble_v_stays_within_its_range_at_1f1b_memory() -> None:
    p, m = 4, 8
    zbv = simulate(torch_schedule_actions("ZBVZeroBubble", p, m, 2))
    one_f_one_b = simulate(torch_schedule_actions("1F1B", p, m))
    assert 0 < zbv.max_bubble_fraction < 2 * (p - 1) / (3 * m)
    assert _first_rank_activations(zbv) == pytest.approx(_first_rank_activations(one_f_one_b))


def test_causal_slices_get_heavier_and_leave_imbalance_bubbles() -> None:
    p, m, n = 4, 2, 8
    cost = CostModel(forward_linear=0.0, forward_attention=1.0)
    result = simulate(sliced_pipeline_actions(p, m, n), num_slices=n, cost=cost)
    forwards = [e for e in result.timeline if e.rank == 0 and e.kind == "F"][:n]
    durations = [event.end - event.start for event in forwards]
    assert durations == sorted(durations) and durations[-1] == pytest.approx(15 * durations[0])
    # Ranks run slices of different weight side by side and wait for each other (§4.2.1).
    assert result.max_bubble_fraction > (p - 1) / (n * m)


def test_transfers_add_latency_per_stage_boundary() -> None:
    p, m = 2, 1
    base = simulate(torch_schedule_actions("GPipe", p, m))
    slow = simulate(torch_schedule_actions("GPipe", p, m), cost=CostModel(p2p_latency=0.25))
    # One forward and one backward crossing of the single boundary.
    assert slow.makespan == pytest.approx(base.makespan + 2 * 0.25)


def test_memory_categories_follow_the_units_in_flight() -> None:
    p, m, n = 2, 2, 4
    cost = CostModel(activation_bytes=8.0, kv_cache_bytes=4.0, boundary_bytes=2.0)
    result = simulate(sliced_pipeline_actions(p, m, n), num_slices=n, cost=cost)
    in_flight = {0: n + 2 * (p - 1), 1: n}
    for rank, units in in_flight.items():
        memory = result.peak_memory[rank]
        assert memory["activations"] == pytest.approx(units * 8.0 / p / n)
        assert memory["kv_cache"] == pytest.approx(units * 4.0 / p / n)
        assert memory["stage_inputs"] == pytest.approx(0 if rank == 0 else units * 2.0 / n)


def test_a_deadlock_names_the_rank_and_the_action_it_waits_for() -> None:
    actions = sliced_pipeline_actions(2, 1, 2)
    # Rank 1 wants slice 0's backward first, but slice 1 must go backward before it.
    actions[1] = [Action(1, FORWARD, 0), Action(1, FORWARD, 1), Action(1, BACKWARD, 0)]
    actions[1].append(Action(1, BACKWARD, 1))
    with pytest.raises(ScheduleDeadlockError, match=r"rank 1 waits forever at position 2") as error:
        simulate(actions, num_slices=2)
    assert error.value.waiting_for == Action(1, BACKWARD, 1)


def test_ranks_waiting_on_each_other_are_a_deadlock() -> None:
    one_f_one_b = torch_schedule_actions("1F1B", 2, 2)
    broken = {0: [a for a in one_f_one_b[0] if a.computation_type == BACKWARD], 1: one_f_one_b[1]}
    broken[0] += [a for a in one_f_one_b[0] if a.computation_type == FORWARD]
    with pytest.raises(ScheduleDeadlockError, match="rank 0 waits forever at position 0"):
        simulate(broken)
