"""Graceful stops: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption) end a job cleanly.

A signal only sets a flag; the training loop finishes the step it is in, and all ranks agree
after each step (a signal may reach some ranks before others, or only one), so every rank stops
after the same step, saves one checkpoint together and exits 0. A second signal on a rank that
is already stopping takes the signal's usual action (Ctrl-C twice interrupts at once).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "StopSignals", "ignore_stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager catching `STOP_SIGNALS` for its duration (main thread only; elsewhere
    signals keep their handlers and `agreed_signal` only reports other ranks')."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is not None:  # asked twice: do what the signal does by default
            self._restore()
            signal.raise_signal(number)
            return
        self.received = number

    def agreed_signal(self, device: torch.device) -> str | None:
        """The name of a stop signal any rank received (collective), or None."""
        received = torch.tensor(self.received or 0, device=device)
        if dist.is_initialized():
            dist.all_reduce(received, op=dist.ReduceOp.MAX)
        number = int(received)
        return signal.Signals(number).name if number else None


def ignore_stop_signals(*_: object) -> None:
    """For helper processes (data-loader workers): Ctrl-C reaches the whole process group and a
    scheduler may signal every process, but stopping is the trainer's decision; the helpers end
    when it shuts them down (or exits)."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
