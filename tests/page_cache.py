"""Test helpers for reads past the page cache: evicting a file, and skipping where the test
folder's file system cannot show a direct read (no O_DIRECT, or files kept in memory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def require_direct_reads(folder: Path) -> None:
    """Skip unless `folder`'s file system reads with O_DIRECT and evicts files (not tmpfs);
    the buffered fallback is tested on its own."""
    probe = folder / "direct-probe"
    probe.write_bytes(bytes(8192))
    evict(probe)
    cached = resident_fraction(probe)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        refused = None
    except OSError as error:
        refused = error
    probe.unlink()
    if refused is not None:
        pytest.skip(f"{folder}'s file system refuses O_DIRECT: {refused}")
    if cached > 0:
        pytest.skip(f"{folder}'s file system keeps files in memory (tmpfs)")
