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
import os
import resource
import statistics
import time
from typing import Any

import torch.distributed as dist

from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pinning_argument,
    add_pipeline_arguments,
    bench_plan,
    build_runner,
    check_pipeline_shape,
    describe_model,
    describe_pinning,
    describe_slices,
    model_spec,
    rank_core_sets,
    run_ranks,
    synthetic_batch,
)
from pipekit.bench._report import print_result, print_table
from pipekit.memory.live_tensors import PeakTensorMemory
from pipekit.memory.tracker import ActivationMemoryTracker
from pipekit.pipelining.features.context_exchange import PipelineContextExchange
from pipekit.pipelining.features.exchange_plan import plan_context_exchange
from pipekit.pipelining.features.measured_choice import MeasuredChoice
from pipekit.pipelining.plan import PipelinePlan
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.pipelining.schedules.simulate import CostModel, SimulationResult, simulate
from pipekit.pipelining.tools.trace import record_schedule

__all__ = [
    "FAIR_ALLOCATOR",
    "main",
    "print_step_breakdown",
    "schedule_runs",
    "simulate_plan",
    "simulated_makespan",
    "time_schedules",
]

FAIR_ALLOCATOR = "glibc.malloc.mmap_max=0"
"""The GLIBC_TUNABLES value of the fair comparison: no mmap-served allocations."""

_SCHEDULES = ("sliced", "sliced+exchange", "sliced+equal-cost", "1F1B")
_SLICED_VARIANTS = ("sliced", "sliced+exchange", "sliced+equal-cost")


def schedule_runs(num_slices: int) -> dict[str, dict[str, Any]]:
    """The compared schedules, as `build_runner` keywords by name: sliced, sliced with context
    exchange, sliced into equal-cost slices, torch's 1F1B."""
    sliced = {"schedule": "sliced", "num_slices": num_slices}
    return {
        "sliced": sliced,
        "sliced+exchange": {**sliced, "context_exchange": True},
        "sliced+equal-cost": {**sliced, "slicing": "equal_cost"},
        "1F1B": {"schedule": "1F1B", "num_slices": 1},
    }


