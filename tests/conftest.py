"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


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
