"""Context exchange in a running pipeline: the plan's transfers as each slice's exchange.

`PipelineContextExchange` is a `PipelineExtension`. It plans the exchange over every rank's
action lists (`prepare`: `plan_context_exchange`, the same pure function on every rank, so all
ranks agree). For each unit whose forward or backward lends, it wraps the slice's KV-cache
attention context in a `ContextExchangeAttention` with that unit's `SliceExchange`
(`stage_context`): which peers its passes lend which earlier KV slices to. The serving is the
extension's own (below).

A lending pass sends one request per attention layer (a forward or a backward request as the
pass is). Every serving pass answers on helper threads that start with the step and answer as
the requests arrive (`LoanServer`), each peer's passes in turn (`ServingChain`); so neither the
server nor the lender waits for the other's layers, and the server goes on with its next passes
while the lender finishes. Lendings to higher ranks travel on `group` and those to lower ranks
on `downward_group`, so a rank's own lending never mixes its messages with its threads' answers.
A serving action the extension adds (`Action(stage, SERVE_AFTER_FORWARD or
SERVE_AFTER_BACKWARD, unit)`) waits for the last answers, at the end of the step.

**Early KV exchange** (SlimPipe §5). A giver lends its earliest KV slices, produced passes ago.
With `chunks_ahead` a sending action (`Action(stage, SEND_AHEAD_FORWARD or SEND_AHEAD_BACKWARD,
unit)`) posts every layer's lent chunks of a lending pass as soon as they may go: right after the
later of the forward that produced the newest of them and the rank's previous lending pass to
the same peers (the peer's threads read each lender's messages in the rank's order). The sends
are non-blocking: the chunks travel while the rank computes the passes in between, and the
lending pass sends only its queries. `ahead_sends` records how long before each lending pass
its chunks were posted, `chunk_leads_s` how long the serving threads had held them when the
first request came.

**Deadlock-free by construction.** The exchange groups carry nothing else, and the plan pairs
only passes of one lockstep moment: passes no dependency orders, so neither waits, through the
pipeline's sends, for the other to finish. A lender waits only for answers to requests it has
sent, and every message before them to that peer was sent earlier (the early chunks included).
A serving thread waits only for its peer's messages, in the order the peer sends them, and for
the previous thread of that peer, which reads the messages before. The rank's passes never wait
for its threads before the end of the step. If a peer dies, the waiting rank's receive times
out with an error naming the pair.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor

from pipekit.attention.across.exchange_context import (
    ContextExchangeAttention,
    PassExchange,
    SliceExchange,
    exchange_loan,
)
from pipekit.attention.across.loan_server import LoanRequest, LoanServer, ServingChain
from pipekit.attention.across.loan_wire import (
    DEFAULT_LOAN_TIMEOUT,
    AttentionLoan,
    LentChunk,
    send_lent_chunks,
)
from pipekit.attention.context import AttentionContext
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.kv_cache import CachedSlice, ChunkedKVCache, SliceAttention
from pipekit.attention.patterns import block_visible, is_causal
from pipekit.pipelining.actions import BACKWARD, FORWARD, Action, ComputationType
from pipekit.pipelining.features.exchange_plan import ExchangePlan, plan_context_exchange
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.runtime.measured_choice import MeasuredChoice
from pipekit.pipelining.schedules.units import unit_index, unit_microbatch_and_slice

__all__ = [
    "SEND_AHEAD_BACKWARD",
    "SEND_AHEAD_FORWARD",
    "SERVE_AFTER_BACKWARD",
    "SERVE_AFTER_FORWARD",
    "AheadSend",
    "ExchangeComputation",
    "PipelineContextExchange",
]


class ExchangeComputation(str, Enum):
    """pipekit's action types for the exchange. `Action(stage, SERVE_AFTER_FORWARD, unit)`
    waits for the answers of the unit's serving forward on that stage (at the end of the step);
    `Action(stage, SEND_AHEAD_FORWARD, unit)` sends the chunks its lending forward lends, ahead
    of it (early KV exchange)."""

    SERVE_AFTER_FORWARD = "SVF"
    SERVE_AFTER_BACKWARD = "SVB"
    SEND_AHEAD_FORWARD = "KVF"
    SEND_AHEAD_BACKWARD = "KVB"


SERVE_AFTER_FORWARD = ExchangeComputation.SERVE_AFTER_FORWARD
SERVE_AFTER_BACKWARD = ExchangeComputation.SERVE_AFTER_BACKWARD
SEND_AHEAD_FORWARD = ExchangeComputation.SEND_AHEAD_FORWARD
SEND_AHEAD_BACKWARD = ExchangeComputation.SEND_AHEAD_BACKWARD
_SERVE_AFTER = {FORWARD: SERVE_AFTER_FORWARD, BACKWARD: SERVE_AFTER_BACKWARD}
_SEND_AHEAD = {FORWARD: SEND_AHEAD_FORWARD, BACKWARD: SEND_AHEAD_BACKWARD}
_PASS_OF = {
    kind: pass_kind
    for pass_kind in (FORWARD, BACKWARD)
    for kind in (_SERVE_AFTER[pass_kind], _SEND_AHEAD[pass_kind])
}


@dataclass(frozen=True)
class AheadSend:
    """One lending pass's chunks sent ahead: how long before the pass reached its first
    attention call they were posted, and their bytes."""

    action: Action
    lead_s: float
    nbytes: int


@dataclass(frozen=True)
class _Posted:
    """Sends of one lending pass's chunks, in flight until the pass has run."""

    posted_at: float
    works: list[dist.Work]
    nbytes: int
    peers: frozenset[int]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class PipelineContextExchange(PipelineExtension):
    """This rank's share of the context exchange of a pipeline schedule.

    `group` and `downward_group`: the pipeline ranks, two groups of their own (the exchange's
    receives must never queue behind the stages' sends; lendings to higher ranks use the first,
    to lower ranks the second). `layers_per_stage`: attention layers of every stage, all ranks'
    (the servers need the lenders' counts). `chunks_ahead`: early KV exchange (see the module
    doc; off under context parallelism, whose lent chunks are built inside the attention).
    `backend`: the attention backend the serving threads compute with. `backward_ratio`: a
    backward slice's cost in forward slices, for the balance. `drop_remote_kv_grads`: for the
    ablation test only. `measured`: lend only if the first steps were faster lending
    (`MeasuredChoice`; `context_exchange = "auto"`).
    """

    name = "context_exchange"
    sliced_only = True  # it lends between slices' passes
    action_types = tuple(ExchangeComputation)

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        layers_per_stage: Mapping[int, int],
        *,
        downward_group: dist.ProcessGroup | None,
        chunks_ahead: bool = True,
        backend: str | AttentionBackend = "auto",
        backward_ratio: float = 2.0,
        timeout: timedelta = DEFAULT_LOAN_TIMEOUT,
        drop_remote_kv_grads: bool = False,
        measured: bool = False,
    ) -> None:
        empty = [stage for stage, layers in layers_per_stage.items() if layers < 1]
        if empty:
            raise ValueError(
                f"context exchange: stages {empty} hold no attention layer; every stage must "
                "hold one (change the stage split) or set context_exchange = false"
            )
        if downward_group is group:
            raise ValueError(
                "context exchange: give downward_group a group of its own (a second "
                "dist.new_group over the pipeline ranks), not the exchange group"
            )
        self.group, self.downward_group = group, downward_group
        self.layers_per_stage = dict(layers_per_stage)
        self.chunks_ahead, self.backward_ratio = chunks_ahead, backward_ratio
        self.backend = backend
        self.timeout, self.drop_remote_kv_grads = timeout, drop_remote_kv_grads
        self.choice = (
            MeasuredChoice(
                "context_exchange", group, (True, False), labels=("on", "off"), default=1
            )
            if measured
            else None
        )
        """`context_exchange = "auto"`: on or off by the first steps' times (None: always on)."""
        self.plan: ExchangePlan | None = None
        self.ahead_sends: list[AheadSend] = []
        """This step's lending passes whose chunks went ahead, as each pass began."""
        self.chunk_leads_s: list[float] = []
        """This step's serving passes' chunks sent ahead: how long they had been received when
        the lender's first request arrived."""
        self.serving_cpu_s = 0.0
        """This step's serving threads' CPU seconds, counted as each serving pass's answers
        complete (`LoanServer.cpu_s`): on a CPU, what the work moved here costs this rank."""
        self._exchanges: dict[tuple[int, int], SliceExchange] = {}
        self._serving: list[tuple[Action, tuple[LoanRequest, ...]]] = []
        self._lending: dict[Action, tuple[tuple[int, tuple[int, ...]], ...]] = {}
        self._servers: dict[Action, LoanServer] = {}
        self._chain = ServingChain()
        self._caches: dict[int, ChunkedKVCache] = {}
        self._ahead: dict[Action, _Posted] = {}

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
        self._lending = {action: tuple(parts) for action, parts in self.plan.lendings(rank).items()}
        for action, parts in self._lending.items():
            passes[action] = PassExchange(lend=parts)
        servings = self.plan.servings(rank)
        for action, sources in servings.items():
            requests = tuple(
                LoanRequest(source, a.computation_type == BACKWARD, self.chunks_ahead)
                for source, a in sources
                for _ in range(self.layers_per_stage[a.stage_index])
            )
            passes[action] = PassExchange(passes[action].lend, requests)
        self._serving = [(a, passes[a].serve) for a in actions_by_rank[rank] if a in servings]
        self._exchanges = {}
        for stage, unit in {(a.stage_index, a.microbatch_index) for a in passes}:
            self._exchanges[stage, unit] = SliceExchange(
                passes[Action(stage, FORWARD, unit)],
                passes[Action(stage, BACKWARD, unit)],
                self.group,
                self.downward_group,
                self.timeout,
                self.chunks_ahead,
                functools.partial(self._lending_started, stage, unit),
                self.drop_remote_kv_grads,
            )

    def measured_choice(self) -> MeasuredChoice[bool] | None:
        """`context_exchange = "auto"`'s choice (None: always on)."""
        return self.choice

    def helper_cpu_s(self) -> float:
        """The serving threads' CPU seconds in the last step."""
        return self.serving_cpu_s

    def step_figures(self) -> dict[str, float]:
        """Early KV exchange in the last step: the lending passes whose chunks went ahead, how
        long before each pass they were posted, their bytes, and how long the serving threads
        held them before the first request (in total and at least)."""
        return {
            "ahead_passes": len(self.ahead_sends),
            "ahead_posted_s": sum(sent.lead_s for sent in self.ahead_sends),
            "ahead_bytes": sum(sent.nbytes for sent in self.ahead_sends),
            "ahead_held_s": sum(self.chunk_leads_s),
            "ahead_served": len(self.chunk_leads_s),
            "ahead_held_min_s": min(self.chunk_leads_s, default=float("nan")),
        }

    @property
    def enabled(self) -> bool:
        """Whether this step lends attention (always, unless a measured choice says not)."""
        return self.choice is None or self.choice.current

    def slice_exchange(self, stage_index: int, unit: int) -> SliceExchange | None:
        """The exchange of `unit`'s passes on `stage_index` (None: neither lends nor serves)."""
        return self._exchanges.get((stage_index, unit))

    def extra_actions(
        self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int
    ) -> dict[int, list[tuple[int, Action]]]:
        """Every serving pass's wait for its answers, at the end of the step (nothing the rank
        runs later mixes with the answers: see the module doc); with early KV exchange, every
        lending pass's sending ahead, as early as its messages may go."""
        assert self.plan is not None, "prepare runs first"
        placed: dict[int, list[tuple[int, Action]]] = {}
        for rank, actions in actions_by_rank.items():
            ends = [(len(actions), _retyped(a, _SERVE_AFTER)) for a in self.plan.servings(rank)]
            ahead = _ahead_sends(actions, self.plan.lendings(rank), num_slices)
            placed[rank] = (ahead if self.chunks_ahead else []) + ends
        return placed

    def begin_step(
        self, units: Sequence[TensorDict], normaliser: Tensor | float
    ) -> list[tuple[Tensor, ...]] | None:
        """Start answering: every serving pass's threads, each peer's in the order of the passes
        (they wait for the requests; the rank's passes never wait for them)."""
        self.ahead_sends, self.chunk_leads_s, self.serving_cpu_s = [], [], 0.0
        if self.choice is not None:
            self.choice.begin_step()
        if not self.enabled:
            return None
        for action, requests in self._serving:
            server = LoanServer(requests, self._server_loan, self.backend, self._chain)
            self._servers[_retyped(action, _SERVE_AFTER)] = server
            server.start()
        return None

    def run_action(self, action: Action, context: object) -> None:
        """A serving action waits until its pass's requests are answered; a sending-ahead action
        sends its lending pass's chunks, every layer's, in the order the pass calls them."""
        kind = action.computation_type
        if not self.enabled:
            return
        if kind in (SEND_AHEAD_FORWARD, SEND_AHEAD_BACKWARD):
            self._send_ahead(Action(action.stage_index, _PASS_OF[kind], action.microbatch_index))
            return
        server = self._servers.pop(action, None)
        if server is not None:
            server.finish()
            self.chunk_leads_s += server.chunk_leads_s
            self.serving_cpu_s += server.cpu_s

    def stage_context(
        self, stage_index: int, unit: int, training: bool, context: AttentionContext
    ) -> AttentionContext:
        """The unit's KV-cache context, lending attention as the plan says (training forwards
        only: an inference forward has no backward to pair with)."""
        if isinstance(context, SliceAttention):
            self._caches[stage_index] = context.cache
        exchange = self.slice_exchange(stage_index, unit) if training and self.enabled else None
        if exchange is None or not (exchange.forward.lend or exchange.backward.lend):
            return context
        if self.chunks_ahead and not isinstance(context, SliceAttention):
            raise ValueError(
                "context exchange: early KV exchange sends the KV cache's slices, which this "
                f"stage's attention ({type(context).__name__}) does not use; pass "
                "chunks_ahead=False (context parallelism does)"
            )
        return ContextExchangeAttention(context, exchange)

    def after_forward(self, stage_index: int, unit: int, context: AttentionContext) -> None:
        """The forward ran the stage's planned number of attention layers."""
        if isinstance(context, ContextExchangeAttention):
            context.check_forward_done(self.layers_per_stage[stage_index])

    def end_step(self) -> None:
        """Every serving pass of the step was answered in full, every chunk sent ahead went."""
        unanswered = sorted(str(action) for action in self._servers)
        self._servers = {}
        self._chain.clear()
        for posted in self._ahead.values():
            posted.wait()
        self._ahead = {}
        if self.choice is not None:
            self.choice.end_step()
        if unanswered:
            raise RuntimeError(
                f"context exchange: serving actions {unanswered} never ran; the schedule must "
                "keep the actions the exchange adds (pipeline_order_with_comms)"
            )

    def _server_loan(self, peer: int) -> AttentionLoan:
        """The loan a serving thread answers `peer` on (the peer lends to this rank)."""
        here = dist.get_rank(self.group)
        return exchange_loan(peer, here, self.group, self.downward_group, self.timeout)

    def _send_ahead(self, lending: Action) -> None:
        """Post the sends of every layer's lent chunks of `lending` (non-blocking)."""
        assert self.plan is not None, "prepare runs first"
        stage, (microbatch, slice_index) = (
            lending.stage_index,
            unit_microbatch_and_slice(lending.microbatch_index, self.plan.num_slices),
        )
        cache = self._caches[stage]
        layers = cache.layer_slices(microbatch)
        if len(layers) != self.layers_per_stage[stage]:
            raise RuntimeError(
                f"context exchange: stage {stage} cached {len(layers)} attention layers, the plan "
                f"has {self.layers_per_stage[stage]}; give the exchange the stage's real layer "
                "count"
            )
        if lending.computation_type == BACKWARD:
            layers = layers[::-1]
        parts = self._lending[lending]
        peers = {peer for peer, _ in parts}
        for earlier, posted in list(self._ahead.items()):
            if posted.peers & peers:  # that lending pass ran before (placement): its chunks went
                posted.wait()  # returns at once; frees the copies sent
                del self._ahead[earlier]
        here = dist.get_rank(self.group)
        exchange = self._exchanges[stage, lending.microbatch_index]
        works: list[dist.Work] = []
        nbytes = 0
        for peer, kv_slices in parts:
            loan = exchange.loan(here, peer)
            for layer, cached in layers:
                lent = lent_chunks(cache, layer, cached, (microbatch, slice_index), kv_slices)
                nbytes += sum(c.k_BGKD.nbytes + c.v_BGKD.nbytes for c in lent)
                works += send_lent_chunks(loan, lent)
        self._ahead[lending] = _Posted(time.perf_counter(), works, nbytes, frozenset(peers))

    def _lending_started(self, stage: int, unit: int, backward: bool) -> None:
        """A lending pass reached its first attention call: note how long ago its chunks went."""
        action = Action(stage, BACKWARD if backward else FORWARD, unit)
        posted = self._ahead.get(action)
        if posted is not None:
            lead_s = time.perf_counter() - posted.posted_at
            self.ahead_sends.append(AheadSend(action, lead_s, posted.nbytes))


