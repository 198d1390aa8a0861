"""Suite-wide fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipekit.checkpoint.file_reads import evict, resident_fraction


@pytest.fixture(autouse=True)
def _forked_tests_use_one_intra_op_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked `forked` runs in a child forked from the pytest process, which may have
    started torch's OpenMP pool in an earlier test; a forked child that enters that pool waits
    forever for threads the fork did not copy. With one intra-op thread it never enters it
    (`run_on_ranks` does the same in its ranks). The parent's setting is untouched: this runs
    in the child."""
    if request.node.get_closest_marker("forked") is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def direct_read_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder whose files can be evicted and read past the page cache: `tmp_path`, or where
    that is a tmpfs (or refuses O_DIRECT) a fresh folder beside the tests, removed after."""
    if _reads_past_the_cache(tmp_path):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix=".direct-reads-", dir=Path(__file__).parent))
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
