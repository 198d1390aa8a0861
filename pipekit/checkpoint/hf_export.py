"""Write a Hugging Face safetensors checkpoint from any layout without gathering the model.

Each rank holds blocks of some parameters: FSDP2 and expert-parallel shards (DTensors), a
pipeline stage's whole modules, vocabulary-parallel row shards, tied copies, replicas. The export
lists every rank's blocks (names and bounds only), then, identically on every rank, plans:
which rank writes each Hugging Face tensor (greedy by bytes, so every rank writes about
1/world of the checkpoint) and which rank sends each block of it (one holder per block; a
replica or tied copy is not sent twice). Tensors are then assembled one at a time on their
writer from point-to-point messages, converted to the Hugging Face layout and buffered until the
writer's current file is full. A tensor that fuses several parameters (`FusedTensor`: gpt-oss's
gate and up projections in one) is assembled from each parameter's blocks alike. A rank holds
its shards, one tensor being assembled and at most one file's worth of whole tensors
(`max_shard_bytes`).

Every rank writes into one hidden staging folder (the ranks must share a file system); rank 0
adds the index and the extra files (config.json) and renames the folder into place once every
rank's files are on disk, so a crash never leaves a checkpoint that loads.

Legend: a block's bounds are (start, stop) per dim of the whole parameter.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from pipekit.checkpoint._durable import fsync_path
from pipekit.checkpoint.local_shards import RowShard, global_block
from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.checkpoint.safetensors_write import (
    DEFAULT_MAX_SHARD_BYTES,
    discard_staging,
    new_staging_directory,
    publish_directory,
    shard_file_names,
    split_into_shards,
    write_index,
)
from pipekit.models.materialize import local_tensor
from pipekit.models.spec import HFTensor

__all__ = ["FusedTensor", "save_hf_sharded"]

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _BlockInfo:
    """What a rank tells the others about one of its blocks."""

    param: str
    shape: tuple[int, ...]
    bounds: Bounds
    dtype: torch.dtype


@dataclass(frozen=True)
class _Piece:
    """Part of one Hugging Face tensor: its bounds in the parameter, and the rank sending it."""

    bounds: Bounds
    holder: int
    holder_bounds: Bounds


@dataclass(frozen=True)
class _Part:
    """One parameter's region of a Hugging Face tensor, and the pieces that cover it."""

    param: str
    region: Bounds
    pieces: tuple[_Piece, ...]


@dataclass(frozen=True)
class _Assignment:
    entry: HFTensor
    writer: int
    dtype: torch.dtype
    parts: tuple[_Part, ...]
    """One per parameter the tensor is built from (several for a `FusedTensor`)."""

    @property
    def nbytes(self) -> int:
        return sum(_volume(part.region) for part in self.parts) * self.dtype.itemsize


@dataclass(frozen=True)
class FusedTensor:
    """A checkpoint tensor built from several parameters rather than copied from one (gpt-oss
    interleaves the gate and up projections of its experts in one tensor)."""

    params: tuple[str, ...]
    """The parameters, in the order `build` takes them (the entry's `param_name` first)."""
    build: Callable[[Sequence[Tensor]], Tensor]
    """Their tensors (whole, or the entry's expert of each) -> the checkpoint tensor."""


