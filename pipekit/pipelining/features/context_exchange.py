"""Context exchange in a running pipeline: the plan's transfers as each slice's exchange.

`PipelineContextExchange` is a `PipelineExtension`. It plans the exchange over every rank's
action lists (`prepare`: `plan_context_exchange`, the same pure function on every rank, so all
ranks agree) and, for each unit a stage runs, wraps the slice's KV-cache attention context in a
`ContextExchangeAttention` with that unit's `SliceExchange` (`stage_context`): which peers its
passes lend which earlier KV slices to, and which peers' requests they serve.

A lending pass sends one request per attention layer (a forward or a backward request as the
pass is). The serving pass answers them on helper threads as they arrive (`LoanServer`), so
neither it nor the lender waits for the other's layers, and the server goes on with its next
passes while the lender finishes. A serving action the extension adds
(`Action(stage, SERVE_AFTER_FORWARD or SERVE_AFTER_BACKWARD, unit)`) waits for the last answer
just before the rank's next pass that lends or serves, or at the end of the step. The threads
answer also while the rank waits for other ranks (the last stage's loss joins an output pass
under vocabulary parallelism, which the lender may reach only after its lending pass).

**Deadlock-free by construction.** The exchange group carries nothing else, and the plan pairs
only passes of one lockstep moment: passes no dependency orders, so neither waits, through the
pipeline's sends, for the other to finish. Within a moment a rank either lends or serves, never
both. A lender waits only for answers, and sends its next request after the answer to its last;
a server's threads wait only for the requests of its moment's lenders, and the server waits for
its threads only before its next exchanging pass, of a later moment. The lenders' passes depend
on nothing of a later moment, so that wait ends. If a peer dies, the waiting rank's receive
times out with an error naming the pair.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import timedelta
from enum import Enum

import torch.distributed as dist

from pipekit.attention.context import AttentionContext
from pipekit.attention.context_exchange import (
    ContextExchangeAttention,
    PassExchange,
    SliceExchange,
)
from pipekit.attention.exchange import DEFAULT_LOAN_TIMEOUT
from pipekit.attention.loan_server import LoanRequest, LoanServer
from pipekit.pipelining._torch_runtime import BACKWARD, FORWARD, Action
from pipekit.pipelining.features.exchange_plan import ExchangePlan, plan_context_exchange
from pipekit.pipelining.runtime.extension import PipelineExtension

__all__ = [
    "SERVE_AFTER_BACKWARD",
    "SERVE_AFTER_FORWARD",
    "ExchangeComputation",
    "PipelineContextExchange",
]


class ExchangeComputation(str, Enum):
    """pipekit's action types for answering a serving pass's remaining requests after it:
    `Action(stage, SERVE_AFTER_FORWARD, unit)` follows the unit's forward on that stage."""

    SERVE_AFTER_FORWARD = "SVF"
    SERVE_AFTER_BACKWARD = "SVB"


SERVE_AFTER_FORWARD = ExchangeComputation.SERVE_AFTER_FORWARD
SERVE_AFTER_BACKWARD = ExchangeComputation.SERVE_AFTER_BACKWARD
_SERVE_AFTER = {FORWARD: SERVE_AFTER_FORWARD, BACKWARD: SERVE_AFTER_BACKWARD}


