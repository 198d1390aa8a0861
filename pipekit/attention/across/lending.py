"""Attention over KV chunks that another rank computes: the lender's half and the server's.

Context exchange (SlimPipe §4.2) moves part of a heavy rank's attention to a light rank.
Attention has no weights, so the light rank needs nothing but the query and the lent chunks:

- `attention_with_lending` (the lender) sends its query and the lent chunks, computes its own chunks
  meanwhile, receives the lent part's `(out, lse)` and merges both by log-sum-exp. In backward it
  sends the query, the lent chunks, `dO` and the merged `(O, lse)`, computes its own chunks'
  gradients, and receives `dQ` and the lent chunks' `dK`/`dV`: they flow into whatever the lent
  chunks came from (a KV cache's leaves).
- `serve_attention_loan` / `serve_attention_loan_backward` (the server) answer one such request.
  They keep nothing between forward and backward, so the backward may be served by another rank
  than the forward (the exchange plan pairs forward and backward passes independently).

Lent chunks are earlier KV slices: the query attends to all of their keys (within documents when
document ids are given), or, for a layer with another `AttentionPattern`, to the keys the pattern
allows by the tokens' indices (`QueryPositions`; sent along, the server rebuilds the mask). A lender
may lend to several peers at once (`Lending`: which chunks go to which peer). Messages go over
`group` in a fixed order per pair. Sends are non-blocking (posted before the local work, waited on
at the end); a lender posts the receives of all its peers' answers at once, before its local work,
since a gloo or NCCL send may not complete until its receive is posted, and a server waits for its
answer's send. The messages themselves (headers with the shapes and the softmax scale, the lent
chunks, which may also go ahead of the request for early KV exchange) are
`pipekit.attention.across.loan_wire`'s. A server may split its work in two: `receive_loan`, then
`answer_loan`.

The gradients use the ring identity (each chunk's kernel backward with the merged `O` and
`lse`): the `cpu` backend provides `backward_chunk`, and FlexAttention (CUDA) gets one by
differentiating its forward (`AutogradRingBackend`).

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from pipekit.attention.across.loan_wire import (
    AttentionLoan,
    LentChunk,
    QueryPositions,
    ReceivedLoan,
    lent_chunk_mask,
    receive_lent_chunks,
    receive_loan,
    send_lent_chunks,
    send_request,
    wait_all,
)
from pipekit.attention.chunked import KVChunk, ring_backward
from pipekit.attention.kernels.backends import (
    AttentionBackend,
    RingBackend,
    get_backend,
    ring_backend,
    select_backend,
)
from pipekit.attention.masks import MaskMod
from pipekit.attention.merge import check_sinks, merge_attention, sink_gradient
from pipekit.attention.patterns import AttentionPattern, is_causal

__all__ = [
    "AttentionLoan",
    "Lending",
    "LentChunk",
    "LoansInFlight",
    "QueryPositions",
    "ReceivedLoan",
    "answer_loan",
    "attention_with_lending",
    "post_loans",
    "receive_lent_chunks",
    "receive_loan",
    "send_lent_chunks",
    "serve_attention_loan",
    "serve_attention_loan_backward",
]


def _ring_backend_and_scale(
    backend: str | AttentionBackend, scale: float | None, q_BHSD: Tensor, *tensors: Tensor
) -> tuple[RingBackend, float]:
    """The backend, differentiable chunk by chunk (`ring_backend`), and the softmax scale
    (default 1/sqrt(D))."""
    chosen = select_backend(backend, q_BHSD, *tensors) if isinstance(backend, str) else backend
    if backend == "auto" and q_BHSD.device.type == "cpu" and not isinstance(chosen, RingBackend):
        chosen = get_backend("cpu")  # CPU FlexAttention has no backward to serve
    return ring_backend(chosen), 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale


def answer_loan(
    loan: AttentionLoan,
    received: ReceivedLoan,
    backend: str | AttentionBackend = "auto",
) -> None:
    """Compute and send the answer to a received request: forward `(out, lse)` over the lent
    chunks; backward (after receiving `dO`, `O`, lse) `dQ` and each lent chunk's `dK`, `dV`."""
    kind = "backward" if received.backward else "forward"
    with record_function(f"exchange: serve {kind} for rank {loan.peer}"):
        if received.backward:
            _answer_backward(loan, received, backend)
        else:
            _answer_forward(loan, received, backend)


