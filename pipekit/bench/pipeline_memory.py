"""`python -m pipekit.bench pipeline-memory --pp 4 --slices 16 --microbatches 4 --seq 4096`.

Peak activation memory of the first and the last pipeline rank for GPipe, 1F1B, interleaved
1F1B (v=2) and the sliced schedule (v=1 and v=2), beside SlimPipe's Table 2, all
relative to 1F1B's first rank: GPipe m/p, 1F1B 1, interleaved 1+(p-1)/(vp), sliced
1/p + 2(p-1)/(nvp) (Eq. 1: (1+2(p-1)/n)/p for v=1). A last row slices into equal-cost slices
(v=1), whose first slices are the longest; its prediction is the simulator's (the plan's
slices in flight, weighted by their tokens).

Activation memory is what autograd saves for backward (`ActivationMemoryTracker`, parameters
excluded; a storage counts once however many tensors view it), measured in one training step on
`--pp` gloo ranks with one sequence per microbatch and the same evenly split model for every
schedule. The received stage inputs and the KV-cache chunks are shown on their own (both are
mostly the same storages autograd saves; the union counts each once). Beside Table 2 the
table shows what each schedule's own action list predicts: the most units (microbatches, or
slices, per stage) in flight on the rank, in microbatch equivalents. Table 2 assumes enough
microbatches for every warm-up to fill; where `--microbatches` is too few for interleaved 1F1B,
a second interleaved row runs with the fewest that fill it.

With `--offload auto|<ratio>` the bench compares the sliced schedule with and without
pipeline-aware activation offload instead (`pipekit.bench.pipeline_offload`); with
`--model deepseek_v3`, multi-head latent attention's latent KV cache with expanded K/V
(`pipekit.bench.latent_cache`).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch.distributed as dist

from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pipeline_arguments,
    bench_plan,
    build_runner,
    check_pipeline_shape,
    describe_model,
    describe_slices,
    model_spec,
    run_ranks,
    synthetic_batch,
)
from pipekit.bench.latent_cache import add_latent_cache_arguments, run_latent_cache_comparison
from pipekit.bench.pipeline_offload import parse_offload, run_offload_comparison
from pipekit.bench.report import print_result, print_table
from pipekit.memory.tracker import ActivationMemoryTracker
from pipekit.pipelining.plan import PipelinePlan
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.pipelining.schedules.sliced import peak_units_in_flight

__all__ = ["main"]

_MIB = 2**20


def schedules_to_measure(p: int, m: int, n: int) -> list[dict[str, Any]]:
    """The rows of the table: label, schedule name, stages per rank v, slices n, microbatches m.

    With few microbatches torch's Interleaved1F1B cannot fill its warm-up of `(v-1)p + 2(p-1)`
    chunks (it runs every forward first), so a second interleaved row uses the fewest
    microbatches (a multiple of p) that fill it, where Table 2's 1+(p-1)/(vp) applies.
    """
    rows = [
        {"label": "GPipe", "schedule": "GPipe", "v": 1, "n": 1, "m": m},
        {"label": "1F1B", "schedule": "1F1B", "v": 1, "n": 1, "m": m},
        {"label": "Interleaved1F1B", "schedule": "Interleaved1F1B", "v": 2, "n": 1, "m": m},
    ]
    filled = _interleaved_filling_microbatches(p, stages_per_rank=2)
    if filled > m:
        rows.append(rows[-1] | {"m": filled})
    rows += [
        {"label": "sliced", "schedule": "sliced", "v": 1, "n": n, "m": m},
        {"label": "sliced", "schedule": "sliced", "v": 2, "n": n, "m": m},
        {"label": _EQUAL_COST, "schedule": "sliced", "v": 1, "n": n, "m": m},
    ]
    return rows


_EQUAL_COST = "sliced equal-cost"


def _interleaved_filling_microbatches(p: int, stages_per_rank: int) -> int:
    """Fewest microbatches, a multiple of p, with v*m >= (v-1)p + 2(p-1) + 1 chunks."""
    chunks = (stages_per_rank - 1) * p + 2 * (p - 1) + 1
    microbatches = -(-chunks // stages_per_rank)
    return -(-microbatches // p) * p


def equal_cost_prediction(plan: PipelinePlan) -> float:
    """First-rank peak activation memory of an equal-cost sliced plan relative to 1F1B's, by
    the simulator: its units in flight weighted by their slices' tokens."""
    cost = CostModel(slice_bounds=plan.slices.fractions)
    result = simulate(plan.actions_by_rank, num_slices=plan.num_slices, cost=cost)
    return result.peak_memory[0]["activations"]  # 1F1B's first rank holds 1 (p microbatches / p)


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
    """Worker: one tracked step of every schedule on this rank (one sequence per microbatch)."""
    model = spec["model"]
    measurements = []
    for config in spec["schedules"]:
        stages_per_rank, num_slices, microbatches = config["v"], config["n"], config["m"]
        batch = synthetic_batch(microbatches, model["max_seq_len"], model["vocab_size"])
        runner = build_runner(
            model,
            schedule=config["schedule"],
            stages_per_rank=stages_per_rank,
            rank=rank,
            num_ranks=num_ranks,
            microbatches=microbatches,
            num_slices=num_slices,
            rows=microbatches,
            slicing="equal_cost" if config["label"] == _EQUAL_COST else "equal_length",
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
            config
            | {
                "saved": report.peak_saved_bytes,
                "stage_inputs": report.peak_stage_input_bytes,
                "kv_cache": report.peak_kv_cache_bytes,
                "total": report.peak_total_bytes,
                "microbatches_in_flight": units / (stages_per_rank * num_slices),
                "seconds": seconds,
            }
        )
        del runner, params, batch
        gc.collect()
    return {"rank": rank, "measurements": measurements}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench pipeline-memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pipeline_arguments(parser, pp=4, slices=16, microbatches=4, seq=4096)
    add_model_arguments(parser, dim=128, heads=8, kv_heads=4, ffn_dim=384, vocab=256)
    parser.add_argument(
        "--offload",
        default=None,
        help='compare the sliced schedule with activation offload at this ratio (or "auto", '
        "each rank down to the last rank's peak) against none",
    )
    add_latent_cache_arguments(parser)
    options = parser.parse_args(argv)
    if options.layers is None:
        options.layers = 2 * options.pp
    if options.model == "deepseek_v3":
        try:
            check_pipeline_shape(
                num_ranks=options.pp,
                microbatches=options.microbatches,
                num_slices=options.slices,
                seq_len=options.seq,
                num_layers=options.layers,
                stages_per_rank=1,
            )
            run_latent_cache_comparison(options)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        return
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
        spec = {
            "model": model_spec(options, options.seq),
            "schedules": schedules_to_measure(p, m, n),
        }
        offload = None if options.offload is None else parse_offload(options.offload)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    print(describe_model(spec["model"]))
    print(
        f"p={p} ranks, m={m} microbatches of 1 x {options.seq} tokens, n={n} slices, "
        "1 thread per rank; activation memory = peak bytes saved for backward"
    )
    if options.layers % (2 * p):
        print(f"note: {options.layers} layers do not split evenly over {2 * p} stages")
    if offload is not None:
        offload_spec = {"model": spec["model"], "microbatches": m, "slices": n, "offload": offload}
        run_offload_comparison(offload_spec, p, options.timeout)
        return
    equal_cost = bench_plan(
        spec["model"],
        schedule="sliced",
        stages_per_rank=1,
        num_ranks=p,
        microbatches=m,
        num_slices=n,
        rows=m,
        slicing="equal_cost",
    )
    print(f"equal-cost slices: {describe_slices(equal_cost)}")
    ranks = run_ranks(f"{__name__}:_measure", p, spec, timeout=options.timeout)
    first, last = ranks[0]["measurements"], ranks[-1]["measurements"]
    baseline = next(row for row in first if row["label"] == "1F1B")
    base_bytes, base_units = baseline["saved"], baseline["microbatches_in_flight"]

    def name(row: dict[str, Any]) -> str:
        slices = f" n={row['n']}" if row["label"].startswith("sliced") else ""
        microbatches = f" m={row['m']}" if row["m"] != m else ""
        return f"{row['label']} v={row['v']}{slices}{microbatches}"

    rows, ratios = [], {}
    equal_cost_predicted = equal_cost_prediction(equal_cost)
    for head, tail in zip(first, last, strict=True):
        ratio_first, ratio_last = head["saved"] / base_bytes, tail["saved"] / base_bytes
        ratios[name(head)] = ratio_first
        if head["label"] == _EQUAL_COST:
            prediction = equal_cost_predicted
        else:
            prediction = table2_prediction(head["label"], p, head["m"], head["v"], head["n"])
        rows.append(
            [
                name(head),
                head["saved"] / _MIB,
                ratio_first,
                prediction,
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
            "predicted",
            "by schedule",
            f"rank {p - 1} MiB",
            f"rank {p - 1} ratio",
            "by schedule",
        ],
        rows,
    )
    print("\nper rank, MiB: saved for backward, received stage inputs, KV cache, their union")
    detail = []
    for rank_result in (ranks[0], ranks[-1]):
        for row in rank_result["measurements"]:
            detail.append(
                [
                    rank_result["rank"],
                    name(row),
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
        sliced_vs_1f1b=ratios[f"sliced v=1 n={n}"],
        formula=(1 + 2 * (p - 1) / n) / p,
        sliced_v2_vs_1f1b=ratios[f"sliced v=2 n={n}"],
        formula_v2=table2_prediction("sliced", p, m, 2, n),
        equal_cost_vs_1f1b=ratios[f"{_EQUAL_COST} v=1 n={n}"],
        equal_cost_simulated=equal_cost_predicted,
    )
