"""Run a function in a forked child process and hand back its result or its exception.

The planner simulates ranks in torch's "fake" process group: the groups and meshes a simulated
rank creates leave global state in torch.distributed that a later real job in the same process
must not inherit, so each simulation lives and dies in a child.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

__all__ = ["in_forked_child"]

T = TypeVar("T")


def in_forked_child(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a forked child; its result, or its exception raised here."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(sender, fn, args), daemon=True)
    child.start()
    sender.close()
    try:
        ok, value = receiver.recv()
    except EOFError:
        child.join()
        raise RuntimeError(
            f"the process simulating a rank died (exit code {child.exitcode})"
        ) from None
    child.join()
    if not ok:
        raise value
    return value


def _child_main(sender: Connection, fn: Callable[..., object], args: tuple) -> None:
    try:
        sender.send((True, fn(*args)))
    except BaseException as error:  # handed to the parent, which raises it
        sender.send((False, error))
    finally:
        sender.close()
