"""`ContextExchangeAttention`: one slice's attention when its pass lends attention.

In a sliced pipeline with context exchange (SlimPipe §4.2) a heavy pass lends part of its
attention to a pass that runs at the same time on a light rank, and the light pass serves it
(`pipekit.pipelining.features.exchange_plan` decides who, `pipekit.attention.across.lending` moves
the data, `pipekit.attention.across.loan_server` answers).
This context lends for one slice on one stage, layer by layer: each layer's query attends to the
slice's own chunk here and to its earlier KV slices (from the chunked KV cache). The forward pass
lends some of them to its peers, and the forward records what the slice's backward pass lends, so
the gradients of lent chunks come back from the peers and collect on the cache's leaves like
local ones. With early KV exchange the lent chunks went to the peers before the pass, and each
layer sends only its query.

Activation checkpointing recomputes a layer's forward inside the backward: the recompute does not
lend forward work again (that was done), but records the backward's lending.

Legend: B batch, H query heads, G kv heads, S slice length, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.lending import Lending, LentChunk, attention_with_lending
from pipekit.attention.across.loan_server import LoanRequest
from pipekit.attention.across.loan_wire import DEFAULT_LOAN_TIMEOUT, AttentionLoan
from pipekit.attention.chunked import KVChunk
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.kv_cache import CachedSlice, SliceAttention
from pipekit.attention.patterns import AttentionPattern, is_causal

__all__ = [
    "ContextExchangeAttention",
    "LendingAttention",
    "PassExchange",
    "SliceExchange",
    "exchange_loan",
    "lent_over_cache",
]

Backend = str | AttentionBackend


class LendingAttention(Protocol):
    """The slice attention an exchange wraps besides the plain KV cache's (`SliceAttention`,
    which lends by `lent_over_cache`): its context-parallel form, which lends the rank's share
    of each earlier slice for every cp rank's queries."""

    recomputing: bool
    backend: Backend

    def chunks(
        self,
        layer_id: str,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        pattern: AttentionPattern | None = None,
    ) -> tuple[list[CachedSlice], KVChunk]: ...

    def attention(
        self,
        q_BHSD: Tensor,
        earlier: list[CachedSlice],
        own: KVChunk,
        scale: float,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> Tensor: ...

    def visible_indices(
        self, earlier: list[CachedSlice], pattern: AttentionPattern | None
    ) -> list[int]: ...

    def lent_attention(
        self,
        q_BHSD: Tensor,
        lendable: list[LentChunk],
        own: KVChunk,
        lendings: tuple[Lending, Lending],
        scale: float,
        pattern: AttentionPattern | None = None,
        lendable_slices: Sequence[CachedSlice] = (),
        sinks_H: Tensor | None = None,
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
    """A slice's forward and backward exchange on one stage. A lending to a higher rank travels
    on `group`, one to a lower rank on `downward_group` (the same ranks, a group of its own;
    None: `group`), so a rank that lends to a peer while its helper threads still serve that
    peer never mixes the two exchanges' messages. Ranks are ranks of `group`.

    `chunks_ahead`: the lent chunks went to the peers before the pass (early KV exchange), so
    the requests carry only the query. `lending_started(backward)` is called at a lending
    pass's first attention call. `drop_remote_kv_grads` exists for the ablation test only: lent
    chunks then get no gradient back, which must break parity."""

    forward: PassExchange
    backward: PassExchange
    group: dist.ProcessGroup | None = None
    downward_group: dist.ProcessGroup | None = None
    timeout: timedelta = DEFAULT_LOAN_TIMEOUT
    chunks_ahead: bool = False
    lending_started: Callable[[bool], None] | None = None
    drop_remote_kv_grads: bool = False

    def loan(self, lender: int, server: int) -> AttentionLoan:
        """The loan between the two ranks for a lending from `lender` to `server`, as this rank
        (one of them) sees it."""
        return exchange_loan(lender, server, self.group, self.downward_group, self.timeout)

    def lending(self, parts: tuple[tuple[int, tuple[int, ...]], ...]) -> Lending:
        here = dist.get_rank(self.group)
        loans = tuple((self.loan(here, peer), kv_slices) for peer, kv_slices in parts)
        return Lending(loans, self.chunks_ahead)


def exchange_loan(
    lender: int,
    server: int,
    group: dist.ProcessGroup | None,
    downward_group: dist.ProcessGroup | None,
    timeout: timedelta = DEFAULT_LOAN_TIMEOUT,
) -> AttentionLoan:
    """The loan between two ranks of `group` for a lending from `lender` to `server`, as this
    rank (one of the two) sees it: on `downward_group` when the server is the lower rank."""
    peer = server if dist.get_rank(group) == lender else lender
    downward = server < lender and downward_group is not None
    return AttentionLoan(peer, downward_group if downward else group, timeout)


def _layer_count_error(ran: int, planned: int) -> RuntimeError:
    """A pass ran other than the planned number of attention layers (its peers would hang)."""
    return RuntimeError(
        f"context exchange: the forward ran {ran} attention layers, the plan has {planned}; give "
        "the exchange the stage's real layer count"
    )


class _NotifyInBackward(torch.autograd.Function):
    """Identity on a layer's attention output; its backward calls `notify` (the first such call
    is the backward pass's first attention layer)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, out_BHSD: Tensor, notify: Callable[[], None]
    ) -> Tensor:
        ctx.notify = notify
        return out_BHSD.view_as(out_BHSD)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out_BHSD: Tensor
    ) -> tuple[Tensor, None]:
        ctx.notify()
        return grad_out_BHSD, None


class _DropGradient(torch.autograd.Function):
    """Identity whose backward gives zero (the ablation of the remote dK/dV)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        return torch.zeros_like(grad)


def lent_over_cache(
    sliced: SliceAttention,
    q_BHSD: Tensor,
    lendable: list[LentChunk],
    own: KVChunk,
    lendings: tuple[Lending, Lending],
    scale: float,
    pattern: AttentionPattern | None = None,
    lendable_slices: Sequence[CachedSlice] = (),
    sinks_H: Tensor | None = None,
) -> Tensor:
    """A plain KV cache's attention (`sliced`) with some earlier slices (`lendable`, cached as
    `lendable_slices`) computed by pipeline peers: `lendings` says which, in forward and in
    backward."""
    q_tokens_S = None
    if not is_causal(pattern):  # the peers mask by token indices
        device, tokens = q_BHSD.device, sliced.token_range
        q_tokens_S = torch.arange(tokens.start, tokens.stop, device=device)
        lendable = [
            replace(chunk, tokens_K=torch.arange(c.start, c.start + c.length, device=device))
            for chunk, c in zip(lendable, lendable_slices, strict=True)
        ]
    return attention_with_lending(
        q_BHSD,
        [own],
        lendable,
        *lendings,
        q_document_ids_BS=sliced.document_ids_BS,
        scale=scale,
        backend=sliced.cache.backend,
        q_tokens_S=q_tokens_S,
        pattern=pattern,
        sinks_H=sinks_H,
    )[0]


class ContextExchangeAttention:
    """AttentionContext of one slice whose forward or backward pass lends attention (see the
    module doc); otherwise it attends exactly as its `SliceAttention`."""

    def __init__(
        self, slice_attention: SliceAttention | LendingAttention, exchange: SliceExchange
    ) -> None:
        self.slice_attention, self.exchange = slice_attention, exchange
        self._lent_attention: Callable[..., Tensor] = (
            functools.partial(lent_over_cache, slice_attention)
            if isinstance(slice_attention, SliceAttention)
            else slice_attention.lent_attention
        )
        self.forward_calls = 0
        self._backward_lending_started = False

    def __repr__(self) -> str:
        return f"ContextExchangeAttention({self.slice_attention!r})"

    def attend(
        self,
        layer_id: str,
        q_BHSD: Tensor,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        scale: float,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> Tensor:
        """The slice's attention output, lending what the plan gives the pass."""
        sliced, exchange = self.slice_attention, self.exchange
        earlier, own = sliced.chunks(layer_id, k_BGSD, v_BGSD, pattern)
        recomputing = sliced.recomputing
        records_backward = torch.is_grad_enabled() and q_BHSD.requires_grad
        lend_forward = () if recomputing else exchange.forward.lend
        lend_backward = exchange.backward.lend if records_backward else ()
        if lend_forward and self.forward_calls == 0 and exchange.lending_started is not None:
            exchange.lending_started(False)
        # A recompute takes the same path as the forward it repeats, lent or not: activation
        # checkpointing hands its tensors to the original autograd node by position.
        if exchange.forward.lend or lend_backward:
            # only slices the layer's pattern lets the slice see are lent (or computed here);
            # a peer whose lent slices all lie outside gets an empty request
            visible = sliced.visible_indices(earlier, pattern)
            lendable = [self._lendable(index, earlier[index], lend_backward) for index in visible]
            lendings = (
                exchange.lending(lend_forward).restricted(visible),
                exchange.lending(lend_backward).restricted(visible),
            )
            lendable_slices = [earlier[index] for index in visible]
            out_BHSD = self._lent_attention(
                q_BHSD, lendable, own, lendings, scale, pattern, lendable_slices, sinks_H
            )
        else:
            out_BHSD = sliced.attention(q_BHSD, earlier, own, scale, pattern, sinks_H)
        if not recomputing:
            self.forward_calls += 1
        if lend_backward and exchange.lending_started is not None:
            out_BHSD = _NotifyInBackward.apply(out_BHSD, self._backward_lending)
        return out_BHSD

    def _backward_lending(self) -> None:
        if not self._backward_lending_started:
            self._backward_lending_started = True
            assert self.exchange.lending_started is not None
            self.exchange.lending_started(True)

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
