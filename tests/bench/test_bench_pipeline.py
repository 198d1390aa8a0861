"""The pipeline benchmarks run end to end on fresh gloo ranks at tiny sizes and end with their
RESULT line; bad shapes fail at once with a one-line error. Memory figures are deterministic
byte counts, so their ordering is asserted; times are not."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from pipekit.bench import _pipeline_launch
from pipekit.bench.__main__ import main
from pipekit.bench._all_schedules import TORCH_SCHEDULES
from pipekit.bench._cpu_per_step import cpu_ratio
from pipekit.bench._pipeline_launch import (
    bench_plan,
    model_spec,
    rank_core_sets,
    run_ranks,
)
from pipekit.bench._rank_deals import DEALS
from pipekit.bench._schedule_timing import schedule_runs, simulated_makespan
from pipekit.memory_plan.forked import in_forked_child

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ["--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "48", "--vocab", "64"]


def _run_bench(*argv: str) -> dict[str, float]:
    """Run `python -m pipekit.bench ARGV` and return its RESULT figures: in a child forked from
    this process (the bench's imports are paid once; its threads end with the child)."""
    stdout = in_forked_child(_bench_stdout, argv)
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), stdout
    figures = dict(part.split("=", 1) for part in last.removeprefix("RESULT ").split())
    return {key: float(value) for key, value in figures.items()}


def _bench_stdout(argv: tuple[str, ...]) -> str:
    os.chdir(REPO_ROOT)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(list(argv))
    return printed.getvalue()


def test_pipeline_memory_bench_sliced_saves_memory_and_prints_formula():
    figures = _run_bench(
        "pipeline-memory", "--pp", "2", "--slices", "4", "--microbatches", "2", "--seq", "64",
        *TINY_MODEL,
    )  # fmt: skip
    assert list(figures) == [
        "sliced_vs_1f1b",
        "formula",
        "sliced_v2_vs_1f1b",
        "formula_v2",
        "equal_cost_vs_1f1b",
        "equal_cost_simulated",
    ]
    assert figures["formula"] == pytest.approx((1 + 2 * (2 - 1) / 4) / 2)
    assert figures["formula_v2"] == pytest.approx(1 / 2 + 2 * (2 - 1) / (4 * 2 * 2))
    assert 0 < figures["sliced_v2_vs_1f1b"] < figures["sliced_vs_1f1b"] < 1
    # the tiny model's light attention: equal-cost slices hardly differ from equal ones
    assert figures["equal_cost_simulated"] == pytest.approx(figures["formula"], rel=0.2)
    assert figures["equal_cost_vs_1f1b"] == pytest.approx(figures["equal_cost_simulated"], rel=0.2)


def test_pipeline_memory_bench_offload_keeps_gradients_and_lowers_resident_bytes():
    figures = _run_bench(
        "pipeline-memory", "--pp", "2", "--slices", "4", "--microbatches", "2", "--seq", "64",
        "--offload", "0.9", *TINY_MODEL,
    )  # fmt: skip
    assert figures["max_difference"] == 0.0  # bit for bit
    assert figures["offload_resident_ratio"] < 0.8
    assert figures["offload_resident_ratio"] == pytest.approx(figures["predicted"], rel=0.1)


def test_pipeline_memory_bench_latent_cache_is_the_formula_of_the_expanded_one():
    """DeepSeek-V3's latent KV cache against the same model caching expanded K/V, one sliced
    step each: the measured ratio is the formula's, and the two forms train the same loss."""
    figures = _run_bench(
        "pipeline-memory", "--model", "deepseek_v3", "--pp", "2", "--slices", "2",
        "--microbatches", "2", "--seq", "64", "--heads", "8", "--dim", "64", "--vocab", "64",
    )  # fmt: skip
    assert figures["formula"] == pytest.approx((32 + 16) / (2 * 8 * 48))
    assert figures["mla_cache_vs_expanded"] == pytest.approx(figures["formula"], rel=0.05)
    assert figures["loss_difference"] < 1e-4


