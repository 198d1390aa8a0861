"""On or off by what it costs here: a feature that changes no result (context exchange moves
attention between ranks; the losses and gradients are the same either way) is timed with and
without over the first steps of a job, and stays on only if its steps were faster.

The trial steps are `TRIALS`: a first step with the feature and one without (warm-ups, not
counted: each way pays for its own first touches), then three with and three without,
alternating. Every rank of `group` times its own steps; the slowest rank's time of each step
counts (a step ends when its last rank does), so all ranks reach the same decision; each side
is its fastest step (interference from the rest of the machine only ever adds time), and the
feature stays on only if its fastest step was the faster. The decision and its reason are
logged once per group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["AUTO", "TRIALS", "WARM_UP_STEPS", "MeasuredChoice"]

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The setting that asks for a measured choice (`context_exchange = "auto"`)."""

TRIALS = (True, False, True, False, True, False, True, False)
"""Whether each trial step runs the feature: a warm-up each way, then alternating."""

WARM_UP_STEPS = 2
"""Trial steps not counted."""


class MeasuredChoice:
    """Whether a feature runs in each step: `TRIALS` first, then what they measured."""

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        trials: tuple[bool, ...] = TRIALS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        timed = trials[WARM_UP_STEPS:]
        if not (True in timed and False in timed):
            raise ValueError(
                f"{name}: trials={trials} must time steps with and without after "
                f"{WARM_UP_STEPS} warm-up steps"
            )
        self.name, self.group, self.trials, self.clock = name, group, trials, clock
        self.step_seconds: list[float] = []
        self.chosen: bool | None = None
        """The decision once the trials are over (None before)."""
        self.reason = ""
        """Why, with the measured step times."""
        self._started = 0.0

    @property
    def enabled(self) -> bool:
        """Whether the feature runs in the current (or next) step."""
        if self.chosen is not None:
            return self.chosen
        return self.trials[len(self.step_seconds)]

    def begin_step(self) -> None:
        self._started = self.clock()

    def end_step(self) -> None:
        """Count the step that ended; after the last trial, decide (collective on `group`)."""
        if self.chosen is not None:
            return
        self.step_seconds.append(self.clock() - self._started)
        if len(self.step_seconds) == len(self.trials):
            self._decide()

    def _decide(self) -> None:
        seconds = torch.tensor(self.step_seconds, dtype=torch.float64)
        if self.group is not None and dist.is_initialized():
            on_device = seconds.to(_collective_device(self.group))
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.group)
            seconds = on_device.cpu()
        timed = list(
            zip(self.trials[WARM_UP_STEPS:], seconds[WARM_UP_STEPS:].tolist(), strict=True)
        )
        with_s = min(s for on, s in timed if on)
        without_s = min(s for on, s in timed if not on)
        self.chosen = with_s < without_s
        change = (without_s - with_s) / without_s
        self.reason = (
            f"fastest step {with_s:.3f} s with it and {without_s:.3f} s without "
            f"({change:+.1%} with it)"
        )
        rank = dist.get_rank(self.group) if self.group is not None and dist.is_initialized() else 0
        if rank == 0:
            state = "on" if self.chosen else "off"
            logger.info(
                "%s = auto: %s, measured over %d steps: %s",
                self.name,
                state,
                len(timed),
                self.reason,
            )


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor for a collective on `group` must live."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
