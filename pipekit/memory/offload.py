"""Saved activations moved off the device after a unit's forward, brought back before its backward.

    offloader = ActivationOffloader(store_for(device))
    with offloader.saving(key):        # around the unit's forward
        loss = model(x)
    offloader.offload(key, ratio=0.5)  # when its backward is far away
    ...
    offloader.reload(key)              # one action before its backward (a prefetch)
    loss.backward()

The saved tensors of one unit are grouped by the storage they view, so a storage that several
saved tensors share (a norm's output that three projections save) moves once and comes back as
one storage with the same views. A storage moves only when the saved tensors are all that hold
it: one that something else keeps alive (a parameter, the KV cache, a stage's input or output)
would not free a byte. `ratio` is the share of the movable bytes to move, the earliest saved
first (their backward comes last). A tensor unpacked before its reload (a prefetch that did
not happen) is read back on the spot and counted in `late_reloads`.

The offloader's hooks are the innermost, so they hold their tensors through the memory
trackers' handles (`hold_saved`): the trackers count a storage while it is on the device and
not while it is away. Tensors saved inside activation checkpointing's own hooks (its
checkpointed regions) are out of their reach.

Legend: U8 a buffer of bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Hashable, Iterator

import torch
from torch import nn

from pipekit._torch_private import storage_holders
from pipekit.memory.offload_store import OffloadStore
from pipekit.memory.tracker import SavedHandle, hold_saved

__all__ = ["ActivationOffloader", "OffloadStats"]


@dataclasses.dataclass
class OffloadStats:
    """What an offloader moved since it was made (or since `reset_stats`)."""

    saved_bytes: int = 0
    """Bytes of the distinct storages the units offered to `offload` saved."""
    movable_bytes: int = 0
    """Of those, the storages only saved tensors held."""
    offloaded_bytes: int = 0
    """Bytes moved off the device."""
    offloaded_units: int = 0
    """Units offered to `offload`."""
    late_reloads: int = 0
    """Storages read back at unpack time because no reload came first."""


class _StorageRecord:
    """One storage the saved tensors of one unit view: on the device, or away (a ticket)."""

    __slots__ = ("arriving", "device", "nbytes", "ticket", "views")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.nbytes = tensor.untyped_storage().nbytes()
        self.views: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.ticket: object | None = None
        self.arriving: torch.Tensor | None = None  # a reloaded buffer not yet made ready


class _Saved:
    """What autograd holds for a saved tensor of a movable storage."""

    __slots__ = ("__weakref__", "dtype", "handle", "offset", "record", "size", "stride")

    def __init__(self, record: _StorageRecord, tensor: torch.Tensor) -> None:
        self.record = record
        self.dtype = tensor.dtype
        self.offset, self.size, self.stride = (
            tensor.storage_offset(),
            tensor.size(),
            tensor.stride(),
        )
        self.handle: SavedHandle | None = hold_saved(tensor)


def _movable_kind(tensor: torch.Tensor) -> bool:
    """Plain strided tensors with storage of their own; parameters stay (and free nothing)."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return False
    if isinstance(tensor._base, nn.Parameter) or tensor.device.type == "meta":
        return False
    return tensor.untyped_storage().nbytes() > 0


class ActivationOffloader:
    """Saved-tensor hooks that can move a unit's saved activations to `store` and back."""

    def __init__(self, store: OffloadStore) -> None:
        self.store = store
        self.stats = OffloadStats()
        self._units: dict[Hashable, list[_StorageRecord]] = {}
        self._open_records: list[_StorageRecord] = []  # the open scope's, in first-save order
        self._open: dict[tuple[torch.device, int], _StorageRecord] | None = None

    @contextlib.contextmanager
    def saving(self, key: Hashable) -> Iterator[None]:
        """Group what autograd saves inside this scope under `key`."""
        if key in self._units:
            raise RuntimeError(f"unit {key} is already saved; reload or discard it first")
        records: list[_StorageRecord] = []
        self._units[key], self._open_records, self._open = records, records, {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._open = None

    def offload(self, key: Hashable, ratio: float) -> int:
        """Move `ratio` of `key`'s movable bytes off the device; returns the bytes moved."""
        saved = self._units[key]
        records = [record for record in saved if _held_only_by_saved(record)]
        movable = sum(record.nbytes for record in records)
        self.stats.saved_bytes += sum(record.nbytes for record in saved)
        target, moved = ratio * movable, 0
        for record in records:  # earliest saved first: their backward comes last
            if abs(moved + record.nbytes - target) <= abs(moved - target):
                self._move_out(record)
                moved += record.nbytes
        self.stats.movable_bytes += movable
        self.stats.offloaded_bytes += moved
        self.stats.offloaded_units += 1
        return moved

    def reload(self, key: Hashable) -> None:
        """Bring `key`'s storages back (before its backward) and forget the unit."""
        for record in self._units.pop(key):
            if record.ticket is not None:
                self._move_in(record)

    def discard(self, key: Hashable) -> None:
        """Forget a unit that stays on the device."""
        self._units.pop(key)

    def clear(self) -> None:
        """End of a step: drop whatever was never read back."""
        for records in self._units.values():
            for record in records:
                if record.ticket is not None:
                    self.store.drop(record.ticket)
                    record.ticket = None
        self._units.clear()

    def _pack(self, tensor: torch.Tensor) -> SavedHandle | _Saved:
        assert self._open is not None
        if not _movable_kind(tensor):
            return hold_saved(tensor)
        storage_key = (tensor.device, tensor.untyped_storage().data_ptr())
        record = self._open.get(storage_key)
        if record is None or not record.views:  # no view left: the address was reused
            record = self._open[storage_key] = _StorageRecord(tensor)
            self._open_records.append(record)
        saved = _Saved(record, tensor)
        record.views.add(saved)
        return saved

    def _unpack(self, packed: SavedHandle | _Saved) -> torch.Tensor:
        if isinstance(packed, SavedHandle):
            return packed.unpack()
        record = packed.record
        if packed.handle is None:
            self.stats.late_reloads += 1
            self._move_in(record)
        if record.arriving is not None:
            self.store.ready(record.arriving)
            record.arriving = None
        assert packed.handle is not None
        return packed.handle.unpack()

    def _move_out(self, record: _StorageRecord) -> None:
        views = list(record.views)
        for saved in views:
            assert saved.handle is not None
            saved.handle.unpack()  # raises if modified in place since it was saved
        storage = views[0].handle.tensor.untyped_storage()  # type: ignore[union-attr]
        bytes_U8 = torch.empty(0, dtype=torch.uint8, device=record.device).set_(storage)
        record.ticket = self.store.put(bytes_U8)
        del bytes_U8, storage
        for saved in views:
            saved.handle = None  # the last holders: the storage is freed here

    def _move_in(self, record: _StorageRecord) -> None:
        assert record.ticket is not None
        buffer_U8 = self.store.get(record.ticket, record.device)
        record.ticket, record.arriving = None, buffer_U8
        storage = buffer_U8.untyped_storage()
        for saved in record.views:
            tensor = torch.empty(0, dtype=saved.dtype, device=record.device)
            tensor.set_(storage, saved.offset, saved.size, saved.stride)
            saved.handle = hold_saved(tensor)


def _held_only_by_saved(record: _StorageRecord) -> bool:
    """Whether moving the storage frees it: its holders are the saved tensors' handles."""
    views = [saved for saved in record.views if saved.handle is not None]
    if not views:
        return False
    return storage_holders(views[0].handle.tensor) == len(views)  # type: ignore[union-attr]