def serve_attention_loan(
    loan: AttentionLoan,
    backend: str | AttentionBackend = "auto",
    chunks_ahead: list[LentChunk] | None = None,
) -> None:
    """Answer one forward request of `loan.peer`: its query's `(out, lse)` over the lent
    chunks (`chunks_ahead`: received before the request, `receive_lent_chunks`)."""
    answer_loan(loan, receive_loan(loan, False, chunks_ahead), backend)


def serve_attention_loan_backward(
    loan: AttentionLoan,
    backend: str | AttentionBackend = "auto",
    chunks_ahead: list[LentChunk] | None = None,
) -> None:
    """Answer one backward request of `loan.peer`: `dQ` and each lent chunk's `dK`, `dV`."""
    answer_loan(loan, receive_loan(loan, True, chunks_ahead), backend)


def _answer_forward(
    loan: AttentionLoan,
    request: ReceivedLoan,
    backend: str | AttentionBackend,
) -> None:
    q_BHSD = request.q_BHSD
    chosen, scale = _ring_backend_and_scale(backend, request.scale, q_BHSD)
    with torch.no_grad():
        partials = [
            chosen.forward_chunk(q_BHSD, c.k_BGKD, c.v_BGKD, c.mask, scale) for c in request.chunks
        ]
        if partials:
            out_BHSD, lse_BHS = merge_attention(partials)
        else:  # every lent chunk lay outside the layer's window: nothing attended
            out_BHSD = torch.zeros_like(q_BHSD)
            lse_BHS = torch.full(q_BHSD.shape[:3], float("-inf"), dtype=_lse_dtype(q_BHSD))
    wait_all(loan.send(out_BHSD, lse_BHS))


def _answer_backward(
    loan: AttentionLoan,
    request: ReceivedLoan,
    backend: str | AttentionBackend,
) -> None:
    q_BHSD = request.q_BHSD
    grad_out_BHSD, out_BHSD = _buffer(q_BHSD), _buffer(q_BHSD)
    lse_BHS = torch.empty(q_BHSD.shape[:3], dtype=_lse_dtype(q_BHSD))
    loan.receive(grad_out_BHSD, out_BHSD, lse_BHS)
    chosen, scale = _ring_backend_and_scale(backend, request.scale, q_BHSD)
    grad_q_BHSD, kv_grads = ring_backward(
        chosen,
        grad_out_BHSD,
        q_BHSD,
        out_BHSD,
        lse_BHS,
        [(c.k_BGKD, c.v_BGKD, c.mask) for c in request.chunks],
        scale,
    )
    wait_all(loan.send(grad_q_BHSD, *kv_grads))


@dataclass(frozen=True)
class Lending:
    """Which lendable chunks each peer computes: `parts` pairs a loan with chunk indices (into
    the lendable chunks, disjoint); the chunks of no part are computed here."""

    parts: tuple[tuple[AttentionLoan, tuple[int, ...]], ...] = ()
    chunks_ahead: bool = False
    """The lent chunks went to the peers before the call (`send_lent_chunks`), so the requests
    carry only the query (early KV exchange)."""

    def kept(self, count: int) -> list[int]:
        """Indices of the lendable chunks this rank computes itself."""
        lent = {index for _, indices in self.parts for index in indices}
        return [index for index in range(count) if index not in lent]

    def restricted(self, visible: Sequence[int]) -> Lending:
        """The same lending over the chunks `visible` (indices into the lendable chunks, in
        order) only: each part keeps its visible chunks, renumbered by position in `visible`,
        and is kept even when none is left (its peer still expects one request)."""
        position = {index: at for at, index in enumerate(visible)}
        parts = tuple(
            (loan, tuple(position[i] for i in indices if i in position))
            for loan, indices in self.parts
        )
        return Lending(parts, self.chunks_ahead)

    def check(self, count: int) -> None:
        indices = [index for _, part in self.parts for index in part]
        if len(set(indices)) != len(indices) or not all(0 <= i < count for i in indices):
            raise ValueError(
                f"lending parts {[list(part) for _, part in self.parts]} must be disjoint "
                f"indices into the {count} lendable chunks"
            )


@dataclass
class LoansInFlight:
    """Requests of one attention call, posted to the peers with the receives of their answers
    (`post_loans`); `collect` waits for the answers."""

    lending: Lending
    sends: list[dist.Work]
    answers: list[list[Tensor]]
    receives: list[list[dist.Work]]

    def collect(self) -> list[list[Tensor]]:
        """Per part of the lending, in order: forward `[out, lse]`; backward `[dQ, dK, dV of
        each lent chunk...]`."""
        peers = ", ".join(str(loan.peer) for loan, _ in self.lending.parts)
        with record_function(f"exchange: wait for answers of rank {peers}"):
            for (loan, _), works in zip(self.lending.parts, self.receives, strict=True):
                loan.wait(works)
            wait_all(self.sends)
        return self.answers


