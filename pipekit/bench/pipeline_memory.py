"""`python -m pipekit.bench pipeline-memory --pp 4 --slices 16 --microbatches 4 --seq 4096`.

Peak activation memory of the first and the last pipeline rank for GPipe, 1F1B, interleaved
1F1B (v=2) and the sliced schedule (v=1 and v=2), beside SlimPipe's Table 2 (seed 000), all
relative to 1F1B's first rank: GPipe m/p, 1F1B 1, interleaved 1+(p-1)/(vp), sliced
1/p + 2(p-1)/(nvp) (Eq. 1: (1+2(p-1)/n)/p for v=1).

Activation memory is what autograd saves for backward (`ActivationMemoryTracker`, parameters
excluded; a storage counts once however many tensors view it), measured in one training step on
`--pp` gloo ranks with one sequence per microbatch and the same evenly split model for every
schedule. The received stage inputs and the KV cache are shown on their own. Beside Table 2 the
table shows what each schedule's own action list predicts: the most units (microbatches, or
slices, per stage) in flight on the rank, in microbatch equivalents; Table 2 assumes
enough microbatches for every warm-up to fill, which small `--microbatches` may not give.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch.distributed as dist

from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    build_runner,
    check_pipeline_shape,
    describe_model,
    model_spec,
    run_ranks,
    synthetic_batch,
)
from pipekit.bench._report import print_result, print_table
from pipekit.pipelining.actions import peak_units_in_flight
from pipekit.pipelining.memory import ActivationMemoryTracker

__all__ = ["main"]

_MIB = 2**20


def _schedules(num_slices: int) -> list[tuple[str, str, int, int]]:
    """(label, schedule name, stages per rank v, slices n) in the order of the table."""
    return [
        ("GPipe", "GPipe", 1, 1),
        ("1F1B", "1F1B", 1, 1),
        ("Interleaved1F1B", "Interleaved1F1B", 2, 1),
        ("sliced", "sliced", 1, num_slices),
        ("sliced", "sliced", 2, num_slices),
    ]


def table2_prediction(label: str, p: int, m: int, v: int, n: int) -> float:
    """First-rank peak activation memory relative to 1F1B's (SlimPipe Table 2)."""
    if label == "GPipe":
        return m / p
    if label == "1F1B":
        return 1.0
    if label == "Interleaved1F1B":
        return 1 + (p - 1) / (v * p)
    return 1 / p + 2 * (p - 1) / (n * v * p)  # SlimPipe Eq. 1


