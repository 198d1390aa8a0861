"""User-defined pipeline schedules: per-rank task lists and their files, checked before anything
runs (`pipekit.pipelining.schedules.check`), then run by torch's runtime like every other
pipekit schedule.

A user says what each rank computes and in which order, as JaxPP (MPMD pipeline parallelism, §3
and Fig. 6) lets users declare a schedule and infers its communication: here torch's lowering
infers the sends and receives. A task is a forward (F), a full backward (B), or a backward split
into its input (I) and weight (W) parts, of one stage on one unit; a unit is one slice of one
microbatch, numbered `microbatch * num_slices + slice` (`pipekit.pipelining.schedules.units`).

In Python, `Task(stage, microbatch, kind, slice)` and `tasks_to_actions`; in a file
(`load_schedule_file`, or `[parallelism] pipeline_schedule_file`), one of two formats:

- CSV, torch's compute-only format: one row per rank, one cell per action written
  `<stage><kind><unit>` (`0F3`, `1B3`, `2I0`, `2W0`); empty cells (idle steps) are skipped.
- TOML, which names every field::

      num_slices = 4            # optional: the num_slices the file is written for
      [[rank]]                  # rank 0; then rank 1, ... in order
      tasks = ["F stage=0 mb=0 slice=0", "F stage=0 mb=0 slice=1", "B stage=0 mb=0 slice=1"]

  A task is its kind, then `stage=`, `mb=` (microbatch) and `slice=` (default 0) in any order.

`check_schedule` (`pipekit.pipelining.schedules.check`) proves the lists can run before any
process group exists, or names the rank and action that cannot.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli

from pipekit.pipelining.actions import BACKWARD, FORWARD, INPUT_BACKWARD, WEIGHT_BACKWARD, Action
from pipekit.pipelining.schedules.check import KINDS, ScheduleError
from pipekit.pipelining.schedules.units import unit_index

__all__ = [
    "Task",
    "load_schedule_file",
    "read_actions_csv",
    "tasks_to_actions",
    "write_actions_csv",
]

_TYPE_OF_KIND = {"F": FORWARD, "B": BACKWARD, "I": INPUT_BACKWARD, "W": WEIGHT_BACKWARD}


_TASK_KEYS = {"stage": "stage", "mb": "microbatch", "slice": "slice"}
_TASK_EXAMPLE = "'F stage=0 mb=1 slice=2' (kind F, B, I or W; slice= may be left out for 0)"


@dataclass(frozen=True)
class Task:
    """One rank's work on one stage for one slice of one microbatch."""

    stage: int
    microbatch: int
    kind: str
    """F (forward), B (full backward), I (input-gradient backward) or W (weight gradients)."""
    slice: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Task kind={self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("stage", "microbatch", "slice"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Task {name}={value!r} must be an integer >= 0")

    def __str__(self) -> str:
        return f"{self.kind} stage={self.stage} mb={self.microbatch} slice={self.slice}"

    @classmethod
    def parse(cls, text: str) -> Task:
        """Inverse of `str(task)`: `"F stage=0 mb=1 slice=2"`, keys in any order."""
        kind, *fields = text.split() or [""]
        if kind not in KINDS:
            raise ValueError(
                f"kind {kind!r} is not one of {', '.join(KINDS)}; write {_TASK_EXAMPLE}"
            )
        values: dict[str, int] = {}
        for field in fields:
            key, _, value = field.partition("=")
            if key not in _TASK_KEYS or not value.isdigit():
                raise ValueError(
                    f"{field!r} is not stage=N, mb=N or slice=N; write {_TASK_EXAMPLE}"
                )
            if _TASK_KEYS[key] in values:
                raise ValueError(f"{key}= is given twice")
            values[_TASK_KEYS[key]] = int(value)
        missing = [key for key in ("stage", "mb") if _TASK_KEYS[key] not in values]
        if missing:
            raise ValueError(
                f"{' and '.join(k + '=' for k in missing)} missing; write {_TASK_EXAMPLE}"
            )
        return cls(kind=kind, **values)

    def to_action(self, num_slices: int = 1) -> Action:
        """torch's action, whose "microbatch" index is the unit."""
        if self.slice >= num_slices:
            raise ValueError(
                f"task '{self}': slice={self.slice} must be below num_slices={num_slices}"
            )
        unit = unit_index(self.microbatch, self.slice, num_slices)
        return Action(self.stage, _TYPE_OF_KIND[self.kind], unit)


def tasks_to_actions(
    tasks_by_rank: Mapping[int, Sequence[Task]] | Sequence[Sequence[Task]], num_slices: int = 1
) -> dict[int, list[Action]]:
    """Per-rank task lists (a dict by rank, or a list whose i-th entry is rank i) as actions."""
    if not isinstance(tasks_by_rank, Mapping):
        tasks_by_rank = dict(enumerate(tasks_by_rank))
    return {
        rank: [task.to_action(num_slices) for task in tasks]
        for rank, tasks in sorted(tasks_by_rank.items())
    }


# -- files -----------------------------------------------------------------------------------


def load_schedule_file(
    path: str | os.PathLike[str], num_slices: int = 1
) -> dict[int, list[Action]]:
    """Compute-only action lists by rank from a `.csv` or `.toml` schedule (see the module
    docstring); ScheduleError names the file, rank and position of a malformed entry."""
    path = Path(path)
    if not path.is_file():
        raise ScheduleError(f"schedule file {str(path)!r} does not exist")
    if path.suffix == ".csv":
        return _load_csv(path)
    if path.suffix == ".toml":
        return _load_toml(path, num_slices)
    raise ScheduleError(
        f"schedule file {str(path)!r}: unknown format {path.suffix!r}; use .csv (torch's "
        "compute-only format) or .toml (see docs/pipelining.md)"
    )


def _load_csv(path: Path) -> dict[int, list[Action]]:
    try:
        by_rank = read_actions_csv(path)
    except (RuntimeError, ValueError):  # find the cell that broke it
        with open(path, newline="") as handle:
            for rank, row in enumerate(csv.reader(handle)):
                for position, cell in enumerate(row):
                    try:
                        Action.from_str(cell)
                    except (RuntimeError, ValueError):
                        raise ScheduleError(
                            f"{path}: rank {rank} (row {rank + 1}), position {position}: "
                            f"{cell.strip()!r} is not an action; write <stage><kind><unit> "
                            "such as 0F3, 1B3, 2I0 or 2W0 (unit = microbatch * num_slices + "
                            "slice), or leave the cell empty"
                        ) from None
        raise
    return {rank: [a for a in actions if a is not None] for rank, actions in by_rank.items()}


def _load_toml(path: Path, num_slices: int) -> dict[int, list[Action]]:
    try:
        document = tomli.loads(path.read_text())
    except tomli.TOMLDecodeError as error:
        raise ScheduleError(f"{path} is not valid TOML: {error}") from None
    unknown = sorted(set(document) - {"num_slices", "rank"})
    if unknown:
        raise ScheduleError(
            f"{path}: unknown top-level keys {unknown}; a schedule has [[rank]] tables with "
            "tasks = [...], and optionally num_slices = N"
        )
    declared = document.get("num_slices", num_slices)
    if declared != num_slices:
        raise ScheduleError(
            f"{path} is written for num_slices={declared} but the job has num_slices="
            f"{num_slices}; set [parallelism] num_slices = {declared}"
        )
    ranks = document.get("rank")
    if not isinstance(ranks, list) or not ranks:
        raise ScheduleError(
            f"{path}: no [[rank]] tables; give one per rank, each with tasks = [...]"
        )
    by_rank: dict[int, list[Action]] = {}
    for rank, table in enumerate(ranks):
        tasks = table.get("tasks") if isinstance(table, dict) else None
        if not isinstance(tasks, list) or set(table) != {"tasks"}:
            raise ScheduleError(
                f"{path}: rank {rank} ([[rank]] table {rank + 1}) must hold exactly tasks = "
                f"[...], a list of strings such as {_TASK_EXAMPLE}"
            )
        by_rank[rank] = []
        for position, text in enumerate(tasks):
            try:
                if not isinstance(text, str):
                    raise ValueError(f"expected a string such as {_TASK_EXAMPLE}")
                by_rank[rank].append(Task.parse(text).to_action(num_slices))
            except ValueError as error:
                raise ScheduleError(
                    f"{path}: rank {rank}, task {position} ({text!r}): {error}"
                ) from None
    return by_rank


def write_actions_csv(
    actions_by_rank: Mapping[int, Sequence[Action | None]], path: str | os.PathLike[str]
) -> None:
    """One row per rank of action strings (`0F3`, `1B2`): torch's compute-only CSV format, which
    `_PipelineScheduleRuntime._load_csv` reads."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        for rank in sorted(actions_by_rank):
            writer.writerow(["" if a is None else str(a) for a in actions_by_rank[rank]])


def read_actions_csv(path: str | os.PathLike[str]) -> dict[int, list[Action | None]]:
    """Inverse of `write_actions_csv`."""
    with open(path, newline="") as handle:
        return {
            rank: [Action.from_str(cell) for cell in row]
            for rank, row in enumerate(csv.reader(handle))
        }