def save_hf_sharded(
    model: nn.Module,
    entries: Sequence[HFTensor],
    to_hf: Callable[[str, Tensor], Tensor],
    directory: str | os.PathLike[str],
    *,
    extra_files: Mapping[str, str] | None = None,
    row_shards: Mapping[str, RowShard] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    buffers: Mapping[str, Tensor] | None = None,
    fused: Mapping[str, FusedTensor] | None = None,
) -> list[Path]:
    """Write `entries` (the checkpoint's tensors, in order) from this rank's part of `model`
    into `directory`; every rank of the default process group calls it (or one process
    without one). `to_hf(param name, whole tensor)` puts a non-expert tensor in the Hugging
    Face layout; `buffers` (by name) are written beside the parameters (a router's bias);
    `fused` (by Hugging Face name) builds the entries that fuse several parameters.
    Returns the tensor files."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    rank, world = _rank_and_world()
    local = _local_blocks(model, row_shards or {}, buffers or {})
    infos = [info for info, _ in local.values()]
    every_rank: list[list[_BlockInfo]] = [infos]
    if world > 1:
        every_rank = [[] for _ in range(world)]
        dist.all_gather_object(every_rank, infos)
    fused = fused or {}
    plan = _plan(entries, every_rank, fused)
    files = _files_per_writer(plan, world, max_shard_bytes)
    names = shard_file_names(sum(len(shards) for shards in files))
    target = Path(directory)
    staging = _shared_staging(target, overwrite, rank, world)
    try:
        _write_own_files(plan, files, names, local, to_hf, fused, staging, rank)
    except BaseException:
        if rank == 0:
            discard_staging(staging)
        raise
    _barrier(world)
    if rank == 0:
        weight_map = {
            assignment.entry.hf_name: names[index]
            for index, assignment in _file_of_each_tensor(plan, files)
        }
        sizes = sum(assignment.nbytes for assignment in plan)
        if len(names) > 1:
            write_index(staging, weight_map, sizes)
        for file_name, text in (extra_files or {}).items():
            (staging / file_name).write_text(text)
        publish_directory(staging, target)
    _barrier(world)
    return [target / name for name in names]


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _local_blocks(
    model: nn.Module, row_shards: Mapping[str, RowShard], buffers: Mapping[str, Tensor]
) -> dict[str, tuple[_BlockInfo, Tensor]]:
    """This rank's non-empty block of each parameter (a tied parameter under its first name)
    and of each of `buffers`."""
    blocks = {}
    for name, param in itertools.chain(model.named_parameters(), buffers.items()):
        values = local_tensor(param)
        if values.is_meta:
            raise ValueError(f"{name} is on the meta device; materialise the model before export")
        if values.numel() == 0:
            continue
        shard = row_shards.get(name)
        shape = tuple(param.shape) if shard is None else (shard.rows, *param.shape[1:])
        bounds = tuple((part.start, part.stop) for part in global_block(param, shard))
        blocks[name] = (_BlockInfo(name, shape, bounds, values.dtype), values.detach())
    return blocks


def _plan(
    entries: Sequence[HFTensor],
    every_rank: list[list[_BlockInfo]],
    fused: Mapping[str, FusedTensor],
) -> list[_Assignment]:
    """Writer and pieces of every tensor, the same on every rank (or one ValueError naming
    the parameter that no rank holds whole)."""
    holders: dict[str, dict[Bounds, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for rank, infos in enumerate(every_rank):
        for info in infos:
            holders.setdefault(info.param, {}).setdefault(info.bounds, rank)
            shapes[info.param], dtypes[info.param] = info.shape, info.dtype
    loads = [0] * len(every_rank)
    plan = []
    for entry in entries:
        params = fused[entry.hf_name].params if entry.hf_name in fused else (entry.param_name,)
        parts = tuple(_part(entry, param, holders, shapes) for param in params)
        kinds = sorted({str(dtypes[param]) for param in params})
        if len(kinds) > 1:
            raise ValueError(
                f"{entry.hf_name} fuses {', '.join(params)} of dtypes {kinds}; give the fused "
                "parameters one dtype before export"
            )
        writer = loads.index(min(loads))
        assignment = _Assignment(entry, writer, dtypes[params[0]], parts)
        loads[writer] += assignment.nbytes
        plan.append(assignment)
    return plan


def _part(
    entry: HFTensor,
    param: str,
    holders: Mapping[str, Mapping[Bounds, int]],
    shapes: Mapping[str, tuple[int, ...]],
) -> _Part:
    """The region of `param` that `entry` takes (its expert's, or all of it), and the ranks'
    blocks covering it."""
    if param not in holders:
        raise ValueError(
            f"no rank holds {param} (for {entry.hf_name}); export from every "
            "rank of the job, with each rank's model or pipeline stages"
        )
    region = tuple((0, size) for size in shapes[param])
    if entry.expert is not None:
        region = ((entry.expert, entry.expert + 1), *region[1:])
    pieces = []
    for bounds, holder in holders[param].items():
        overlap = _intersection(bounds, region)
        if overlap is not None:
            pieces.append(_Piece(overlap, holder, bounds))
    covered = sum(_volume(piece.bounds) for piece in pieces)
    if covered != _volume(region):
        raise ValueError(
            f"the ranks' blocks of {param} cover {covered} of its "
            f"{_volume(region)} elements for {entry.hf_name}; its shards overlap or one is "
            "missing (export from every rank, with the same model layout)"
        )
    return _Part(param, region, tuple(pieces))


def _files_per_writer(
    plan: list[_Assignment], world: int, max_shard_bytes: int
) -> list[list[list[str]]]:
    """Per rank, its files as lists of tensor names (empty for a rank that writes nothing)."""
    files = []
    for rank in range(world):
        sizes = {a.entry.hf_name: a.nbytes for a in plan if a.writer == rank}
        files.append(split_into_shards(sizes, max_shard_bytes) if sizes else [])
    return files


def _file_of_each_tensor(
    plan: list[_Assignment], files: list[list[list[str]]]
) -> list[tuple[int, _Assignment]]:
    """(global file index, assignment) of every tensor, files numbered rank by rank."""
    index_of, index = {}, 0
    for shards in files:
        for shard in shards:
            index_of.update(dict.fromkeys(shard, index))
            index += 1
    return [(index_of[a.entry.hf_name], a) for a in plan]


def _shared_staging(target: Path, overwrite: bool, rank: int, world: int) -> Path:
    """Rank 0's fresh staging folder, its path told to every rank (or its refusal, raised on
    every rank, so none waits for a folder that will not come)."""
    made: list[Path | CheckpointError | None] = [None]
    if rank == 0:
        try:
            made[0] = new_staging_directory(target, overwrite)
        except CheckpointError as error:
            made[0] = error
    if world > 1:
        dist.broadcast_object_list(made, src=0)
    if isinstance(made[0], CheckpointError):
        raise made[0]
    assert made[0] is not None
    return made[0]


def _write_own_files(
    plan: list[_Assignment],
    files: list[list[list[str]]],
    names: list[str],
    local: Mapping[str, tuple[_BlockInfo, Tensor]],
    to_hf: Callable[[str, Tensor], Tensor],
    fused: Mapping[str, FusedTensor],
    staging: Path,
    rank: int,
) -> None:
    """Assemble, in plan order, the tensors this rank writes; send the blocks it holds to the
    others' writers; write each of its files as soon as its last tensor is whole."""
    first_file = sum(len(shards) for shards in files[:rank])
    own_files = files[rank]
    file_of = {name: first_file + i for i, shard in enumerate(own_files) for name in shard}
    last_of_file = {shard[-1] for shard in own_files}
    device = next((values.device for _, values in local.values()), torch.device("cpu"))
    pending: dict[str, Tensor] = {}
    for assignment in plan:
        wholes = [_assemble(assignment, part, local, rank, device) for part in assignment.parts]
        if wholes[0] is None:
            continue
        entry = assignment.entry
        if entry.hf_name in fused:
            whole = fused[entry.hf_name].build(wholes)
        else:
            whole = to_hf(entry.param_name, wholes[0]) if entry.expert is None else wholes[0][0]
        pending[entry.hf_name] = whole.to("cpu").contiguous()
        if entry.hf_name in last_of_file:
            path = staging / names[file_of[entry.hf_name]]
            save_file(pending, str(path), metadata={"format": "pt"})
            fsync_path(path)
            pending.clear()


