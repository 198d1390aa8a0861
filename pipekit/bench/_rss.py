"""Resident memory of this process, and a peak that can be reset between phases (Linux).

`peak_rss` is the kernel's high-water mark (VmHWM), which `reset_peak_rss` sets back to the
current RSS (`/proc/self/clear_refs`), so one process can measure several phases. RSS counts
mapped file pages the process has touched (a safetensors read maps its file) as well as its own
memory. `release_freed_memory` hands glibc's free lists back to the kernel, so a phase does not
start with the last one's freed-but-kept pages counted.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

__all__ = ["current_rss", "peak_rss", "release_freed_memory", "reset_peak_rss"]

_STATUS = Path("/proc/self/status")


def _status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{_STATUS} has no {key}; the memory benches need Linux")


def current_rss() -> int:
    """Bytes resident now."""
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """Most bytes resident since the process started or `reset_peak_rss` last ran."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> int:
    """Start a new peak at the current RSS; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return current_rss()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def release_freed_memory() -> None:
    """Return freed heap pages to the kernel (glibc's malloc_trim)."""
    _libc().malloc_trim(0)
