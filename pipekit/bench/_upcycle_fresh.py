"""The first-touch side of `python -m pipekit.bench upcycle`: the first upcycle of a process
against the first plain read of the same blocks, each in fresh rank processes, cold.

A user upcycles once per process, into memory the process has never touched, so the figure
that matters is the first upcycle against the first plain read in the same state: both in
fresh processes, the checkpoint evicted from the page cache before each. A third set of fresh
ranks only allocates the rank's owned bytes and writes each once (`fill_`): the floor of any
upcycle on this machine, since every owned byte is new memory (the kernel maps and zeroes each
page on its first write).

Each kind runs in new processes, and round r starts the order (plain read, upcycle, fill)
at kind r mod 3, so that over three rounds each kind follows each other kind once. The order
matters on a virtual machine: memory a process frees is handed back to the host after a
while, and a process that starts soon after one that freed gigabytes finds them cheap to fault
in again. Measured on a 2-core virtual machine, a fill of 4.4 GiB took 2.2-2.5 s right after an
upcycle (which freed 8.8 GiB over two ranks) and 5.0-5.5 s right after a plain read (2.7 GiB):
a fixed order favours whichever kind follows the largest.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench._upcycle_steps import (
    DTYPES,
    checkpoint_files,
    cold_start,
    parallelizer,
    plain_read,
    timed_upcycle,
)
from pipekit.checkpoint import TensorRead
from pipekit.models.materialize import local_tensor

__all__ = ["fresh_first_touch", "local_shapes", "ratios", "read_log_of"]

_KINDS = ("plain", "upcycle", "fill")


def read_log_of(reads: list[TensorRead]) -> list[list[Any]]:
    """A read log as JSON values (for ranks in other processes)."""
    return [[read.name, [list(bounds) for bounds in read.bounds], read.nbytes] for read in reads]


def local_shapes(model: torch.nn.Module) -> list[list[Any]]:
    """Shape and dtype of each local tensor the model owns (its parameters and buffers)."""
    tensors = [local_tensor(t) for t in (*model.parameters(), *model.buffers())]
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]


def _worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh rank: evict, then time its kind of first touch."""
    directory = spec["directory"]
    files = checkpoint_files(directory)
    kind = spec["kind"]
    if kind == "upcycle":
        parallelize = parallelizer(num_ranks, DTYPES[spec["dtype"]])
        cold_start(files)
        _, seconds = timed_upcycle(directory, spec, parallelize, [])
    elif kind == "plain":
        reads = [
            TensorRead(name, tuple(tuple(b) for b in bounds), nbytes)
            for name, bounds, nbytes in spec["reads"][rank]
        ]
        cold_start(files)
        seconds = plain_read(directory, reads)
    else:
        shapes = spec["shapes"][rank]
        started = time.perf_counter()
        owned = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes]
        for tensor in owned:
            tensor.fill_(1)
        seconds = time.perf_counter() - started
    return {"seconds": seconds}


def fresh_first_touch(
    spec: dict[str, Any], num_ranks: int, rounds: int, timeout: float
) -> dict[str, list[list[float]]]:
    """Per kind (plain, upcycle, fill), per rank, the seconds of each round's fresh ranks."""
    seconds: dict[str, list[list[float]]] = {
        kind: [[] for _ in range(num_ranks)] for kind in _KINDS
    }
    for round_index in range(rounds):
        start = round_index % len(_KINDS)
        for kind in _KINDS[start:] + _KINDS[:start]:
            ranks = run_ranks(
                f"{__name__}:_worker", num_ranks, spec | {"kind": kind}, timeout=timeout
            )
            for rank, result in enumerate(ranks):
                seconds[kind][rank].append(result["seconds"])
    return seconds


def ratios(seconds: dict[str, list[list[float]]]) -> dict[str, float]:
    """The RESULT figures: means over rounds, the maximum over ranks."""
    mean = {kind: [statistics.mean(per_rank) for per_rank in seconds[kind]] for kind in _KINDS}
    pairs = zip(mean["upcycle"], mean["plain"], mean["fill"], strict=True)
    return {
        "first_upcycle_vs_first_plain_read": max(u / p for u, p, _ in pairs),
        "first_fill_vs_first_plain_read": max(
            f / p for f, p in zip(mean["fill"], mean["plain"], strict=True)
        ),
        "first_upcycle_vs_first_fill": max(
            u / f for u, f in zip(mean["upcycle"], mean["fill"], strict=True)
        ),
    }
