"""Discrete-event simulation of per-rank pipeline action lists: time, bubbles, memory, deadlocks.

Any schedule pipekit can run is a dict of per-rank lists of torch `_Action`s (F, B, or split
I and W) whose microbatch indices are units (`schedules.units`). Each rank runs its list in
order; an action starts when its rank is free and its inputs exist:

- F of stage s needs F of stage s-1 on the same unit (plus a transfer if the stages sit on
  different ranks);
- B or I of stage s needs F of stage s and B or I of stage s+1; W needs I of its own stage;
- with slices, a stage's slices of one microbatch run forward in order (the KV cache) and
  backward in reverse order (the cache's gradients).

A rank whose next action can never start is a deadlock, reported before anything runs with the
rank, the action and the action it waits for.

Cost model (`CostModel`): a stage's forward on one whole microbatch costs a linear part plus a
causal-attention part; slice j of n gets `1/n` of the linear part and `(2j+1)/n²` of the
attention part (it attends to j earlier slices and half of its own), so later slices are
heavier. Slices cut elsewhere (`slice_bounds`, e.g. equal-cost slicing) cover `[a, b)` of the
sequence: `b - a` of the linear part and of the bytes, `b² - a²` of the attention part.
Every pass also pays `action_overhead` whole, whatever its tokens (a stage its share).
Backward is `backward_ratio` times forward, split into I and W by `input_backward_share`.
Transfers cost latency plus bytes over bandwidth. Memory per rank: activations (live from a
unit's forward to its backward; W keeps `weight_grad_activation_share` of them after I), the KV
cache (same lifetime) and received stage inputs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipekit.pipelining.actions import INPUT_BACKWARD, WEIGHT_BACKWARD, Action, ComputationType
from pipekit.pipelining.schedules.events import ScheduledAction
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = [
    "LOCKSTEP_COST",
    "CostModel",
    "ScheduleDeadlockError",
    "SimulationResult",
    "as_action",
    "simulate",
    "unit_dependencies",
]

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
_KEY = tuple[int, str, int]  # (stage, kind, unit)


@dataclass(frozen=True)
class CostModel:
    """Costs of the whole model on one whole microbatch, in any time unit; a stage gets
    `1/num_stages` of compute and activations (times its stage weight), a slice its share."""

    forward_linear: float = 1.0
    """Forward time of everything but attention."""
    forward_attention: float = 0.0
    """Forward time of causal attention over the whole sequence."""
    backward_ratio: float = 2.0
    """Backward (I + W) time over forward time."""
    input_backward_share: float = 0.5
    """Share of the backward time that I takes when the backward is split."""
    stage_weights: tuple[float, ...] = ()
    """Per-stage multipliers of the compute time (empty = all 1)."""
    p2p_latency: float = 0.0
    """Time of one send/receive, whatever its size."""
    p2p_bandwidth: float = math.inf
    """Bytes per time unit of a send/receive."""
    boundary_bytes: float = 0.0
    """Bytes of one whole microbatch's hidden states crossing a stage boundary."""
    activation_bytes: float = 1.0
    """Activations the whole model saves for one whole microbatch (KV cache excluded)."""
    kv_cache_bytes: float = 0.0
    """K/V the whole model caches for one whole microbatch (sliced schedules)."""
    weight_grad_activation_share: float = 1.0
    """Share of a unit's activations that I leaves for W (split backward only). torch's input
    backward keeps the whole graph (`retain_graph=True`) for the weight backward, so all of
    them stay; the intermediate gradients W starts from come on top and are not counted."""
    action_overhead: float = 0.0
    """Forward time of the whole model that does not shrink with a pass's tokens (launches,
    the runtime's bookkeeping): every pass pays it whole, a stage its share."""
    slice_bounds: tuple[float, ...] = ()
    """Where the slices start and end, as fractions of the sequence from 0 to 1 (n + 1 of
    them); empty: n equal slices."""
    unit_shares: tuple[tuple[tuple[float, float], ...], ...] = ()
    """Per microbatch, per slice: its share of the sequence's tokens and its attention over
    one causal sequence's (`forward_attention`): packed documents, each microbatch cut and
    costed by its own (`pipekit.pipelining.schedules.document_costs`); empty: every
    microbatch by `slice_bounds`."""

    def slice_shares(
        self, slice_index: int, num_slices: int, microbatch: int = 0
    ) -> tuple[float, float]:
        """Slice `slice_index`'s (of `microbatch`) share of the sequence's tokens and of one
        causal sequence's attention."""
        if self.unit_shares:
            if (
                microbatch >= len(self.unit_shares)
                or len(self.unit_shares[microbatch]) != num_slices
            ):
                raise ValueError(
                    f"CostModel.unit_shares covers {len(self.unit_shares)} microbatches; unit "
                    f"(microbatch {microbatch}, slice {slice_index} of {num_slices}) is not in it"
                )
            return self.unit_shares[microbatch][slice_index]
        if not self.slice_bounds:
            return 1 / num_slices, (2 * slice_index + 1) / num_slices**2
        if len(self.slice_bounds) != num_slices + 1:
            raise ValueError(
                f"CostModel.slice_bounds has {len(self.slice_bounds)} entries; {num_slices} "
                f"slices need {num_slices + 1}"
            )
        start, end = self.slice_bounds[slice_index], self.slice_bounds[slice_index + 1]
        return end - start, end * end - start * start

    def forward_time(
        self,
        stage: int,
        num_stages: int,
        slice_index: int,
        num_slices: int,
        attended_slices: float | None = None,
        microbatch: int = 0,
    ) -> float:
        """`attended_slices`: the key/value slices whose attention this pass computes, in
        equal slices (default its own causal share; context exchange moves some between
        ranks)."""
        weight = self.stage_weights[stage] if self.stage_weights else 1.0
        tokens, attention_share = self.slice_shares(slice_index, num_slices, microbatch)
        if attended_slices is not None:
            attention_share = 2 * attended_slices / num_slices**2
        linear = self.forward_linear * tokens + self.action_overhead
        return weight * (linear + self.forward_attention * attention_share) / num_stages

    def transfer_time(self, num_slices: int, slice_index: int = 0, microbatch: int = 0) -> float:
        tokens, _ = self.slice_shares(slice_index, num_slices, microbatch)
        return self.p2p_latency + self.boundary_bytes * tokens / self.p2p_bandwidth