def _measure(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: one tracked step of every schedule on this rank."""
    model, microbatches = spec["model"], spec["microbatches"]
    rows = microbatches  # one sequence per microbatch
    batch = synthetic_batch(rows, model["max_seq_len"], model["vocab_size"])
    measurements = []
    for label, schedule, stages_per_rank, num_slices in _schedules(spec["slices"]):
        runner = build_runner(
            model,
            schedule=schedule,
            stages_per_rank=stages_per_rank,
            rank=rank,
            num_ranks=num_ranks,
            microbatches=microbatches,
            num_slices=num_slices,
            rows=rows,
        )
        params = [p for stage in runner.stages for p in stage.submod.parameters()]
        dist.barrier()
        with ActivationMemoryTracker(exclude=params) as tracker:
            start = time.perf_counter()
            runner.step(batch, float(batch["labels"].numel()))
            seconds = time.perf_counter() - start
        report = tracker.report()
        units = peak_units_in_flight(runner.schedule.pipeline_order[rank])
        measurements.append(
            {
                "label": label,
                "v": stages_per_rank,
                "n": num_slices,
                "saved": report.peak_saved_bytes,
                "stage_inputs": report.peak_stage_input_bytes,
                "kv_cache": report.peak_kv_cache_bytes,
                "total": report.peak_total_bytes,
                "microbatches_in_flight": units / (stages_per_rank * num_slices),
                "seconds": seconds,
            }
        )
        del runner, params
        gc.collect()
    return {"rank": rank, "measurements": measurements}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench pipeline-memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    parser.add_argument("--slices", type=int, default=16, help="slices per sequence n (sliced)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches m per step")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length S")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for all ranks")
    add_model_arguments(parser, dim=128, heads=8, kv_heads=4, ffn_dim=384, vocab=256)
    options = parser.parse_args(argv)
    if options.layers is None:
        options.layers = 2 * options.pp
    p, m, n = options.pp, options.microbatches, options.slices
    try:
        check_pipeline_shape(
            num_ranks=p,
            microbatches=m,
            num_slices=n,
            seq_len=options.seq,
            num_layers=options.layers,
            stages_per_rank=2,
        )
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(
                f"--microbatches={m} must be a multiple of {rounds} (= m // p) for torch's "
                f"Interleaved1F1B; try {m // rounds * rounds}"
            )
        spec = {"model": model_spec(options, options.seq), "microbatches": m, "slices": n}
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    print(describe_model(spec["model"]))
    print(
        f"p={p} ranks, m={m} microbatches of 1 x {options.seq} tokens, n={n} slices, "
        "1 thread per rank; activation memory = peak bytes saved for backward"
    )
    if options.layers % (2 * p):
        print(f"note: {options.layers} layers do not split evenly over {2 * p} stages")
    ranks = run_ranks(f"{__name__}:_measure", p, spec, timeout=options.timeout)
    first, last = ranks[0]["measurements"], ranks[-1]["measurements"]
    baseline = next(row for row in first if row["label"] == "1F1B")
    base_bytes, base_units = baseline["saved"], baseline["microbatches_in_flight"]

    rows, ratios = [], {}
    for head, tail in zip(first, last, strict=True):
        label, v, slices = head["label"], head["v"], head["n"]
        name = f"{label} v={v}" + (f" n={slices}" if label == "sliced" else "")
        ratio_first, ratio_last = head["saved"] / base_bytes, tail["saved"] / base_bytes
        ratios[(label, v)] = ratio_first
        rows.append(
            [
                name,
                head["saved"] / _MIB,
                ratio_first,
                table2_prediction(label, p, m, v, slices),
                head["microbatches_in_flight"] / base_units,
                tail["saved"] / _MIB,
                ratio_last,
                tail["microbatches_in_flight"] / base_units,
            ]
        )
    print(
        f"\npeak saved activations; ratios relative to 1F1B's rank 0 ({base_bytes / _MIB:.1f} MiB)"
    )
    print_table(
        [
            "schedule",
            "rank 0 MiB",
            "rank 0 ratio",
            "Table 2",
            "by schedule",
            f"rank {p - 1} MiB",
            f"rank {p - 1} ratio",
            "by schedule",
        ],
        rows,
    )
    print("\nper rank detail: saved / received stage inputs / KV cache / union, MiB; step s")
    detail = []
    for rank_result in (ranks[0], ranks[-1]):
        for row in rank_result["measurements"]:
            detail.append(
                [
                    rank_result["rank"],
                    f"{row['label']} v={row['v']} n={row['n']}",
                    row["saved"] / _MIB,
                    row["stage_inputs"] / _MIB,
                    row["kv_cache"] / _MIB,
                    row["total"] / _MIB,
                    row["microbatches_in_flight"],
                    row["seconds"],
                ]
            )
    print_table(
        [
            "rank",
            "schedule",
            "saved",
            "stage inputs",
            "KV cache",
            "union",
            "microbatches in flight",
            "step s",
        ],
        detail,
    )
    print_result(
        sliced_vs_1f1b=ratios[("sliced", 1)],
        formula=(1 + 2 * (p - 1) / n) / p,
        sliced_v2_vs_1f1b=ratios[("sliced", 2)],
        formula_v2=table2_prediction("sliced", p, m, 2, n),
    )
