"""Reads a DCP checkpoint's metadata without running code from the file.

torch's `FileSystemReader` unpickles `.metadata` with `pickle.load`, which calls whatever
importable function the file names. Resume is automatic from `{output_dir}/checkpoints`, so a
folder copied in from elsewhere would be code. `SafeFileSystemReader` reads the same file with
an unpickler that admits only what DCP's metadata is made of: its metadata classes, the
filesystem's storage records, `torch.Size`, dtypes, layouts and memory formats, and paths. A
file naming anything else fails with one line before any of it runs.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["CheckpointMetadataError", "SafeFileSystemReader", "read_metadata_file"]

_METADATA_TYPES = {
    name
    for name, value in vars(dcp_metadata).items()
    if isinstance(value, type) and value.__module__ == dcp_metadata.__name__
}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class CheckpointMetadataError(pickle.UnpicklingError):
    """A checkpoint's metadata names something DCP's metadata never holds."""


def _admitted(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == dcp_metadata.__name__:
        return name in _METADATA_TYPES
    if module == "torch":  # dtypes and memory formats, never functions
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise CheckpointMetadataError(
                f"{self.path} names {module}.{name}, which a checkpoint's metadata never holds; "
                "it was not written by DCP (or was tampered with): nothing of it was run; "
                "remove the checkpoint folder"
            )
        return super().find_class(module, name)


def read_metadata_file(path: str | Path) -> Metadata:
    """The `Metadata` pickled in `path`, through the restricted unpickler."""
    with open(path, "rb") as stream:
        metadata = _MetadataUnpickler(stream, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointMetadataError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata; remove the folder"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by `read_metadata_file`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        filename = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata_file(Path(self.path) / filename)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
