"""`ServingPriority`: a rank's own passes give way to its serving threads' attention.

In context exchange a lender waits, at every attention layer, for the server's answer; the
server answers on a helper thread beside its own pass (`LoanServer`). The exchange plan's
balance assumes the answer is computed as soon as the request arrives, as on a GPU where the
serving kernels would run on a stream of higher priority. On a CPU the helper thread and the
rank's pass share the rank's cores, and the OS shares them fairly: each answer then takes about
twice its compute, the lender waits for the difference, and at 8K context on two pinned ranks
the lenders' backward passes grew by 5-26% instead of shrinking.

So, on a CPU and when asked, the rank's own passes give way: while any serving thread computes
an answer (`computing`), the rank's thread, inside `giving_way`, stops before its next ATen
operation until the answers in progress are sent. The hand-over is per operation (a dispatch
mode on the rank's thread sees every forward and backward operation), so an answer waits at
most for the one operation the pass is inside. The wait is what the plan assumed: the server's
pass is longer by the attention it serves. It is opt-in: it removes the lenders' waits, but
at 8K context the step was no faster with it beyond the noise, and the dispatch mode costs
small models time (docs/context_exchange.md, "Serving priority").

Nothing waits on a serving thread that could wait on the rank's thread: the threads compute
from messages already received and never take the dispatch mode's lock, so the gate cannot
deadlock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from pipekit._torch_private import TorchDispatchMode

__all__ = ["ServingPriority"]


class ServingPriority:
    """The serving threads' compute goes first: `computing()` around an answer's compute (on
    the serving thread), `giving_way()` around the rank's own passes (on its thread)."""

    def __init__(self) -> None:
        self._computing = 0
        self._idle = threading.Condition()
        self.gave_way_s = 0.0
        """How long the rank's own passes waited for answers, in total."""

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """An answer's compute, on a serving thread: the rank's passes wait meanwhile."""
        with self._idle:
            self._computing += 1
        try:
            yield
        finally:
            with self._idle:
                self._computing -= 1
                if not self._computing:
                    self._idle.notify_all()

    def give_way(self) -> None:
        """Return once no answer is being computed (at once when none is)."""
        if not self._computing:  # read without the lock: a stale 0 costs one operation's delay
            return
        started = time.perf_counter()
        with self._idle:
            self._idle.wait_for(lambda: not self._computing)
        self.gave_way_s += time.perf_counter() - started

    @contextlib.contextmanager
    def giving_way(self) -> Iterator[None]:
        """On the rank's thread: every ATen operation inside first gives way."""
        with _GiveWay(self):
            yield


class _GiveWay(TorchDispatchMode):
    """Before each operation the rank's thread runs, `priority.give_way()`."""

    def __init__(self, priority: ServingPriority) -> None:
        super().__init__()
        self.priority = priority

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.priority.give_way()
        return func(*args, **(kwargs or {}))