def post_loans(
    lending: Lending,
    q_BHSD: Tensor,
    lendable: Sequence[LentChunk],
    positions: QueryPositions,
    scale: float,
    backward: tuple[Tensor, Tensor, Tensor] | None = None,
) -> LoansInFlight:
    """Send each peer its request (the query, the softmax scale and its lent chunks unless they
    went ahead; in backward also `(dO, O, lse)`, the merged output's) and post the receives of
    every answer, so the peers compute while this rank does its own chunks."""
    sends = []
    for loan, indices in lending.parts:
        lent = [lendable[i] for i in indices]
        request = (positions, scale, backward is not None, lending.chunks_ahead)
        sends += send_request(loan, q_BHSD, lent, *request)
        if backward is not None:
            sends += loan.send(*backward)
    if backward is None:
        lse_BHS = torch.empty(q_BHSD.shape[:3], dtype=_lse_dtype(q_BHSD))
        answers = [[_buffer(q_BHSD), torch.empty_like(lse_BHS)] for _ in lending.parts]
    else:
        answers = [
            [_buffer(q_BHSD), *(_buffer(t) for i in indices for t in _kv(lendable[i]))]
            for _, indices in lending.parts
        ]
    receives = [
        loan.post_receives(*answer)
        for (loan, _), answer in zip(lending.parts, answers, strict=True)
    ]
    return LoansInFlight(lending, sends, answers, receives)


def _kv(chunk: LentChunk) -> tuple[Tensor, Tensor]:
    return chunk.k_BGKD, chunk.v_BGKD


class _LentAttention(torch.autograd.Function):
    """Local chunks here, lent chunks on the peers; merged by LSE. See the module doc."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        backend: RingBackend,
        scale: float,
        local_masks: tuple,
        lendings: tuple[Lending, Lending],
        positions: tuple[QueryPositions, tuple[_ChunkPositions, ...]],
        num_local: int,
        sinks_H: Tensor | None,
        q_BHSD: Tensor,
        *kv_tensors: Tensor,
    ) -> tuple[Tensor, Tensor]:
        forward, _ = lendings
        query, lendable_positions = positions
        local_kv, lendable_kv = kv_tensors[: 2 * num_local], kv_tensors[2 * num_local :]
        lendable = _lent_chunks(lendable_kv, lendable_positions)
        loans = post_loans(forward, q_BHSD, lendable, query, scale)
        here = list(zip(local_kv[0::2], local_kv[1::2], local_masks, strict=True))
        here += [_with_mask(query, lendable[i]) for i in forward.kept(len(lendable))]
        partials = [backend.forward_chunk(q_BHSD, k, v, mask, scale) for k, v, mask in here]
        partials += [(out, lse) for out, lse in loans.collect()]
        out_BHSD, lse_BHS = merge_attention(partials, sinks_H)
        ctx.backend, ctx.scale, ctx.local_masks = backend, scale, local_masks
        ctx.sinks_H = sinks_H
        ctx.lendings, ctx.positions, ctx.num_local = lendings, positions, num_local
        ctx.save_for_backward(q_BHSD, out_BHSD, lse_BHS, *kv_tensors)
        ctx.mark_non_differentiable(lse_BHS)
        return out_BHSD, lse_BHS

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out_BHSD: Tensor, _grad_lse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q_BHSD, out_BHSD, lse_BHS, *kv_tensors = ctx.saved_tensors
        _, backward = ctx.lendings
        query, lendable_positions = ctx.positions
        local_kv, lendable_kv = kv_tensors[: 2 * ctx.num_local], kv_tensors[2 * ctx.num_local :]
        lendable = _lent_chunks(lendable_kv, lendable_positions)
        merged = (grad_out_BHSD, out_BHSD, lse_BHS)
        loans = post_loans(backward, q_BHSD, lendable, query, ctx.scale, merged)
        kept = backward.kept(len(lendable))
        here = list(zip(local_kv[0::2], local_kv[1::2], ctx.local_masks, strict=True))
        here += [_with_mask(query, lendable[i]) for i in kept]
        grad_q_BHSD, here_grads = ring_backward(
            ctx.backend, grad_out_BHSD, q_BHSD, out_BHSD, lse_BHS, here, ctx.scale
        )
        local_grads = here_grads[: 2 * ctx.num_local]
        lendable_grads: list[Tensor | None] = [None] * len(lendable_kv)
        for position, index in enumerate(kept):
            pair = here_grads[2 * (ctx.num_local + position) : 2 * (ctx.num_local + position + 1)]
            lendable_grads[2 * index : 2 * index + 2] = pair
        for (_, indices), remote in zip(backward.parts, loans.collect(), strict=True):
            grad_q_BHSD += remote[0]
            for position, index in enumerate(indices):
                lendable_grads[2 * index : 2 * index + 2] = remote[
                    1 + 2 * position : 3 + 2 * position
                ]
        grad_sinks = None
        if ctx.sinks_H is not None and ctx.needs_input_grad[6]:
            grad_sinks = sink_gradient(grad_out_BHSD, out_BHSD, lse_BHS, ctx.sinks_H)
        return (
            None, None, None, None, None, None, grad_sinks, grad_q_BHSD, *local_grads,
            *lendable_grads,
        )  # fmt: skip


def _buffer(like: Tensor) -> Tensor:
    """A contiguous receive buffer shaped like `like` (which may be a strided view)."""
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _lse_dtype(q_BHSD: Tensor) -> torch.dtype:
    return torch.promote_types(q_BHSD.dtype, torch.float32)


_ChunkPositions = tuple[Tensor | None, Tensor | None]
"""A lendable chunk's (document ids, token indices)."""


