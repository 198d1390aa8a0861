"""Peak bytes of the tensors a block of code allocates, counted by storage, on any device.

`PeakTensorMemory` is a dispatch mode: every tensor an operator returns is looked at, and a
storage not seen before is counted until it is freed. A result that shares a storage with one of
the operator's inputs (a view, an in-place or `out=` result) is no allocation and counts once, if
at all: when the storage was allocated inside the block it was counted then, and when it came
from outside (a parameter and its transposed view, an existing gradient accumulated into, the
dataset a batch is sliced from) it is not counted. The peak of that sum is what the block needed
on top of what existed before it: on CPU, where no caching allocator keeps statistics, it is the
figure that says how much activation and buffer memory a step takes. With `timeline=True` the
live bytes after every operator are kept too (`timeline`), so two runs of the same code at two
sizes can be compared moment by moment. A DTensor counts as its local shard: what this rank
holds. With a `label` callable each storage keeps the label it returned when the storage was
allocated (`live_bytes_by_label`; e.g. which part of a layer was running).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from pipekit._torch_private import TorchDispatchMode, tree_leaves

__all__ = ["PeakTensorMemory", "kept_bytes", "kept_bytes_by_label", "local_storage_holder"]


def local_storage_holder(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `tensor`'s bytes on this rank: a DTensor's local shard
    (the wrapper has no storage of its own), any other tensor itself."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


class PeakTensorMemory(TorchDispatchMode):
    """`with PeakTensorMemory() as memory: ...`; then `memory.peak_bytes`."""

    def __init__(
        self,
        *,
        timeline: bool = False,
        label: Callable[[], str] | None = None,
        meta: bool = False,
    ) -> None:
        super().__init__()
        self._counted = (lambda _: True) if meta else (lambda leaf: leaf.device.type != "meta")
        """Which tensors hold memory: with `meta`, meta tensors too (their storages have sizes
        and lifetimes, not bytes), so a size no machine here holds is counted as it would run;
        by default they are the unallocated modules of a plan and count for nothing."""
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self._label = label
        self.current_bytes = 0
        self.peak_bytes = 0
        self.timeline: list[int] | None = [] if timeline else None
        """Live bytes after each operator (with `timeline=True`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            leaf.untyped_storage()._cdata
            for leaf in _local_leaves((args, kwargs))
            if self._counted(leaf)
        }
        grew = False
        for leaf in _local_leaves(out):
            if self._counted(leaf) and leaf.untyped_storage()._cdata not in inputs:
                grew |= self._track(leaf)
        if grew or self.timeline is not None:
            self._release_freed()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.timeline is not None:
            self.timeline.append(self.current_bytes)
        return out

    def live_bytes(self) -> int:
        """Bytes of the storages allocated inside the block that are still alive now (the
        running count is settled lazily, when something new is allocated)."""
        self._release_freed()
        return self.current_bytes

    def live_bytes_by_label(self) -> dict[str, int]:
        """`live_bytes`, split by the label each storage got when it was allocated."""
        self._release_freed()
        by_label: dict[str, int] = {}
        for _, nbytes, label in self._live.values():
            by_label[label] = by_label.get(label, 0) + nbytes
        return by_label

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`'s storage (a result the caller keeps, not the block)."""
        self._release_freed()
        known = self._live.pop(local_storage_holder(tensor).untyped_storage()._cdata, None)
        if known is not None:
            self.current_bytes -= known[1]

    def _track(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        key = storage._cdata
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            return False
        label = self._label() if self._label is not None else ""
        self._live[key] = (StorageWeakRef(storage), storage.nbytes(), label)
        self.current_bytes += storage.nbytes()
        return True

    def _release_freed(self) -> None:
        for key, (ref, nbytes, _) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current_bytes -= nbytes


def _local_leaves(tree: object) -> list[torch.Tensor]:
    return [
        local_storage_holder(leaf) for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)
    ]


def kept_bytes_by_label(
    forward: Callable[[], torch.Tensor], label: Callable[[], str]
) -> dict[str, int]:
    """`kept_bytes`, split by what `label()` returned when each storage was allocated."""
    with PeakTensorMemory(label=label) as memory:
        out = forward()
        memory.forget(out)
        return memory.live_bytes_by_label()


def kept_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes that `forward()` allocates and leaves alive besides its output: what its autograd
    graph (and any activation checkpointing around it) keeps for the backward. Feed it inputs
    made outside, that need no gradient of their own kept here (a leaf that requires grad stays
    alive through the graph)."""
    return sum(kept_bytes_by_label(forward, lambda: "").values())