LOCKSTEP_COST = CostModel(backward_ratio=1.0)
"""Equal forward and backward costs, no attention: a schedule runs in lockstep steps, every
rank at most one pass per step, all passes of a step starting and ending together."""


class ScheduleDeadlockError(ValueError):
    """A rank's next action waits for something no rank will ever do."""

    def __init__(self, rank: int, action: Action, waiting_for: Action, position: int) -> None:
        self.rank, self.action, self.waiting_for, self.position = (
            rank,
            action,
            waiting_for,
            position,
        )
        super().__init__(
            f"deadlock: rank {rank} waits forever at position {position} ({action}): it needs "
            f"{waiting_for}, which no rank can run before it (check the order of the ranks' "
            "lists)"
        )


@dataclass(frozen=True)
class SimulationResult:
    """What a schedule costs under a cost model."""

    makespan: float
    timeline: list[ScheduledAction]
    busy_time: dict[int, float]
    bubble_fraction: dict[int, float]
    """Idle over busy time per rank (Table 2's convention: 1F1B's is (p-1)/m)."""
    peak_memory: dict[int, dict[str, float]]
    """Per rank, the peak bytes of "activations", "kv_cache", "stage_inputs" and "total"."""

    @property
    def max_bubble_fraction(self) -> float:
        return max(self.bubble_fraction.values())


