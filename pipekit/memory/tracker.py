"""Peak live bytes of a training step's activations, per rank, beside the process RSS.

`ActivationMemoryTracker` counts three categories:
- "saved": tensors autograd saves for backward, seen through `saved_tensors_hooks`;
- "kv_cache" and "stage_inputs": tensors a KV cache or a pipeline stage reports with
  `track_tensor`/`untrack_tensor` (or `tracker.track`/`tracker.untrack`).

Accounting is by storage: a tensor counts as the whole `untyped_storage()` it views (a saved slice
of a big buffer counts the buffer), and a storage reached through several tensors counts once, in
each category and in the union (`peak_total_bytes`). Parameters, tensors that view them and the
storages of `exclude` are not counted: weights saved by a linear layer are not activations.

Like any `saved_tensors_hooks`, the tracker sees nothing saved inside an inner pair of hooks
(e.g. activation checkpointing's region). Autograd skips its in-place check on hooked tensors;
unpacking does that check here instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipekit.memory.live_tensors import local_storage_holder

__all__ = [
    "CATEGORIES",
    "KV_CACHE",
    "SAVED",
    "STAGE_INPUTS",
    "ActivationMemoryTracker",
    "MemoryReport",
    "SavedHandle",
    "active_memory_tracker",
    "hold_saved",
    "process_memory_bytes",
    "track_tensor",
    "untrack_tensor",
]

SAVED = "saved"
KV_CACHE = "kv_cache"
STAGE_INPUTS = "stage_inputs"
CATEGORIES = (SAVED, KV_CACHE, STAGE_INPUTS)
"""What a tracker counts, each on its own."""
_TRACKABLE = (KV_CACHE, STAGE_INPUTS)

_StorageKey = tuple[torch.device, int]  # (device, untyped_storage().data_ptr())

# Entered trackers, outermost first. torch applies only the innermost pair of saved-tensor hooks,
# so every pack records into all of them.
_ACTIVE: list[ActivationMemoryTracker] = []


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Peaks of one tracker's categories, in bytes, and the process RSS when it was taken."""

    rank: int
    """Rank in the default process group; 0 when none is initialized."""
    peak_saved_bytes: int
    """Peak live bytes of tensors saved for backward."""
    peak_kv_cache_bytes: int
    """Peak live bytes tracked as "kv_cache"."""
    peak_stage_input_bytes: int
    """Peak live bytes tracked as "stage_inputs"."""
    peak_total_bytes: int
    """Peak of the union of all categories, each storage counted once."""
    rss_now_bytes: int | None
    """VmRSS of this process at report time (None off Linux)."""
    rss_peak_bytes: int | None
    """VmHWM: this process's RSS high-water mark since it started, not since the tracker did."""

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        def mib(nbytes: int | None) -> str:
            return "n/a" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"

        return (
            f"rank {self.rank}: peak saved {mib(self.peak_saved_bytes)}, "
            f"kv_cache {mib(self.peak_kv_cache_bytes)}, "
            f"stage_inputs {mib(self.peak_stage_input_bytes)}, "
            f"total {mib(self.peak_total_bytes)}; rss {mib(self.rss_now_bytes)} "
            f"(process peak {mib(self.rss_peak_bytes)})"
        )


