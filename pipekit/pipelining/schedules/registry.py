"""Every selectable pipeline schedule, in one table, and its rules.

Planning (`pipelining.plan`), the runner, the pictures and simulator (`tools.draw`) and the
benches read this table; nothing else lists schedule names or their rules. An entry says how to
get every rank's compute-only action lists, where stages sit, how many stages a rank may hold,
whether units may be slices (what the pipeline features that work between slices' passes
need), and (for torch's schedules) the torch class that runs it when no feature needs
pipekit's action runtime.

Adding a generated schedule: write `def my_actions(shape: ScheduleShape) -> dict[int,
list[Action]]` and `register_schedule(ScheduleEntry("mine", my_actions, ...))`. A hand-written
one needs no entry: give its file as `pipeline_schedule_file` (the "user" entry).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipekit.pipelining.actions import Action
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions

__all__ = [
    "SCHEDULES",
    "ScheduleEntry",
    "ScheduleShape",
    "get_schedule",
    "register_schedule",
    "schedule_names",
]


@dataclass(frozen=True)
class ScheduleShape:
    """The counts every schedule's action lists depend on."""

    num_ranks: int
    num_microbatches: int
    num_slices: int = 1
    stages_per_rank: int = 1


@dataclass(frozen=True)
class ScheduleEntry:
    """One schedule and its rules."""

    name: str
    actions: Callable[[ScheduleShape], dict[int, list[Action]]] | None
    """Every rank's compute-only lists; None when they come from a file (user schedules)."""
    stage_style: str = "loop"
    """Stage placement: "loop" (stage s on rank s mod p), "v" (down the ranks and back up), or
    "user" (where the lists run each stage)."""
    stages_per_rank: int | None = None
    """The stages a rank must hold (1 or 2), or None for any number >= 1."""
    sliced: bool = False
    """Units may be slices of a sequence (num_slices > 1): the schedule carries the features
    that work between slices' passes."""
    torch_class: str | None = None
    """torch's class for this schedule, run as it is when no feature is on (the baseline)."""
    description: str = ""

    def check(self, shape: ScheduleShape, sliced_only: Sequence[str] = ()) -> None:
        """ValueError naming the fix when `shape` breaks this schedule's rules, or when it runs
        whole microbatches and `sliced_only` names features that need sliced passes."""
        if shape.stages_per_rank < 1:
            raise ValueError(f"stages_per_rank={shape.stages_per_rank} must be at least 1")
        required = self.stages_per_rank
        if required is not None and shape.stages_per_rank != required:
            layout = "places 2 stages per rank in a V" if required == 2 else "runs one stage"
            raise ValueError(
                f"pipeline_schedule={self.name!r} {layout} per rank; set stages_per_rank={required}"
            )
        if shape.num_slices != 1 and not self.sliced:
            raise ValueError(
                f"num_slices={shape.num_slices} needs a sliced schedule (pipeline_schedule="
                f"'sliced' or a schedule file); {self.name!r} runs whole microbatches (set "
                "num_slices=0 or 1)"
            )
        if sliced_only and not self.sliced:
            sliced = [name for name, entry in SCHEDULES.items() if entry.sliced]
            raise ValueError(
                f"pipeline_schedule={self.name!r} cannot carry {', '.join(sliced_only)}: it runs "
                "whole microbatches, and that works between slices' passes; use a schedule "
                f"that can ({', '.join(sliced)}) or turn it off"
            )


def _sliced(shape: ScheduleShape) -> dict[int, list[Action]]:
    return sliced_pipeline_actions(
        shape.num_ranks, shape.num_microbatches, shape.num_slices, shape.stages_per_rank
    )


def _torch_entry(name: str, **rules: object) -> ScheduleEntry:
    """torch's schedule `name`: its own class without features; its lists (read from that
    class) under pipekit's action runtime with features that fit whole-microbatch passes."""

    def actions(shape: ScheduleShape) -> dict[int, list[Action]]:
        return torch_schedule_actions(
            name, shape.num_ranks, shape.num_microbatches, shape.stages_per_rank
        )

    return ScheduleEntry(name, actions, torch_class=name, **rules)


SCHEDULES: dict[str, ScheduleEntry] = {}


def register_schedule(entry: ScheduleEntry) -> None:
    """Add (or replace) a schedule in the table."""
    SCHEDULES[entry.name] = entry


for _entry in (
    ScheduleEntry(
        "sliced",
        _sliced,
        sliced=True,
        description="SlimPipe: sequence slices, 1F1B over slices, chunked KV cache",
    ),
    ScheduleEntry(
        "user",
        None,
        stage_style="user",
        sliced=True,
        description="a schedule file (pipeline_schedule_file): per-rank task lists",
    ),
    _torch_entry("GPipe", stages_per_rank=1),
    _torch_entry("1F1B", stages_per_rank=1),
    _torch_entry("Interleaved1F1B"),
    _torch_entry("LoopedBFS"),
    _torch_entry("InterleavedZeroBubble"),
    _torch_entry("ZBVZeroBubble", stage_style="v", stages_per_rank=2),
    _torch_entry("DualPipeV", stage_style="v", stages_per_rank=2),
):
    register_schedule(_entry)


def schedule_names() -> list[str]:
    """Every schedule's name, in table order."""
    return list(SCHEDULES)


def get_schedule(name: str) -> ScheduleEntry:
    """The entry of `name`, with an error listing the known ones."""
    if name not in SCHEDULES:
        raise ValueError(
            f"pipeline_schedule={name!r} is not known; choose one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]
