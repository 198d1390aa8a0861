"""Which pipeline ranks exchange attention context in which pass (SlimPipe §4.2, Eq. 2).

With equal-length slices and causal attention, a pass over slice j attends to j earlier KV slices
and its own, so its attention work is `j + 1` slices (times the backward's cost ratio in a
backward pass). Passes that run at the same moment on different ranks carry different work, and
the light ranks wait for the heavy ones. Attention has no weights, so a heavy rank can hand its
query and some of its KV slices to a light rank, which computes that partial attention (forward,
or backward for a backward pass) inside its own pass and sends the result back to be merged.

The plan, a pure function of the action lists:

- **Moments.** The schedule is simulated with equal forward and backward costs and no attention
  work, which runs it in lockstep: every rank runs at most one pass per step, and the passes that
  start at one step form a moment. In the sliced 1F1B steady state neighbouring ranks run
  different kinds (ranks 0 and 2 forward while 1 and 3 go backward), so a moment mixes kinds;
  that is fine, because the partner answers the borrowed requests on helper threads beside its
  own pass, whichever way that pass walks the layers (`pipekit.attention.across.loan_server`).
- **Balance.** Work is counted in forward-slice units: a KV slice of a forward pass is 1, of a
  backward pass `backward_ratio`. Ranks above the moment's mean give one KV slice at a time to
  the rank furthest below it, while the giver is half a slice or more above the mean and the
  taker as far below it; so a moment ends with a spread of about one slice (one backward slice
  where backward passes give; at most one slice when all its passes are forwards).
- **Early KV exchange.** A giver hands over its earliest KV slices (0, 1, ...), never its own
  diagonal one: those were produced passes ago and can travel while earlier passes still compute
  (`PipelineContextExchange` sends them ahead of the lending pass).

Legend: p ranks, m microbatches, n slices per sequence.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipekit.pipelining.actions import FORWARD, Action, ComputationType
from pipekit.pipelining.schedules.simulate import LOCKSTEP_COST, simulate
from pipekit.pipelining.schedules.torch_lists import compute_actions
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = [
    "ExchangeMoment",
    "ExchangePlan",
    "KVTransfer",
    "balance_work",
    "eq2_exchanged_slices",
    "plan_context_exchange",
]


@dataclass(frozen=True)
class KVTransfer:
    """In one moment, `target_rank` computes the attention of `source_rank`'s query over the KV
    slices `kv_slices` (of the source's microbatch) for the source's pass, and sends it back."""

    moment: int
    source_rank: int
    target_rank: int
    source_action: Action
    target_action: Action
    kv_slices: tuple[int, ...]


@dataclass(frozen=True)
class ExchangeMoment:
    """The passes that start at one lockstep step and their attention work (forward-slice
    units) before and after the exchange."""

    index: int
    actions: dict[int, Action]
    work_before: dict[int, float]
    work_after: dict[int, float]

    @property
    def spread_before(self) -> float:
        return max(self.work_before.values()) - min(self.work_before.values())

    @property
    def spread_after(self) -> float:
        return max(self.work_after.values()) - min(self.work_after.values())


@dataclass(frozen=True)
class ExchangePlan:
    """Every moment of a schedule and the transfers that balance it."""

    num_slices: int
    backward_ratio: float
    moments: list[ExchangeMoment]
    transfers: list[KVTransfer]

    def attended_slices(self) -> dict[Action, float]:
        """Per action, the attention its rank computes after the exchange, in slices of the
        action's own kind (its own kept slices, the diagonal one counting one half as causal
        attention does half its work, plus the borrowed work), for
        `simulate(attended_slices=...)`."""
        attended = {}
        for moment in self.moments:
            for rank, action in moment.actions.items():
                attended[action] = moment.work_after[rank] / self._unit(action) - 0.5
        return attended

    def exchanged_slices(self, num_microbatches: int, num_ranks: int) -> float:
        """Slices that forward passes send per microbatch per rank, counted as Eq. 2 counts
        them: the query and its output per transfer, a key and a value per KV slice."""
        sent = sum(
            2 + 2 * len(transfer.kv_slices)
            for transfer in self.transfers
            if transfer.source_action.computation_type == FORWARD
        )
        return sent / (num_microbatches * num_ranks)

    def lendings(self, rank: int) -> dict[Action, list[tuple[int, tuple[int, ...]]]]:
        """What `rank` lends in each of its passes: `(target rank, KV slices)` per peer, in
        the order the pass must send them (the same order its peers expect them in)."""
        lent: dict[Action, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        for transfer in self.transfers:
            if transfer.source_rank == rank:
                lent[transfer.source_action].append((transfer.target_rank, transfer.kv_slices))
        return dict(lent)

    def servings(self, rank: int) -> dict[Action, list[tuple[int, Action]]]:
        """Whom `rank` serves in each of its passes: `(source rank, source pass)`, in the order
        the requests come (each source's parts in transfer order)."""
        served: dict[Action, list[tuple[int, Action]]] = defaultdict(list)
        for transfer in self.transfers:
            if transfer.target_rank == rank:
                served[transfer.target_action].append(
                    (transfer.source_rank, transfer.source_action)
                )
        return dict(served)

    def _unit(self, action: Action) -> float:
        return 1.0 if action.computation_type == FORWARD else self.backward_ratio


def eq2_exchanged_slices(num_ranks: int, num_slices: int) -> float:
    """SlimPipe Eq. 2 per microbatch per device, in slices of one rank's Q, K, V or O:
    `2n + 2(n-p+1)⌊(p-1)/2⌋ + 2(p-1)⌊(n-1)/2⌋`."""
    p, n = num_ranks, num_slices
    return 2 * n + 2 * (n - p + 1) * ((p - 1) // 2) + 2 * (p - 1) * ((n - 1) // 2)


def balance_work(
    work: Mapping[int, float], unit: Mapping[int, float], sendable: Mapping[int, int]
) -> list[tuple[int, int, int]]:
    """`(source, target, slices)` moves of whole KV slices: a slice of rank r carries `unit[r]`
    work, and r can give at most `sendable[r]` slices. Ranks above the mean give, heaviest first,
    one slice at a time to the rank furthest below it, while the giver is at least half a slice
    above the mean, the taker at least half a slice below it, and the giver more than a slice
    above the taker (so every move narrows the pair). Givers never take."""
    if not work:
        return []
    mean = sum(work.values()) / len(work)
    current = dict(work)
    moves: dict[tuple[int, int], int] = defaultdict(int)
    takers = [rank for rank in work if work[rank] < mean]
    for source in sorted(work, key=lambda rank: (-work[rank], rank)):
        if work[source] <= mean:
            break
        for _ in range(sendable[source]):
            target = max(takers, key=lambda rank: (mean - current[rank], -rank), default=None)
            half = unit[source] / 2
            if (
                target is None
                or current[source] - mean < half  # the giver would drop below the mean
                or mean - current[target] < half  # the taker would rise above it
                or current[source] - current[target] <= unit[source]  # no narrower after
            ):
                break
            current[source] -= unit[source]
            current[target] += unit[source]
            moves[source, target] += 1
    return [(source, target, count) for (source, target), count in moves.items()]


def plan_context_exchange(
    actions_by_rank: Mapping[int, Sequence[Action | None]],
    num_slices: int,
    backward_ratio: float = 2.0,
) -> ExchangePlan:
    """The moments of `actions_by_rank` (F and B actions on units of `num_slices` slices) and
    the transfers that balance each; see the module docstring."""
    lists = {rank: compute_actions(list(actions)) for rank, actions in actions_by_rank.items()}
    kinds = {a.computation_type for actions in lists.values() for a in actions}
    if kinds - {ComputationType.FORWARD, ComputationType.FULL_BACKWARD}:
        raise ValueError(
            "context exchange needs full backwards (F and B actions): the split I/W backward "
            "does not carry the KV cache's gradients; use the sliced schedule"
        )
    grouped: dict[float, dict[int, Action]] = defaultdict(dict)
    for event in simulate(lists, num_slices=num_slices, cost=LOCKSTEP_COST).timeline:
        grouped[round(event.start, 9)][event.rank] = event.action
    plan = ExchangePlan(num_slices, backward_ratio, [], [])
    for index, start in enumerate(sorted(grouped)):
        actions = grouped[start]
        unit = {rank: plan._unit(action) for rank, action in actions.items()}
        own = {rank: _own_slices(action, num_slices) for rank, action in actions.items()}
        work = {rank: unit[rank] * own[rank] for rank in actions}
        after = dict(work)
        next_slice: dict[int, int] = defaultdict(int)  # givers hand over their earliest slices
        sendable = {rank: own[rank] - 1 for rank in actions}  # never the diagonal slice
        for source, target, count in balance_work(work, unit, sendable):
            kv = tuple(range(next_slice[source], next_slice[source] + count))
            next_slice[source] += count
            after[source] -= unit[source] * count
            after[target] += unit[source] * count
            plan.transfers.append(
                KVTransfer(index, source, target, actions[source], actions[target], kv)
            )
        plan.moments.append(ExchangeMoment(index, actions, work, after))
    return plan


def _own_slices(action: Action, num_slices: int) -> int:
    """KV slices a pass attends to: the earlier slices of its sequence and its own."""
    _, slice_index = unit_microbatch_and_slice(action.microbatch_index, num_slices)
    return slice_index + 1
