"""MPipeMoE's Algorithm 1 (cache and ranges), its memory model (Eq. 1-6) and Table II / Eq. 10."""

from __future__ import annotations

import pytest

from pipekit.moe.granularity import GranularitySearch
from pipekit.moe.memory_model import (
    activation_elements,
    model_state_elements,
    reuse_saving_elements,
    reuse_saving_ratio,
    temporary_buffer_elements,
)
from pipekit.moe.restore import (
    RESTORE_STRATEGIES,
    ExpertShape,
    HardwareSpeeds,
    choose_restore_strategy,
    restore_cost,
    strategy_workload,
)


def _monotone_trial(calls: list[tuple[int, int]]):
    """Best n doubles every 8k tokens (1 below 8k, 2 up to 16k, ...), like the paper's Fig. 12."""

    def trial(batch_tokens: int, partitions: int) -> float:
        calls.append((batch_tokens, partitions))
        best = min(8, 2 ** (batch_tokens // 8192))
        return abs(partitions - best) + 1.0

    return trial


def test_algorithm_1_caches_and_grows_ranges_without_new_trials() -> None:
    calls: list[tuple[int, int]] = []
    search = GranularitySearch(_monotone_trial(calls))
    assert search.search(9000) == 2
    assert len(calls) == 4  # one trial per candidate n for an unseen B
    assert search.search(9000) == 2 and len(calls) == 4  # cache table
    assert search.search(12000) == 2  # outside every range: trials, then range of n=2 grows
    assert [(r.lower, r.upper, r.partitions) for r in search.ranges] == [(9000, 12000, 2)]
    calls.clear()
    assert search.search(10000) == 2 and calls == []  # inside [9000, 12000]: no trial
    assert search.search(20000) == 4
    assert search.search(40000) == 8
    assert [r.partitions for r in search.ranges] == [2, 4, 8]
    assert search.find(30000) is None and search.find(11000).partitions == 2


def test_algorithm_1_does_not_merge_across_another_range() -> None:
    answers = {1000: 2, 2000: 4, 3000: 2}  # not monotone in B
    search = GranularitySearch(lambda b, n: 0.0 if n == answers[b] else 1.0)
    for batch_tokens, expected in answers.items():
        assert search.search(batch_tokens) == expected
    assert [(r.lower, r.upper, r.partitions) for r in search.ranges] == [
        (1000, 1000, 2),
        (2000, 2000, 4),
    ]
    assert search.cache_table[3000] == 2


def test_algorithm_1_skips_candidates_above_the_batch_size() -> None:
    calls: list[tuple[int, int]] = []
    search = GranularitySearch(_monotone_trial(calls), candidates=(1, 2, 4, 8))
    search.search(3)
    assert [n for _, n in calls] == [1, 2]


def test_memory_formulas_match_the_paper() -> None:
    tokens, dim, hidden, n = 4096, 1024, 4096, 4
    assert model_state_elements(64, dim, hidden) == 4 * (64 * dim + 2 * hidden * dim)
    assert activation_elements(tokens, dim, hidden) == 4 * tokens * dim + tokens * hidden
    assert temporary_buffer_elements(tokens, dim, hidden) == tokens * dim + tokens * hidden
    assert reuse_saving_elements(tokens, dim, hidden, n) == tokens * (
        2 * dim * (n - 2) / n + hidden * (n - 1) / n
    )
    ratio = reuse_saving_ratio(tokens, dim, hidden, n, 64)
    saving = reuse_saving_elements(tokens, dim, hidden, n)
    total = model_state_elements(64, dim, hidden) + 2 * activation_elements(tokens, dim, hidden)
    assert ratio == pytest.approx(2 * saving / total)
    assert 0 < ratio < 1
    # More partitions save more; n = 2 saves only T_M's half.
    assert reuse_saving_ratio(tokens, dim, hidden, 8, 64) > ratio
    assert reuse_saving_elements(tokens, dim, hidden, 2) == tokens * hidden / 2


def test_workloads_reproduce_table_ii() -> None:
    table_ii = {
        "none": ((2, 2, 0), (4, 2, 0)),
        "S1": ((2, 2, 5), (4, 2, 5)),
        "S2": ((2, 2, 4), (4, 3, 4)),
        "S3": ((2, 2, 1), (5, 2, 1)),
        "S4": ((2, 2, 0), (5, 3, 0)),
    }
    paper_ffn = ExpertShape(tokens=4096, dim=1024, hidden=4096)  # 2 GEMMs, H = 4M
    for name, expected in table_ii.items():
        assert strategy_workload(RESTORE_STRATEGIES[name], paper_ffn) == expected
    swiglu = strategy_workload(
        RESTORE_STRATEGIES["S1"],
        ExpertShape(tokens=4096, dim=1024, hidden=4096, forward_gemms=3, middle_tensors=2),
    )
    assert swiglu == ((3, 2, 9), (6, 2, 9))


def test_cost_model_picks_by_the_bottleneck() -> None:
    shape = ExpertShape(tokens=4096, dim=1024, hidden=4096, element_size=2)
    fast_copies = HardwareSpeeds(compute_flops=1e12, communication_bytes=1e12, copy_bytes=1e13)
    # Compute-bound: recompute is the costly choice, copying T_M is cheap: S1 or S2.
    assert choose_restore_strategy(fast_copies, shape).middle == "offload"
    slow_copies = HardwareSpeeds(compute_flops=1e15, communication_bytes=1e12, copy_bytes=1e9)
    # Copies are very slow: restore by recomputation and re-communication (S4).
    assert choose_restore_strategy(slow_copies, shape).name == "S4"
    cost = restore_cost(RESTORE_STRATEGIES["S4"], slow_copies, shape)
    gemm, comm = 2 * 4096 * 4096 * 1024 / 1e15, 4096 * 1024 * 2 / 1e12
    # Eq. 10: each pass costs its slowest stream; S4 is [2, 2, 0] forward, [5, 3, 0] backward.
    assert cost == pytest.approx(max(2 * gemm, 2 * comm) + max(5 * gemm, 3 * comm))