def _lent_chunks(
    lent_kv: Sequence[Tensor], positions: Sequence[_ChunkPositions]
) -> list[LentChunk]:
    """The lendable chunks from the tensors autograd hands back and their positions."""
    pairs = zip(lent_kv[0::2], lent_kv[1::2], positions, strict=True)
    return [LentChunk(k, v, documents, tokens) for k, v, (documents, tokens) in pairs]


def _with_mask(query: QueryPositions, chunk: LentChunk) -> tuple[Tensor, Tensor, MaskMod | None]:
    """A lendable chunk computed here: its keys, values and the query's mask against it."""
    mask = lent_chunk_mask(chunk, query.document_ids_BS, query.tokens_S, query.pattern)
    return chunk.k_BGKD, chunk.v_BGKD, mask


def attention_with_lending(
    q_BHSD: Tensor,
    local_chunks: Sequence[KVChunk],
    lendable_chunks: Sequence[LentChunk],
    forward: Lending,
    backward: Lending | None = None,
    *,
    q_document_ids_BS: Tensor | None = None,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    q_tokens_S: Tensor | None = None,
    pattern: AttentionPattern | None = None,
    sinks_H: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over `local_chunks` and `lendable_chunks` (and the attention sinks
    `sinks_H`, if given, counted here): `(out_BHSD, lse_BHS)`.

    `forward` says which lendable chunks which peer computes (each peer calls
    `serve_attention_loan`), `backward` the same for the gradients (the peers call
    `serve_attention_loan_backward`; default: nothing lent). Gradients flow to `q`, the local
    and the lendable chunks alike. `q_document_ids_BS` (with each lendable chunk's ids)
    restricts the lendable chunks to the query's documents. A non-causal `pattern` needs each
    query's token index (`q_tokens_S`) and each lendable chunk's (`LentChunk.tokens_K`).
    """
    backward = backward or Lending()
    if not lendable_chunks and not (forward.parts or backward.parts):
        raise ValueError("attention_with_lending needs lendable chunks; use attention_over_chunks")
    if lendable_chunks and (q_document_ids_BS is None) != (
        lendable_chunks[0].document_ids_BK is None
    ):
        raise ValueError("give document ids for the query exactly when the lent chunks have them")
    if not is_causal(pattern) and (
        q_tokens_S is None or any(c.tokens_K is None for c in lendable_chunks)
    ):
        raise ValueError(
            f"attention_with_lending: {pattern} needs the query's and every lendable chunk's "
            "token indices (q_tokens_S, LentChunk.tokens_K)"
        )
    for lending in (forward, backward):
        lending.check(len(lendable_chunks))
    check_sinks(sinks_H, q_BHSD)
    kv_tensors = [t for c in local_chunks for t in (c.k_BGKD, c.v_BGKD)]
    kv_tensors += [t for c in lendable_chunks for t in (c.k_BGKD, c.v_BGKD)]
    backend, scale = _ring_backend_and_scale(backend, scale, q_BHSD, *kv_tensors)
    query = QueryPositions(q_document_ids_BS, q_tokens_S, pattern)
    return _LentAttention.apply(
        backend,
        scale,
        tuple(chunk.mask for chunk in local_chunks),
        (forward, backward),
        (query, tuple((c.document_ids_BK, c.tokens_K) for c in lendable_chunks)),
        len(local_chunks),
        sinks_H,
        q_BHSD,
        *kv_tensors,
    )