def lent_chunks(
    cache: ChunkedKVCache,
    layer: str,
    cached: Sequence[CachedSlice],
    unit: tuple[int, int],
    kv_slices: Sequence[int],
) -> list[LentChunk]:
    """What slice `unit` (microbatch, slice index) lends of one layer's cached slices
    `kv_slices`: those its pattern lets it see, as the lending attention itself chooses them
    (with token indices when the pattern is not plain causal)."""
    pattern = cache.patterns.get(layer)
    microbatch, slice_index = unit
    tokens = cache.slice_range(cached, slice_index, 0, microbatch)
    with_tokens = not is_causal(pattern)
    return [
        LentChunk(
            c.k_BGSD,
            c.v_BGSD,
            c.document_ids_BS,
            torch.arange(c.start, c.start + c.length) if with_tokens else None,
        )
        for c in (cached[index] for index in kv_slices)
        if block_visible(pattern, tokens.start, len(tokens), c.start, c.length)
    ]


def _retyped(action: Action, kinds: Mapping[ComputationType, ExchangeComputation]) -> Action:
    """The exchange action of `action`'s pass: `kinds[its kind]`, same stage and unit."""
    kind = kinds[action.computation_type]
    return Action(action.stage_index, kind, action.microbatch_index)


def _ahead_sends(
    actions: Sequence[Action],
    lendings: Mapping[Action, Sequence[tuple[int, tuple[int, ...]]]],
    num_slices: int,
) -> list[tuple[int, Action]]:
    """Where each lending pass sends its chunks ahead: right after the later of the forward that
    produced its newest lent slice and the rank's previous lending pass to any of its peers
    (messages to a peer must follow that pass's requests, in the order the peer's serving
    threads read them)."""
    index_of = {action: index for index, action in enumerate(actions)}
    placed = []
    last_lending_to: dict[int, int] = {}
    for index, action in enumerate(actions):
        parts = lendings.get(action)
        if not parts:
            continue
        microbatch, _ = unit_microbatch_and_slice(action.microbatch_index, num_slices)
        newest = max(max(kv_slices) for _, kv_slices in parts)
        produced = index_of[
            Action(action.stage_index, FORWARD, unit_index(microbatch, newest, num_slices))
        ]
        after = max([produced, *(last_lending_to.get(peer, -1) for peer, _ in parts)])
        placed.append((after + 1, _retyped(action, _SEND_AHEAD)))
        for peer, _ in parts:
            last_lending_to[peer] = index
    return placed
