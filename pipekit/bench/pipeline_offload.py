"""`python -m pipekit.bench pipeline-memory ... --offload auto|<ratio>`: activation offload.

The sliced schedule (v=1) runs one step without offload and one with it, on the same seeded
weights and batch, after a warm-up step each. Per rank the table shows the ratio the rank
offloads at, the peak bytes saved for backward that stay on the device (`ActivationMemoryTracker`,
which counts an offloaded storage only while it is back), the schedule's prediction of that
peak (`offload_plan.resident_peak` at the share of each offloaded unit's saved bytes that
actually moved; storages something else holds, as the KV cache, cannot move), the rise of the
process's resident memory during the step (the offload file's pages are the kernel's page cache,
not the process's), the step time and the bytes moved. The losses and every gradient of the two
runs must be equal bit for bit.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import torch.distributed as dist
from tensordict import TensorDict

from pipekit.bench._pipeline_launch import build_runner, run_ranks, synthetic_batch
from pipekit.bench._rss import peak_rss, release_freed_memory, reset_peak_rss
from pipekit.bench.report import print_result, print_table
from pipekit.memory.offload import OffloadStats
from pipekit.memory.tracker import ActivationMemoryTracker
from pipekit.pipelining.features.activation_offload import PipelineActivationOffload
from pipekit.pipelining.features.offload_plan import resident_peak
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions

__all__ = ["parse_offload", "run_offload_comparison"]

_MIB = 2**20


def parse_offload(text: str) -> float | str:
    """`--offload`: "auto" or a ratio in [0, 1]."""
    if text == "auto":
        return text
    ratio = float(text)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--offload={text} must be 'auto' or a ratio in (0, 1]")
    return ratio


def _step(runner: PipelineRunner, batch: TensorDict) -> tuple[dict[str, Any], list, Any]:
    """One tracked and timed step: its measurements, gradients and loss."""
    params = [p for stage in runner.stages for p in stage.submod.parameters()]
    for param in params:
        param.grad = None
    gc.collect()
    release_freed_memory()
    dist.barrier()
    rss_before = reset_peak_rss()
    with ActivationMemoryTracker(exclude=params) as tracker:
        start = time.perf_counter()
        loss = runner.step(batch, float(batch["labels"].numel()))
        seconds = time.perf_counter() - start
    measured = {
        "saved": tracker.peak_bytes("saved"),
        "rss_rise": peak_rss() - rss_before,
        "seconds": seconds,
    }
    return measured, [p.grad.detach().clone() for p in params if p.grad is not None], loss


def _measure(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: both runners warmed up, then measured steps alternating (none, offload) x 2; a
    configuration's memory is its first measured step's, its time the faster of its two."""
    model, m, n = spec["model"], spec["microbatches"], spec["slices"]
    batch = synthetic_batch(m, model["max_seq_len"], model["vocab_size"])
    settings = {"none": 0.0, "offload": spec["offload"]}
    runners = {
        label: build_runner(
            model,
            schedule="sliced",
            stages_per_rank=1,
            rank=rank,
            num_ranks=num_ranks,
            microbatches=m,
            num_slices=n,
            rows=m,
            activation_offload=setting,
        )
        for label, setting in settings.items()
    }
    for runner in runners.values():
        runner.step(batch, float(batch["labels"].numel()))  # warm-up
    offload = runners["offload"].extension("activation_offload")
    assert isinstance(offload, PipelineActivationOffload)
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, tuple[list, Any]] = {}
    offload.offloader.stats = OffloadStats()  # what the first measured step moves
    for repeat in range(2):
        for label, runner in runners.items():
            measured, grads, loss = _step(runner, batch)
            if repeat:
                runs[label]["seconds"] = min(runs[label]["seconds"], measured["seconds"])
            else:
                runs[label], outputs[label] = measured, (grads, loss)
        if not repeat:
            stats = dataclasses.replace(offload.offloader.stats)
    (plain_grads, plain_loss), (grads, loss) = outputs["none"], outputs["offload"]
    differences = [(a - b).abs().max().item() for a, b in zip(grads, plain_grads, strict=True)]
    if loss is not None:
        differences.append((loss - plain_loss).abs().item())
    actions = sliced_pipeline_actions(num_ranks, m, n, 1)[rank]
    peak_units = resident_peak(actions, 0.0)
    # the share of an in-flight unit's bytes (at the no-offload peak) that one offload moves
    moved_share = 0.0
    if stats.offloaded_units:
        moved_share = (stats.offloaded_bytes / stats.offloaded_units) / (
            runs["none"]["saved"] / peak_units
        )
    runs["offload"] |= {
        "ratio": offload.ratios[rank],
        "offloaded": stats.offloaded_bytes,
        "moved_share": moved_share,
        "predicted": resident_peak(actions, min(moved_share, 1.0)) / peak_units,
        "late_reloads": stats.late_reloads,
        "max_difference": max(differences, default=0.0),
    }
    return {"rank": rank, "runs": runs}


def run_offload_comparison(spec: dict[str, Any], num_ranks: int, timeout: float) -> None:
    """Run the comparison on `num_ranks` ranks and print its table and RESULT line."""
    ranks = run_ranks(f"{__name__}:_measure", num_ranks, spec, timeout=timeout)
    rows = []
    for result in ranks:
        plain, offload = result["runs"]["none"], result["runs"]["offload"]
        rows.append(
            [
                result["rank"],
                offload["ratio"],
                plain["saved"] / _MIB,
                offload["saved"] / _MIB,
                offload["saved"] / plain["saved"],
                offload["predicted"],
                offload["moved_share"],
                plain["rss_rise"] / _MIB,
                offload["rss_rise"] / _MIB,
                plain["seconds"],
                offload["seconds"],
                offload["offloaded"] / _MIB,
                offload["late_reloads"],
                offload["max_difference"],
            ]
        )
    print(
        f"\nsliced v=1, activation offload {spec['offload']!r} against none; saved = peak bytes "
        "saved for backward on the device"
    )
    print_table(
        [
            "rank",
            "ratio",
            "saved MiB",
            "offload MiB",
            "resident",
            "predicted",
            "moved share",
            "RSS rise MiB",
            "offload RSS",
            "step s",
            "offload s",
            "moved MiB",
            "late",
            "max |diff|",
        ],
        rows,
    )
    first = ranks[0]["runs"]
    seconds = [max(r["runs"][label]["seconds"] for r in ranks) for label in ("none", "offload")]
    print_result(
        offload_resident_ratio=first["offload"]["saved"] / first["none"]["saved"],
        predicted=first["offload"]["predicted"],
        offload_time_ratio=seconds[1] / seconds[0],
        offload_rss_ratio=first["offload"]["rss_rise"] / max(first["none"]["rss_rise"], 1),
        max_difference=max(r["runs"]["offload"]["max_difference"] for r in ranks),
    )
