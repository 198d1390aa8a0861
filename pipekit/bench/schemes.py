"""`python -m pipekit.bench schemes [--contexts 4096 8192 16384] [--out schemes.png]`.

Pipeline schemes across context lengths, in one picture as SlimPipe compares them: torch's 1F1B,
Interleaved1F1B (v=2) and ZBVZeroBubble (v=2) against the sliced schedule, with and without
attention context exchange.

Measured (left panels, this machine): for each context, `--pp` gloo ranks time every scheme in
alternating rounds on the same small Llama and batch (`--microbatches` sequences; the
pipeline-throughput bench's worker and fair allocator): tokens/s, and the worst rank's peak
activation bytes (saved tensors, KV cache, stage inputs) in one recorded step.

Simulated (right panels, cluster scale): Llama 70B (d 8192, 80 layers, 64 heads, 8 K/V heads,
FFN 28672) on p = 16 ranks, one sequence per microbatch and m = p, at 128K to 2048K tokens:
each scheme's utilisation (busy time over p x makespan, causal attention costs at
S / (12 d) of the linear FLOPs, no overheads), and its worst rank's peak activations in GiB:
bf16 tensors a layer saves per token by pipekit's layer formula (memory-efficient norm and
SwiGLU, no recompute) and, sliced, the K/V cache.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pinning_argument,
    describe_model,
    model_spec,
    rank_core_sets,
    run_ranks,
)
from pipekit.bench._schedule_timing import FAIR_ALLOCATOR
from pipekit.bench.report import print_result, print_table
from pipekit.bench.schedules import attention_to_linear_ratio
from pipekit.memory.layer_formula import LayerShape, saved_bytes_per_token
from pipekit.pipelining.features.exchange_plan import plan_context_exchange
from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
from pipekit.pipelining.schedules.simulate import CostModel, simulate

__all__ = ["SCHEMES", "main", "simulated_schemes"]

SCHEMES = {
    "1F1B": {"schedule": "1F1B", "stages_per_rank": 1},
    "Interleaved1F1B v=2": {"schedule": "Interleaved1F1B", "stages_per_rank": 2},
    "ZB-V": {"schedule": "ZBVZeroBubble", "stages_per_rank": 2},
    "sliced": {"schedule": "sliced", "stages_per_rank": 1},
    "sliced+exchange": {"schedule": "sliced", "stages_per_rank": 1, "context_exchange": True},
}
"""The compared schemes: torch's schedules at their stages per rank, and pipekit's."""

_LLAMA_70B = LayerShape(dim=8192, heads=64, kv_heads=8, head_dim=128, ffn_dim=28672)
_LLAMA_70B_LAYERS = 80
_GIB = 2**30


def simulated_schemes(
    contexts: list[int], p: int = 16, slices_per_rank: int = 2
) -> dict[str, dict[int, tuple[float, float]]]:
    """Per scheme and context: (utilisation, worst rank's peak activation GiB) of Llama 70B on
    `p` ranks, m = p sequences, n = `slices_per_rank` x p slices."""
    m, n = p, slices_per_rank * p
    layer, element = _LLAMA_70B, 2
    per_token = saved_bytes_per_token(layer, "efficient", element) * _LLAMA_70B_LAYERS
    kv_per_token = 2 * layer.kv_heads * layer.head_dim * element * _LLAMA_70B_LAYERS
    results: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in SCHEMES}
    for name, scheme in SCHEMES.items():
        sliced = scheme["schedule"] == "sliced"
        slices = n if sliced else 1
        shape = ScheduleShape(p, m, slices, scheme["stages_per_rank"])
        actions = get_schedule(scheme["schedule"]).actions(shape)
        attended = None
        if scheme.get("context_exchange"):
            attended = plan_context_exchange(actions, slices).attended_slices()
        for context in contexts:
            cost = CostModel(
                forward_attention=attention_to_linear_ratio(context, layer.dim),
                activation_bytes=per_token * context,
                kv_cache_bytes=kv_per_token * context if sliced else 0.0,
            )
            result = simulate(actions, num_slices=slices, cost=cost, attended_slices=attended)
            utilisation = sum(result.busy_time.values()) / (p * result.makespan)
            peak = max(memory["total"] for memory in result.peak_memory.values())
            results[name][context] = (utilisation, peak / _GIB)
    return results


def _measure(options: argparse.Namespace) -> dict[str, dict[int, tuple[float, float]]]:
    """Per scheme and context: (tokens/s, worst rank's peak activation MiB), timed here."""
    results: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in SCHEMES}
    cores = rank_core_sets(options.pp, pin=not options.no_pin)
    for context in options.contexts:
        model = model_spec(options, context)
        runs = {
            name: {**scheme, "num_slices": options.slices if scheme["schedule"] == "sliced" else 1}
            for name, scheme in SCHEMES.items()
        }
        spec = {
            "model": model, "microbatches": options.microbatches, "rows_per_microbatch": 1,
            "warmup": options.warmup, "repeats": options.repeats, "runs": runs,
        }  # fmt: skip
        ranks = run_ranks(
            "pipekit.bench._schedule_timing:time_schedules", options.pp, spec,
            env={"GLIBC_TUNABLES": FAIR_ALLOCATOR}, timeout=options.timeout, cores=cores,
        )  # fmt: skip
        tokens = options.microbatches * context
        for name in SCHEMES:
            seconds = statistics.median(ranks[0]["samples"][name])
            peak = max(rank["recorded"][name]["peak_activation_bytes"] for rank in ranks)
            results[name][context] = (tokens / seconds, peak / 2**20)
        print(f"measured {context} tokens: {describe_model(model)}", flush=True)
    return results


def _draw(
    measured: dict[str, dict[int, tuple[float, float]]],
    simulated: dict[str, dict[int, tuple[float, float]]],
    out: Path,
) -> None:
    """Four panels: measured tokens/s and peak MiB, simulated utilisation and peak GiB."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the picture needs matplotlib: pip install 'pipekit[viz]'") from None
    figure = Figure(figsize=(12, 8), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2)
    panels = [
        (axes[0][0], measured, 0, "measured here: tokens/s"),
        (axes[1][0], measured, 1, "measured here: peak activations (MiB, worst rank)"),
        (axes[0][1], simulated, 0, "Llama 70B, p=16, simulated: utilisation"),
        (axes[1][1], simulated, 1, "Llama 70B, p=16, simulated: peak activations (GiB)"),
    ]
    for ax, data, index, title in panels:
        for name, by_context in data.items():
            contexts = sorted(by_context)
            ax.plot(
                [c // 1024 for c in contexts], [by_context[c][index] for c in contexts],
                marker="o", label=name,
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out)


def _table(data: dict[str, dict[int, tuple[float, float]]], headers: tuple[str, str]) -> None:
    rows = [
        [name, context // 1024, *values]
        for name, by_context in data.items()
        for context, values in sorted(by_context.items())
    ]
    print_table(["scheme", "context K", *headers], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench schemes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument(
        "--cluster-contexts", type=int, nargs="+",
        default=[131072, 262144, 524288, 1048576, 2097152],
        help="contexts of the simulated Llama 70B panel",
    )  # fmt: skip
    parser.add_argument("--pp", type=int, default=2, help="measured pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=2, help="measured microbatches")
    parser.add_argument("--slices", type=int, default=8, help="measured sliced n")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each scheme")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps of each scheme")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per context")
    parser.add_argument("--out", type=Path, default=Path("schemes.png"), help="the PNG")
    add_pinning_argument(parser)
    add_model_arguments(parser, dim=128, layers=4, heads=2, kv_heads=1, ffn_dim=384, vocab=256)
    options = parser.parse_args(argv)
    if options.pp < 2 or options.microbatches % options.pp or options.layers < 2 * options.pp:
        parser.error(
            f"--pp {options.pp} must be >= 2 and divide --microbatches {options.microbatches}, "
            f"and --layers {options.layers} >= 2 x pp (two stages per rank)"
        )
    if any(context % options.slices for context in options.contexts):
        parser.error(f"every context must divide into --slices {options.slices}")
    simulated = simulated_schemes(options.cluster_contexts)
    measured = _measure(options)
    print(f"\nmeasured: p={options.pp}, m={options.microbatches}, sliced n={options.slices}")
    _table(measured, ("tokens/s", "peak act. MiB"))
    print("\nsimulated: Llama 70B, p=16, m=16, sliced n=32")
    _table(simulated, ("utilisation", "peak act. GiB"))
    _draw(measured, simulated, options.out)
    print(f"\nwrote {options.out}")
    longest, cluster = max(options.contexts), max(options.cluster_contexts)
    others = [name for name in SCHEMES if not name.startswith("sliced")]
    best_other = max(measured[name][longest][0] for name in others)
    figures: dict[str, Any] = {
        "measured_sliced_vs_best_torch": measured["sliced"][longest][0] / best_other,
        "simulated_sliced_utilisation": simulated["sliced"][cluster][0],
        "simulated_1f1b_utilisation": simulated["1F1B"][cluster][0],
        "simulated_sliced_vs_1f1b_memory": simulated["sliced"][cluster][1]
        / simulated["1F1B"][cluster][1],
    }
    print_result(**figures)