def test_pipeline_throughput_bench_prints_the_ratios_of_both_allocators_and_variants():
    figures = _run_bench(
        "pipeline-throughput", "--pp", "2", "--slices", "4", "--microbatches", "2",
        "--seq", "64", "--layers", "2", "--warmup", "0", "--repeats", "1", *TINY_MODEL,
    )  # fmt: skip
    assert list(figures) == [
        "sliced_vs_1f1b_speedup",
        "best_variant_speedup",
        "exchange_vs_1f1b_speedup",
        "equal_cost_vs_1f1b_speedup",
        "equal_cost_simulated_gain",
        "equal_cost_measured_gain",
        "default_allocator_speedup",
        "sliced_tokens_per_s",
        "f1b_tokens_per_s",
        "bubble_only_speedup",
        "simulated_sliced_speedup",
        "sliced_share_of_simulated",
    ]
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), figures
    # causal attention only lengthens later slices: the simulated limit is below bubble-only
    assert figures["simulated_sliced_speedup"] < figures["bubble_only_speedup"]
    assert figures["sliced_share_of_simulated"] == pytest.approx(
        figures["sliced_vs_1f1b_speedup"] / figures["simulated_sliced_speedup"], rel=1e-3
    )
    # the tiny model's attention is light at 64 tokens, but its equal-cost slices still differ
    assert figures["equal_cost_simulated_gain"] > 1.0, figures


def test_every_schedule_is_timed_beside_the_sliced_ones(capsys):
    """`--schedules all`: the six sliced variants (one choosing its layout by measurement)
    and every torch schedule of the registry, each at its own stages per rank, in one table;
    the zero-bubble schedules simulate less bubble than 1F1B."""
    main([
        "pipeline-throughput", "--schedules", "all", "--pp", "2", "--slices", "4",
        "--microbatches", "4", "--seq", "64", "--layers", "4", "--warmup", "0", "--repeats",
        "1", *TINY_MODEL,
    ])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    names = ["sliced", "sliced+exchange", "sliced+equal-cost", "sliced v=2",
             "sliced v=2+equal-cost", "sliced auto", *TORCH_SCHEDULES]  # fmt: skip
    assert {"GPipe", "1F1B", "LoopedBFS", "ZBVZeroBubble", "DualPipeV"} <= set(TORCH_SCHEDULES)
    rows = {}
    for line in lines:
        name = next((n for n in reversed(names) if line.startswith(f"{n} ")), None)
        if name is not None:
            rows[name] = line.removeprefix(name).split()  # v, median s, tokens/s, ...
    assert list(rows) == names
    bubble = {name: float(row[5]) for name, row in rows.items()}
    assert bubble["ZBVZeroBubble"] < bubble["1F1B"] and bubble["DualPipeV"] < bubble["1F1B"]
    assert all(float(row[7]) > 0 for row in rows.values())  # measured peak activations
    figures = dict(part.split("=", 1) for part in lines[-1].removeprefix("RESULT ").split())
    assert float(figures["sliced_vs_best_torch"]) > 0
    assert float(figures["best_sliced_vs_best_torch"]) >= float(figures["sliced_vs_best_torch"])
    assert figures["best_torch"] in names[6:]
    assert float(figures["auto_sliced_vs_best_torch"]) > 0
    kept = next(line for line in lines if line.startswith("the layout sliced auto kept: "))
    assert "num_slices=4 equal_" in kept and "fastest step" in kept  # 64 tokens: n=4 only


def test_schemes_bench_draws_measured_and_simulated_panels(tmp_path):
    """One small context measured, two simulated at Llama 70B scale: a PNG, and at scale the
    sliced schedule keeps less than 1F1B and idles less."""
    out = tmp_path / "schemes.png"
    figures = _run_bench(
        "schemes", "--contexts", "64", "--cluster-contexts", "131072", "262144",
        "--warmup", "0", "--repeats", "1", "--slices", "4", "--out", str(out), *TINY_MODEL,
    )  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figures["measured_sliced_vs_best_torch"] > 0
    assert figures["simulated_sliced_utilisation"] > figures["simulated_1f1b_utilisation"]
    assert 0 < figures["simulated_sliced_vs_1f1b_memory"] < 0.5


def test_simulated_limits_order_the_variants_at_8k_context():
    """At 8K the model's attention outweighs its matmuls: causal costs pull equal-length
    slices well under the bubble-only ratio; the exchange's moves and equal-cost slices each
    win part of it back (no ranks are started: plans and simulation only)."""
    spec = model_spec(
        argparse.Namespace(dim=256, layers=4, heads=4, kv_heads=2, ffn_dim=768, vocab=256), 8192
    )
    makespans = {
        name: simulated_makespan(
            bench_plan(spec, stages_per_rank=1, num_ranks=2, microbatches=2, rows=2, **run)
        )
        for name, run in schedule_runs(8).items()
    }
    speedup = {name: makespans["1F1B"] / makespan for name, makespan in makespans.items()}
    bubble_only = (1 + 1 / 2) / (1 + 1 / 16)
    assert speedup["sliced"] < speedup["sliced+exchange"] < speedup["sliced+equal-cost"]
    assert speedup["sliced+equal-cost"] < bubble_only
    assert speedup["sliced"] < 0.95 * bubble_only  # the imbalance costs more than 5%


