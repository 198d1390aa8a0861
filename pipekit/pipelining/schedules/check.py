"""Checks that user pipeline schedules can run, before any process group exists.

Every (stage, unit) must have one F and one B (or one I, then one W) on the one rank holding the
stage, in an order that respects the data dependencies and, with slices, the KV cache's slice
order (forwards in increasing, backwards in strictly decreasing slice order). Then a simulation
(`schedules.simulate`) finds any deadlock and names the rank and the action that would wait
forever, and torch's lowering must place every send and receive.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from pipekit.pipelining._torch_runtime import lower_to_comms
from pipekit.pipelining.actions import BACKWARD, FORWARD, INPUT_BACKWARD, WEIGHT_BACKWARD, Action
from pipekit.pipelining.schedules.simulate import simulate
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["KINDS", "ScheduleError", "check_schedule"]

KINDS = ("F", "B", "I", "W")
"""Forward, full backward, input-gradient backward, weight-gradient backward."""


class ScheduleError(ValueError):
    """A user schedule breaks a rule; the message names the rank, position, action and rule."""


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
        if shape.num_slices > 1 and action.computation_type in (INPUT_BACKWARD, WEIGHT_BACKWARD):
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
                Action(stage, kind, unit) for kind in (BACKWARD, INPUT_BACKWARD, WEIGHT_BACKWARD)
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