def unit_dependencies(action: Action, num_stages: int, num_slices: int) -> list[tuple[_KEY, bool]]:
    """(stage, kind, unit) keys this action waits for; the flag marks a stage-to-stage transfer."""
    stage, kind, unit = action.stage_index, action.computation_type, action.microbatch_index
    _, slice_index = unit_microbatch_and_slice(unit, num_slices)
    needs: list[tuple[_KEY, bool]] = []
    if kind == F:
        if stage > 0:
            needs.append(((stage - 1, "F", unit), True))
        if slice_index > 0:
            needs.append(((stage, "F", unit - 1), False))
    elif kind in (B, INPUT_BACKWARD):
        needs.append(((stage, "F", unit), False))
        if stage < num_stages - 1:
            needs.append(((stage + 1, "BI", unit), True))
        if slice_index < num_slices - 1:
            needs.append(((stage, "BI", unit + 1), False))
    elif kind == WEIGHT_BACKWARD:
        needs.append(((stage, "I", unit), False))
    else:
        raise ValueError(f"simulate: {action} is not a compute action (F, B, I or W)")
    return needs


def _keys_of(action: Action) -> list[_KEY]:
    kind = action.computation_type.value
    keys = [(action.stage_index, kind, action.microbatch_index)]
    if kind in ("B", "I"):
        keys.append((action.stage_index, "BI", action.microbatch_index))
    return keys


def as_action(key: _KEY) -> Action:
    stage, kind, unit = key
    return Action(stage, ComputationType.from_str("B" if kind == "BI" else kind), unit)


def simulate(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
    *,
    num_slices: int = 1,
    cost: CostModel | None = None,
    attended_slices: Mapping[Action, float] | None = None,
    track_memory: bool = True,
) -> SimulationResult:
    """Run the lists under `cost`; raise ScheduleDeadlockError if some rank waits forever.
    `track_memory=False` leaves `peak_memory` empty (a caller after times only).

    `attended_slices` overrides the attention work of some actions (see
    `CostModel.forward_time`), e.g. after a context-exchange plan moved it between ranks.
    """
    cost = cost or CostModel()
    lists = {
        rank: [a for a in actions if a is not None] for rank, actions in actions_by_rank.items()
    }
    stage_rank = {a.stage_index: rank for rank, actions in lists.items() for a in actions}
    num_stages = max(stage_rank) + 1
    finished: dict[_KEY, float] = {}
    rank_free = dict.fromkeys(lists, 0.0)
    position = dict.fromkeys(lists, 0)
    timeline: list[ScheduledAction] = []
    while any(position[rank] < len(lists[rank]) for rank in lists):
        progressed = False
        for rank, actions in lists.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = unit_dependencies(action, num_stages, num_slices)
                if any(key not in finished for key, _ in needs):
                    break
                microbatch, slice_index = unit_microbatch_and_slice(
                    action.microbatch_index, num_slices
                )
                transfer = cost.transfer_time(num_slices, slice_index, microbatch)
                ready = max(
                    [finished[key] + (transfer if crosses and stage_rank[key[0]] != rank else 0.0)
                     for key, crosses in needs] or [0.0]
                )  # fmt: skip
                start = max(rank_free[rank], ready)
                attended = (attended_slices or {}).get(action)
                end = start + _duration(action, cost, num_stages, num_slices, attended)
                for key in _keys_of(action):
                    finished[key] = end
                timeline.append(ScheduledAction(rank, action, start, end))
                rank_free[rank], position[rank] = end, position[rank] + 1
                progressed = True
        if not progressed:
            raise _deadlock(lists, position, finished, num_stages, num_slices)
    makespan = max((event.end for event in timeline), default=0.0)
    busy = defaultdict(float)
    events_by_rank: dict[int, list[ScheduledAction]] = defaultdict(list)
    for event in timeline:
        busy[event.rank] += event.end - event.start
        events_by_rank[event.rank].append(event)
    return SimulationResult(
        makespan=makespan,
        timeline=timeline,
        busy_time={rank: busy[rank] for rank in lists},
        bubble_fraction={
            rank: (makespan - busy[rank]) / busy[rank] if busy[rank] else 0.0 for rank in lists
        },
        peak_memory={
            rank: _peak_memory(events_by_rank[rank], cost, num_stages, num_slices) for rank in lists
        }
        if track_memory
        else {},
    )


