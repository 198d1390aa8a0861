"""Where a training run is: the step counter with the random states (checkpointed), and the
window of steps whose throughput the next log line reports."""

from __future__ import annotations

import time
from typing import Any, Protocol

from pipekit.checkpoint.dcp import capture_rng_state, restore_rng_state

__all__ = ["StepCounter", "ThroughputWindow", "TrainingProgress"]


class StepCounter(Protocol):
    """What holds the step: the trainer."""

    step: int


class TrainingProgress:
    """The step counter and RNG states, as a checkpointable object."""

    def __init__(self, counter: StepCounter) -> None:
        self.counter = counter

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.counter.step, "rng": capture_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counter.step = int(state["step"])
        restore_rng_state(state["rng"])


class ThroughputWindow:
    """The steps since the last logged one: when they started and the tokens they trained."""

    def __init__(self, step: int) -> None:
        self.first_step = step
        self.start = time.perf_counter()
        self.tokens = 0
