"""`python -m pipekit.bench pipeline-throughput --schedules all`: the sliced schedule and its
variants against every torch schedule, built in the same rank processes and timed in
alternating rounds on the same model, weights and global batch (m microbatches of one
sequence each).

Each schedule runs at its natural stages per rank v: those the schedule registry requires
(GPipe and 1F1B one, the V schedules two), two for the other multi-stage ones; the sliced schedule
both (n slices per sequence; equal-length and equal-cost at v=2 as at v=1). "sliced auto"
first times its layouts (`num_slices` and `slicing` = "auto": 2p, 4p and 8p slices, each cut
both ways) and keeps the fastest. Per schedule the table gives its tokens/s, its ratio to
1F1B and to the fastest torch schedule, the simulator's bubble (idle over busy time, the worst
rank) and peak activations relative to 1F1B (causal costs, no overheads; for "sliced auto", of
the layout kept), and the peak activation bytes measured on the worst rank (saved tensors, KV
cache and stage inputs) in one recorded step. The fair allocator
(`GLIBC_TUNABLES=glibc.malloc.mmap_max=0`) serves every schedule.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from pipekit.bench._pipeline_launch import (
    bench_plan,
    check_pipeline_shape,
    describe_model,
    describe_pinning,
    model_spec,
    rank_core_sets,
    run_ranks,
)
from pipekit.bench._schedule_timing import FAIR_ALLOCATOR, simulate_plan
from pipekit.bench.report import print_result, print_table
from pipekit.pipelining.runtime.measured_choice import AUTO
from pipekit.pipelining.schedules.registry import SCHEDULES

__all__ = ["TORCH_SCHEDULES", "all_schedule_runs", "checked_model", "compare_all_schedules"]

TORCH_SCHEDULES = {
    name: entry.stages_per_rank or 2 for name, entry in SCHEDULES.items() if entry.torch_class
}
"""torch's schedules (every one the registry runs) and their stages per rank: what the entry
requires, else two (the multi-stage schedules)."""


def all_schedule_runs(num_slices: int) -> dict[str, dict[str, Any]]:
    """Every compared schedule as `build_runner` keywords, the sliced ones first."""
    sliced = {"schedule": "sliced", "num_slices": num_slices, "stages_per_rank": 1}
    runs = {
        "sliced": sliced,
        "sliced+exchange": {**sliced, "context_exchange": True},
        "sliced+equal-cost": {**sliced, "slicing": "equal_cost"},
        "sliced v=2": {**sliced, "stages_per_rank": 2},
        "sliced v=2+equal-cost": {**sliced, "stages_per_rank": 2, "slicing": "equal_cost"},
        "sliced auto": {**sliced, "num_slices": AUTO, "slicing": AUTO},
    }
    for name, stages in TORCH_SCHEDULES.items():
        runs[name] = {"schedule": name, "num_slices": 1, "stages_per_rank": stages}
    return runs


def checked_model(parser: argparse.ArgumentParser, options: argparse.Namespace) -> dict:
    """The model of `options` once its pipeline shape holds at one and two stages per rank
    (every schedule here runs one or the other); else one error line and exit 2."""
    try:
        for stages in (1, 2):
            check_pipeline_shape(
                num_ranks=options.pp, microbatches=options.microbatches,
                num_slices=options.slices, seq_len=options.seq, num_layers=options.layers,
                stages_per_rank=stages,
            )  # fmt: skip
        if options.repeats < 1 or options.warmup < 0:
            raise ValueError("--repeats must be at least 1 and --warmup 0 or more")
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return model_spec(options, options.seq)


def compare_all_schedules(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Time every schedule; print the table and the RESULT line."""
    p, m, n = options.pp, options.microbatches, options.slices
    model = checked_model(parser, options)
    rows_per_step = m * options.rows_per_microbatch
    runs, plans, refused = {}, {}, {}
    for name, run in all_schedule_runs(n).items():
        try:  # a schedule whose own rules refuse this shape is reported, not run
            plans[name] = bench_plan(model, num_ranks=p, microbatches=m, rows=rows_per_step, **run)
            runs[name] = run
        except ValueError as error:
            refused[name] = str(error)
    if "1F1B" not in runs:
        parser.exit(2, f"{parser.prog}: error: 1F1B refuses this shape: {refused['1F1B']}\n")
    spec = {
        "model": model, "microbatches": m, "slices": n,
        "rows_per_microbatch": options.rows_per_microbatch,
        "warmup": options.warmup, "repeats": options.repeats, "runs": runs,
    }  # fmt: skip
    tokens = rows_per_step * options.seq
    cores = rank_core_sets(p, pin=not options.no_pin)
    print(describe_model(model))
    print(
        f"p={p} ranks, m={m} microbatches of {options.rows_per_microbatch} x {options.seq} "
        f"tokens ({tokens} per step), sliced n={n}, 1 thread per rank, {describe_pinning(cores)}"
        f", GLIBC_TUNABLES={FAIR_ALLOCATOR}; {options.warmup} warm-up and {options.repeats} "
        "timed steps of each schedule, alternating"
    )
    ranks = run_ranks(
        "pipekit.bench._schedule_timing:time_schedules", p, spec,
        env={"GLIBC_TUNABLES": options.fair_tunables}, timeout=options.timeout, cores=cores,
    )  # fmt: skip
    layouts = {name: ranks[0]["choices"][name].get("layout") for name in runs}
    simulated = {  # of the layout a measured choice kept: the one timed
        name: simulate_plan(plan.layouts[layouts[name]["chosen"]] if layouts[name] else plan)
        for name, plan in plans.items()
    }
    samples = ranks[0]["samples"]  # every rank times the same barrier-to-barrier steps
    tokens_per_s = {name: tokens / statistics.median(samples[name]) for name in runs}
    torch_names = [name for name in TORCH_SCHEDULES if name in runs]
    best_torch = max(torch_names, key=tokens_per_s.__getitem__)
    best_sliced = max(
        (name for name in runs if name.startswith("sliced")), key=tokens_per_s.__getitem__
    )
    reference_memory = max(simulated["1F1B"].peak_memory[r]["total"] for r in range(p))
    rows = []
    for name, run in runs.items():
        peak_measured = max(rank["recorded"][name]["peak_activation_bytes"] for rank in ranks)
        peak_simulated = max(simulated[name].peak_memory[r]["total"] for r in range(p))
        rows.append([
            name, run["stages_per_rank"], statistics.median(samples[name]), tokens_per_s[name],
            tokens_per_s[name] / tokens_per_s["1F1B"],
            tokens_per_s[name] / tokens_per_s[best_torch],
            simulated[name].max_bubble_fraction, peak_simulated / reference_memory,
            peak_measured / 2**20,
        ])  # fmt: skip
    headers = ["schedule", "v", "median s", "tokens/s", "vs 1F1B", "vs best torch"]
    print_table([*headers, "sim. bubble", "sim. act. vs 1F1B", "peak act. MiB"], rows)
    for name, reason in refused.items():
        print(f"{name} not run: {reason}")
    for name, layout in layouts.items():
        if layout:
            print(f"the layout {name} kept: {layout['label']} ({layout['reason']})")
    print(f"\nfastest torch schedule: {best_torch}; fastest sliced: {best_sliced}")
    print_result(
        sliced_vs_best_torch=tokens_per_s["sliced"] / tokens_per_s[best_torch],
        best_sliced_vs_best_torch=tokens_per_s[best_sliced] / tokens_per_s[best_torch],
        best_torch=best_torch,
        best_sliced=best_sliced.replace(" ", "_"),
        sliced_tokens_per_s=tokens_per_s["sliced"],
        best_torch_tokens_per_s=tokens_per_s[best_torch],
        sliced_vs_1f1b=tokens_per_s["sliced"] / tokens_per_s["1F1B"],
        auto_sliced_vs_best_torch=tokens_per_s["sliced auto"] / tokens_per_s[best_torch],
    )
