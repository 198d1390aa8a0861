"""`ServingPriority`: while a serving thread computes an answer, the rank's thread, giving way,
starts no ATen operation (forward or backward); without giving way it runs on (the ablation).
The parity of the pipeline with the gate on is `test_context_exchange_pipeline`'s (it is on by
default on a CPU)."""

from __future__ import annotations

import threading

import torch

from pipekit.attention.serving_priority import ServingPriority

_BLOCKED_S = 0.2  # how long an operation must stay blocked to count as waiting


def _serve_until_released(
    priority: ServingPriority, computing: threading.Event, release: threading.Event
) -> threading.Thread:
    """A serving thread inside `computing()` until `release` is set."""

    def serve() -> None:
        with priority.computing():
            computing.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert computing.wait(timeout=30)
    return thread


def _rank_pass(priority: ServingPriority, give_way: bool, done: threading.Event) -> list[float]:
    """The rank's thread: a forward and a backward, giving way or not; returns the gradient."""
    grads: list[float] = []

    def run() -> None:
        x = torch.ones(3, requires_grad=True)
        if give_way:
            with priority.giving_way():
                (x * 2).sum().backward()
        else:
            (x * 2).sum().backward()
        grads.extend(x.grad.tolist())
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return grads


def test_the_rank_waits_while_an_answer_is_computed() -> None:
    priority = ServingPriority()
    computing, release, done = threading.Event(), threading.Event(), threading.Event()
    server = _serve_until_released(priority, computing, release)
    grads = _rank_pass(priority, give_way=True, done=done)
    assert not done.wait(timeout=_BLOCKED_S), "the rank's pass ran while an answer was computed"
    release.set()
    assert done.wait(timeout=30)
    server.join(timeout=30)
    assert grads == [2.0, 2.0, 2.0]
    assert priority.gave_way_s > _BLOCKED_S / 2


def test_without_giving_way_the_rank_runs_on() -> None:
    """The ablation: the same serving, the rank's pass outside `giving_way`."""
    priority = ServingPriority()
    computing, release, done = threading.Event(), threading.Event(), threading.Event()
    server = _serve_until_released(priority, computing, release)
    grads = _rank_pass(priority, give_way=False, done=done)
    assert done.wait(timeout=30), "the pass waited without giving way"
    release.set()
    server.join(timeout=30)
    assert grads == [2.0, 2.0, 2.0] and priority.gave_way_s == 0.0


def test_nothing_served_costs_no_wait() -> None:
    """Giving way with no answer in progress, and after one ended, waits for nothing."""
    priority = ServingPriority()
    with priority.computing():
        pass
    done = threading.Event()
    grads = _rank_pass(priority, give_way=True, done=done)
    assert done.wait(timeout=30)
    assert grads == [2.0, 2.0, 2.0] and priority.gave_way_s == 0.0


class _CountingPriority(ServingPriority):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def give_way(self) -> None:
        self.checks += 1
        super().give_way()


def test_backward_operations_give_way_too() -> None:
    """A pass's backward runs inside the step's scope too: its operations check the gate."""
    priority = _CountingPriority()
    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    with priority.giving_way():
        loss.backward()
    assert priority.checks > 0 and x.grad.tolist() == [2.0, 2.0, 2.0]
