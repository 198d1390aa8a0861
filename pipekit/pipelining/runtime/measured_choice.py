"""Chosen by what it costs here: options that change no result (context exchange on or off, the
pipeline's slice layout) are each timed over the first steps of a job, and the fastest is kept.

The trial steps (`trial_order`): one step with each option (warm-ups, not counted: each option
pays for its own first touches), then `ROUNDS` rounds of one step with each, in turn. Every
rank of `group` times its own steps; the slowest rank's time of each step counts (a step ends
when its last rank does), so all ranks reach the same decision; each option's time is its
fastest step (interference from the rest of the machine only ever adds time), and the option
with the fastest is kept, the default on a tie. The decision and its reason are logged once per
group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

__all__ = ["AUTO", "ROUNDS", "MeasuredChoice", "trial_order"]

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The setting that asks for a measured choice (`context_exchange = "auto"`,
`slicing = "auto"`, `num_slices = "auto"`)."""

ROUNDS = 3
"""Timed steps of each option, after its warm-up step."""

Option = TypeVar("Option")


def trial_order(num_options: int, rounds: int = ROUNDS) -> tuple[int, ...]:
    """The option index of each trial step: a warm-up step of each, then `rounds` rounds."""
    return tuple(range(num_options)) * (1 + rounds)


class MeasuredChoice(Generic[Option]):
    """Which of `options` runs each step: `trial_order` first, then the fastest of them.

    `labels` name the options in the log (default: their text); `default` is the index kept
    on a tie; `group`: the ranks that decide together (None: this process alone).
    """

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        options: Sequence[Option],
        *,
        labels: Sequence[str] = (),
        default: int = 0,
        rounds: int = ROUNDS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if len(options) < 2 or rounds < 1:
            raise ValueError(f"{name}: a measured choice needs two options or more and rounds >= 1")
        self.name, self.group, self.clock = name, group, clock
        self.options = tuple(options)
        self.labels = tuple(labels) or tuple(str(option) for option in options)
        self.default = default
        self.trials = trial_order(len(options), rounds)
        self.step_seconds: list[float] = []
        self.chosen_index: int | None = None
        """The index of the option kept once the trials are over (None before)."""
        self.reason = ""
        """Why, with each option's fastest step."""
        self._started = 0.0

    @property
    def warm_up_steps(self) -> int:
        """Trial steps not counted: one per option."""
        return len(self.options)

    @property
    def chosen(self) -> Option | None:
        """The option kept once the trials are over (None before)."""
        return None if self.chosen_index is None else self.options[self.chosen_index]

    @property
    def current_index(self) -> int:
        """The index of the option the current (or next) step runs."""
        if self.chosen_index is not None:
            return self.chosen_index
        return self.trials[len(self.step_seconds)]

    @property
    def current(self) -> Option:
        """The option the current (or next) step runs."""
        return self.options[self.current_index]

    def begin_step(self) -> None:
        self._started = self.clock()

    def end_step(self) -> None:
        """Count the step that ended; after the last trial, decide (collective on `group`)."""
        if self.chosen_index is not None:
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
        timed = list(zip(self.trials, seconds.tolist(), strict=True))[self.warm_up_steps :]
        fastest = [
            min(s for index, s in timed if index == option) for option in range(len(self.options))
        ]
        best = min(range(len(fastest)), key=fastest.__getitem__)
        if fastest[self.default] <= fastest[best]:
            best = self.default
        self.chosen_index = best
        self.reason = "fastest step " + ", ".join(
            f"{s:.3f} s {label}" for label, s in zip(self.labels, fastest, strict=True)
        )
        rank = dist.get_rank(self.group) if self.group is not None and dist.is_initialized() else 0
        if rank == 0:
            logger.info(
                "%s = auto: %s, measured over %d steps: %s",
                self.name,
                self.labels[best],
                len(timed),
                self.reason,
            )


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor for a collective on `group` must live."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
