"""`python -m pipekit.bench upcycle --layers 16 --dim 2048 --ep 2`: online upcycling on N ranks.

A dense Llama checkpoint in Hugging Face layout (seeded random weights, written by pipekit's
streaming writer in 512 MB shards) becomes an E-expert top-k MoE on `--ep` fresh gloo ranks:
experts split over the ranks (expert parallelism), everything else sharded by FSDP2 (dp_shard =
ep), each rank filling only its own blocks (`upcycle_model` with the registered Llama). Per
rank it measures:

- bytes read (the blocks the rank read, `TensorRead.nbytes`) against bytes owned (its local
  shards of every parameter): below 1 because the E/ep local experts copy one dense FFN read;
- peak RSS of the rank process (`ru_maxrss`) right after its first upcycle, and its RSS before
  (the interpreter, torch and the process group). RSS counts the checkpoint pages the rank has
  mapped (safetensors reads through a memory map) as well as its own tensors;
- wall time of `upcycle_model` (meta build, parallelize, materialise, fill) against a plain read
  of exactly the same blocks (the rank's read log replayed through `read_block`, each block
  copied into a fresh tensor, all held until the last is read).

Timing order on every rank, all ranks together: a first upcycle (its read log feeds the plain
reads), then plain read, upcycle, plain read, upcycle (ABAB); the page cache is emptied of the
checkpoint (`posix_fadvise(DONTNEED)` after the writer's fsync) before each. The first upcycle
is the process's first touch of gigabytes of fresh memory, which costs more than any later fill
(about twice as much here, with the storage prefaulted): it is reported on its own, and the ABAB
means compare both sides in one memory state. How much of the checkpoint is still cached after
eviction is measured with mincore(2), and a warm plain read (no eviction) is timed too, so the
output says how cold "cold" was. Ranks read concurrently and both read every dense FFN whole, so
a block one rank has just read may be cached for the other: alike for both sides.

RESULT: peak_rss_vs_owned, read_bytes_vs_owned, time_vs_plain_read (mean upcycle / mean plain
read) and first_upcycle_vs_plain_read, each the maximum over ranks.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench._rss import current_rss, peak_rss
from pipekit.bench._upcycle_fresh import fresh_first_touch, local_shapes, ratios, read_log_of
from pipekit.bench._upcycle_steps import (
    DTYPES,
    checkpoint_files,
    cold_start,
    dense_args,
    parallelizer,
    plain_read,
    resident_share,
    timed_upcycle,
)
from pipekit.bench.report import print_result, print_table
from pipekit.checkpoint import PendingTensor, TensorRead, save_safetensors
from pipekit.checkpoint.local_shards import local_nbytes
from pipekit.models.registry import get_model_spec

__all__ = ["main"]

_GIB = 2**30
_MAX_SHARD_BYTES = 512_000_000
_DEFAULT_SHAPE = {
    "layers": 16,
    "dim": 2048,
    "heads": 16,
    "kv_heads": 8,
    "vocab": 32000,
    "ffn_dim": None,
    "dtype": "bfloat16",
}
_DEFAULT_SIZE_RANGE = (1e9, 2e9)  # bytes the default dense checkpoint must take
_INIT_STD = 0.02


def _llama_ffn_dim(dim: int) -> int:
    """Llama's SwiGLU width: 8/3 of the model dim, rounded up to a multiple of 256."""
    return -(-round(8 * dim / 3) // 256) * 256


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=dtype).mul_(_INIT_STD)


def _write_dense(args: Any, dtype: torch.dtype, directory: Path) -> None:
    """Stream a random dense checkpoint into `directory` (one shard in memory at a time)."""
    hf = get_model_spec("llama").hf
    assert hf is not None
    tensors = {
        entry.hf_name: PendingTensor(
            entry.hf_shape, dtype, functools.partial(_random_tensor, entry.hf_shape, dtype, seed)
        )
        for seed, entry in enumerate(hf.tensors(args))
    }
    config = json.dumps(hf.config(args, dtype), indent=2) + "\n"
    save_safetensors(
        tensors, directory, max_shard_bytes=_MAX_SHARD_BYTES, extra_files={"config.json": config}
    )


