"""`python -m pipekit.bench <name> [options]`: run one benchmark; `--help` lists them."""

from __future__ import annotations

import importlib
import sys

_BENCHMARKS = {
    "attention": ("pipekit.bench.attention", "attention kernels vs torch SDPA (time, error)"),
    "flex-cpu": (
        "pipekit.bench.flex_cpu",
        "where compiled FlexAttention is wrong on this CPU, and whether the guard covers it",
    ),
    "step": ("pipekit.bench.step", "training step of a config: tokens/s and MFU"),
    "pipeline-memory": (
        "pipekit.bench.pipeline_memory",
        "peak activation memory per schedule vs SlimPipe Table 2",
    ),
    "pipeline-throughput": (
        "pipekit.bench.pipeline_throughput",
        "tokens/s of the sliced pipeline vs torch's 1F1B",
    ),
    "layout-search": (
        "pipekit.bench.layout_search",
        "the layout search at SlimPipe's published settings, beside the paper's layouts and MFU",
    ),
    "layout-search-cpu": (
        "pipekit.bench.layout_search_cpu",
        "the layout search's top layouts for the debug Llama, predicted vs measured on this CPU",
    ),
    "schedules": ("pipekit.bench.schedules", "simulated bubbles and memory vs SlimPipe Table 2"),
    "schemes": (
        "pipekit.bench.schemes",
        "tokens/s and peak memory of pipeline schemes across contexts, measured and at scale (PNG)",
    ),
    "context-exchange": (
        "pipekit.bench.context_exchange",
        "attention context exchange: balance, bubbles and traffic (simulated)",
    ),
    "context-parallel": (
        "pipekit.bench.context_parallel",
        "context parallelism: bytes per slice, commutated vs KV passing, and the choice",
    ),
    "activation-memory": (
        "pipekit.bench.activation_memory",
        "bytes a Llama layer keeps per token: plain, memory-efficient, selective, full, every-k",
    ),
    "tensor-parallel": (
        "pipekit.bench.tensor_parallel",
        "activations with and without sequence parallelism, TP bytes vs Megatron's formulas",
    ),
    "moe": (
        "pipekit.bench.moe",
        "MoE all-to-all pipelining (native and emulated link) and memory reuse vs Eq. 6",
    ),
    "packed-documents": (
        "pipekit.bench.packed_documents",
        "slices of packed documents: cut once or per microbatch by its documents' work",
    ),
    "vocab-parallel": (
        "pipekit.bench.vocab_parallel",
        "peak memory and output-layer time per rank, vocabulary-parallel pipeline vs not",
    ),
    "init-memory": (
        "pipekit.bench.init_memory",
        "peak RSS per rank: sharded init, Hugging Face export and load of a 1B-class model",
    ),
    "plan-accuracy": (
        "pipekit.bench.plan_accuracy",
        "the memory planner's per-rank peak against measured peaks of the debug configs",
    ),
    "chunked-loss": (
        "pipekit.bench.chunked_loss",
        "the output layer and loss's peak bytes, chunked vs whole, against their formulas",
    ),
    "muon": (
        "pipekit.bench.muon",
        "Muon's step under FSDP2 against AdamW's: seconds, bytes gathered vs the formula",
    ),
    "upcycle": (
        "pipekit.bench.upcycle",
        "online upcycling on N ranks: peak RSS and bytes read vs owned, time vs a plain read",
    ),
}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _BENCHMARKS:
        listing = "\n".join(f"  {name:20s} {doc}" for name, (_, doc) in _BENCHMARKS.items())
        print(f"usage: python -m pipekit.bench <name> [options]\nbenchmarks:\n{listing}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown benchmark {argv[0]!r}", file=sys.stderr)
            raise SystemExit(2)
        return
    module_name, _ = _BENCHMARKS[argv[0]]
    importlib.import_module(module_name).main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
