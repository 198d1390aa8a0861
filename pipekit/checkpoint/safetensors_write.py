"""Atomic writing of safetensors checkpoint directories (Hugging Face layout).

The writer never pickles, fills shards in order (a `PendingTensor` is produced only when its
shard is written, so at most one shard is in memory), and publishes a directory only once it is
complete, so a crash never leaves something that loads as a valid checkpoint
(`pipekit.checkpoint.safetensors_io` reads them).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipekit.checkpoint._durable import fsync_path
from pipekit.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "PendingTensor",
    "discard_staging",
    "new_staging_directory",
    "publish_directory",
    "save_safetensors",
    "shard_file_names",
    "split_into_shards",
    "write_index",
]

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""Hugging Face's default shard size ("5GB")."""


@dataclass(frozen=True)
class PendingTensor:
    """A tensor to be written, produced only when its shard is written (streaming writes)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor | PendingTensor],
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, str] | None = None,
    overwrite: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
) -> list[Path]:
    """Write `state_dict` as a safetensors checkpoint directory; returns the tensor files.

    One `model.safetensors` when everything fits in `max_shard_bytes`, otherwise shards filled in
    the order of `state_dict` plus an index (a tensor larger than the limit gets a shard alone).
    A `PendingTensor` is produced when its shard is written, so at most one shard is in memory.
    `on_tensor(name, nbytes)` is called as each tensor is ready (progress bars). `extra_files`
    (name -> text, e.g. config.json) go into the same directory. Everything is written into a
    hidden sibling directory that is renamed into place once complete.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    sizes = {name: _planned_nbytes(name, tensor) for name, tensor in state_dict.items()}
    shards = split_into_shards(sizes, max_shard_bytes)
    file_names = shard_file_names(len(shards))
    target = Path(directory)
    staging = new_staging_directory(target, overwrite)
    try:
        for file_name, shard in zip(file_names, shards, strict=True):
            tensors = {}
            for name in shard:
                tensors[name] = _host_tensor(name, state_dict[name])
                if on_tensor is not None:
                    on_tensor(name, sizes[name])
            save_file(tensors, str(staging / file_name), metadata={"format": "pt"})
            del tensors
        if len(shards) > 1:
            weight_map = {
                name: file_name
                for file_name, shard in zip(file_names, shards, strict=True)
                for name in shard
            }
            write_index(staging, weight_map, sum(sizes.values()))
        for file_name, text in (extra_files or {}).items():
            (staging / file_name).write_text(text)
        publish_directory(staging, target)
    except BaseException:
        discard_staging(staging)
        raise
    return [Path(directory) / file_name for file_name in file_names]


def _planned_nbytes(name: str, tensor: torch.Tensor | PendingTensor) -> int:
    if isinstance(tensor, PendingTensor):
        return tensor.nbytes
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"cannot save {name!r}: it is a {type(tensor).__name__}, not a tensor")
    return tensor.numel() * tensor.element_size()


def _host_tensor(name: str, tensor: torch.Tensor | PendingTensor) -> torch.Tensor:
    if isinstance(tensor, PendingTensor):
        produced = tensor.produce()
        if tuple(produced.shape) != tensor.shape or produced.dtype != tensor.dtype:
            raise ValueError(
                f"{name!r} was announced as {list(tensor.shape)} {tensor.dtype} but produced as "
                f"{list(produced.shape)} {produced.dtype}"
            )
        tensor = produced
    if tensor.is_meta:
        raise ValueError(f"cannot save {name!r}: it is on the meta device; materialise it first")
    return tensor.detach().to("cpu").contiguous()


def split_into_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into files of at most `max_shard_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, size in sizes.items():
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    return shards


def shard_file_names(count: int) -> list[str]:
    """Hugging Face's file names for `count` tensor files (one: `model.safetensors`)."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(staging: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """The index of a sharded checkpoint: tensor name -> file, and the tensors' total bytes."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def new_staging_directory(target: Path, overwrite: bool) -> Path:
    """An empty hidden folder next to `target` to write a checkpoint into; CheckpointError if
    `target` exists and may not be replaced."""
    if target.exists() and not overwrite:
        raise CheckpointError(
            f"{target} already exists; pass overwrite=True or choose a new directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def publish_directory(staging: Path, target: Path) -> None:
    """Flush `staging`'s files, then rename it to `target` (replacing an old copy)."""
    for path in staging.iterdir():
        fsync_path(path)
    fsync_path(staging)
    if target.exists():
        # Move the old copy aside first: a crash between the two renames leaves no target
        # (and the old copy intact under a hidden name), never a half-written one.
        retired = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired)
    else:
        staging.rename(target)
    fsync_path(target.parent)


def discard_staging(staging: Path) -> None:
    """Remove an unfinished checkpoint's staging folder."""
    shutil.rmtree(staging, ignore_errors=True)