def _rank_worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    directory = spec["directory"]
    files = checkpoint_files(directory)
    parallelize = parallelizer(num_ranks, DTYPES[spec["dtype"]])
    rss_before = current_rss()
    cached_before = resident_share(files)

    # The first upcycle logs the blocks the plain reads replay. It is the process's first touch
    # of gigabytes of fresh memory, which costs more than any later fill (page faults): it is
    # reported on its own, and the ABAB comparison after it finds both sides in one state.
    reads: list[TensorRead] = []
    cached_cold = [cold_start(files)]
    model, first_s = timed_upcycle(directory, spec, parallelize, reads)
    del model
    gc.collect()
    plain_s, upcycle_s = [], []
    peak = owned = 0
    for _ in range(2):  # plain read, upcycle, plain read, upcycle (ABAB, all cold)
        cached_cold.append(cold_start(files))
        plain_s.append(plain_read(directory, reads))
        again: list[TensorRead] = []
        cached_cold.append(cold_start(files))
        model, seconds = timed_upcycle(directory, spec, parallelize, again)
        assert [read.nbytes for read in again] == [read.nbytes for read in reads]
        upcycle_s.append(seconds)
        peak, owned = max(peak, peak_rss()), local_nbytes(model)
        shapes = local_shapes(model)
        del model
        gc.collect()
    dist.barrier()
    warm_s = plain_read(directory, reads)
    return {
        "owned": owned,
        "read": sum(read.nbytes for read in reads),
        "rss_before": rss_before,
        "peak_rss": peak,
        "first_s": first_s,
        "upcycle_s": upcycle_s,
        "plain_s": plain_s,
        "warm_s": warm_s,
        "cached_before": cached_before,
        "cached_cold": max(cached_cold),
        "reads": read_log_of(reads),
        "shapes": shapes,
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench upcycle", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--ep", type=int, default=2, help="ranks: expert parallel = FSDP2 shard")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (E)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (k)")
    model = parser.add_argument_group("dense Llama (random weights)")
    model.add_argument("--layers", type=int, default=_DEFAULT_SHAPE["layers"], help="blocks")
    model.add_argument("--dim", type=int, default=_DEFAULT_SHAPE["dim"], help="model dim D")
    model.add_argument(
        "--ffn-dim", type=int, default=None, help="SwiGLU width (default: 8/3 D up to 256s)"
    )
    model.add_argument("--heads", type=int, default=_DEFAULT_SHAPE["heads"], help="query heads")
    model.add_argument("--kv-heads", type=int, default=_DEFAULT_SHAPE["kv_heads"], help="K/V heads")
    model.add_argument("--vocab", type=int, default=_DEFAULT_SHAPE["vocab"], help="vocabulary")
    model.add_argument("--dtype", choices=sorted(DTYPES), default=_DEFAULT_SHAPE["dtype"])
    parser.add_argument(
        "--dir", default=None, help="dense checkpoint folder (default: a temporary one, deleted)"
    )
    parser.add_argument(
        "--fresh-rounds",
        type=int,
        default=3,
        help="rounds of fresh-process first touches (3: each kind follows each other once)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all ranks")
    options = parser.parse_args(argv)
    if options.ep < 1 or options.experts % options.ep:
        parser.error(f"--ep {options.ep} must be >= 1 and divide --experts {options.experts}")
    if not 1 <= options.top_k <= options.experts:
        parser.error(f"--top-k {options.top_k} must be between 1 and --experts {options.experts}")
    if options.dir is not None and Path(options.dir).exists():
        parser.error(f"--dir {options.dir} already exists; name a new folder")
    try:
        dense_args(_spec(options))
    except ValueError as error:
        parser.error(str(error))
    return options


def _spec(options: argparse.Namespace) -> dict[str, Any]:
    shape = {key: getattr(options, key) for key in _DEFAULT_SHAPE}
    return shape | {
        "ffn_dim": options.ffn_dim or _llama_ffn_dim(options.dim),
        "experts": options.experts,
        "top_k": options.top_k,
    }