def report_cores(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, list[int]]:
    """Rank worker: the cores this rank's main thread and a thread it starts may run on."""
    seen: dict[str, list[int]] = {"main": sorted(os.sched_getaffinity(0))}
    thread = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))
    thread.start()
    thread.join()
    return seen


def test_run_ranks_pins_each_rank_and_the_threads_it_starts_to_cores_of_its_own():
    available = sorted(os.sched_getaffinity(0))
    cores = rank_core_sets(2)
    here = str(Path(__file__).resolve().parent)  # the ranks import this module by name
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), here])}
    if len(available) < 2:
        assert cores is None
    else:
        assert cores is not None and not set(cores[0]) & set(cores[1])
        pinned = run_ranks(f"{__name__}:report_cores", 2, {}, env=env, cores=cores)
        assert [rank["main"] for rank in pinned] == cores
        assert [rank["thread"] for rank in pinned] == cores
    unpinned = run_ranks(f"{__name__}:report_cores", 2, {}, env=env)
    assert all(rank["main"] == rank["thread"] == available for rank in unpinned)


def test_rank_core_sets_split_the_cores_evenly_or_refuse(monkeypatch):
    monkeypatch.setattr(_pipeline_launch.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert rank_core_sets(2) == [[0, 1], [2, 3]]
    assert rank_core_sets(5) == [[0], [1], [2], [3], [5]]
    assert rank_core_sets(6) is None
    assert rank_core_sets(2, pin=False) is None  # --no-pin
    with pytest.raises(ValueError, match="cores has 1 sets for 2 ranks"):
        run_ranks(f"{__name__}:report_cores", 2, {}, cores=[[0]])


def test_vocab_parallel_bench_shrinks_the_last_ranks_saved_logits():
    figures = _run_bench(
        "vocab-parallel", "--pp", "2", "--seq", "64", "--dim", "32", "--heads", "4",
        "--kv-heads", "2", "--ffn-dim", "48", "--vocab", "4096",
    )  # fmt: skip
    assert list(figures) == [
        "last_rank_peak_ratio",
        "output_time_imbalance",
        "first_rank_peak_ratio",
        "last_rank_saved_ratio",
        "step_time_ratio",
    ]
    # without it the last rank keeps 4 slices' [16, 4096] logits for the loss's backward
    assert 0 < figures["last_rank_saved_ratio"] < 0.6
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), figures


def test_context_exchange_bench_simulates_fewer_bubbles_and_less_traffic_than_eq2():
    figures = _run_bench("context-exchange", "--pp", "4", "--slices", "8", "--seq", "8192",
                         "--microbatches", "2", "--dim", "512", "--simulate")  # fmt: skip
    assert list(figures) == ["bubble_with", "bubble_without", "bytes_vs_eq2", "makespan_ratio"]
    assert figures["bubble_with"] < figures["bubble_without"]
    assert 0 < figures["bytes_vs_eq2"] <= 1
    assert figures["makespan_ratio"] < 1


def test_context_exchange_bench_runs_the_exchange_beside_the_plain_schedules():
    figures = _run_bench(
        "context-exchange", "--pp", "2", "--slices", "8", "--seq", "128", "--microbatches", "2",
        "--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "48", "--layers", "2",
        "--repeats", "1", "--no-pin",
    )  # fmt: skip
    assert list(figures) == [
        "bubble_with",
        "bubble_without",
        "bytes_vs_eq2",
        "makespan_ratio",
        "ahead_held_ms",
        "measured_speedup",
        "auto_vs_sliced",
        "auto_chose_exchange",
        "vs_1f1b",
        "sliced_vs_1f1b",
        "per_round_speedup",
        "exchange_cpu_ratio",
        "share_of_simulated_gain",
    ]
    share = figures.pop("share_of_simulated_gain")  # any sign: timings this small are noise
    assert figures.pop("auto_chose_exchange") in (0, 1)  # settled by its trial steps
    assert math.isfinite(share) and figures["makespan_ratio"] < 1  # a gain is simulated here
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), figures


