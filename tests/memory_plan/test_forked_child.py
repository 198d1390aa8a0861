"""`in_forked_child`, which the memory plan's simulated ranks and the suite's `own_process`
tests run in: threads a child starts stay in the child, and its failures come back whole."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pipekit.memory_plan.forked import in_forked_child


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _start_a_thread_and_count() -> tuple[int, int]:
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    return _thread_count(), torch.get_num_threads()


def _fail(value: int) -> None:
    assert value == 4, f"value was {value}"


class _TwoPartError(Exception):
    def __init__(self, first: str, second: str) -> None:  # not rebuildable from its args
        super().__init__(f"{first} {second}")


def _fail_unrebuildably() -> None:
    raise _TwoPartError("cannot", "cross")


def _fail_unpicklably() -> None:
    class LocalError(Exception):
        pass

    raise LocalError("local")


def test_threads_a_child_starts_stay_in_the_child() -> None:
    before = _thread_count()
    in_child, intra_op_threads = in_forked_child(_start_a_thread_and_count)
    assert in_child >= 2 and intra_op_threads == 1
    assert _thread_count() <= before


def test_a_childs_failure_is_raised_with_its_traceback() -> None:
    with pytest.raises(AssertionError, match="value was 3") as raised:
        in_forked_child(_fail, 3)
    assert any("in _fail" in note for note in raised.value.__notes__)


def test_an_error_that_cannot_come_back_is_named_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="cannot be rebuilt") as raised:
        in_forked_child(_fail_unrebuildably)
    assert any("cannot cross" in note for note in raised.value.__notes__)
    with pytest.raises(RuntimeError, match="LocalError cannot be sent back") as raised:
        in_forked_child(_fail_unpicklably)
    assert any("LocalError: local" in note for note in raised.value.__notes__)


@pytest.mark.own_process
def test_an_own_process_test_runs_in_a_child() -> None:
    assert torch.get_num_threads() == 1 and os.getpid() != _PYTEST_PID


_PYTEST_PID = os.getpid()
