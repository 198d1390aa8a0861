"""The steps of `python -m pipekit.bench upcycle` that its warm rounds and its fresh-process
rounds (`_upcycle_fresh`) both run on a rank: the dense Llama of a shape, the EP x FSDP2
parallelizer, evicting the checkpoint, the timed upcycle and the plain read of the same blocks."""

from __future__ import annotations

import dataclasses
import mmap
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipekit.checkpoint import SafetensorsCheckpoint, TensorRead
from pipekit.checkpoint.file_reads import evict, resident_fraction
from pipekit.checkpoint.upcycle import upcycle_model
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models.registry import get_model_spec
from pipekit.models.upcycling import UpcycleSpec
from pipekit.moe.expert_parallel import apply_expert_parallel, expert_mesh

__all__ = [
    "DTYPES",
    "MAX_SEQ_LEN",
    "checkpoint_files",
    "cold_start",
    "dense_args",
    "parallelizer",
    "plain_read",
    "resident_share",
    "timed_upcycle",
]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_SEQ_LEN = 4096


def dense_args(spec: dict[str, Any]) -> Any:
    """The registered Llama's args of this shape."""
    return dataclasses.replace(
        get_model_spec("llama").flavor("debug"),
        dim=spec["dim"],
        n_layers=spec["layers"],
        n_heads=spec["heads"],
        n_kv_heads=spec["kv_heads"],
        ffn_dim=spec["ffn_dim"],
        vocab_size=spec["vocab"],
        rope_theta=500000.0,
        rope_scaling=None,
        max_seq_len=MAX_SEQ_LEN,
        tie_embeddings=False,
    )


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    return SafetensorsCheckpoint(directory).files


def resident_share(paths: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore(2); no reads)."""
    pages = [-(-path.stat().st_size // mmap.PAGESIZE) for path in paths]
    fractions = [resident_fraction(path) for path in paths]
    resident = sum(f * count for f, count in zip(fractions, pages, strict=True))
    return resident / sum(pages)


def parallelizer(num_ranks: int, dtype: torch.dtype):
    """Expert parallelism over all ranks, FSDP2 (dp_shard = ranks) over everything else."""
    dims = ParallelDims(
        dp_replicate=1, dp_shard=num_ranks, cp=1, tp=1, pp=1, ep=num_ranks, world_size=num_ranks
    )
    mesh = dims.build_mesh("cpu")
    experts = expert_mesh("cpu", num_ranks, num_ranks)

    def parallelize(model: nn.Module) -> None:
        apply_expert_parallel(model, experts["ep"])
        apply_data_parallel(
            model, mesh, dims, param_dtype=dtype, reduce_dtype=dtype,
            experts_mesh=experts["ep_replicate"],
        )  # fmt: skip

    return parallelize


def cold_start(files: list[Path]) -> float:
    """Evict the checkpoint on every rank, then meet; returns the fraction still cached."""
    for path in files:
        evict(path)
    dist.barrier()
    resident = resident_share(files)
    dist.barrier()
    return resident


def timed_upcycle(directory: str, spec: dict[str, Any], parallelize, reads: list[TensorRead]):
    upcycle = UpcycleSpec(num_experts=spec["experts"], top_k=spec["top_k"])
    dense, moe = get_model_spec("llama"), get_model_spec("llama_moe")
    assert dense.upcycler is not None
    started = time.perf_counter()
    model, _ = upcycle_model(
        directory,
        dense.upcycler,
        dense_args(spec),
        moe.build,
        upcycle,
        dtype=DTYPES[spec["dtype"]],
        parallelize=parallelize,
        read_log=reads,
    )
    return model, time.perf_counter() - started


def plain_read(directory: str, reads: list[TensorRead]) -> float:
    """Seconds to read the blocks of `reads` again, each copied into a fresh tensor.

    `read_block` hands back a view of the file's memory map (safetensors reads lazily), so the
    copy is what brings the bytes in; the blocks are held until the last one is read.
    """
    started = time.perf_counter()
    with SafetensorsCheckpoint(directory) as checkpoint:
        blocks = []
        for read in reads:
            view = checkpoint.read_block(read.name, tuple(slice(*bounds) for bounds in read.bounds))
            blocks.append(torch.empty(view.shape, dtype=view.dtype).copy_(view))
    seconds = time.perf_counter() - started
    del blocks
    return seconds
