"""Context exchange in a running pipeline: the plan's transfers as each slice's exchange.

`PipelineContextExchange` is a `PipelineExtension`. It plans the exchange over every rank's
action lists (`prepare`: `plan_context_exchange`, the same pure function on every rank, so all
ranks agree) and, for each unit a stage runs, wraps the slice's KV-cache attention context in a
`ContextExchangeAttention` with that unit's `SliceExchange` (`stage_context`): which peers its
passes lend which earlier KV slices to, and which peers' requests each attention call serves.

A lending pass sends one request per attention layer (a forward or a backward request as the
pass is); the serving pass answers them at its own attention calls, whatever its own kind:
request i of a source with `L_s` layers at call `floor(i * L_t / L_s)` of a target with `L_t`
(one each when the stages hold equally many layers).

**Deadlock-free by construction.** The exchange group carries nothing else, and the plan pairs
only passes of one lockstep moment: passes no dependency orders, so neither waits, through the
pipeline's sends, for the other to finish. Within a moment a rank either lends or serves, never
both. A lender posts its requests for call c without waiting (non-blocking sends) and then
waits for their answers; a server answers the requests of call c once they arrive. So by
induction on c every call's requests are posted, served and answered. Across moments, the
passes of earlier moments finish first, as in the schedule without exchange. If a peer dies,
the waiting rank's receive times out with an error naming the pair.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch.distributed as dist

from pipekit.attention.context import AttentionContext
from pipekit.attention.context_exchange import (
    ContextExchangeAttention,
    LoanRequest,
    PassExchange,
    SliceExchange,
)
from pipekit.attention.exchange import DEFAULT_LOAN_TIMEOUT
from pipekit.pipelining._torch_runtime import BACKWARD, FORWARD, Action
from pipekit.pipelining.features.exchange_plan import ExchangePlan, plan_context_exchange
from pipekit.pipelining.runtime.extension import PipelineExtension

__all__ = ["PipelineContextExchange", "serving_calls"]


def serving_calls(
    sources: Sequence[tuple[LoanRequest, int]], target_layers: int
) -> tuple[tuple[LoanRequest, ...], ...]:
    """Per attention call of a serving pass with `target_layers` layers, the requests it
    answers, in order; `sources` are the lending passes (what they request, their layer
    count), in plan order."""
    if target_layers < 1:
        raise ValueError("a serving stage needs at least one attention layer")
    calls: list[list[LoanRequest]] = [[] for _ in range(target_layers)]
    for request, layers in sources:
        for index in range(layers):
            calls[index * target_layers // layers].append(request)
    return tuple(tuple(call) for call in calls)


class PipelineContextExchange(PipelineExtension):
    """This rank's share of the context exchange of a pipeline schedule.

    `group`: the pipeline ranks, a group of their own (the exchange's receives must never
    queue behind the stages' sends). `layers_per_stage`: attention layers of every stage, all
    ranks' (the servers need the lenders' counts). `backward_ratio`: a backward slice's cost in
    forward slices, for the balance. `drop_remote_kv_grads`: for the ablation test only.
    """

    name = "context_exchange"

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
            requests = [
                (LoanRequest(source, a.computation_type == BACKWARD), self._layers(a))
                for source, a in sources
            ]
            calls = serving_calls(requests, self._layers(action))
            passes[action] = PassExchange(lend=passes[action].lend, serve=calls)
        self._exchanges = {}
        for stage, unit in {(a.stage_index, a.microbatch_index) for a in passes}:
            self._exchanges[stage, unit] = SliceExchange(
                passes[Action(stage, FORWARD, unit)],
                passes[Action(stage, BACKWARD, unit)],
                self.group,
                self.timeout,
                self.drop_remote_kv_grads,
            )

    def _layers(self, action: Action) -> int:
        return self.layers_per_stage[action.stage_index]

    def slice_exchange(self, stage_index: int, unit: int) -> SliceExchange | None:
        """The exchange of `unit`'s passes on `stage_index` (None: neither lends nor serves)."""
        return self._exchanges.get((stage_index, unit))

    def stage_context(
        self, stage_index: int, unit: int, training: bool, context: AttentionContext
    ) -> AttentionContext:
        """The unit's KV-cache context, lending or serving attention as the plan says (training
        forwards only: an inference forward has no backward to pair with)."""
        exchange = self.slice_exchange(stage_index, unit) if training else None
        return context if exchange is None else ContextExchangeAttention(context, exchange)

    def after_forward(self, stage_index: int, unit: int, context: AttentionContext) -> None:
        """Every loan of the forward must have been made and served."""
        if isinstance(context, ContextExchangeAttention):
            context.check_forward_done()
