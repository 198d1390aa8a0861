"""Suite-wide fixtures."""

from __future__ import annotations

import pytest
import torch

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
