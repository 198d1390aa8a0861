"""Reading byte ranges of checkpoint files into caller-owned buffers, through the page cache or
past it.

`read_buffered` is the plain path: `preadv` straight into the buffers, the kernel copying from
its page cache. `DirectReader` reads a range the page cache does not hold with O_DIRECT into a
small page-aligned bounce buffer and copies it from there: the kernel allocates no page-cache
page for it. That pays where each byte read is written to several places and read once, as
upcycling does (one dense FFN read, copied into every local expert): a buffered read also
fills fresh page-cache pages, which costs CPU the disk transfer does not (on a 2-core virtual
machine, 1 GiB read into the cache cost up to 3 s of CPU, a direct read 0.05 s; first upcycles
there took 5.3 s against 5.9 s buffered, in alternating order). It can lose where the bytes are
cached already (memory beats the disk) and where several ranks read the same bytes (the cache
would serve the second one), so the reader checks residency first (mincore) and is used only
where a caller asks for it. A file system that refuses O_DIRECT (tmpfs on older kernels, some
network file systems) gets the buffered read.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["DirectReader", "evict", "read_buffered", "resident_fraction"]

_MAX_IOVECS = os.sysconf("SC_IOV_MAX")
"""Buffers one `preadv` call takes (1024 on Linux)."""
_ALIGN = 4096
"""O_DIRECT alignment of file offsets, lengths and memory (a page covers every block size)."""
_BOUNCE_BYTES = 16 << 20
"""Bytes one direct read moves: large enough that the per-call cost vanishes."""
_MAX_RESIDENT_FOR_DIRECT = 0.5
"""A range with at least this fraction of its pages cached is read through the cache."""


def read_buffered(path: Path, offset: int, buffers: Sequence[np.ndarray]) -> None:
    """Bytes from `offset` of `path` into `buffers` in order (byte arrays) through the page
    cache, with as few `preadv` calls as the iovec limit allows; EOFError if the file ends
    first."""
    pending, done = list(buffers), 0  # pending[done:] still to fill
    descriptor = os.open(path, os.O_RDONLY)
    try:
        while done < len(pending):
            count = os.preadv(descriptor, pending[done : done + _MAX_IOVECS], offset)
            if count == 0:
                raise EOFError(f"{path} ends at byte {offset}")
            offset += count
            while done < len(pending) and count >= pending[done].size:
                count -= pending[done].size
                done += 1
            if count:  # a short read stopped inside this buffer
                pending[done] = pending[done][count:]
    finally:
        os.close(descriptor)


def evict(path: Path) -> None:
    """Write `path`'s dirty pages, then ask the kernel to drop its pages from the page cache
    (what a cold read, or a test of one, starts from)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


def resident_fraction(path: Path, offset: int = 0, length: int | None = None) -> float:
    """Fraction of the pages of bytes `offset:offset + length` of `path` (default: to its end)
    that are in the page cache, by mincore(2) on a fresh map: nothing is read."""
    size = path.stat().st_size
    end = size if length is None else min(size, offset + length)
    start = offset - offset % mmap.PAGESIZE
    if end <= start:
        return 1.0
    pages = -(-(end - start) // mmap.PAGESIZE)
    libc = _libc()
    descriptor = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, end - start, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, start)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, end - start, vector):
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = int(np.bitwise_and(np.frombuffer(vector, dtype=np.uint8), 1).sum())
        finally:
            libc.munmap(address, end - start)
    finally:
        os.close(descriptor)
    return resident / pages


class DirectReader:
    """O_DIRECT reads of uncached ranges through one page-aligned bounce buffer.

    `read` returns False, having written nothing it will not rewrite, where the range is mostly
    cached or the system cannot read it directly; the caller then reads it buffered.
    """

    def __init__(self, bounce_bytes: int = _BOUNCE_BYTES) -> None:
        if bounce_bytes <= 0 or bounce_bytes % _ALIGN:
            raise ValueError(f"bounce_bytes={bounce_bytes} must be a positive multiple of 4096")
        self._bounce_bytes = bounce_bytes
        self._bounce: np.ndarray | None = None
        self.supported = getattr(os, "O_DIRECT", None) is not None
        """False once the system has refused a direct read: every later read is buffered."""
        self.bytes_read = 0
        """Bytes delivered by direct reads (what bypassed the page cache)."""

    def read(self, path: Path, offset: int, buffers: Sequence[np.ndarray]) -> bool:
        """Bytes from `offset` of `path` into `buffers` in order, read past the page cache;
        False where it did not (cached range, or no O_DIRECT here); EOFError if the file ends
        first."""
        total = sum(buffer.size for buffer in buffers)
        if not self.supported or total == 0:
            return False
        if resident_fraction(path, offset, total) >= _MAX_RESIDENT_FOR_DIRECT:
            return False
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as error:
            return self._refused(error)
        try:
            self._read_aligned(descriptor, path, offset, total, buffers)
        except OSError as error:
            return self._refused(error)
        finally:
            os.close(descriptor)
        self.bytes_read += total
        return True

    def _refused(self, error: OSError) -> bool:
        """A file system without O_DIRECT says EINVAL; anything else is a real error."""
        if error.errno != errno.EINVAL:
            raise error
        self.supported = False
        return False

    def _read_aligned(
        self, descriptor: int, path: Path, offset: int, total: int, buffers: Sequence[np.ndarray]
    ) -> None:
        """Aligned chunks covering the range into the bounce buffer, each copied on into
        `buffers`."""
        bounce = self._bounce_buffer()
        position = offset - offset % _ALIGN  # file position of the next chunk
        skip = offset - position  # bytes at the chunk's start that precede the range
        targets = _Targets(buffers)
        remaining = total
        while remaining:
            want = min(len(bounce), -(-(skip + remaining) // _ALIGN) * _ALIGN)
            count = os.preadv(descriptor, [bounce[:want]], position)
            useful = max(0, min(count - skip, remaining))
            targets.take(bounce[skip : skip + useful])
            remaining -= useful
            if remaining and count < want:  # a regular file reads short only at its end
                raise EOFError(f"{path} ends at byte {position + count}")
            position += count
            skip = 0

    def close(self) -> None:
        """Free the bounce buffer (a later read allocates it again)."""
        self._bounce = None

    def _bounce_buffer(self) -> np.ndarray:
        if self._bounce is None:  # an anonymous map is page-aligned, as O_DIRECT needs
            self._bounce = np.frombuffer(mmap.mmap(-1, self._bounce_bytes), dtype=np.uint8)
        return self._bounce


class _Targets:
    """Byte arrays filled in order, each piece of data continuing where the last one ended."""

    def __init__(self, buffers: Sequence[np.ndarray]) -> None:
        self._buffers, self._index, self._filled = list(buffers), 0, 0

    def take(self, data: np.ndarray) -> None:
        start = 0
        while start < data.size:
            buffer = self._buffers[self._index]
            count = min(buffer.size - self._filled, data.size - start)
            buffer[self._filled : self._filled + count] = data[start : start + count]
            start += count
            self._filled += count
            if self._filled == buffer.size:
                self._index, self._filled = self._index + 1, 0