def test_the_cpu_ratio_pairs_each_round_and_sums_the_ranks() -> None:
    def steps(*process_s: float) -> list[dict[str, float]]:
        return [{"process_s": seconds} for seconds in process_s]

    ranks = [{"cpu": {"plain": steps(5, 10, 15), "other": steps(15, 5, 10)}} for _ in range(2)]
    # summed over ranks, the rounds' ratios are 30/10, 10/20, 20/30: the median is 2/3, where
    # a ratio of the medians (20/20) would hide that the machine drifted between rounds
    assert cpu_ratio(ranks, "plain", "other") == pytest.approx(2 / 3)
    ranks[1]["cpu"]["other"] = steps(15, 5, 20)  # the last round's sum is now 30/30
    assert cpu_ratio(ranks, "plain", "other") == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["pipeline-memory", "--pp", "4", "--slices", "6"],
            "num_slices=6 must be a multiple of pipeline_parallel_degree=4 (SlimPipe §4.1.2); "
            "try 4 or 8",
        ),
        (
            ["pipeline-memory", "--pp", "2", "--slices", "8", "--seq", "100"],
            "--seq=100 must split into --slices=8 equal slices",
        ),
        (
            ["pipeline-memory", "--pp", "2", "--layers", "3"],
            "--layers=3 is too few for 4 stages",
        ),
        (
            ["pipeline-throughput", "--pp", "2", "--microbatches", "1"],
            "--microbatches=1 must be at least --pp=2",
        ),
        (
            ["pipeline-throughput", "--dim", "30", "--heads", "4"],
            "dim=30 is not divisible by n_heads=4",
        ),
        (["pipeline-throughput", "--repeats", "0"], "--repeats=0 must be at least 1"),
        (["vocab-parallel", "--pp", "1"], "--pp=1 must be at least 2"),
        (["context-exchange", "--pp", "2", "--layers", "1"], "--layers=1 is too few"),
        (["context-exchange", "--simulate", "--slices", "6"], "num_slices=6 must be a multiple"),
        (["vocab-parallel", "--pp", "2", "--slices", "3"], "num_slices=3 must be a multiple"),
    ],
)
def test_pipeline_bench_rejects_bad_shape_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(r"python -m pipekit\.bench [\w-]+: error: .+\n", captured.err)
    assert message in captured.err


def test_packed_documents_bench_balances_the_slices_work_by_cutting_per_microbatch():
    """Short documents (median 512 tokens) in 8K rows, slices of about four of the CPU
    kernel's 512-token tiles: neither static cut fits them."""
    figures = _run_bench(
        "packed-documents", "--work-only", "--seq", "8192", "--slices", "4", "--median", "512",
        "--dp-seq", "2048",
    )  # fmt: skip
    documents = figures["work_imbalance_documents"]
    assert documents < 1.05
    assert documents < figures["work_imbalance_equal_length"] - 0.2
    assert documents < figures["work_imbalance_equal_cost"] - 0.2
    assert figures["cp_work_imbalance_documents"] < 1.05 < figures["cp_work_imbalance_sequence"]
    static, dealt = (figures[f"pp_cp_work_imbalance_{n}"] for n in ("static", "documents"))
    assert dealt < 1.05 < static  # the pipeline's slices over 2 cp ranks, cut and dealt
    assert figures["dp_work_imbalance_by_work"] < figures["dp_work_imbalance_in_order"]
    assert figures["simulated_documents_vs_equal_length"] > 1.0


def test_packed_documents_bench_times_the_three_cuts_on_the_packed_batch():
    figures = _run_bench(
        "packed-documents", "--seq", "512", "--slices", "4", "--dim", "64", "--layers", "2",
        "--median", "64", "--warmup", "0", "--repeats", "1", "--no-pin", "--dp-rows", "4",
        "--dp-seq", "512",
    )  # fmt: skip
    for cut in ("equal_length", "equal_cost", "documents"):
        assert figures[f"time_imbalance_{cut}"] >= 1.0
    assert figures["documents_vs_equal_length"] > 0 and figures["documents_vs_equal_cost"] > 0
    for kind, deals in DEALS.items():  # the cp and dp ranks, both deals timed
        assert all(figures[f"{kind}_time_imbalance_{deal}"] >= 1.0 for deal in deals)
        assert figures[f"{kind}_balanced_vs_static"] > 0
