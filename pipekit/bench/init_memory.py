"""`python -m pipekit.bench init-memory`: what a rank holds while a 1B-class model is created,
exported to Hugging Face safetensors and loaded back, sharded by FSDP2 over 2 ranks.

The model is the registered Llama in Llama 3.2 1B's shape (D 2048, 16 layers, 32 heads, 8 K/V
heads, FFN 8192, vocabulary 128256, tied embeddings: 1.24e9 parameters), in float32 (the
training weights). On `--ranks` fresh gloo ranks (dp_shard = ranks), each rank, one phase after
another:

1. **init**: build on the meta device, apply FSDP2, then `materialize_sharded` from the job
   seed: storage for the rank's shards only, each init unit drawn whole once and cut;
2. **export**: every rank writes its share of the Hugging Face checkpoint (whole tensors,
   assembled one at a time from the shards, `--shard-mb` per file);
3. **load**: the model is freed, built and sharded again on the meta device, given storage,
   and loaded from that checkpoint, each rank reading only its blocks; its shards must equal
   the exported ones bit for bit.

Memory is the kernel's RSS high-water mark (VmHWM), reset before each phase; every figure is
peak RSS minus the rank's RSS before the first model existed (the interpreter, torch and the
process group), over its shards' bytes plus the largest single parameter's. RSS counts the
checkpoint pages a load has mapped, as well as the rank's own tensors. Bytes read are the blocks
the load asked the files for.

RESULT: init_peak_vs_shard, export_peak_vs_shard, load_peak_vs_shard and
load_read_bytes_vs_owned, each the maximum over ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench._rss import current_rss, peak_rss, release_freed_memory, reset_peak_rss
from pipekit.bench.report import machine_description, print_result, print_table
from pipekit.checkpoint import TensorRead
from pipekit.checkpoint.local_shards import local_nbytes
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models.materialize import local_tensor, seeded_materializer
from pipekit.models.registry import get_model_spec

__all__ = ["main"]

_GIB = 2**30
_SEED = 0
_LLAMA_3_2_1B = {
    "dim": 2048,
    "n_layers": 16,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_dim": 8192,
    "vocab_size": 128256,
    "tie_embeddings": True,
}


def _args(layers: int) -> Any:
    """The registered Llama in Llama 3.2 1B's shape, with `layers` blocks."""
    base = get_model_spec("llama").flavor("debug")
    shape = _LLAMA_3_2_1B | {"n_layers": layers}
    return dataclasses.replace(
        base, **shape, rope_theta=500000.0, rope_scaling=None, max_seq_len=8192
    )


def _sharded_on_meta(args: Any, num_ranks: int) -> nn.Module:
    llama = get_model_spec("llama")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=num_ranks, cp=1, tp=1, pp=1, ep=1, world_size=num_ranks
    )
    with torch.device("meta"):
        model = llama.build(args)
    blocks = llama.structure.blocks_of(model)
    apply_data_parallel(model, dims.build_mesh("cpu"), dims, blocks=blocks)
    return model


def _checksums(model: nn.Module) -> dict[str, float]:
    return {name: float(local_tensor(p).double().sum()) for name, p in model.named_parameters()}