def main(argv: list[str]) -> None:
    options = _parse(argv)
    spec = _spec(options)
    args = dense_args(spec)
    dtype = DTYPES[spec["dtype"]]
    parent = None if options.dir else tempfile.mkdtemp(prefix="pipekit-upcycle-")
    directory = Path(options.dir) if options.dir else Path(parent, "dense")
    try:
        started = time.perf_counter()
        _write_dense(args, dtype, directory)
        write_s = time.perf_counter() - started
        files = checkpoint_files(directory)
        size = sum(path.stat().st_size for path in files)
        if all(getattr(options, key) == value for key, value in _DEFAULT_SHAPE.items()):
            low, high = _DEFAULT_SIZE_RANGE
            if not low <= size <= high:
                raise RuntimeError(f"the default dense checkpoint is {size} bytes, not 1-2 GB")
        print(
            f"dense Llama: D={args.dim}, {args.n_layers} layers, {args.n_heads} heads "
            f"({args.num_kv_heads} kv), ffn {args.ffn_dim}, vocab {args.vocab_size}, "
            f"{spec['dtype']}; written in {write_s:.1f} s: {size / 1e9:.4g} GB "
            f"({size / _GIB:.4g} GiB) in {len(files)} safetensors file(s)"
            + (" + index" if len(files) > 1 else "")
            + " + config.json"
        )
        print(
            f"upcycled: E={spec['experts']} top-{spec['top_k']} in every layer, {options.ep} "
            f"gloo ranks (1 thread each): expert parallel {options.ep}, FSDP2 dp_shard "
            f"{options.ep}; order per rank: evict, upcycle, then twice (evict, plain read, evict, "
            "upcycle), warm plain read\n",
            flush=True,
        )
        results = run_ranks(
            "pipekit.bench.upcycle:_rank_worker",
            options.ep,
            spec | {"directory": str(directory)},
            timeout=options.timeout,
        )
        fresh_spec = spec | {
            "directory": str(directory),
            "reads": [result["reads"] for result in results],
            "shapes": [result["shapes"] for result in results],
        }
        fresh = fresh_first_touch(fresh_spec, options.ep, options.fresh_rounds, options.timeout)
    finally:
        if parent is not None:
            shutil.rmtree(parent, ignore_errors=True)
    _report(results, fresh)


def _report(results: list[dict[str, Any]], fresh: dict[str, list[list[float]]]) -> None:
    rows, figures = [], {"peak": [], "read": [], "time": [], "first": []}
    for rank, result in enumerate(results):
        owned, read = result["owned"], result["read"]
        upcycle_s, plain_s = (
            statistics.mean(result["upcycle_s"]),
            statistics.mean(result["plain_s"]),
        )
        figures["peak"].append(result["peak_rss"] / owned)
        figures["read"].append(read / owned)
        figures["time"].append(upcycle_s / plain_s)
        figures["first"].append(result["first_s"] / plain_s)
        rows.append(
            [
                rank,
                owned / _GIB,
                read / _GIB,
                read / owned,
                result["peak_rss"] / _GIB,
                result["peak_rss"] / owned,
                (result["peak_rss"] - result["rss_before"]) / owned,
                result["first_s"],
                "/".join(f"{seconds:.2f}" for seconds in result["upcycle_s"]),
                "/".join(f"{seconds:.2f}" for seconds in result["plain_s"]),
                upcycle_s / plain_s,
                result["warm_s"],
            ]
        )
    headers = ["rank", "owned GiB", "read GiB", "read/owned", "peak RSS GiB", "peak/owned"]
    headers += ["growth/owned", "1st upcycle s", "upcycle s", "plain read s", "ratio"]
    print_table([*headers, "warm read s"], rows)
    cached_before = max(result["cached_before"] for result in results)
    cached_cold = max(result["cached_cold"] for result in results)
    print(
        "\n1st upcycle: the process's first, into never-touched memory (its read log feeds the "
        "plain reads). Then plain read, upcycle, plain read, upcycle, all cold; ratio = mean "
        "upcycle / mean plain read.\ngrowth/owned: (peak RSS - RSS before) / owned. peak RSS "
        "includes the mapped checkpoint pages the rank touched.\n"
        f"page cache (mincore): {cached_before:.1%} of the checkpoint cached before the first "
        f"eviction, at most {cached_cold:.1%} right after each eviction: "
        + _eviction_verdict(cached_before, cached_cold)
    )
    fresh_rows = [
        [
            rank,
            *(
                "/".join(f"{t:.2f}" for t in fresh[kind][rank])
                for kind in ("plain", "upcycle", "fill")
            ),
        ]
        for rank in range(len(results))
    ]
    print(
        "\nfresh processes, cold (plain read, upcycle and fill of the owned bytes; each round "
        "starts at the next kind):"
    )
    print_table(["rank", "1st plain read s", "1st upcycle s", "1st fill s"], fresh_rows)
    print_result(
        **ratios(fresh),
        peak_rss_vs_owned=max(figures["peak"]),
        read_bytes_vs_owned=max(figures["read"]),
        time_vs_plain_read=max(figures["time"]),
        first_upcycle_vs_plain_read=max(figures["first"]),
    )


def _eviction_verdict(cached_before: float, cached_cold: float) -> str:
    if cached_cold >= 0.01:
        return "eviction did NOT empty the page cache; the cold timings are partly warm."
    start = "eviction worked" if cached_before >= 0.01 else "nothing was cached to evict"
    return (
        f"{start}; each timed read started from the (virtual) disk as this kernel sees it "
        "(a host below it may still cache)."
    )
