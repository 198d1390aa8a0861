"""Lazy reading and atomic writing of safetensors checkpoint directories (Hugging Face layout).

A checkpoint directory holds either one `model.safetensors`, or shards `model-0000i-of-0000n
.safetensors` plus `model.safetensors.index.json` mapping each tensor name to its shard. The
reader lists names, shapes and dtypes from the files' headers only, and opens a shard the first
time one of its tensors is asked for, so a rank that owns a few tensors (or a few rows of them)
reads only those bytes. The writer never pickles, and publishes a directory only once it is
complete, so a crash never leaves something that loads as a valid checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipekit.checkpoint._durable import fsync_path

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "PendingTensor",
    "SafetensorsCheckpoint",
    "TensorInfo",
    "TensorRead",
    "discard_staging",
    "new_staging_directory",
    "publish_directory",
    "save_safetensors",
    "shard_file_names",
    "split_into_shards",
    "write_index",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""Hugging Face's default shard size ("5GB")."""

_MAX_IOVECS = os.sysconf("SC_IOV_MAX")
"""Buffers one `preadv` call takes (1024 on Linux)."""

# The dtype codes of the safetensors header format.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, malformed, or does not fit what it is loaded into."""


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says about one tensor; reading it costs no tensor data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorRead:
    """One block read from a checkpoint: tensor, (start, stop) per dim, and the block's size in
    bytes (the bytes that come off disk when it is used; a block narrower than its rows touches
    whole pages of each row)."""

    name: str
    bounds: tuple[tuple[int, int], ...]
    nbytes: int


