"""Where every rank joins the vocabulary-parallel output pass of each unit.

With `vocab_parallel`, a unit's output layer and loss run on all pipeline ranks at once
(collectives over the pipeline group): after the last stage's forward of the unit, before its
backward. Each other rank must join at a point of its own list where it neither waits for
something that needs the pass nor holds back something the last stage needs first.

The rule: simulate the schedule without output passes; on every rank, the output pass of unit u
goes after the actions that end no later than the last stage's forward of u ends. The actions
that have ended by a given time form a consistent cut (an action's inputs end before it starts),
so nothing a rank runs before its pass waits for anything another rank runs after its pass; and
the cuts of later units contain those of earlier ones, so the passes run in unit order on every
rank. Hence no rank waits forever, whatever the real timings are. `check_output_passes` replays
the lists with the passes as barriers to confirm it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from enum import Enum

from pipekit.pipelining.actions import FORWARD, Action
from pipekit.pipelining.schedules.simulate import (
    LOCKSTEP_COST,
    CostModel,
    ScheduleDeadlockError,
    as_action,
    simulate,
    unit_dependencies,
)
from pipekit.pipelining.schedules.torch_lists import compute_actions

__all__ = [
    "OUTPUT_PASS",
    "VocabComputation",
    "check_output_passes",
    "output_pass_positions",
    "with_output_passes",
]


class VocabComputation(str, Enum):
    """pipekit's action type beside torch's: `Action(last_stage, OUTPUT_PASS, unit)`."""

    OUTPUT_PASS = "OUT"


OUTPUT_PASS = VocabComputation.OUTPUT_PASS


def _compute_lists(actions_by_rank: Mapping[int, Sequence[Action | None]]) -> dict[int, list]:
    lists = {}
    for rank, actions in actions_by_rank.items():
        if any(a is not None and a.sub_actions is not None for a in actions):
            raise ValueError(
                f"rank {rank}'s list overlaps a forward and a backward in one action; "
                "vocabulary parallelism cannot place its output passes inside such an action: "
                "split it into its parts, choose another pipeline_schedule or set "
                "vocab_parallel = false"
            )
        lists[rank] = compute_actions(list(actions))
    return lists


def output_pass_positions(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
    num_slices: int = 1,
    lockstep: bool = False,
) -> dict[int, list[int]]:
    """`positions[rank][u]`: how many of the rank's compute actions run before unit u's pass
    (simulated in `LOCKSTEP_COST`'s steps with `lockstep`)."""
    return _positions(_compute_lists(actions_by_rank), num_slices, lockstep)


def _positions(
    lists: dict[int, list[Action]], num_slices: int, lockstep: bool
) -> dict[int, list[int]]:
    last_stage = max(a.stage_index for actions in lists.values() for a in actions)
    cost = LOCKSTEP_COST if lockstep else CostModel()
    timeline = simulate(lists, num_slices=num_slices, cost=cost).timeline
    ends_by_rank: dict[int, list[float]] = {rank: [] for rank in lists}
    for event in timeline:
        ends_by_rank[event.rank].append(event.end)
    for ends in ends_by_rank.values():
        ends.sort()
    last_forward_end = {
        e.action.microbatch_index: e.end
        for e in timeline
        if e.action.stage_index == last_stage and e.action.computation_type == FORWARD
    }
    positions = {}
    for rank, ends in ends_by_rank.items():
        # ends are sorted (and in list order: a rank runs its actions one after another)
        positions[rank] = [
            bisect.bisect_right(ends, last_forward_end[unit]) for unit in sorted(last_forward_end)
        ]
    return positions


def with_output_passes(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
    num_slices: int = 1,
    lockstep: bool = False,
) -> dict[int, list[Action]]:
    """Every rank's compute actions with `Action(last_stage, OUTPUT_PASS, u)` placed by
    `output_pass_positions` (on the last stage's rank: right after its forward of u).
    `lockstep` cuts at lockstep steps, which never part two passes of one step (context
    exchange pairs those)."""
    lists = _compute_lists(actions_by_rank)
    positions = _positions(lists, num_slices, lockstep)
    last_stage = max(a.stage_index for actions in lists.values() for a in actions)
    placed = {}
    for rank, actions in lists.items():
        merged: list[Action] = []
        cursor = 0
        for unit, position in enumerate(positions[rank]):
            merged += actions[cursor:position]
            merged.append(Action(last_stage, OUTPUT_PASS, unit))
            cursor = position
        placed[rank] = merged + actions[cursor:]
    check_output_passes(placed, num_slices)
    return placed


def check_output_passes(
    actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int = 1
) -> None:
    """Replay the lists with each output pass as a barrier of all ranks (after the last stage's
    forward of its unit); raise `ScheduleDeadlockError` naming a stuck rank if some rank would
    wait forever."""
    lists = {rank: list(actions) for rank, actions in actions_by_rank.items()}
    num_stages = 1 + max(
        a.stage_index
        for actions in lists.values()
        for a in actions
        if a.computation_type != OUTPUT_PASS
    )
    done: set[tuple[int, str, int]] = set()
    position = dict.fromkeys(lists, 0)

    def ready(action: Action) -> bool:
        if action.computation_type == OUTPUT_PASS:
            unit = action.microbatch_index
            return (num_stages - 1, "F", unit) in done and all(
                position[r] < len(lists[r]) and lists[r][position[r]] == action for r in lists
            )
        return all(key in done for key, _ in unit_dependencies(action, num_stages, num_slices))

    while any(position[r] < len(lists[r]) for r in lists):
        progressed = False
        for rank, actions in lists.items():
            if position[rank] >= len(actions) or not ready(actions[position[rank]]):
                continue
            action = actions[position[rank]]
            if action.computation_type == OUTPUT_PASS:
                for other in lists:
                    position[other] += 1
            else:
                kind = action.computation_type.value
                done.add((action.stage_index, kind, action.microbatch_index))
                if kind in ("B", "I"):
                    done.add((action.stage_index, "BI", action.microbatch_index))
                position[rank] += 1
            progressed = True
        if not progressed:
            raise _stuck(lists, position, done, num_stages, num_slices)


def _stuck(
    lists: dict[int, list[Action]],
    position: dict[int, int],
    done: set[tuple[int, str, int]],
    num_stages: int,
    num_slices: int,
) -> ScheduleDeadlockError:
    """The first stuck rank and what it waits for: a missing input, or (at a pass) a rank that
    is not at the same pass."""
    rank = next(r for r in lists if position[r] < len(lists[r]))
    action = lists[rank][position[rank]]
    if action.computation_type == OUTPUT_PASS:
        other = next(
            r for r in lists if position[r] >= len(lists[r]) or lists[r][position[r]] != action
        )
        waiting_for = (
            lists[other][position[other]] if position[other] < len(lists[other]) else action
        )
    else:
        needs = unit_dependencies(action, num_stages, num_slices)
        waiting_for = as_action(next(key for key, _ in needs if key not in done))
    return ScheduleDeadlockError(rank, action, waiting_for, position[rank])