def _duration(
    action: Action,
    cost: CostModel,
    num_stages: int,
    num_slices: int,
    attended_slices: float | None = None,
) -> float:
    microbatch, slice_index = unit_microbatch_and_slice(action.microbatch_index, num_slices)
    forward = cost.forward_time(
        action.stage_index, num_stages, slice_index, num_slices, attended_slices, microbatch
    )
    backward = cost.backward_ratio * forward
    kind = action.computation_type
    if kind == F:
        return forward
    if kind == B:
        return backward
    share = cost.input_backward_share
    return backward * (share if kind == INPUT_BACKWARD else 1.0 - share)


def _deadlock(
    lists: Mapping[int, list[Action]],
    position: Mapping[int, int],
    finished: Mapping[_KEY, float],
    num_stages: int,
    num_slices: int,
) -> ScheduleDeadlockError:
    """Follow who waits for whom to the root: a rank that waits for an action of its own (listed
    later) or the first rank of a cycle of ranks waiting for each other."""
    stage_rank = {a.stage_index: rank for rank, actions in lists.items() for a in actions}

    def blocked(rank: int) -> tuple[Action, _KEY]:
        action = lists[rank][position[rank]]
        needs = unit_dependencies(action, num_stages, num_slices)
        return action, next(key for key, _ in needs if key not in finished)

    rank = next(r for r in lists if position[r] < len(lists[r]))
    seen: list[int] = []
    while rank not in seen:
        seen.append(rank)
        _, missing = blocked(rank)
        owner = stage_rank.get(missing[0], rank)
        if owner == rank or position[owner] >= len(lists[owner]):
            break
        rank = owner
    action, missing = blocked(rank)
    return ScheduleDeadlockError(rank, action, as_action(missing), position[rank])


def _peak_memory(
    events: Sequence[ScheduledAction], cost: CostModel, num_stages: int, num_slices: int
) -> dict[str, float]:
    """Sweep one rank's events: memory is taken at an action's start, given back at its end."""
    changes: list[tuple[float, int, str, float]] = []  # (time, order, category, bytes)
    per_sequence = {
        "activations": cost.activation_bytes / num_stages,
        "kv_cache": cost.kv_cache_bytes / num_stages,
        "stage_inputs": cost.boundary_bytes,
    }
    for event in events:
        kind, stage = event.action.computation_type, event.action.stage_index
        microbatch, slice_index = unit_microbatch_and_slice(
            event.action.microbatch_index, num_slices
        )
        tokens, _ = cost.slice_shares(slice_index, num_slices, microbatch)
        held = {
            category: size * tokens
            for category, size in per_sequence.items()
            if category != "stage_inputs" or stage > 0
        }
        if kind == F:
            changes += [(event.start, 1, category, size) for category, size in held.items()]
        elif kind == B:
            changes += [(event.end, 0, category, -size) for category, size in held.items()]
        elif kind == INPUT_BACKWARD:
            kept = cost.weight_grad_activation_share
            changes.append((event.end, 0, "activations", -held["activations"] * (1 - kept)))
            changes += [(event.end, 0, c, -s) for c, s in held.items() if c != "activations"]
        elif kind == WEIGHT_BACKWARD:
            kept = cost.weight_grad_activation_share * held["activations"]
            changes.append((event.end, 0, "activations", -kept))
    live: dict[str, float] = defaultdict(float)
    peak: dict[str, float] = defaultdict(float)
    for _, _, category, size in sorted(changes):
        live[category] += size
        peak[category] = max(peak[category], live[category])
        total = sum(live.values())
        peak["total"] = max(peak["total"], total)
    return {category: peak[category] for category in (*per_sequence, "total")}