def _assemble(
    assignment: _Assignment,
    part: _Part,
    local: Mapping[str, tuple[_BlockInfo, Tensor]],
    rank: int,
    device: torch.device,
) -> Tensor | None:
    """The whole region of one part on its writer (None elsewhere), each piece sent by its
    holder over the process group, on the model's device (NCCL sends device tensors)."""
    writer, region = assignment.writer, part.region
    whole = None
    if rank == writer:
        whole = torch.empty(
            [stop - start for start, stop in region], dtype=assignment.dtype, device=device
        )
    handles, received = [], []
    for piece in part.pieces:
        if piece.holder == rank:
            _, values = local[part.param]
            block = values[_relative(piece.bounds, piece.holder_bounds)]
            if rank == writer:
                whole[_relative(piece.bounds, region)].copy_(block)
            else:
                block = block.contiguous()
                handles.append(dist.isend(_as_bytes(block), dst=writer))
                received.append((None, block))  # kept alive until sent
        elif rank == writer:
            shape = [stop - start for start, stop in piece.bounds]
            block = torch.empty(shape, dtype=assignment.dtype, device=device)
            handles.append(dist.irecv(_as_bytes(block), src=piece.holder))
            received.append((piece.bounds, block))
    for handle in handles:
        handle.wait()
    for bounds, block in received:
        if bounds is not None:
            whole[_relative(bounds, region)].copy_(block)
    return whole


def _as_bytes(tensor: Tensor) -> Tensor:
    """A contiguous tensor's bytes (point-to-point messages of any dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


def _intersection(a: Bounds, b: Bounds) -> Bounds | None:
    parts = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in parts) else parts


def _relative(bounds: Bounds, within: Bounds) -> tuple[slice, ...]:
    """`bounds` as an index into a tensor holding the block `within`."""
    return tuple(
        slice(start - origin, stop - origin)
        for (start, stop), (origin, _) in zip(bounds, within, strict=True)
    )


def _volume(bounds: Bounds) -> int:
    return math.prod(stop - start for start, stop in bounds)
