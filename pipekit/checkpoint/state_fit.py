"""Whether a DCP checkpoint holds the state a job loads into it: entry names and shapes compared
from the checkpoint's metadata, before any tensor is read.

A checkpoint that does not fit is not damaged: it was written for another model (or optimizer,
or layout of state). `state_mismatch` says which entries are missing, which differ in shape and
which the job lacks, so an error can name them instead of calling a good checkpoint corrupt.
`FittingLoadPlanner` makes `dcp.load` raise that (`CheckpointMismatchError`) instead of DCP's
first missing key. Shapes are global (a DTensor's whole shape), so layouts that DCP reshards
between (FSDP, tp, pipeline, vocabulary rows) never count as a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipekit.checkpoint.safe_metadata import SafeFileSystemReader

__all__ = [
    "CheckpointMismatchError",
    "FittingLoadPlanner",
    "Shapes",
    "StateMismatch",
    "checkpoint_shapes",
    "state_mismatch",
]

Shapes = Mapping[str, tuple[int, ...] | None]
"""Entry name -> its global shape (None: not a tensor, e.g. a step counter)."""


@dataclass(frozen=True)
class StateMismatch:
    """How a checkpoint's entries differ from those a job wants; false when they fit."""

    missing: tuple[str, ...] = ()
    """Wanted, not in the checkpoint."""
    resized: tuple[tuple[str, tuple[int, ...] | None, tuple[int, ...] | None], ...] = ()
    """(name, saved shape, wanted shape) of entries in both with different shapes."""
    unexpected: tuple[str, ...] = ()
    """In the checkpoint, not wanted (counted only where asked: a load ignores them)."""

    def __bool__(self) -> bool:
        return bool(self.missing or self.resized or self.unexpected)

    def describe(self, limit: int = 3) -> str:
        """One line naming the first `limit` entries of each kind."""
        parts = []
        if self.missing:
            parts.append(f"missing {_names(self.missing, limit)}")
        if self.resized:
            shown = [
                f"{name} (saved {_shape(saved)}, wanted {_shape(wanted)})"
                for name, saved, wanted in self.resized[:limit]
            ]
            parts.append(f"other shapes for {_names(shown, limit, len(self.resized))}")
        if self.unexpected:
            parts.append(f"entries the model lacks {_names(self.unexpected, limit)}")
        return "; ".join(parts)


def _names(names: tuple[str, ...] | list[str], limit: int, total: int | None = None) -> str:
    total = len(names) if total is None else total
    shown = ", ".join(names[:limit])
    return shown if total <= limit else f"{shown} and {total - limit} more"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "not a tensor" if shape is None else str(tuple(shape))


def state_mismatch(saved: Shapes, wanted: Shapes, *, unexpected: bool = False) -> StateMismatch:
    """The entries of `wanted` that `saved` lacks or holds in another shape (and, with
    `unexpected`, the entries of `saved` that `wanted` lacks), each sorted by name."""
    return StateMismatch(
        missing=tuple(sorted(name for name in wanted if name not in saved)),
        resized=tuple(
            (name, saved[name], shape)
            for name, shape in sorted(wanted.items())
            if name in saved and saved[name] != shape
        ),
        unexpected=tuple(sorted(name for name in saved if name not in wanted))
        if unexpected
        else (),
    )


def checkpoint_shapes(path: Path, prefix: str = "") -> dict[str, tuple[int, ...] | None]:
    """The entries of the DCP checkpoint folder `path` whose names start with `prefix` (the
    prefix taken off) and their shapes, from its metadata alone (read without running code
    from it; any error reading it propagates)."""
    metadata = SafeFileSystemReader(path).read_metadata()
    return {
        name.removeprefix(prefix): shape
        for name, shape in _metadata_shapes(metadata).items()
        if name.startswith(prefix)
    }


def _metadata_shapes(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    return {
        name: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for name, entry in metadata.state_dict_metadata.items()
    }


class CheckpointMismatchError(ValueError):
    """The checkpoint's entries do not fit the state loaded into it (`mismatch` says how)."""

    def __init__(self, mismatch: StateMismatch) -> None:
        super().__init__(mismatch)  # the one argument, so the error pickles across ranks
        self.mismatch = mismatch

    def __str__(self) -> str:
        return self.mismatch.describe()


class FittingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which on a missing entry or a shape mismatch raises
    `CheckpointMismatchError` naming every such entry of this rank's state (DCP's own error
    names the first)."""

    def create_local_plan(self) -> Any:
        try:
            return super().create_local_plan()
        except (RuntimeError, ValueError):
            assert self.metadata is not None  # set by set_up_planner before planning
            wanted = {name: _value_shape(value) for name, value in self.state_dict.items()}
            mismatch = state_mismatch(_metadata_shapes(self.metadata), wanted)
            if mismatch:
                raise CheckpointMismatchError(mismatch) from None
            raise


def _value_shape(value: object) -> tuple[int, ...] | None:
    """A state entry's global shape (a DTensor's whole one), None for a non-tensor."""
    size = getattr(value, "size", None)
    return tuple(size()) if callable(size) and hasattr(value, "dtype") else None
