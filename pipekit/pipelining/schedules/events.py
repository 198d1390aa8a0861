"""A pipeline timeline's events: which action ran on which rank, from when to when.

The simulator (`schedules.simulate`) returns a timeline of them, the recorder of an executed
step (`tools.trace`) gathers one, and the pictures and traces (`tools.draw`, `tools.timeline`)
read one. Action microbatch indices are units (`schedules.units`); `num_slices` turns them back
into (microbatch, slice).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.pipelining.actions import Action
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["ScheduledAction"]


@dataclass(frozen=True)
class ScheduledAction:
    """One compute action of a rank, with its start and end (seconds, or model time units)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def kind(self) -> str:
        """`"F"`, `"B"`, `"I"` or `"W"` (torch's `_ComputationType` value)."""
        return self.action.computation_type.value

    def microbatch_and_slice(self, num_slices: int = 1) -> tuple[int, int]:
        """`(microbatch, slice)` of the action's unit."""
        return unit_microbatch_and_slice(self.action.microbatch_index, num_slices)

    def label(self, num_slices: int = 1) -> str:
        """E.g. `"F mb1 s3 (stage 2)"`; without the slice when `num_slices == 1`."""
        microbatch, slice_index = self.microbatch_and_slice(num_slices)
        slice_text = f" s{slice_index}" if num_slices > 1 else ""
        return f"{self.kind} mb{microbatch}{slice_text} (stage {self.action.stage_index})"
