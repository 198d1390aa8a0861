"""Where offloaded activations wait for their backward: a file on CPU, pinned host memory on CUDA.

A store takes the bytes of one storage (`put`), gives them back as a new device buffer (`get`)
and forgets them (`drop`). Both keep the bytes outside the process's device memory:

- `FileStore` (CPU): one unnamed temporary file per process (gone when the process ends, even on
  a crash), written with `pwrite` and read back with `preadv`, regions reused first-fit. The
  pages land in the kernel's page cache, not in the process: its resident memory falls.
- `PinnedHostStore` (CUDA): page-locked host buffers (torch's caching host allocator), copied
  on a side stream so a copy overlaps the compute stream's work; `get` returns with the copy in
  flight and an event the compute stream waits on before the bytes are used (`ready`).
"""

from __future__ import annotations

import abc
import bisect
import os
import tempfile
from dataclasses import dataclass

import torch

__all__ = ["FileStore", "OffloadStore", "PinnedHostStore", "store_for"]


class OffloadStore(abc.ABC):
    """Keeps byte buffers off the device between `put` and `get`."""

    @abc.abstractmethod
    def put(self, bytes_U8: torch.Tensor) -> object:
        """Keep a copy of `bytes_U8` (1-D uint8); returns the ticket that `get` takes."""

    @abc.abstractmethod
    def get(self, ticket: object, device: torch.device) -> torch.Tensor:
        """A new 1-D uint8 buffer on `device` with the bytes `ticket` names; the ticket is
        dropped. Call `ready(buffer)` before the compute stream reads it."""

    @abc.abstractmethod
    def drop(self, ticket: object) -> None:
        """Forget bytes that will not be read back (a step that ended early)."""

    def ready(self, buffer_U8: torch.Tensor) -> None:  # noqa: B027 - a default, not abstract
        """Make the compute stream wait until `get`'s buffer holds its bytes (default: it
        does on return)."""


@dataclass(frozen=True)
class _Region:
    offset: int
    nbytes: int


class FileStore(OffloadStore):
    """Bytes in an unnamed temporary file in `directory` (the system's temporary folder when
    None); freed regions are reused first-fit, so the file grows to the peak offloaded, not to
    everything a step offloads."""

    def __init__(self, directory: str | None = None) -> None:
        self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - open while in use
        self._fd = self._file.fileno()
        self._free: list[_Region] = []  # sorted by offset, adjacent regions merged
        self._end = 0

    def put(self, bytes_U8: torch.Tensor) -> _Region:
        region = self._allocate(bytes_U8.numel())
        view = memoryview(bytes_U8.contiguous().numpy())
        written = 0
        while written < region.nbytes:
            written += os.pwrite(self._fd, view[written:], region.offset + written)
        return region

    def get(self, ticket: object, device: torch.device) -> torch.Tensor:
        assert isinstance(ticket, _Region)
        buffer_U8 = torch.empty(ticket.nbytes, dtype=torch.uint8)
        view = memoryview(buffer_U8.numpy())
        read = 0
        while read < ticket.nbytes:
            got = os.preadv(self._fd, [view[read:]], ticket.offset + read)
            if got == 0:
                raise OSError(f"the activation offload file ended at byte {ticket.offset + read}")
            read += got
        self.drop(ticket)
        return buffer_U8.to(device)

    def drop(self, ticket: object) -> None:
        assert isinstance(ticket, _Region)
        index = bisect.bisect(self._free, ticket.offset, key=lambda region: region.offset)
        self._free.insert(index, ticket)
        merged: list[_Region] = []
        for region in self._free:
            if merged and merged[-1].offset + merged[-1].nbytes == region.offset:
                merged[-1] = _Region(merged[-1].offset, merged[-1].nbytes + region.nbytes)
            else:
                merged.append(region)
        self._free = merged

    @property
    def file_bytes(self) -> int:
        """The file's size: the most bytes it held at once (regions are reused)."""
        return self._end

    def _allocate(self, nbytes: int) -> _Region:
        for index, region in enumerate(self._free):
            if region.nbytes >= nbytes:
                rest = _Region(region.offset + nbytes, region.nbytes - nbytes)
                self._free[index : index + 1] = [rest] if rest.nbytes else []
                return _Region(region.offset, nbytes)
        region = _Region(self._end, nbytes)
        self._end += nbytes
        return region


@dataclass
class _HostCopy:
    host_U8: torch.Tensor
    copied: torch.cuda.Event


class PinnedHostStore(OffloadStore):
    """Bytes in pinned host memory, copied on a side stream of `device` (CUDA only; written
    for CUDA's stream semantics, not run by the CPU test suite)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._arrivals: dict[int, torch.cuda.Event] = {}  # buffer data_ptr -> copy done

    def put(self, bytes_U8: torch.Tensor) -> _HostCopy:
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the bytes are final on the compute stream
        host_U8 = torch.empty(bytes_U8.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self._stream):
            host_U8.copy_(bytes_U8, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        bytes_U8.record_stream(self._stream)  # not reused before the copy has read it
        return _HostCopy(host_U8, copied)

    def get(self, ticket: object, device: torch.device) -> torch.Tensor:
        assert isinstance(ticket, _HostCopy)
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ticket.copied)
            buffer_U8 = torch.empty(ticket.host_U8.numel(), dtype=torch.uint8, device=device)
            buffer_U8.copy_(ticket.host_U8, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self._stream)
        buffer_U8.record_stream(compute)  # used, then freed, on the compute stream
        self._arrivals[buffer_U8.data_ptr()] = arrived
        return buffer_U8

    def drop(self, ticket: object) -> None:
        """Nothing to wait for: torch's caching host allocator keeps a pinned buffer until the
        copies recorded on it have finished."""

    def ready(self, buffer_U8: torch.Tensor) -> None:
        arrived = self._arrivals.pop(buffer_U8.data_ptr(), None)
        if arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(arrived)


def store_for(device: torch.device, directory: str | None = None) -> OffloadStore:
    """Pinned host memory for a CUDA device, a file in `directory` otherwise."""
    if device.type == "cuda":
        return PinnedHostStore(device)
    return FileStore(directory)
