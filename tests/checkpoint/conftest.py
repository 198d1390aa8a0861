"""Fixtures of the checkpoint tests: a folder that reads past the page cache."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipekit.checkpoint.file_reads import evict, resident_fraction


@pytest.fixture
def direct_read_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder whose files can be evicted and read past the page cache: `tmp_path`, or where
    that is a tmpfs (or refuses O_DIRECT) a fresh folder beside the tests, removed after."""
    if _reads_past_the_cache(tmp_path):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix=".direct-reads-", dir=Path(__file__).parents[1]))
    try:
        if not _reads_past_the_cache(folder):
            pytest.fail(
                f"neither {tmp_path} nor {folder} can be read past the page cache (O_DIRECT on "
                "a file system that evicts files); run the tests from a disk-backed checkout"
            )
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _reads_past_the_cache(folder: Path) -> bool:
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
