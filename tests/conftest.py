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
from pipekit.memory_plan.forked import in_forked_child
from pipekit.train.metrics import measure_matmul_flops


@pytest.fixture(autouse=True, scope="session")
def _peak_flops_measured_once_for_every_rank() -> None:
    """Every trainer measures the matmul peak its MFU is reported against, once per process;
    measured here with one intra-op thread, as a forked rank runs, every rank group the suite
    forks inherits it instead of spending half a second of a core on it again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measure_matmul_flops()
    finally:
        torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A test marked `own_process` runs in a child forked from the pytest process, the way
    pipekit's rank groups run: libraries that start threads (datasets, DataLoader workers,
    tokenizers) leave them in the child, so the pytest process, which forks every later rank
    group, stays single-threaded (a fork copies only the calling thread). Fixtures are set up
    here, in the parent; a failure comes back with the child's traceback."""
    if pyfuncitem.get_closest_marker("own_process") is None:
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    in_forked_child(pyfuncitem.obj, **arguments)
    return True


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
