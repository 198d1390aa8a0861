"""`ContextExchangeAttention`: one slice's attention when its pass lends or serves attention.

In a sliced pipeline with context exchange (SlimPipe §4.2) a heavy pass lends part of its
attention to a pass that runs at the same time on a light rank, and the light pass serves it
(`pipekit.pipelining.features.exchange_plan` decides who, `pipekit.attention.exchange` moves
the data).
This context does both for one slice on one stage, layer by layer:

- **Lending.** Each layer's query attends to the slice's own chunk here and to its earlier KV
  slices (from the chunked KV cache): the forward pass lends some of them to its peers, and the
  forward records what the slice's backward pass lends, so the gradients of lent chunks come back
  from the peers and collect on the cache's leaves like local ones.
- **Serving.** A serving pass answers the requests the plan gave it with a `LoanServer`, whose
  helper threads start at the pass's first attention call (in a forward pass after its own
  attention; in a backward pass from an identity on the attention output, whose backward runs
  when the gradient reaches that layer) and answer each request as it arrives, beside the pass's
  own work. The schedule's serving action waits for the last answer before the rank's next pass
  that lends or serves. A request is a forward or a backward one as the lending pass is,
  whichever kind the serving pass is: the plan pairs passes of both kinds.

Activation checkpointing recomputes a layer's forward inside the backward: the recompute neither
lends nor serves forward work (that was done), but records the backward's lending and serving.

Legend: B batch, H query heads, G kv heads, S slice length, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.backends import AttentionBackend
from pipekit.attention.chunked import KVChunk
from pipekit.attention.exchange import DEFAULT_LOAN_TIMEOUT, AttentionLoan, Lending, LentChunk
from pipekit.attention.kv_cache import CachedSlice
from pipekit.attention.loan_server import LoanRequest, LoanServer

__all__ = [
    "ContextExchangeAttention",
    "LendingAttention",
    "PassExchange",
    "SliceExchange",
]

Backend = str | AttentionBackend


class LendingAttention(Protocol):
    """The slice attention an exchange wraps: `SliceAttention` (the KV cache), or its context
    parallel form, which lends the rank's share of each earlier slice for every cp rank's
    queries."""

    recomputing: bool
    backend: Backend

    def chunks(
        self, layer_id: str, k_BGSD: Tensor, v_BGSD: Tensor
    ) -> tuple[list[CachedSlice], KVChunk]: ...

    def attention(
        self, q_BHSD: Tensor, earlier: list[CachedSlice], own: KVChunk, scale: float
    ) -> Tensor: ...

    def lent_attention(
        self,
        q_BHSD: Tensor,
        lendable: list[LentChunk],
        own: KVChunk,
        lendings: tuple[Lending, Lending],
        scale: float,
    ) -> Tensor: ...


@dataclass(frozen=True)
class PassExchange:
    """What one pass (a slice's forward or backward on one stage) lends and serves.

    `lend`: `(peer, earlier KV slices)` per peer, in message order, at every attention call.
    `serve`: the requests it answers, each peer's in the order the peer sends them (one per
    attention layer of the lending pass).
    """

    lend: tuple[tuple[int, tuple[int, ...]], ...] = ()
    serve: tuple[LoanRequest, ...] = ()


@dataclass(frozen=True)
class SliceExchange:
    """A slice's forward and backward exchange on one stage, over `group` (ranks are ranks of
    it). `drop_remote_kv_grads` exists for the ablation test only: lent chunks then get no
    gradient back, which must break parity."""

    forward: PassExchange
    backward: PassExchange
    group: dist.ProcessGroup | None = None
    timeout: timedelta = DEFAULT_LOAN_TIMEOUT
    drop_remote_kv_grads: bool = False

    def loan(self, peer: int) -> AttentionLoan:
        return AttentionLoan(peer, self.group, self.timeout)

    def lending(self, parts: tuple[tuple[int, tuple[int, ...]], ...]) -> Lending:
        return Lending(tuple((self.loan(peer), kv_slices) for peer, kv_slices in parts))

    def server(self, serve: tuple[LoanRequest, ...], backend: Backend) -> LoanServer | None:
        """A pass's `LoanServer` (None: the pass serves nothing)."""
        return LoanServer(serve, self.loan, backend) if serve else None