def time_schedules(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: build one runner per entry of `spec["runs"]` (name -> `build_runner` keywords
    `schedule`, `num_slices`, optionally `context_exchange`, `slicing`, `activation_offload`
    or `activation_checkpoint`), warm each up, then time them alternately: every step's
    seconds, page faults and CPU seconds. With `spec["step_peak"]`, one more step of each
    under `PeakTensorMemory`: the bytes its tensors take at their fullest beyond the weights
    and gradients (activations, K/V caches, messages, backward working sets)."""
    model, microbatches = spec["model"], spec["microbatches"]
    rows = microbatches * spec["rows_per_microbatch"]
    batch = synthetic_batch(rows, model["max_seq_len"], model["vocab_size"])
    num_label_tokens = float(batch["labels"].numel())
    runners = {
        name: build_runner(
            model,
            rank=rank,
            num_ranks=num_ranks,
            microbatches=microbatches,
            rows=rows,
            **{"stages_per_rank": 1, **run},
        )
        for name, run in spec["runs"].items()
    }

    def timed_step(name: str) -> tuple[float, int, dict[str, float]]:
        """Seconds between barriers around one step, this rank's minor page faults, and its
        CPU seconds: the rank's own thread, the context exchange's serving threads, the whole
        process (which adds gloo's threads)."""
        runner = runners[name]
        exchange = runner.extension("context_exchange")
        dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        thread_cpu, process_cpu = time.thread_time(), time.process_time()
        start = time.perf_counter()
        runner.step(batch, num_label_tokens)
        dist.barrier()
        seconds = time.perf_counter() - start
        cpu = {
            "rank_thread_s": time.thread_time() - thread_cpu,
            "process_s": time.process_time() - process_cpu,
            "serving_s": exchange.serving_cpu_s
            if isinstance(exchange, PipelineContextExchange)
            else 0.0,
        }
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        _zero_gradients(runner)
        return seconds, faults, cpu

    for _ in range(spec["warmup"]):
        for name in runners:
            timed_step(name)
    for name, runner in runners.items():  # a measured choice is settled before the timing
        while any(choice.chosen_index is None for choice in _measured_choices(runner).values()):
            timed_step(name)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    page_faults: dict[str, list[int]] = {name: [] for name in runners}
    cpu_seconds: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(spec["repeats"]):
        for name in runners:
            seconds, faults, cpu = timed_step(name)
            samples[name].append(seconds)
            page_faults[name].append(faults)
            cpu_seconds[name].append(cpu)
    choices = {
        name: {
            kind: {
                "chosen": choice.chosen,
                "label": choice.labels[choice.current_index],
                "reason": choice.reason,
            }
            for kind, choice in _measured_choices(runner).items()
        }
        for name, runner in runners.items()
    }
    step_peaks = {}
    if spec.get("step_peak"):  # after the timing: the dispatch mode slows the step it watches
        for name, runner in runners.items():
            with PeakTensorMemory() as memory:
                runner.step(batch, num_label_tokens)
            dist.barrier()
            _zero_gradients(runner)
            step_peaks[name] = memory.peak_bytes
    return {
        "samples": samples,
        "step_peaks": step_peaks,
        "choices": choices,
        "page_faults": page_faults,
        "cpu": cpu_seconds,
        "recorded": {
            name: _recorded_step(runner, batch, num_label_tokens)
            for name, runner in runners.items()
            if spec.get("record", True)
        },
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }


def _measured_choices(runner: PipelineRunner) -> dict[str, MeasuredChoice[Any]]:
    """The runner's measured choices by kind: "exchange" (`context_exchange = "auto"`) and
    "layout" (`num_slices` or `slicing = "auto"`)."""
    choices: dict[str, MeasuredChoice[Any]] = {}
    exchange = runner.extension("context_exchange")
    if isinstance(exchange, PipelineContextExchange) and exchange.choice is not None:
        choices["exchange"] = exchange.choice
    if runner.layout_choice is not None:
        choices["layout"] = runner.layout_choice
    return choices


def _zero_gradients(runner: PipelineRunner) -> None:
    """Gradients back to zero in place after a step, so every step does the same work."""
    for stage in runner.stages:
        stage.submod.zero_grad(set_to_none=False)


def _recorded_step(runner: PipelineRunner, batch: Any, num_label_tokens: float) -> dict[str, float]:
    """One more step with every compute action timed (`record_schedule`): the step's time (to
    the barrier after it), the time inside this rank's actions and how many it ran, and the
    peak bytes of its activations (saved tensors, KV cache, stage inputs). What is
    left is idle: waiting for the other ranks (the bubble, which causal imbalance lengthens)
    plus everything outside the compute, the runtime's Python, sends, receives and the loss."""
    exchange = runner.extension("context_exchange")
    params = [param for stage in runner.stages for param in stage.submod.parameters()]
    with ActivationMemoryTracker(exclude=params) as tracker, record_schedule(runner) as recorder:
        runner.step(batch, num_label_tokens)
    dist.barrier()  # every rank's step ends when the last rank's does, as the bubble counts it
    step_s = time.perf_counter() - recorder.origin
    _zero_gradients(runner)
    compute_s = sum(event.end - event.start for event in recorder.events)
    figures = {"step_s": step_s, "compute_s": compute_s, "actions": len(recorder.events)}
    figures["peak_activation_bytes"] = tracker.report().peak_total_bytes
    if isinstance(exchange, PipelineContextExchange):  # early KV exchange
        figures["ahead_passes"] = len(exchange.ahead_sends)
        figures["ahead_posted_s"] = sum(sent.lead_s for sent in exchange.ahead_sends)
        figures["ahead_bytes"] = sum(sent.nbytes for sent in exchange.ahead_sends)
        figures["ahead_held_s"] = sum(exchange.chunk_leads_s)
        figures["ahead_served"] = len(exchange.chunk_leads_s)
        figures["ahead_held_min_s"] = min(exchange.chunk_leads_s, default=float("nan"))
    return figures


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
        from pipekit.bench._memory_budget import compare_at_budget, sweep_budgets

        if options.schedules != "all":
            parser.exit(2, f"{parser.prog}: error: --memory-budget needs --schedules all\n")
        if options.memory_budget == "sweep":
            sweep_budgets(parser, options)
        else:
            compare_at_budget(parser, options)
        return
    if options.schedules == "all":
        from pipekit.bench._all_schedules import compare_all_schedules

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
            f"{__name__}:time_schedules",
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


def simulated_makespan(plan: PipelinePlan, backward_ratio: float = 2.0) -> float:
    """The simulator's makespan of `plan` (`simulate_plan`)."""
    return simulate_plan(plan, backward_ratio).makespan


def simulate_plan(plan: PipelinePlan, backward_ratio: float = 2.0) -> SimulationResult:
    """The simulator's run of `plan` with its own slices at the model's attention-to-linear
    FLOPs (the costs equal-cost slices are placed by), context exchange's moves included; no
    overheads, so the simulated ratios are the limits the measured ones approach."""
    cost = CostModel(
        forward_attention=plan.attention_to_linear,
        backward_ratio=backward_ratio,
        slice_bounds=plan.slice_fractions,
    )
    attended = None
    if "context_exchange" in plan.features:
        exchange = plan_context_exchange(plan.actions_by_rank, plan.num_slices, backward_ratio)
        attended = exchange.attended_slices()
    return simulate(
        plan.actions_by_rank, num_slices=plan.num_slices, cost=cost, attended_slices=attended
    )


def print_step_breakdown(
    recorded: list[dict[str, dict[str, float]]], p: int, m: int, n: int
) -> None:
    """Where each rank's step went in the recorded step: compute actions against idle time,
    and the idle left after the bubble that equal-cost actions would leave
    ((p-1)/(units+p-1) of the step, units = m for 1F1B, n m sliced), per action."""
    rows = []
    for name in recorded[0]:
        units = m if name == "1F1B" else n * m
        bubble = (p - 1) / (units + p - 1)
        for rank, by_schedule in enumerate(recorded):
            step = by_schedule[name]
            idle = step["step_s"] - step["compute_s"]
            excess = idle - bubble * step["step_s"]
            rows.append(
                [
                    name,
                    rank,
                    step["step_s"],
                    step["compute_s"],
                    idle / step["step_s"],
                    bubble,
                    int(step["actions"]),
                    1000 * excess / step["actions"],
                ]
            )
    print("\nrecorded step (fair allocator), per rank:")
    headers = ["schedule", "rank", "step s", "compute s", "idle share", "uniform bubble"]
    print_table([*headers, "actions", "excess idle/action ms"], rows)
