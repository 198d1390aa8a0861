"""Start and stop the default process group from torchrun's environment.

`init_distributed` picks the backend from the hardware (nccl with one GPU per process on CUDA,
gloo on CPU) and applies the config's collective timeout. Run as plain `python` (no torchrun
variables), it creates no group and reports a world of one, so single-process runs and tests need
no launcher. `exit_process` ends a rank after its group is destroyed.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipekit.attention.across.hierarchical import HierarchicalGroups

__all__ = [
    "DistributedInfo",
    "destroy_distributed",
    "exit_process",
    "free_local_port",
    "hierarchical_groups",
    "init_distributed",
    "join_local_gloo",
    "new_group_along",
    "new_group_between",
    "new_groups_within",
    "single_rank_mesh",
]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits in the job, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def device_type(self) -> str:
        """`cuda` or `cpu`: the device type of every mesh of the job."""
        return self.device.type


def init_distributed(timeout_s: float) -> DistributedInfo:
    """Join the job's default process group (if launched by torchrun); return this rank's place.

    Every collective fails after `timeout_s` seconds instead of hanging forever on a dead rank.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "init_distributed: the default process group already exists; call it once per "
            "process (destroy_distributed() ends the group)"
        )
    if "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistributedInfo(rank=0, world_size=1, local_rank=0, device=device)
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: WORLD_SIZE is set but {', '.join(missing)} are not; launch with "
            "`torchrun --nproc-per-node N ...`, or unset WORLD_SIZE for a single process"
        )
    if os.environ["MASTER_PORT"] == "0":
        # torchrun 2.13 hands `--master-port 0` to the workers as is; they would retry port 0
        # until the store timeout (minutes) instead of failing.
        raise RuntimeError(
            "init_distributed: MASTER_PORT=0 cannot be connected to; launch with "
            "`torchrun --standalone ...` (it picks a free port) or a fixed --master-port"
        )
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                "visible; launch at most that many processes per node"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # device_id binds the group to this GPU at once (eager NCCL init, no guessed device).
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return DistributedInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def free_local_port() -> int:
    """A TCP port free on this machine now, for a store of local processes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_local_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a gloo default group of `world_size` processes forked on this machine (rank 0
    serves the store on `port`): measurements that run real collectives outside a job."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def new_group_along(mesh: DeviceMesh, *dims: str) -> dist.ProcessGroup:
    """A new process group over the ranks of `mesh` that differ from this rank only along
    `dims` (ranked in mesh order), separate from the mesh's own (e.g. collectives that must not
    queue behind the pipeline's sends: an NCCL send blocks its communicator until received).
    Every rank of the mesh must call it."""
    mine = None
    for row in _rows_along(mesh, dims):  # every rank creates every group, in the same order
        group = dist.new_group(sorted(row))
        if dist.get_rank() in row:
            mine = group
    assert mine is not None  # this rank is in the mesh
    return mine


def new_groups_within(
    mesh: DeviceMesh, dim: str, inner_size: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Split `mesh`'s `dim` into (outer, inner) with `inner_size` adjacent ranks inside:
    this rank's inner group (its block of `inner_size` consecutive positions along `dim`) and
    its outer group (the ranks at its position in every block). Every rank of the mesh must
    call it."""
    size = mesh.mesh.shape[_dim_index(mesh, dim)]
    if inner_size < 1 or size % inner_size:
        raise ValueError(f"{inner_size} ranks per group do not split the {size} {dim!r} ranks")
    inner = outer = None
    for row in _rows_along(mesh, (dim,)):  # every rank creates every group, in the same order
        blocks = [row[start : start + inner_size] for start in range(0, size, inner_size)]
        for ranks in [*blocks, *(row[offset::inner_size] for offset in range(inner_size))]:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                inner, outer = (group, outer) if ranks in blocks else (inner, group)
    assert inner is not None and outer is not None  # this rank is in the mesh
    return inner, outer


def _rows_along(mesh: DeviceMesh, dims: Sequence[str]) -> list[list[int]]:
    """The mesh's ranks in rows that differ only along `dims` (ranked in mesh order)."""
    indices = [_dim_index(mesh, dim) for dim in dims]
    others = [index for index in range(mesh.ndim) if index not in indices]
    size = math.prod(mesh.mesh.shape[index] for index in indices)
    return mesh.mesh.permute(*others, *sorted(indices)).reshape(-1, size).tolist()


def new_group_between(
    mesh: DeviceMesh, dim: str, positions: Sequence[int]
) -> dist.ProcessGroup | None:
    """A new process group over the ranks at `positions` along `dim` that share this rank's
    other coordinates (e.g. the first and last pipeline ranks of each data-parallel replica);
    None on a rank at another position. Every rank of the mesh must call it."""
    index = _dim_index(mesh, dim)
    rows = mesh.mesh.movedim(index, -1).reshape(-1, mesh.mesh.shape[index]).tolist()
    mine = None
    for row in rows:  # every rank creates every group, in the same order
        ranks = sorted({row[position] for position in positions})
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _dim_index(mesh: DeviceMesh, dim: str) -> int:
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(f"mesh with dims {names} has no {dim!r} dim")
    return names.index(dim)


def single_rank_mesh(device_type: str) -> DeviceMesh:
    """A mesh of this rank alone: FSDP2 on it shards nothing but applies its mixed precision
    (bf16 compute, float32 master weights). Every rank must call this together (it creates one
    group per rank)."""
    group, _ = dist.new_subgroups(group_size=1)
    return DeviceMesh.from_group(group, device_type)


def destroy_distributed(wait_for_peers: bool = True) -> None:
    """Destroy the default process group if there is one (safe to call in any case).

    By default ranks first meet at a barrier: a rank that tears its gloo group down while a peer
    still uses it (a quick exit, e.g. resuming a finished run) aborts the peer with
    std::terminate. After an error, pass False: the peers may never reach the barrier.
    """
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with `code`: run its exit handlers and flush its output while the
    interpreter is whole, then skip the interpreter's own finalization.

    torch keeps a gloo group's worker threads running after `destroy_process_group` while a
    device mesh or FSDP state still refers to the group. A worker that needs the GIL once the
    interpreter finalizes is ended by Python with a forced unwind, which C++ turns into
    std::terminate: a rank whose run succeeded dies with SIGABRT ("terminate called without an
    active exception"). Without finalization there is no such moment.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def hierarchical_groups(
    mesh: DeviceMesh, ulysses_size: int, across_variant: str
) -> HierarchicalGroups:
    """The groups of `mesh`'s `cp` dim split into blocks of `ulysses_size` adjacent ranks.
    Every rank of the mesh must call it."""
    ulysses, across = new_groups_within(mesh, "cp", ulysses_size)
    return HierarchicalGroups(ulysses, across, across_variant)
