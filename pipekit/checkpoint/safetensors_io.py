"""Lazy reading of safetensors checkpoint directories (Hugging Face layout).

A checkpoint directory holds either one `model.safetensors`, or shards `model-0000i-of-0000n
.safetensors` plus `model.safetensors.index.json` mapping each tensor name to its shard. The
reader lists names, shapes and dtypes from the files' headers only, and opens a shard the first
time one of its tensors is asked for, so a rank that owns a few tensors (or a few rows of them)
reads only those bytes. `pipekit.checkpoint.safetensors_write` writes such directories.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from pipekit.checkpoint.file_reads import DirectReader, read_buffered

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "SafetensorsCheckpoint",
    "TensorInfo",
    "TensorRead",
    "takes_file_rows",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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
        self,
        directory: str | os.PathLike[str],
        *,
        read_log: list[TensorRead] | None = None,
        direct_reads: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.read_log = read_log
        """Every block read is appended here when given (what a rank read, for tests and
        benches)."""
        self.direct = DirectReader() if direct_reads else None
        """With `direct_reads`, blocks of whole rows the page cache does not hold are read past
        it (O_DIRECT, `pipekit.checkpoint.file_reads`): for loads that copy each byte read into
        several places, as upcycling does."""
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
        direct = out is not None and takes_file_rows(out, dtype)
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
        if not takes_file_rows(out, dtype):
            raise ValueError(f"{name!r}: scattered reads need contiguous CPU storage of {dtype}")
        out_rows = out.detach().view(out.shape[0], -1).view(torch.uint8).numpy()
        scratch = np.empty_like(out_rows[0])  # takes the rows no destination wants
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
        into `buffers` in order (byte arrays, together the rows' bytes): past the page cache
        where this reader reads directly and the rows are not cached, else through it."""
        row_bytes = math.prod(shape[1:]) * itemsize
        first = bounds[0][0] if bounds else 0
        offset = self._data_offsets(path)[name] + first * row_bytes
        try:
            if self.direct is None or not self.direct.read(path, offset, buffers):
                read_buffered(path, offset, buffers)
        except EOFError:
            raise CheckpointError(
                f"{path} ends inside tensor {name!r}; the file is truncated, download or save it "
                "again"
            ) from None

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
        """Drop the open file handles and the direct reader's bounce buffer; a memory map lives
        on while a block read from it does."""
        self._handles.clear()
        if self.direct is not None:
            self.direct.close()

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
        outside = sorted(
            str(name)
            for name in set(weight_map.values())
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")
        )
        if outside:
            raise CheckpointError(
                f"{index_path} names shard files outside its folder: {outside}; a weight_map "
                "may name only files in the checkpoint's own folder (plain file names)"
            )
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


def takes_file_rows(out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `out` can take a checkpoint's rows of `dtype` byte for byte: contiguous CPU
    storage of that dtype (a read then lands in it with no temporary)."""
    return out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"


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
