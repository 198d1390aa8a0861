"""Timing pipeline schedules in the same ranks (the worker every pipeline bench launches), and
their simulated limits: the pieces `pipeline-throughput`, its every-schedule and memory-budget
comparisons, `schemes` and `context-exchange` share.

Fair CPU timing: glibc serves large tensors with fresh mmaps, so full-sequence schedules pay
page faults that sliced ones, with their smaller tensors, mostly avoid; `FAIR_ALLOCATOR` starts
ranks that reuse the heap instead.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist

from pipekit.bench._pipeline_launch import (
    build_runner,
    describe_model,
    describe_pinning,
    rank_core_sets,
    run_ranks,
    synthetic_batch,
)
from pipekit.bench.report import max_over_mean, print_table
from pipekit.memory.live_tensors import PeakTensorMemory
from pipekit.memory.tracker import ActivationMemoryTracker
from pipekit.pipelining.features.registry import simulated_attention
from pipekit.pipelining.plan import PipelinePlan
from pipekit.pipelining.runtime.measured_choice import MeasuredChoice
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.pipelining.schedules.simulate import CostModel, SimulationResult, simulate
from pipekit.pipelining.tools.trace import record_schedule

__all__ = [
    "FAIR_ALLOCATOR",
    "print_step_breakdown",
    "schedule_runs",
    "simulate_plan",
    "simulated_makespan",
    "time_alternately",
    "time_schedules",
]


FAIR_ALLOCATOR = "glibc.malloc.mmap_max=0"
"""The GLIBC_TUNABLES value of the fair comparison: no mmap-served allocations."""


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


def time_alternately(
    num_ranks: int, spec: dict[str, Any], *, pin: bool, timeout: float
) -> list[dict[str, Any]]:
    """Run `time_schedules(spec)` on `num_ranks` fresh ranks (pinned to cores of their own
    where `pin` and the cores allow, the fair allocator), after printing the model and how it
    is timed; every rank's figures."""
    cores = rank_core_sets(num_ranks, pin=pin)
    print(f"\nmeasured: {describe_model(spec['model'])}")
    print(
        f"{num_ranks} gloo ranks, 1 thread each, {describe_pinning(cores)}, "
        f"GLIBC_TUNABLES={FAIR_ALLOCATOR}; {spec['warmup']} warm-up and {spec['repeats']} timed "
        "steps of each, alternating"
    )
    return run_ranks(
        "pipekit.bench._schedule_timing:time_schedules", num_ranks, spec,
        env={"GLIBC_TUNABLES": FAIR_ALLOCATOR}, timeout=timeout, cores=cores,
    )  # fmt: skip


def time_schedules(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: build one runner per entry of `spec["runs"]` (name -> `build_runner` keywords
    `schedule`, `num_slices`, optionally `context_exchange`, `slicing`, `activation_offload`
    or `activation_checkpoint`), warm each up, then time them alternately: every step's
    seconds, page faults and CPU seconds. With `spec["step_peak"]`, one more step of each
    under `PeakTensorMemory`: the bytes its tensors take at their fullest beyond the weights
    and gradients (activations, K/V caches, messages, backward working sets)."""
    model, microbatches = spec["model"], spec["microbatches"]
    rows = microbatches * spec["rows_per_microbatch"]
    documents = spec.get("document_ids")
    batch = synthetic_batch(
        rows,
        model["max_seq_len"],
        model["vocab_size"],
        None if documents is None else torch.tensor(documents),
    )
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
            "serving_s": sum(extension.helper_cpu_s() for extension in runner.extensions),
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
            name: _recorded_step(runner, batch, num_label_tokens, spec.get("slice_steps", 1))
            for name, runner in runners.items()
            if spec.get("record", True)
        },
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }


def _measured_choices(runner: PipelineRunner) -> dict[str, MeasuredChoice[Any]]:
    """The runner's measured choices by kind: each feature's by its name (its setting is
    "auto") and "layout" (`num_slices` or `slicing = "auto"`)."""
    choices: dict[str, MeasuredChoice[Any]] = {
        extension.name: choice
        for extension in runner.extensions
        if (choice := extension.measured_choice()) is not None
    }
    if runner.layout_choice is not None:
        choices["layout"] = runner.layout_choice
    return choices


def _zero_gradients(runner: PipelineRunner) -> None:
    """Gradients back to zero in place after a step, so every step does the same work."""
    for stage in runner.stages:
        stage.submod.zero_grad(set_to_none=False)


def _recorded_step(
    runner: PipelineRunner, batch: Any, num_label_tokens: float, slice_steps: int = 1
) -> dict[str, float]:
    """One more step with every compute action timed (`record_schedule`): the step's time (to
    the barrier after it), the time inside this rank's actions and how many it ran, and the
    peak bytes of its activations (saved tensors, KV cache, stage inputs). What is
    left is idle: waiting for the other ranks (the bubble, which causal imbalance lengthens)
    plus everything outside the compute, the runtime's Python, sends, receives and the loss.
    The slice-time imbalance adds `slice_steps - 1` more recorded steps of the same batch:
    each slice's seconds summed over them, so the machine's step-to-step jitter averages out
    and what remains is the cut's."""
    params = [param for stage in runner.stages for param in stage.submod.parameters()]
    with ActivationMemoryTracker(exclude=params) as tracker, record_schedule(runner) as recorder:
        runner.step(batch, num_label_tokens)
    dist.barrier()  # every rank's step ends when the last rank's does, as the bubble counts it
    step_s = time.perf_counter() - recorder.origin
    _zero_gradients(runner)
    compute_s = sum(event.end - event.start for event in recorder.events)
    figures = {"step_s": step_s, "compute_s": compute_s, "actions": len(recorder.events)}
    events = list(recorder.events)
    for _ in range(slice_steps - 1):
        with record_schedule(runner) as more:
            runner.step(batch, num_label_tokens)
        dist.barrier()
        _zero_gradients(runner)
        events += more.events
    figures["slice_time_imbalance"] = _slice_time_imbalance(events, runner.num_slices)
    figures["peak_activation_bytes"] = tracker.report().peak_total_bytes
    for extension in runner.extensions:
        figures.update(extension.step_figures())
    return figures


def _slice_time_imbalance(events: list[Any], num_slices: int) -> float:
    """How unevenly a microbatch's slices took this rank's compute: per (stage, microbatch),
    the slowest slice's forward plus backward seconds (summed over the recorded steps) over
    the mean of its slices, averaged (1: even; NaN without slices)."""
    if num_slices < 2:
        return float("nan")
    seconds: dict[tuple[int, int], dict[int, float]] = {}
    for event in events:
        microbatch, slice_index = divmod(event.action.microbatch_index, num_slices)
        per_slice = seconds.setdefault((event.action.stage_index, microbatch), {})
        per_slice[slice_index] = per_slice.get(slice_index, 0.0) + event.end - event.start
    ratios = [max_over_mean(list(times.values())) for times in seconds.values()]
    return sum(ratios) / len(ratios)


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
        slice_bounds=plan.slices.fractions,
    )
    attended = simulated_attention(plan, backward_ratio)
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