class PipelineContextExchange(PipelineExtension):
    """This rank's share of the context exchange of a pipeline schedule.

    `group`: the pipeline ranks, a group of their own (the exchange's receives must never
    queue behind the stages' sends). `layers_per_stage`: attention layers of every stage, all
    ranks' (the servers need the lenders' counts). `backward_ratio`: a backward slice's cost in
    forward slices, for the balance. `drop_remote_kv_grads`: for the ablation test only.
    """

    name = "context_exchange"
    action_types = (SERVE_AFTER_FORWARD, SERVE_AFTER_BACKWARD)

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        layers_per_stage: Mapping[int, int],
        *,
        backward_ratio: float = 2.0,
        timeout: timedelta = DEFAULT_LOAN_TIMEOUT,
        drop_remote_kv_grads: bool = False,
    ) -> None:
        empty = [stage for stage, layers in layers_per_stage.items() if layers < 1]
        if empty:
            raise ValueError(
                f"context exchange: stages {empty} hold no attention layer; every stage must "
                "hold one (change the stage split) or set context_exchange = false"
            )
        self.group, self.layers_per_stage = group, dict(layers_per_stage)
        self.backward_ratio, self.timeout = backward_ratio, timeout
        self.drop_remote_kv_grads = drop_remote_kv_grads
        self.plan: ExchangePlan | None = None
        self._exchanges: dict[tuple[int, int], SliceExchange] = {}
        self._servers: dict[Action, LoanServer] = {}
        """This step's serving passes that have started, by their serving action."""

    def prepare(self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int) -> None:
        """Plan over every rank's compute lists and keep this rank's slice exchanges."""
        stages = {a.stage_index for acts in actions_by_rank.values() for a in acts if a}
        missing = sorted(stages - set(self.layers_per_stage))
        if missing:
            raise ValueError(
                f"context exchange: layers_per_stage lacks stages {missing}; give every "
                "stage's attention layer count"
            )
        self.plan = plan_context_exchange(actions_by_rank, num_slices, self.backward_ratio)
        rank = dist.get_rank(self.group)
        passes: dict[Action, PassExchange] = defaultdict(PassExchange)
        for action, parts in self.plan.lendings(rank).items():
            passes[action] = PassExchange(lend=tuple(parts))
        for action, sources in self.plan.servings(rank).items():
            requests = tuple(
                LoanRequest(source, a.computation_type == BACKWARD)
                for source, a in sources
                for _ in range(self.layers_per_stage[a.stage_index])
            )
            passes[action] = PassExchange(passes[action].lend, requests)
        self._exchanges = {}
        for stage, unit in {(a.stage_index, a.microbatch_index) for a in passes}:
            self._exchanges[stage, unit] = SliceExchange(
                passes[Action(stage, FORWARD, unit)],
                passes[Action(stage, BACKWARD, unit)],
                self.group,
                self.timeout,
                self.drop_remote_kv_grads,
            )

    def slice_exchange(self, stage_index: int, unit: int) -> SliceExchange | None:
        """The exchange of `unit`'s passes on `stage_index` (None: neither lends nor serves)."""
        return self._exchanges.get((stage_index, unit))

    def extra_actions(
        self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int
    ) -> dict[int, list[tuple[int, Action]]]:
        """For every serving pass, the action that waits for its last answers: just before the
        rank's next pass that lends or serves (its messages must not mix with the answers'), or
        at the end of the step; the passes between run beside the answering."""
        assert self.plan is not None, "prepare runs first"
        placed: dict[int, list[tuple[int, Action]]] = {}
        for rank, actions in actions_by_rank.items():
            servings = self.plan.servings(rank)
            exchanging = self.plan.lendings(rank).keys() | servings.keys()
            indices = [index for index, action in enumerate(actions) if action in exchanging]
            placed[rank] = [
                (next_index, _serve_after(actions[index]))
                for index, next_index in zip(indices, [*indices[1:], len(actions)], strict=True)
                if actions[index] in servings
            ]
        return placed

    def run_action(self, action: Action, context: object) -> None:
        """A serving action: wait until its pass's requests are answered (none when the pass
        did not serve: a forward without a backward lends and serves nothing)."""
        server = self._servers.pop(action, None)
        if server is not None:
            server.finish()

    def stage_context(
        self, stage_index: int, unit: int, training: bool, context: AttentionContext
    ) -> AttentionContext:
        """The unit's KV-cache context, lending or serving attention as the plan says (training
        forwards only: an inference forward has no backward to pair with)."""
        exchange = self.slice_exchange(stage_index, unit) if training else None
        if exchange is None:
            return context
        wrapped = ContextExchangeAttention(context, exchange)
        servers = {FORWARD: wrapped.forward_server, BACKWARD: wrapped.backward_server}
        for kind, server in servers.items():
            if server is not None:
                self._servers[_serve_after(Action(stage_index, kind, unit))] = server
        return wrapped

    def after_forward(self, stage_index: int, unit: int, context: AttentionContext) -> None:
        """The forward ran the stage's planned number of attention layers."""
        if isinstance(context, ContextExchangeAttention):
            context.check_forward_done(self.layers_per_stage[stage_index])

    def end_step(self) -> None:
        """Every serving pass of the step was answered in full."""
        unanswered = sorted(str(action) for action in self._servers)
        self._servers = {}
        if unanswered:
            raise RuntimeError(
                f"context exchange: serving actions {unanswered} never ran; the schedule must "
                "keep the actions the exchange adds (pipeline_order_with_comms)"
            )


def _serve_after(action: Action) -> Action:
    """The serving action that follows `action`."""
    kind = _SERVE_AFTER[action.computation_type]
    return Action(action.stage_index, kind, action.microbatch_index)
