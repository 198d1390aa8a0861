"""Attention over KV chunks that another rank computes: the lender's half and the server's.

Context exchange (SlimPipe §4.2) moves part of a heavy rank's attention to a light rank.
Attention has no weights, so the light rank needs nothing but the query and the lent chunks:

- `attention_with_loan` (the lender) sends its query and the lent chunks, computes its own chunks
  meanwhile, receives the lent part's `(out, lse)` and merges both by log-sum-exp. In backward it
  sends the query, the lent chunks, `dO` and the merged `(O, lse)`, computes its own chunks'
  gradients, and receives `dQ` and the lent chunks' `dK`/`dV`: they flow into whatever the lent
  chunks came from (a KV cache's leaves).
- `serve_attention_loan` / `serve_attention_loan_backward` (the server) answer one such request.
  They keep nothing between forward and backward, so the backward may be served by another rank
  than the forward (the exchange plan pairs forward and backward passes independently).

Lent chunks are earlier KV slices: the query attends to all of their keys, or within documents
when document ids are given (sent along; the server rebuilds the mask). Messages go over `group`
with plain sends and receives in a fixed order; a small header first carries the shapes, so the
server needs no prior knowledge. The gradients use the ring identity (each chunk's kernel
backward with the merged `O` and `lse`), so the backend must provide `backward_chunk` (the `cpu`
backend does; FlexAttention's lse-with-gradient path does not yet).

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.backends import AttentionBackend, RingBackend, select_backend
from pipekit.attention.chunked import KVChunk, ring_backward
from pipekit.attention.masks import MaskMod, documents_or_all
from pipekit.attention.merge import merge_attention

__all__ = [
    "AttentionLoan",
    "LentChunk",
    "attention_with_loan",
    "serve_attention_loan",
    "serve_attention_loan_backward",
]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LentChunk:
    """Keys and values of an earlier KV slice, and its document ids (None: attend to all)."""

    k_BGKD: Tensor
    v_BGKD: Tensor
    document_ids_BK: Tensor | None = None


@dataclass(frozen=True)
class AttentionLoan:
    """Rank `peer` of `group` computes the lent part of this query's attention."""

    peer: int
    group: dist.ProcessGroup | None = None

    def send(self, *tensors: Tensor) -> None:
        for tensor in tensors:
            dist.send(tensor.contiguous(), group=self.group, group_dst=self.peer)

    def receive(self, *tensors: Tensor) -> None:
        for tensor in tensors:
            dist.recv(tensor, group=self.group, group_src=self.peer)


def _ring_backend(backend: str | AttentionBackend, *tensors: Tensor) -> RingBackend:
    chosen = select_backend(backend, *tensors) if isinstance(backend, str) else backend
    if not hasattr(chosen, "backward_chunk"):
        raise TypeError(
            f"attention backend {chosen.name!r} has no backward_chunk; lending attention needs "
            "one (use the 'cpu' backend)"
        )
    return chosen


def _header(q_BHSD: Tensor, lent: Sequence[LentChunk], documents: bool, backward: bool) -> Tensor:
    """[backward, dtype, B, H, S, D, G, documents, chunks, K_1..K_c]."""
    batch, heads, queries, head_dim = q_BHSD.shape
    kv_heads = lent[0].k_BGKD.shape[1]
    keys = [chunk.k_BGKD.shape[2] for chunk in lent]
    fields = [backward, _DTYPES.index(q_BHSD.dtype), batch, heads, queries, head_dim, kv_heads]
    return torch.tensor([*fields, documents, len(lent), *keys], dtype=torch.long)


def _send_request(
    loan: AttentionLoan,
    q_BHSD: Tensor,
    lent: Sequence[LentChunk],
    q_document_ids_BS: Tensor | None,
    backward: bool,
) -> None:
    header = _header(q_BHSD, lent, q_document_ids_BS is not None, backward)
    loan.send(torch.tensor([header.numel()]), header, q_BHSD)
    for chunk in lent:
        loan.send(chunk.k_BGKD, chunk.v_BGKD)
        if q_document_ids_BS is not None:
            loan.send(chunk.document_ids_BK)
    if q_document_ids_BS is not None:
        loan.send(q_document_ids_BS)


@dataclass
class _Request:
    q_BHSD: Tensor
    chunks: list[KVChunk]