class ActivationMemoryTracker:
    """`with ActivationMemoryTracker(exclude=model.parameters()) as tracker:` around a step."""

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        on_change: Callable[[ActivationMemoryTracker], None] | None = None,
    ) -> None:
        self.on_change = on_change
        """Called after every change of the live bytes (a memory timeline samples there)."""
        self._excluded = {found[0] for t in exclude if (found := _storage_of(t)) is not None}
        self._refs: dict[str, dict[_StorageKey, int]] = {c: {} for c in CATEGORIES}
        self._live = dict.fromkeys(CATEGORIES, 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._union_refs: dict[_StorageKey, int] = {}  # storage -> number of categories holding it
        self._nbytes: dict[_StorageKey, int] = {}  # storage -> bytes, recorded when first seen
        self._union_live = 0
        self._union_peak = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> ActivationMemoryTracker:
        if self._hooks is not None:
            raise RuntimeError("this ActivationMemoryTracker is already entered; nest a new one")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(hold_saved, SavedHandle.unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _ACTIVE.remove(self)
        assert self._hooks is not None
        self._hooks.__exit__(*exc_info)
        self._hooks = None

    def track(self, category: str, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage live in `category` until `untrack` (caller keeps it alive)."""
        _check_trackable(category)
        if (found := self._countable(tensor)) is not None:
            self._acquire(category, *found)

    def untrack(self, category: str, tensor: torch.Tensor) -> None:
        """Undo one `track`; a storage this tracker never saw (tracked before it) is ignored."""
        _check_trackable(category)
        if (found := self._countable(tensor)) is not None:
            self._release(category, found[0])

    def live_bytes(self, category: str | None = None) -> int:
        """Bytes live now in `category`, or in the union of all categories when None."""
        return self._union_live if category is None else self._live[_checked(category)]

    def peak_bytes(self, category: str | None = None) -> int:
        """Peak of `live_bytes(category)` since this tracker was made."""
        return self._union_peak if category is None else self._peak[_checked(category)]

    def report(self) -> MemoryReport:
        rss = process_memory_bytes()
        dist = torch.distributed
        return MemoryReport(
            rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
            peak_saved_bytes=self._peak[SAVED],
            peak_kv_cache_bytes=self._peak[KV_CACHE],
            peak_stage_input_bytes=self._peak[STAGE_INPUTS],
            peak_total_bytes=self._union_peak,
            rss_now_bytes=rss.get("VmRSS"),
            rss_peak_bytes=rss.get("VmHWM"),
        )

    def _countable(self, tensor: torch.Tensor) -> tuple[_StorageKey, int] | None:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return None
        found = _storage_of(tensor)
        return None if found is None or found[0] in self._excluded else found

    def _acquire(self, category: str, key: _StorageKey, nbytes: int) -> None:
        refs = self._refs[category]
        refs[key] = refs.get(key, 0) + 1
        if refs[key] > 1:
            return
        self._union_refs[key] = self._union_refs.get(key, 0) + 1
        if self._union_refs[key] == 1:
            self._nbytes[key] = nbytes
            self._union_live += nbytes
            self._union_peak = max(self._union_peak, self._union_live)
        self._live[category] += self._nbytes[key]
        self._peak[category] = max(self._peak[category], self._live[category])
        if self.on_change is not None:
            self.on_change(self)

    def _release(self, category: str, key: _StorageKey) -> None:
        refs = self._refs[category]
        if key not in refs:
            return
        refs[key] -= 1
        if refs[key] > 0:
            return
        del refs[key]
        self._live[category] -= self._nbytes[key]
        self._union_refs[key] -= 1
        if self._union_refs[key] == 0:
            del self._union_refs[key]
            self._union_live -= self._nbytes.pop(key)
        if self.on_change is not None:
            self.on_change(self)


def active_memory_tracker() -> ActivationMemoryTracker | None:
    """The innermost entered tracker, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def track_tensor(category: str, tensor: torch.Tensor) -> None:
    """`track` into every entered tracker (nested ones all see it); a no-op when none is."""
    _check_trackable(category)
    for tracker in _ACTIVE:
        tracker.track(category, tensor)


def untrack_tensor(category: str, tensor: torch.Tensor) -> None:
    """`untrack` from every entered tracker; a no-op when none is."""
    _check_trackable(category)
    for tracker in _ACTIVE:
        tracker.untrack(category, tensor)


class SavedHandle:
    """What autograd holds instead of a saved tensor; releases the storage when freed.

    Saved-tensor hooks nested inside the trackers' (activation offload) hold their tensors
    through one of these (`hold_saved`), so the trackers still count them."""

    __slots__ = ("held", "tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # Detached: holding a saved output (relu's result) with its grad_fn would make a cycle
        # through C++ that the garbage collector never frees.
        self.tensor = tensor.detach()
        self.version = tensor._version
        self.held: list[tuple[ActivationMemoryTracker, _StorageKey]] = []

    def __del__(self) -> None:
        for tracker, key in self.held:
            tracker._release(SAVED, key)

    def unpack(self) -> torch.Tensor:
        """The saved tensor, after autograd's check that nothing modified it in place."""
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"a tensor saved for backward {tuple(self.tensor.shape)} was modified in place "
                f"(version {self.version} when saved, {self.tensor._version} now)"
            )
        return self.tensor


def hold_saved(tensor: torch.Tensor) -> SavedHandle:
    """Hold a tensor saved for backward, counted by every entered tracker until released."""
    handle = SavedHandle(tensor)
    for tracker in _ACTIVE:
        if (found := tracker._countable(tensor)) is not None:
            tracker._acquire(SAVED, *found)
            handle.held.append((tracker, found[0]))
    return handle


def _storage_of(tensor: torch.Tensor) -> tuple[_StorageKey, int] | None:
    """(key, bytes) of the storage under `tensor` (a DTensor's: its local shard's); None for
    meta, sparse or empty storages."""
    tensor = local_storage_holder(tensor)
    if tensor.device.type == "meta" or tensor.layout != torch.strided:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without a storage
        return None
    nbytes = storage.nbytes()
    return None if nbytes == 0 else ((tensor.device, storage.data_ptr()), nbytes)


def _check_trackable(category: str) -> None:
    if category not in _TRACKABLE:
        raise ValueError(
            f"category={category!r} cannot be tracked explicitly; use one of {_TRACKABLE} "
            f"({SAVED!r} is counted by autograd hooks)"
        )


def _checked(category: str) -> str:
    if category not in CATEGORIES:
        raise ValueError(f"category={category!r} is not one of {CATEGORIES}")
    return category


def process_memory_bytes() -> dict[str, int]:
    """VmRSS and VmHWM from /proc/self/status in bytes; empty off Linux."""
    try:
        with open("/proc/self/status") as status:
            lines = status.readlines()
    except OSError:
        return {}
    fields = (line.split() for line in lines if line.startswith(("VmRSS:", "VmHWM:")))
    return {name.rstrip(":"): int(kib) * 1024 for name, kib, *_ in fields}
