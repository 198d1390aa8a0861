"""User-defined pipeline schedules: per-rank task lists, checked before anything runs, then run
by torch's runtime like every other pipekit schedule.

A user says what each rank computes and in which order, as JaxPP lets users declare a schedule
and infers its communication (seed 002, §3 and Fig. 6): here torch's lowering infers the sends
and receives. A task is a forward (F), a full backward (B), or a backward split into its input
(I) and weight (W) parts, of one stage on one unit; a unit is one slice of one microbatch,
numbered `microbatch * num_slices + slice` (`pipekit.pipelining.actions.unit_index`).

In Python, `Task(stage, microbatch, kind, slice)` and `tasks_to_actions`; in a file
(`load_schedule_file`, or `[parallelism] pipeline_schedule_file`), one of two formats:

- CSV, torch's compute-only format: one row per rank, one cell per action written
  `<stage><kind><unit>` (`0F3`, `1B3`, `2I0`, `2W0`); empty cells (idle steps) are skipped.
- TOML, which names every field::

      num_slices = 4            # optional: the num_slices the file is written for
      [[rank]]                  # rank 0; then rank 1, ... in order
      tasks = ["F stage=0 mb=0 slice=0", "F stage=0 mb=0 slice=1", "B stage=0 mb=0 slice=1"]

  A task is its kind, then `stage=`, `mb=` (microbatch) and `slice=` (default 0) in any order.

`check_schedule` proves before any process group that the lists can run: every (stage, unit)
has one F and one B (or one I, then one W) on the one rank holding the stage, in an order that
respects the data dependencies and, with slices, the KV cache's slice order; then a simulation
(`pipekit.pipelining.simulate`) finds any deadlock and names the rank and action that would wait
forever, and torch's lowering must place every send and receive.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tomli

from pipekit.pipelining._torch_runtime import (
    BACKWARD,
    FORWARD,
    Action,
    ComputationType,
    PipelineScheduleRuntime,
    lower_to_comms,
)
from pipekit.pipelining.actions import read_actions_csv, unit_index, unit_microbatch_and_slice
from pipekit.pipelining.simulate import simulate
from pipekit.pipelining.stage import SlicedPipelineStage
from pipekit.train.loss import token_sum_cross_entropy

if TYPE_CHECKING:
    from pipekit.pipelining.schedule import LossFn

__all__ = [
    "KINDS",
    "ScheduleError",
    "Task",
    "UserPipelineSchedule",
    "check_schedule",
    "load_schedule_file",
    "tasks_to_actions",
]

_INPUT_BACKWARD = ComputationType.BACKWARD_INPUT
_WEIGHT_BACKWARD = ComputationType.BACKWARD_WEIGHT
_TYPE_OF_KIND = {"F": FORWARD, "B": BACKWARD, "I": _INPUT_BACKWARD, "W": _WEIGHT_BACKWARD}

KINDS = tuple(_TYPE_OF_KIND)
"""Forward, full backward, input-gradient backward, weight-gradient backward."""

_TASK_KEYS = {"stage": "stage", "mb": "microbatch", "slice": "slice"}
_TASK_EXAMPLE = "'F stage=0 mb=1 slice=2' (kind F, B, I or W; slice= may be left out for 0)"


class ScheduleError(ValueError):
    """A user schedule breaks a rule; the message names the rank, position, action and rule."""


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


# -- checks ----------------------------------------------------------------------------------


def check_schedule(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
    *,
    num_stages: int,
    num_microbatches: int,
    num_slices: int = 1,
    stage_to_rank: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """Check that compute-only lists can run; return the stage -> rank placement they imply.

    Raises ScheduleError naming the rank, position, action and rule, or (from the simulation)
    `ScheduleDeadlockError` naming the rank and action that would wait forever.
    """
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_slices", num_slices),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    shape = _Shape(num_stages, num_microbatches, num_slices)
    ranks = sorted(actions_by_rank)
    if ranks != list(range(len(ranks))) or not ranks:
        raise ScheduleError(f"the schedule's ranks are {ranks}; give lists for ranks 0, 1, ...")
    owners = _stage_owners(actions_by_rank, shape, stage_to_rank)
    _check_complete(actions_by_rank, owners, shape)
    _check_order(actions_by_rank, owners, shape)
    _check_no_deadlock(actions_by_rank, owners, shape)
    return owners


@dataclass(frozen=True)
class _Shape:
    num_stages: int
    num_microbatches: int
    num_slices: int

    @property
    def num_units(self) -> int:
        return self.num_microbatches * self.num_slices

    def unit_text(self, stage: int, unit: int) -> str:
        """`stage=0 mb=1 slice=1` (the slice left out when there are none)."""
        microbatch, slice_index = unit_microbatch_and_slice(unit, self.num_slices)
        slice_text = f" slice={slice_index}" if self.num_slices > 1 else ""
        return f"stage={stage} mb={microbatch}{slice_text}"

    def describe(self, action: Action) -> str:
        """`0B5 = B stage=0 mb=1 slice=1`."""
        kind = action.computation_type.value
        return f"{action} = {kind} {self.unit_text(action.stage_index, action.microbatch_index)}"


def _where(rank: int, position: int, action: Action, shape: _Shape) -> str:
    return f"rank {rank}, position {position} ({shape.describe(action)})"


def _entries(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
) -> Iterator[tuple[int, int, Action]]:
    """(rank, position, action) of every action, idle steps (None) skipped."""
    for rank in sorted(actions_by_rank):
        for position, action in enumerate(actions_by_rank[rank]):
            if action is not None:
                yield rank, position, action


def _stage_owners(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
    shape: _Shape,
    stage_to_rank: Mapping[int, int] | None,
) -> dict[int, int]:
    owners: dict[int, tuple[int, int, Action]] = {}
    for rank, position, action in _entries(actions_by_rank):
        where = f"rank {rank}, position {position} ({action})"
        if action.computation_type.value not in KINDS or action.sub_actions is not None:
            raise ScheduleError(
                f"{where}: only F, B, I and W actions belong in a schedule; pipekit infers the "
                "sends and receives (and FSDP unshard/reshard) itself"
            )
        if not 0 <= action.stage_index < shape.num_stages:
            raise ScheduleError(
                f"{where}: stage {action.stage_index} is outside 0..{shape.num_stages - 1} "
                f"(num_stages={shape.num_stages})"
            )
        unit = action.microbatch_index
        if unit is None or not 0 <= unit < shape.num_units:
            raise ScheduleError(
                f"{where}: unit {unit} is outside 0..{shape.num_units - 1} (num_microbatches="
                f"{shape.num_microbatches} x num_slices={shape.num_slices})"
            )
        if shape.num_slices > 1 and action.computation_type in (_INPUT_BACKWARD, _WEIGHT_BACKWARD):
            raise ScheduleError(
                f"{_where(rank, position, action, shape)}: a split backward (I/W) cannot run "
                f"with num_slices={shape.num_slices}: the input-gradient pass (autograd.grad) "
                "does not carry the KV-cache gradients to earlier slices; use B, or num_slices=1"
            )
        first = owners.setdefault(action.stage_index, (rank, position, action))
        if first[0] != rank:
            raise ScheduleError(
                f"stage {action.stage_index} is on two ranks: rank {first[0]}, position "
                f"{first[1]} ({first[2]}) and {where}; a stage lives on one rank, so run all "
                f"of stage {action.stage_index}'s tasks on one of them"
            )
        if stage_to_rank is not None and stage_to_rank.get(action.stage_index) != rank:
            raise ScheduleError(
                f"{where}: stage {action.stage_index} is placed on rank "
                f"{stage_to_rank.get(action.stage_index)}, not rank {rank}"
            )
    for rank in sorted(actions_by_rank):
        if not any(action is not None for action in actions_by_rank[rank]):
            raise ScheduleError(f"rank {rank} runs nothing; every rank needs at least one stage")
    absent = [stage for stage in range(shape.num_stages) if stage not in owners]
    if absent:
        raise ScheduleError(
            f"stages {absent} run on no rank; every stage 0..{shape.num_stages - 1} needs its "
            "tasks on one rank"
        )
    return {stage: owners[stage][0] for stage in sorted(owners)}


def _check_complete(
    actions_by_rank: Mapping[int, Sequence[Action | None]], owners: dict[int, int], shape: _Shape
) -> None:
    """One F and one B (or one I and one W) per (stage, unit)."""
    seen: dict[tuple[int, str, int], tuple[int, int]] = {}
    for rank, position, action in _entries(actions_by_rank):
        key = (action.stage_index, action.computation_type.value, action.microbatch_index)
        if key in seen:
            first = seen[key]
            raise ScheduleError(
                f"{_where(rank, position, action, shape)}: runs twice (first at rank {first[0]}, "
                f"position {first[1]}); each task runs exactly once"
            )
        seen[key] = (rank, position)
    for stage in range(shape.num_stages):
        for unit in range(shape.num_units):
            kinds = {kind for kind in KINDS if (stage, kind, unit) in seen}
            where = f"{shape.unit_text(stage, unit)} (rank {owners[stage]})"
            if "F" not in kinds:
                raise ScheduleError(f"{where} has no forward; add {Action(stage, FORWARD, unit)}")
            if "B" in kinds and kinds & {"I", "W"}:
                raise ScheduleError(
                    f"{where} has both a full backward (B) and a split one (I/W); keep one"
                )
            full, input_part, weight_part = (
                Action(stage, kind, unit) for kind in (BACKWARD, _INPUT_BACKWARD, _WEIGHT_BACKWARD)
            )
            if kinds == {"F"}:
                raise ScheduleError(
                    f"{where} has no backward; add {full}, or both {input_part} and {weight_part}"
                )
            if kinds == {"F", "I"}:
                raise ScheduleError(f"{where} has I without W; add {weight_part} after it")
            if kinds == {"F", "W"}:
                raise ScheduleError(f"{where} has W without I; add {input_part} before it")


def _check_order(
    actions_by_rank: Mapping[int, Sequence[Action | None]], owners: dict[int, int], shape: _Shape
) -> None:
    """On each rank, every task after those it needs that run on the same rank."""
    last_stage, last_slice = shape.num_stages - 1, shape.num_slices - 1
    for rank in sorted(actions_by_rank):
        done: set[tuple[int, str, int]] = set()
        for position, action in enumerate(actions_by_rank[rank]):
            if action is None:
                continue
            stage, unit = action.stage_index, action.microbatch_index
            kind = action.computation_type.value
            _, slice_index = unit_microbatch_and_slice(unit, shape.num_slices)
            backed = {(stage, "B", unit + 1), (stage, "I", unit + 1)}
            rules: list[tuple[bool, str]] = []
            if kind == "F":
                rules.append(
                    (
                        stage > 0
                        and owners[stage - 1] == rank
                        and (stage - 1, "F", unit) not in done,
                        f"runs before the forward of stage {stage - 1} on this rank, which "
                        "makes its input",
                    )
                )
                rules.append(
                    (
                        slice_index > 0 and (stage, "F", unit - 1) not in done,
                        f"runs before the forward of slice {slice_index - 1}; a stage runs a "
                        "sequence's slices forward in increasing slice order (each attends to "
                        "the KV cache of the ones before)",
                    )
                )
            elif kind in ("B", "I"):
                rules.append(
                    ((stage, "F", unit) not in done, "runs before its own forward on this rank")
                )
                rules.append(
                    (
                        stage < last_stage
                        and owners[stage + 1] == rank
                        and not {(stage + 1, "B", unit), (stage + 1, "I", unit)} & done,
                        f"runs before the backward of stage {stage + 1} on this rank, which "
                        "makes its output gradient",
                    )
                )
                rules.append(
                    (
                        slice_index < last_slice and not backed & done,
                        f"runs before the backward of slice {slice_index + 1}; a stage runs a "
                        "sequence's slices backward in strictly decreasing slice order (a "
                        "slice's KV-cache gradient is complete only after every later slice's "
                        "backward)",
                    )
                )
            else:  # W
                rules.append(((stage, "I", unit) not in done, "runs before its input backward (I)"))
            for broken, rule in rules:
                if broken:
                    raise ScheduleError(f"{_where(rank, position, action, shape)}: {rule}")
            done.add((stage, kind, unit))


def _check_no_deadlock(
    actions_by_rank: Mapping[int, Sequence[Action | None]], owners: dict[int, int], shape: _Shape
) -> None:
    """Simulate (names the waiting rank and action), then lower with torch (places the sends
    and receives the runtime will post)."""
    simulate(actions_by_rank, num_slices=shape.num_slices)
    lists = {rank: list(actions) for rank, actions in actions_by_rank.items()}  # it pops them
    try:
        lower_to_comms(lists, stage_to_rank=owners.__getitem__, num_stages=shape.num_stages)
    except AssertionError as error:
        raise ScheduleError(
            f"torch's lowering cannot place the sends and receives of this schedule: {error}"
        ) from None


# -- running ---------------------------------------------------------------------------------


class UserPipelineSchedule(PipelineScheduleRuntime):
    """Runs checked user action lists (all ranks') with torch's runtime; this rank's stages must
    be those the lists place on it. The loss of each unit is normalised by the global label
    tokens, so no gradient scaling is needed."""

    def __init__(
        self,
        stages: Sequence[SlicedPipelineStage],
        actions_by_rank: Mapping[int, Sequence[Action | None]],
        num_microbatches: int,
        num_slices: int = 1,
        loss_fn: LossFn = token_sum_cross_entropy,
    ) -> None:
        for stage in stages:
            if stage.num_slices != num_slices:
                raise ValueError(
                    f"stage {stage.stage_index} was built for {stage.num_slices} slices, the "
                    f"schedule for {num_slices}; build both from the same num_slices"
                )
        rank, num_ranks = stages[0].group_rank, stages[0].group_size
        if len(actions_by_rank) != num_ranks:
            raise ScheduleError(
                f"the schedule has lists for {len(actions_by_rank)} ranks, the pipeline group "
                f"has {num_ranks} ranks"
            )
        owners = check_schedule(
            actions_by_rank,
            num_stages=stages[0].num_stages,
            num_microbatches=num_microbatches,
            num_slices=num_slices,
        )
        held = sorted(stage.stage_index for stage in stages)
        placed = [stage for stage, owner in owners.items() if owner == rank]
        if held != placed:
            raise ScheduleError(
                f"rank {rank} holds stages {held} but the schedule runs stages {placed} on it; "
                f"build this rank's stages with stage_indices={placed}"
            )
        actions = {rank: list(actions_by_rank[rank]) for rank in sorted(actions_by_rank)}
        super().__init__(
            list(stages), num_microbatches * num_slices, loss_fn=loss_fn, scale_grads=False
        )
        self.num_microbatches, self.num_slices = num_microbatches, num_slices
        self.pipeline_order = dict(actions)
        self._prepare_schedule_with_comms(actions)