def _receive_request(loan: AttentionLoan, backward: bool) -> _Request:
    size = torch.empty(1, dtype=torch.long)
    loan.receive(size)
    header = torch.empty(int(size), dtype=torch.long)
    loan.receive(header)
    is_backward, dtype_index, batch, heads, queries, head_dim, kv_heads, documents, count = (
        int(x) for x in header[:9]
    )
    if bool(is_backward) != backward:
        raise RuntimeError(
            f"attention loan: a {'backward' if is_backward else 'forward'} request arrived where "
            f"a {'backward' if backward else 'forward'} one was expected; the two ranks' plans "
            "disagree"
        )
    dtype = _DTYPES[dtype_index]
    q_BHSD = torch.empty(batch, heads, queries, head_dim, dtype=dtype)
    loan.receive(q_BHSD)
    kv, kv_docs = [], []
    for keys in header[9 : 9 + count].tolist():
        k_BGKD, v_BGKD = (torch.empty(batch, kv_heads, keys, head_dim, dtype=dtype) for _ in "kv")
        loan.receive(k_BGKD, v_BGKD)
        kv.append((k_BGKD, v_BGKD))
        if documents:
            kv_docs.append(torch.empty(batch, keys, dtype=torch.long))
            loan.receive(kv_docs[-1])
    q_docs = None
    if documents:
        q_docs = torch.empty(batch, queries, dtype=torch.long)
        loan.receive(q_docs)
    chunks = [
        KVChunk(k, v, documents_or_all(q_docs, kv_docs[i] if documents else None))
        for i, (k, v) in enumerate(kv)
    ]
    return _Request(q_BHSD, chunks)


def serve_attention_loan(
    peer: int,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
) -> None:
    """Answer one forward request of `peer`: its query's `(out, lse)` over the lent chunks."""
    loan = AttentionLoan(peer, group)
    request = _receive_request(loan, backward=False)
    chosen = _ring_backend(backend, request.q_BHSD)
    scale = 1.0 / math.sqrt(request.q_BHSD.shape[-1]) if scale is None else scale
    with torch.no_grad():
        out_BHSD, lse_BHS = merge_attention(
            [
                chosen.forward_chunk(request.q_BHSD, c.k_BGKD, c.v_BGKD, c.mask, scale)
                for c in request.chunks
            ]
        )
    loan.send(out_BHSD, lse_BHS)


def serve_attention_loan_backward(
    peer: int,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
) -> None:
    """Answer one backward request of `peer`: `dQ` and each lent chunk's `dK`, `dV`."""
    loan = AttentionLoan(peer, group)
    request = _receive_request(loan, backward=True)
    q_BHSD = request.q_BHSD
    grad_out_BHSD, out_BHSD = torch.empty_like(q_BHSD), torch.empty_like(q_BHSD)
    lse_BHS = torch.empty(q_BHSD.shape[:3], dtype=torch.promote_types(q_BHSD.dtype, torch.float32))
    loan.receive(grad_out_BHSD, out_BHSD, lse_BHS)
    chosen = _ring_backend(backend, q_BHSD)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    grad_q_BHSD, kv_grads = ring_backward(
        chosen,
        grad_out_BHSD,
        q_BHSD,
        out_BHSD,
        lse_BHS,
        [(c.k_BGKD, c.v_BGKD, c.mask) for c in request.chunks],
        scale,
    )
    loan.send(grad_q_BHSD, *kv_grads)