class SafetensorsCheckpoint:
    """Read-only, lazy view of a safetensors checkpoint directory.

    Usable as a context manager; `close()` drops the memory maps of the files opened so far.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, read_log: list[TensorRead] | None = None
    ) -> None:
        self.directory = Path(directory)
        self.read_log = read_log
        """Every block read is appended here when given (what a rank read, for tests and
        benches)."""
        if not self.directory.is_dir():
            what = "is not a directory" if self.directory.exists() else "does not exist"
            raise CheckpointError(f"checkpoint directory {self.directory} {what}")
        self._handles: dict[Path, safe_open] = {}
        self._offsets: dict[Path, dict[str, int]] = {}
        self._weight_map: dict[str, Path] | None = None
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            self._weight_map = self._read_index(index_path)
            self._files = sorted(set(self._weight_map.values()))
        else:
            self._files = sorted(self.directory.glob("*.safetensors"))
            if not self._files:
                raise CheckpointError(
                    f"no *.safetensors files in {self.directory}; expected {SINGLE_FILE}, or "
                    f"model-*.safetensors shards with {INDEX_FILE}"
                )

    @property
    def files(self) -> list[Path]:
        """The safetensors files this checkpoint consists of."""
        return list(self._files)

    @property
    def names(self) -> list[str]:
        """Sorted tensor names (from the index alone when there is one)."""
        return sorted(self._tensor_files())

    def info(self, name: str) -> TensorInfo:
        """Dtype and shape of one tensor, from its file's header."""
        path = self._file_of(name)
        tensor_slice = self._slice(path, name)
        dtype = self._dtype(path, name, tensor_slice.get_dtype())
        return TensorInfo(name, dtype, tuple(tensor_slice.get_shape()), path)

    @staticmethod
    def _dtype(path: Path, name: str, code: str) -> torch.dtype:
        """The torch dtype of a header's dtype code, or a CheckpointError naming it."""
        if code not in _DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {code}, which pipekit does not read; "
                f"supported: {sorted(_DTYPES)}"
            )
        return _DTYPES[code]

    def infos(self) -> dict[str, TensorInfo]:
        """TensorInfo of every tensor, by name (opens every file's header)."""
        return {name: self.info(name) for name in self.names}

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """One tensor, or rows `rows.start:rows.stop` of its first dimension, on CPU.

        Only the bytes of those rows are read from disk.
        """
        return self.read_block(name, () if rows is None else (rows,))

    def read_block(self, name: str, index: Sequence[slice]) -> torch.Tensor:
        """The block `index` of one tensor (a step-1 slice per leading dim; the rest whole).

        Rows are contiguous on disk, so a block of whole rows is one byte range, read with
        `pread` into a fresh tensor: it never maps the file, so the checkpoint's pages do not
        count towards the process's resident memory. A block narrower than the full width in a
        later dim reads its elements of each row through the file's memory map (safetensors'
        slicing); those pages count while the map is open.
        """
        return self._read(name, index, None)

    def read_block_into(self, name: str, index: Sequence[slice], out: torch.Tensor) -> None:
        """`out.copy_(read_block(name, index))` without the block-sized temporary where it can:
        a block of whole rows, in `out`'s dtype, is read with `pread` straight into `out`
        (contiguous, on CPU), so its bytes are written once, into their final storage."""
        self._read(name, index, out)

    def _read(self, name: str, index: Sequence[slice], out: torch.Tensor | None) -> torch.Tensor:
        path = self._file_of(name)
        tensor_slice = self._slice(path, name)
        shape = tuple(tensor_slice.get_shape())
        bounds = _block_bounds(name, shape, index)
        block_shape = [stop - start for start, stop in bounds]
        if out is not None and list(out.shape) != block_shape:
            raise ValueError(
                f"{name!r}: block {list(bounds)} has shape {block_shape}, but the storage to "
                f"fill has shape {list(out.shape)}; the model and its checkpoint disagree"
            )
        dtype = self._dtype(path, name, tensor_slice.get_dtype())
        whole_rows = all(
            bound == (0, size) for bound, size in zip(bounds[1:], shape[1:], strict=True)
        )
        direct = out is not None and out.dtype == dtype and out.is_contiguous() and not out.is_cuda
        if whole_rows:
            block = out if direct else torch.empty(block_shape, dtype=dtype)
            buffer = block.detach().view(-1).view(torch.uint8).numpy()
            self._read_rows_into(path, name, shape, bounds, dtype.itemsize, [buffer])
        else:
            block = tensor_slice[tuple(slice(start, stop) for start, stop in bounds)]
        if out is not None and block is not out:
            out.copy_(block)
        if self.read_log is not None:
            self.read_log.append(TensorRead(name, bounds, math.prod(block_shape) * dtype.itemsize))
        return block

    def read_rows_scattered(
        self, name: str, rows: slice, out: torch.Tensor, destinations: Sequence[int | None]
    ) -> None:
        """Rows `rows` of a tensor, row i of them into row `destinations[i]` of `out` (or
        nowhere for None): one scattered read (`preadv`) straight into `out`, contiguous on CPU
        in the file's dtype, with no temporary beyond one row. Logged as the block of those
        rows."""
        path = self._file_of(name)
        tensor_slice = self._slice(path, name)
        shape = tuple(tensor_slice.get_shape())
        bounds = _block_bounds(name, shape, (rows,))
        dtype = self._dtype(path, name, tensor_slice.get_dtype())
        row_shape = list(shape[1:])
        if len(destinations) != rows.stop - rows.start or list(out.shape[1:]) != row_shape:
            raise ValueError(
                f"{name!r}: rows {rows.start}:{rows.stop} need one destination each and storage "
                f"rows of shape {row_shape}; got {len(destinations)} and {list(out.shape)}"
            )
        if out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"{name!r}: scattered reads need contiguous CPU storage of {dtype}")
        out_rows = out.detach().view(out.shape[0], -1).view(torch.uint8).numpy()
        scratch = out_rows[0].copy()  # takes the rows no destination wants
        buffers = [scratch if row is None else out_rows[row] for row in destinations]
        self._read_rows_into(path, name, shape, bounds, dtype.itemsize, buffers)
        if self.read_log is not None:
            self.read_log.append(TensorRead(name, bounds, len(buffers) * scratch.size))

    def _read_rows_into(
        self,
        path: Path,
        name: str,
        shape: tuple[int, ...],
        bounds: tuple[tuple[int, int], ...],
        itemsize: int,
        buffers: Sequence[np.ndarray],
    ) -> None:
        """Rows `bounds[0]` of a tensor (every other dim whole), read straight from the file
        into `buffers` in order (byte arrays, together the rows' bytes), with as few `preadv`
        calls as the system's iovec limit allows."""
        pending = list(buffers)
        row_bytes = math.prod(shape[1:]) * itemsize
        first = bounds[0][0] if bounds else 0
        offset = self._data_offsets(path)[name] + first * row_bytes
        descriptor = os.open(path, os.O_RDONLY)
        try:
            while pending:
                count = os.preadv(descriptor, pending[:_MAX_IOVECS], offset)
                if count == 0:
                    raise CheckpointError(
                        f"{path} ends inside tensor {name!r}; the file is truncated, download "
                        "or save it again"
                    )
                offset += count
                while pending and count >= pending[0].size:
                    count -= pending.pop(0).size
                if count:
                    pending[0] = pending[0][count:]
        finally:
            os.close(descriptor)

    def _data_offsets(self, path: Path) -> dict[str, int]:
        """Where each tensor's data starts in `path` (from its header, read once)."""
        if path not in self._offsets:
            with open(path, "rb") as handle:
                header_size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(header_size))
            start = 8 + header_size
            self._offsets[path] = {
                name: start + entry["data_offsets"][0]
                for name, entry in header.items()
                if name != "__metadata__"
            }
        return self._offsets[path]

    def close(self) -> None:
        """Drop the open file handles; a memory map lives on while a block read from it does."""
        self._handles.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _read_index(self, index_path: Path) -> dict[str, Path]:
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"cannot read {index_path}: {error!r}; it must be JSON with a 'weight_map' object "
                "from tensor name to shard file name"
            ) from error
        files = {file_name: self.directory / file_name for file_name in set(weight_map.values())}
        missing = sorted(name for name, path in files.items() if not path.is_file())
        if missing:
            raise CheckpointError(
                f"{index_path} names shard files that are not in {self.directory}: {missing}; "
                "the download or copy is incomplete"
            )
        return {name: files[file_name] for name, file_name in weight_map.items()}

    def _tensor_files(self) -> dict[str, Path]:
        if self._weight_map is None:
            weight_map: dict[str, Path] = {}
            for path in self._files:
                for name in self._open(path).keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name in weight_map:
                        raise CheckpointError(
                            f"tensor {name!r} is in both {weight_map[name]} and {path}; "
                            f"remove the stray file or add a {INDEX_FILE}"
                        )
                    weight_map[name] = path
            self._weight_map = weight_map
        return self._weight_map

    def _file_of(self, name: str) -> Path:
        tensor_files = self._tensor_files()
        if name not in tensor_files:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        return tensor_files[name]

    def _open(self, path: Path) -> safe_open:
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as error:
                raise CheckpointError(
                    f"cannot read {path}: {error}; the file is corrupt or truncated, "
                    "download or save it again"
                ) from error
        return self._handles[path]

    def _slice(self, path: Path, name: str):  # -> safetensors' PySafeSlice (no public type)
        try:
            return self._open(path).get_slice(name)
        except SafetensorError as error:
            raise CheckpointError(
                f"{INDEX_FILE} of {self.directory} puts {name!r} in {path.name}, "
                "but that file does not contain it"
            ) from error


def _block_bounds(
    name: str, shape: tuple[int, ...], index: Sequence[slice]
) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dim of `index` on a tensor of `shape`, or a CheckpointError."""
    if len(index) > len(shape) or any(part.step not in (None, 1) for part in index):
        raise CheckpointError(
            f"cannot take block {list(index)} of {name!r} with shape {list(shape)}: give at most "
            "one step-1 slice per dim"
        )
    bounds = []
    for dim, size in enumerate(shape):
        part = index[dim] if dim < len(index) else slice(None)
        start, stop = part.start or 0, size if part.stop is None else part.stop
        if not 0 <= start <= stop <= size or (start == stop and size > 0):
            raise CheckpointError(
                f"block {start}:{stop} of dim {dim} is out of range for {name!r} with shape "
                f"{list(shape)}"
            )
        bounds.append((start, stop))
    return tuple(bounds)


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