def _rank_worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    args, hf = _args(spec["layers"]), get_model_spec("llama").hf
    assert hf is not None
    directory = spec["directory"]
    baseline = reset_peak_rss()

    model = _sharded_on_meta(args, num_ranks)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    started = time.perf_counter()
    seeded_materializer("cpu", _SEED)(model)
    init_s, init_peak = time.perf_counter() - started, peak_rss()
    owned = local_nbytes(model)
    exported = _checksums(model)

    dist.barrier()
    reset_peak_rss()
    started = time.perf_counter()
    hf.save(model, args, directory, max_shard_bytes=spec["shard_bytes"])
    export_s, export_peak = time.perf_counter() - started, peak_rss()

    del model
    gc.collect()
    release_freed_memory()
    dist.barrier()
    after_free = reset_peak_rss()
    model = _sharded_on_meta(args, num_ranks)
    model.to_empty(device="cpu")
    reads: list[TensorRead] = []
    started = time.perf_counter()
    hf.load(directory, model, args, read_log=reads)
    load_s, load_peak = time.perf_counter() - started, peak_rss()
    if _checksums(model) != exported:
        raise RuntimeError(f"rank {rank}: the loaded shards differ from the exported ones")
    return {
        "baseline": baseline,
        "after_free": after_free,
        "owned": owned,
        "largest": largest,
        "read": sum(read.nbytes for read in reads),
        "peaks": {"init": init_peak, "export": export_peak, "load": load_peak},
        "seconds": {"init": init_s, "export": export_s, "load": load_s},
        "rss_end": current_rss(),
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench init-memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks (dp_shard)")
    parser.add_argument("--layers", type=int, default=16, help="blocks (Llama 3.2 1B: 16)")
    parser.add_argument("--shard-mb", type=int, default=512, help="MB per safetensors file")
    parser.add_argument(
        "--dir", default=None, help="checkpoint folder (default: a temporary one, deleted)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all ranks")
    options = parser.parse_args(argv)
    if options.ranks < 1 or options.layers < 1 or options.shard_mb < 1:
        parser.error("--ranks, --layers and --shard-mb must be positive")
    if options.dir is not None and Path(options.dir).exists():
        parser.error(f"--dir {options.dir} already exists; name a new folder")
    return options


def main(argv: list[str]) -> None:
    options = _parse(argv)
    args = _args(options.layers)
    with torch.device("meta"):
        total = sum(p.numel() for p in get_model_spec("llama").build(args).parameters())
    parent = None if options.dir else tempfile.mkdtemp(prefix="pipekit-init-memory-")
    directory = Path(options.dir) if options.dir else Path(parent, "hf")
    print(machine_description())
    print(
        f"Llama 3.2 1B shape: D={args.dim}, {args.n_layers} layers, {args.n_heads} heads "
        f"({args.num_kv_heads} kv), ffn {args.ffn_dim}, vocab {args.vocab_size}, tied; "
        f"{total / 1e9:.3f}e9 parameters, {total * 4 / _GIB:.2f} GiB in float32; FSDP2 over "
        f"{options.ranks} gloo ranks; files of {options.shard_mb} MB\n",
        flush=True,
    )
    spec = {
        "layers": options.layers,
        "shard_bytes": options.shard_mb * 1_000_000,
        "directory": str(directory),
    }
    try:
        results = run_ranks(
            "pipekit.bench.init_memory:_rank_worker", options.ranks, spec, timeout=options.timeout
        )
    finally:
        if parent is not None:
            shutil.rmtree(parent, ignore_errors=True)
    _report(results)


def _report(results: list[dict[str, Any]]) -> None:
    phases = ("init", "export", "load")
    rows, ratios = [], {phase: [] for phase in phases}
    for rank, result in enumerate(results):
        budget = result["owned"] + result["largest"]
        for phase in phases:
            growth = result["peaks"][phase] - result["baseline"]
            ratios[phase].append(growth / budget)
            rows.append(
                [
                    rank,
                    phase,
                    result["owned"] / _GIB,
                    result["largest"] / _GIB,
                    result["baseline"] / _GIB,
                    result["peaks"][phase] / _GIB,
                    growth / _GIB,
                    growth / budget,
                    result["seconds"][phase],
                ]
            )
    print_table(
        [
            "rank",
            "phase",
            "shards GiB",
            "largest param GiB",
            "RSS before GiB",
            "peak RSS GiB",
            "growth GiB",
            "growth/(shards+largest)",
            "seconds",
        ],
        rows,
    )
    read_ratios = [result["read"] / result["owned"] for result in results]
    freed = ", ".join(
        f"{(result['after_free'] - result['baseline']) / _GIB:.3f}" for result in results
    )
    print(
        "\ngrowth: peak RSS of the phase minus RSS before the first model. Loaded shards equal "
        "the exported ones on every rank. Bytes read / owned per rank: "
        + ", ".join(f"{ratio:.4f}" for ratio in read_ratios)
        + f". RSS left above the baseline once the first model was freed (GiB): {freed}."
    )
    print_result(
        init_peak_vs_shard=max(ratios["init"]),
        export_peak_vs_shard=max(ratios["export"]),
        load_peak_vs_shard=max(ratios["load"]),
        load_read_bytes_vs_owned=max(read_ratios),
    )
