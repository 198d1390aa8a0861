"""`python -m pipekit.bench pipeline-throughput --pp 2 --microbatches 2 --seq 8192`.

Training tokens/s of the sliced pipeline (`--slices` n per sequence) against torch's
Schedule1F1B on the same model, weights and batch (one sequence per microbatch), on `--pp` gloo
ranks with one intra-op thread each. Both schedules are built in the same rank processes and
timed alternately (a warm-up step each, then sliced, 1F1B, sliced, 1F1B, ...); the figure is
the ratio of median step times.

Fair CPU timing: glibc serves large tensors with fresh mmaps, so full-sequence
schedules pay page faults that sliced ones, with their smaller tensors, mostly avoid. The
headline ratio therefore runs both schedules in ranks started with
`GLIBC_TUNABLES=glibc.malloc.mmap_max=0` (the heap is reused instead); a second set of ranks
with the default allocator gives the ratio beside it. The bubble-only prediction is
(1 + (p-1)/m) / (1 + (p-1)/(n m)); causal attention makes later slices slower than earlier
ones, which costs the sliced schedule part of that. Two variants recover it: context exchange
(heavy passes lend attention to light ones) and equal-cost slicing (early slices longer). The
`simulated` column is each schedule's ratio under the simulator at the model's FLOPs, causal
costs and exchange included but no overheads: the limit its measured ratio can reach, and
`sliced_share_of_simulated` says how close the equal-length sliced schedule comes. Each rank
is pinned to cores of its own when there are enough (one core stands for one device;
`--no-pin` leaves the placement to the OS).
"""

from __future__ import annotations

import argparse
import statistics

from pipekit.bench._all_schedules import compare_all_schedules
from pipekit.bench._memory_budget import compare_at_budget, sweep_budgets
from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pinning_argument,
    add_pipeline_arguments,
    bench_plan,
    check_pipeline_shape,
    describe_model,
    describe_pinning,
    describe_slices,
    model_spec,
    rank_core_sets,
    run_ranks,
)
from pipekit.bench._schedule_timing import (
    FAIR_ALLOCATOR,
    print_step_breakdown,
    schedule_runs,
    simulated_makespan,
)
from pipekit.bench.report import print_result, print_table

__all__ = ["main"]


