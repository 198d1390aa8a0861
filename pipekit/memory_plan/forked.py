"""Run a function in a forked child process and hand back its result or its exception.

The planner simulates ranks in torch's "fake" process group: the groups and meshes a simulated
rank creates leave global state in torch.distributed that a later real job in the same process
must not inherit, so each simulation lives and dies in a child. pipekit's tests run the same way
where a library would leave threads behind in the process that forks later rank groups.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

__all__ = ["in_forked_child", "map_in_forked_children"]

T = TypeVar("T")


def in_forked_child(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """`fn(*args, **kwargs)` in a forked child with one intra-op thread; its result, or its
    exception raised here with the child's traceback attached as a note.

    One intra-op thread because a forked child that enters the OpenMP pool its parent started
    waits forever for pool threads the fork did not copy.
    """
    return _collect(*_start(fn, args, kwargs))


def map_in_forked_children(
    fn: Callable[..., T], calls: Sequence[tuple[object, ...]], processes: int
) -> list[T]:
    """`[fn(*call) for call in calls]`, each in a forked child as `in_forked_child` runs it,
    at most `processes` at a time (independent measurements on a machine's cores)."""
    results: list[T] = []
    for first in range(0, len(calls), max(1, processes)):
        started = [_start(fn, call, {}) for call in calls[first : first + processes]]
        results += [_collect(*child) for child in started]
    return results


def _start(
    fn: Callable[..., object], args: tuple, kwargs: dict
) -> tuple[Callable[..., object], Any, Connection]:
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    # not a daemon: the child may start processes of its own (DataLoader workers)
    child = context.Process(target=_child_main, args=(sender, fn, args, kwargs))
    child.start()
    sender.close()
    return fn, child, receiver


def _collect(fn: Callable[..., T], child: Any, receiver: Connection) -> T:
    try:
        ok, payload, child_traceback = pickle.loads(receiver.recv_bytes())
    except EOFError:
        child.join()
        raise RuntimeError(
            f"the forked child running {getattr(fn, '__qualname__', fn)} died "
            f"(exit code {child.exitcode}) before reporting"
        ) from None
    child.join()
    try:
        value = pickle.loads(payload)
    except Exception as unrebuildable:
        ok, value = False, RuntimeError(f"the child's outcome cannot be rebuilt ({unrebuildable})")
    if not ok:
        value.add_note(f"raised in a forked child:\n{child_traceback}")
        raise value
    return value


def _child_main(
    sender: Connection, fn: Callable[..., object], args: tuple, kwargs: dict[str, object]
) -> None:
    torch.set_num_threads(1)
    try:
        ok, outcome, child_traceback = True, fn(*args, **kwargs), ""
    except BaseException as error:  # handed to the parent, which raises it
        ok, outcome, child_traceback = False, error, traceback.format_exc()
    try:
        payload = pickle.dumps(outcome)
    except Exception as unpicklable:  # the result or the error cannot cross: say what it was
        message = f"{type(outcome).__name__} cannot be sent back ({unpicklable})"
        ok, payload = False, pickle.dumps(RuntimeError(message))
    try:
        # the outcome pickled on its own: the parent reads the traceback even if it cannot
        # rebuild the outcome (an exception whose __init__ its args do not fit)
        sender.send_bytes(pickle.dumps((ok, payload, child_traceback)))
    finally:
        sender.close()
        # Skip the exit handlers the fork copied (a test runner's; multiprocessing's, which
        # would wait for processes the function left running, such as DataLoader workers).
        os._exit(0)