def _layer_count_error(ran: int, planned: int) -> RuntimeError:
    """A pass ran other than the planned number of attention layers (its peers would hang)."""
    return RuntimeError(
        f"context exchange: the forward ran {ran} attention layers, the plan has {planned}; give "
        "the exchange the stage's real layer count"
    )


class _ServeInBackward(torch.autograd.Function):
    """Identity on a layer's attention output; its backward starts the pass's serving (the
    first call a backward pass reaches)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        out_BHSD: Tensor,
        server: LoanServer,
        scale: float,
    ) -> Tensor:
        ctx.server, ctx.scale = server, scale
        return out_BHSD.view_as(out_BHSD)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out_BHSD: Tensor
    ) -> tuple[Tensor, None, None]:
        ctx.server.start(ctx.scale)
        return grad_out_BHSD, None, None


class _DropGradient(torch.autograd.Function):
    """Identity whose backward gives zero (the ablation of the remote dK/dV)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        return torch.zeros_like(grad)


class ContextExchangeAttention:
    """AttentionContext of one slice whose forward or backward pass lends or serves attention
    (see the module doc); otherwise it attends exactly as its `SliceAttention`."""

    def __init__(self, slice_attention: LendingAttention, exchange: SliceExchange) -> None:
        self.slice_attention, self.exchange = slice_attention, exchange
        self.forward_calls = 0
        backend = slice_attention.backend
        self.forward_server = exchange.server(exchange.forward.serve, backend)
        self.backward_server = exchange.server(exchange.backward.serve, backend)
        """What the forward and the backward pass serve (None: nothing); the schedule's serving
        actions wait for their last answers."""

    def __repr__(self) -> str:
        return f"ContextExchangeAttention({self.slice_attention!r})"

    def attend(
        self, layer_id: str, q_BHSD: Tensor, k_BGSD: Tensor, v_BGSD: Tensor, scale: float
    ) -> Tensor:
        """The slice's attention output; lends what the plan gives the pass and answers the
        requests waiting."""
        sliced, exchange = self.slice_attention, self.exchange
        earlier, own = sliced.chunks(layer_id, k_BGSD, v_BGSD)
        recomputing = sliced.recomputing
        records_backward = torch.is_grad_enabled() and q_BHSD.requires_grad
        lend_forward = () if recomputing else exchange.forward.lend
        lend_backward = exchange.backward.lend if records_backward else ()
        # A recompute takes the same path as the forward it repeats, lent or not: activation
        # checkpointing hands its tensors to the original autograd node by position.
        if exchange.forward.lend or lend_backward:
            lendable = [
                self._lendable(index, cached, lend_backward) for index, cached in enumerate(earlier)
            ]
            lendings = (exchange.lending(lend_forward), exchange.lending(lend_backward))
            out_BHSD = sliced.lent_attention(q_BHSD, lendable, own, lendings, scale)
        else:
            out_BHSD = sliced.attention(q_BHSD, earlier, own, scale)
        if not recomputing:
            self.forward_calls += 1
            if self.forward_server is not None:
                self.forward_server.start(scale)
        if records_backward and self.backward_server is not None:
            out_BHSD = _ServeInBackward.apply(out_BHSD, self.backward_server, scale)
        return out_BHSD

    def check_forward_done(self, layers: int) -> None:
        """After the slice's forward: it ran the stage's `layers` attention layers, as the plan
        has it (a lender sends, and a server is sent, one request per layer: a count that
        differs would leave a peer waiting)."""
        if self.forward_calls != layers:
            raise _layer_count_error(self.forward_calls, layers)

    def _lendable(
        self,
        index: int,
        cached: CachedSlice,
        lend_backward: tuple[tuple[int, tuple[int, ...]], ...],
    ) -> LentChunk:
        """Earlier slice `index` as a lendable chunk (its gradient dropped for the ablation when
        the backward lends it)."""
        k_BGSD, v_BGSD = cached.k_BGSD, cached.v_BGSD
        lent_in_backward = any(index in kv_slices for _, kv_slices in lend_backward)
        if self.exchange.drop_remote_kv_grads and lent_in_backward:
            k_BGSD, v_BGSD = _DropGradient.apply(k_BGSD), _DropGradient.apply(v_BGSD)
        return LentChunk(k_BGSD, v_BGSD, cached.document_ids_BS)