_SCHEDULES = ("sliced", "sliced+exchange", "sliced+equal-cost", "1F1B")
_SLICED_VARIANTS = ("sliced", "sliced+exchange", "sliced+equal-cost")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench pipeline-throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pipeline_arguments(parser, pp=2, slices=8, microbatches=2, seq=8192)
    parser.add_argument(
        "--rows-per-microbatch", type=int, default=1, help="sequences in one microbatch"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each schedule")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each schedule")
    parser.add_argument(
        "--fair-tunables",
        default=FAIR_ALLOCATOR,
        help="GLIBC_TUNABLES of the fair comparison (default: %(default)s)",
    )
    add_pinning_argument(parser)
    parser.add_argument(
        "--schedules",
        choices=("sliced", "all"),
        default="sliced",
        help="sliced: the sliced variants against 1F1B under two allocators; all: every "
        "schedule, sliced and torch's, each at its own stages per rank (fair allocator)",
    )
    parser.add_argument(
        "--memory-budget",
        help="with --schedules all: every schedule at the cheapest activation policy that "
        "fits B per rank (768MiB, 1.5GiB, bytes, or a fraction <= 1 of 1F1B's peak without "
        "recomputation); sweep: every schedule under every policy, drawn to --out",
    )
    parser.add_argument(
        "--out", default="memory_budget_sweep.png", help="the sweep's picture (PNG)"
    )
    add_model_arguments(parser, dim=256, layers=4, heads=4, kv_heads=2, ffn_dim=768, vocab=256)
    options = parser.parse_args(argv)
    if options.memory_budget is not None:
        if options.schedules != "all":
            parser.exit(2, f"{parser.prog}: error: --memory-budget needs --schedules all\n")
        if options.memory_budget == "sweep":
            sweep_budgets(parser, options)
        else:
            compare_at_budget(parser, options)
        return
    if options.schedules == "all":
        compare_all_schedules(parser, options)
        return
    p, m, n = options.pp, options.microbatches, options.slices
    try:
        check_pipeline_shape(
            num_ranks=p,
            microbatches=m,
            num_slices=n,
            seq_len=options.seq,
            num_layers=options.layers,
            stages_per_rank=1,
        )
        for name in ("--rows-per-microbatch", "--repeats"):
            value = getattr(options, name[2:].replace("-", "_"))
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        if options.warmup < 0:
            raise ValueError(f"--warmup={options.warmup} must be 0 or more")
        spec = {
            "model": model_spec(options, options.seq),
            "microbatches": m,
            "slices": n,
            "rows_per_microbatch": options.rows_per_microbatch,
            "warmup": options.warmup,
            "repeats": options.repeats,
            "runs": schedule_runs(n),
        }
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    tokens = m * options.rows_per_microbatch * options.seq
    print(describe_model(spec["model"]))
    print(
        f"p={p} ranks, m={m} microbatches of {options.rows_per_microbatch} x {options.seq} "
        f"tokens ({tokens} per step), sliced n={n}, 1 thread per rank; {options.warmup} warm-up "
        f"and {options.repeats} timed steps of each schedule, alternating"
    )
    plans = {
        name: bench_plan(
            spec["model"],
            stages_per_rank=1,
            num_ranks=p,
            microbatches=m,
            rows=m * options.rows_per_microbatch,
            **run,
        )
        for name, run in spec["runs"].items()
    }
    makespans = {name: simulated_makespan(plan) for name, plan in plans.items()}
    print(f"equal-cost slices: {describe_slices(plans['sliced+equal-cost'])}")
    cores = rank_core_sets(p, pin=not options.no_pin)
    allocators = {"fair": options.fair_tunables, "default": None}
    rows, speedups, fair_tokens_per_s, recorded = [], {}, {}, []
    for allocator, tunables in allocators.items():
        ranks = run_ranks(
            "pipekit.bench._schedule_timing:time_schedules",
            p,
            spec,
            env={"GLIBC_TUNABLES": tunables},
            timeout=options.timeout,
            cores=cores,
        )
        assert all(rank["glibc_tunables"] == tunables for rank in ranks)
        samples = ranks[0]["samples"]  # ranks time the same barrier-to-barrier intervals
        medians = {name: statistics.median(samples[name]) for name in _SCHEDULES}
        faults = {
            name: statistics.median(
                sum(rank["page_faults"][name][i] for rank in ranks) for i in range(options.repeats)
            )
            for name in _SCHEDULES
        }
        speedups[allocator] = {name: medians["1F1B"] / medians[name] for name in _SCHEDULES}
        for name in _SCHEDULES:
            rows.append(
                [
                    f"GLIBC_TUNABLES={tunables}" if tunables else "default",
                    name.replace("sliced", f"sliced n={n}"),
                    medians[name],
                    min(samples[name]),
                    max(samples[name]),
                    tokens / medians[name],
                    medians["1F1B"] / medians[name],
                    makespans["1F1B"] / makespans[name],
                    faults[name] / 1000,
                ]
            )
            if allocator == "fair":
                fair_tokens_per_s[name] = tokens / medians[name]
        if allocator == "fair":
            recorded = [rank["recorded"] for rank in ranks]
    print(describe_pinning(cores))
    headers = ["allocator", "schedule", "median s", "min s", "max s", "tokens/s", "vs 1F1B"]
    print_table([*headers, "simulated", "page faults/step (k, all ranks)"], rows)
    print_step_breakdown(recorded, p, m, n)
    fair = speedups["fair"]
    best = max(_SLICED_VARIANTS, key=lambda name: fair[name])
    bubble_only = (1 + (p - 1) / m) / (1 + (p - 1) / (n * m))
    simulated = makespans["sliced"] / makespans["sliced+equal-cost"]
    measured = fair["sliced+equal-cost"] / fair["sliced"]
    simulated_sliced = makespans["1F1B"] / makespans["sliced"]
    print(
        f"\nbubble-only prediction (1+(p-1)/m)/(1+(p-1)/(nm)) = {bubble_only:.3f}; with causal "
        f"attention's costs (simulated column) {simulated_sliced:.3f}; fair ratio "
        f"{fair['sliced']:.3f} (best variant: {best}, {fair[best]:.3f}), default allocator "
        f"{speedups['default']['sliced']:.3f}\nequal-cost over equal-length slices: simulated "
        f"{simulated:.4f}, measured {measured:.4f}"
    )
    print_result(
        sliced_vs_1f1b_speedup=fair["sliced"],
        best_variant_speedup=fair[best],
        exchange_vs_1f1b_speedup=fair["sliced+exchange"],
        equal_cost_vs_1f1b_speedup=fair["sliced+equal-cost"],
        equal_cost_simulated_gain=simulated,
        equal_cost_measured_gain=measured,
        default_allocator_speedup=speedups["default"]["sliced"],
        sliced_tokens_per_s=fair_tokens_per_s["sliced"],
        f1b_tokens_per_s=fair_tokens_per_s["1F1B"],
        bubble_only_speedup=bubble_only,
        simulated_sliced_speedup=simulated_sliced,
        sliced_share_of_simulated=fair["sliced"] / simulated_sliced,
    )
