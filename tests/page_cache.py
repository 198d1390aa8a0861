"""Test helpers for reads past the page cache: evicting a file, and whether a folder's file
system can show a direct read (O_DIRECT, files that leave the cache when evicted)."""

from __future__ import annotations

import os
from pathlib import Path

from pipekit.checkpoint.file_reads import resident_fraction


def evict(path: Path) -> Path:
    """`path` synced and dropped from the page cache."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)
    return path


def reads_past_the_cache(folder: Path) -> bool:
    """Whether files in `folder` can be evicted from the page cache and read with O_DIRECT
    (not on a tmpfs, nor a file system that refuses O_DIRECT)."""
    probe = folder / "direct-probe"
    probe.write_bytes(bytes(8192))
    evict(probe)
    cached = resident_fraction(probe)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        refused = False
    except OSError:
        refused = True
    probe.unlink()
    return not refused and cached == 0