class _LentAttention(torch.autograd.Function):
    """Local chunks here, lent chunks on the loan's peer; merged by LSE. See the module doc."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        backend: RingBackend,
        scale: float,
        local_masks: tuple,
        loans: tuple[AttentionLoan | None, AttentionLoan | None],
        documents: tuple[Tensor | None, tuple[Tensor | None, ...]],
        num_local: int,
        q_BHSD: Tensor,
        *kv_tensors: Tensor,
    ) -> tuple[Tensor, Tensor]:
        forward_loan, _ = loans
        q_docs, lent_docs = documents
        local_kv, lent_kv = kv_tensors[: 2 * num_local], kv_tensors[2 * num_local :]
        lent = _lent_chunks(lent_kv, lent_docs)
        partials = []
        if forward_loan is not None:
            _send_request(forward_loan, q_BHSD, lent, q_docs, backward=False)
        partials += [
            backend.forward_chunk(q_BHSD, k, v, mask, scale)
            for k, v, mask in zip(local_kv[0::2], local_kv[1::2], local_masks, strict=True)
        ]
        if forward_loan is not None:
            out_r = torch.empty_like(q_BHSD)
            lse_r = torch.empty(partials[0][1].shape, dtype=partials[0][1].dtype)
            forward_loan.receive(out_r, lse_r)
            partials.append((out_r, lse_r))
        else:
            partials += [
                backend.forward_chunk(q_BHSD, c.k_BGKD, c.v_BGKD, _lent_mask(q_docs, c), scale)
                for c in lent
            ]
        out_BHSD, lse_BHS = merge_attention(partials)
        ctx.backend, ctx.scale, ctx.local_masks = backend, scale, local_masks
        ctx.loans, ctx.documents, ctx.num_local = loans, documents, num_local
        ctx.save_for_backward(q_BHSD, out_BHSD, lse_BHS, *kv_tensors)
        ctx.mark_non_differentiable(lse_BHS)
        return out_BHSD, lse_BHS

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out_BHSD: Tensor, _grad_lse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q_BHSD, out_BHSD, lse_BHS, *kv_tensors = ctx.saved_tensors
        _, backward_loan = ctx.loans
        q_docs, lent_docs = ctx.documents
        local_kv, lent_kv = kv_tensors[: 2 * ctx.num_local], kv_tensors[2 * ctx.num_local :]
        lent = _lent_chunks(lent_kv, lent_docs)
        if backward_loan is not None:
            _send_request(backward_loan, q_BHSD, lent, q_docs, backward=True)
            backward_loan.send(grad_out_BHSD, out_BHSD, lse_BHS)
        here = list(zip(local_kv[0::2], local_kv[1::2], ctx.local_masks, strict=True))
        if backward_loan is None:
            here += [(c.k_BGKD, c.v_BGKD, _lent_mask(q_docs, c)) for c in lent]
        grad_q_BHSD, kv_grads = ring_backward(
            ctx.backend, grad_out_BHSD, q_BHSD, out_BHSD, lse_BHS, here, ctx.scale
        )
        if backward_loan is not None:
            remote = [torch.empty_like(q_BHSD), *(torch.empty_like(t) for t in lent_kv)]
            backward_loan.receive(*remote)
            grad_q_BHSD += remote[0]
            kv_grads += remote[1:]
        return None, None, None, None, None, None, grad_q_BHSD, *kv_grads


def _lent_chunks(lent_kv: Sequence[Tensor], docs: Sequence[Tensor | None]) -> list[LentChunk]:
    return [LentChunk(k, v, d) for k, v, d in zip(lent_kv[0::2], lent_kv[1::2], docs, strict=True)]


def _lent_mask(q_docs_BS: Tensor | None, chunk: LentChunk) -> MaskMod | None:
    return documents_or_all(q_docs_BS, chunk.document_ids_BK)


def attention_with_loan(
    q_BHSD: Tensor,
    local_chunks: Sequence[KVChunk],
    lent_chunks: Sequence[LentChunk],
    forward_loan: AttentionLoan | None,
    backward_loan: AttentionLoan | None = None,
    *,
    q_document_ids_BS: Tensor | None = None,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over `local_chunks` and `lent_chunks`: `(out_BHSD, lse_BHS)`.

    The lent chunks' part is computed by `forward_loan.peer` (which calls
    `serve_attention_loan`) and, in backward, by `backward_loan.peer` (which calls
    `serve_attention_loan_backward`); a None loan computes them here. Gradients flow to `q`,
    the local chunks and the lent chunks alike. `q_document_ids_BS` (with each lent chunk's
    ids) restricts the lent part to the query's documents.
    """
    if not lent_chunks:
        raise ValueError(
            "attention_with_loan needs at least one lent chunk; use attention_over_chunks"
        )
    if (q_document_ids_BS is None) != (lent_chunks[0].document_ids_BK is None):
        raise ValueError("give document ids for the query exactly when the lent chunks have them")
    kv_tensors = [t for c in local_chunks for t in (c.k_BGKD, c.v_BGKD)]
    kv_tensors += [t for c in lent_chunks for t in (c.k_BGKD, c.v_BGKD)]
    backend = _ring_backend(backend, q_BHSD, *kv_tensors)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    lent_docs = tuple(chunk.document_ids_BK for chunk in lent_chunks)
    return _LentAttention.apply(
        backend,
        scale,
        tuple(chunk.mask for chunk in local_chunks),
        (forward_loan, backward_loan),
        (q_document_ids_BS, lent_docs),
        len(local_chunks),
        q_BHSD,
        *kv_tensors,
    )
