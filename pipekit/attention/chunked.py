"""Attention of one query block over a list of KV chunks, merged exactly by log-sum-exp.

This is the entry point everything above the kernels uses: plain attention is one chunk; a
sliced sequence attends to its KV-cache chunks plus its own; context exchange and ring context
parallelism add chunks computed elsewhere. Gradients are exact for both backend kinds (see
`pipekit.attention.kernels.backends`): by autograd through `merge_attention`, or by
`_RingIdentityAttention`, whose backward runs every chunk's kernel backward with the merged output
and lse. The chunks are saved as they are (never concatenated), so a KV cache costs autograd
nothing beyond the chunks themselves.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipekit.attention.kernels.backends import AttentionBackend, RingBackend, select_backend
from pipekit.attention.masks import MaskMod
from pipekit.attention.merge import check_sinks, merge_attention, sink_gradient

__all__ = ["KVChunk", "attention", "attention_over_chunks", "ring_backward"]


@dataclass(frozen=True)
class KVChunk:
    """Keys and values of one chunk, and the mask of the query block against it (None = all)."""

    k_BGKD: Tensor
    v_BGKD: Tensor
    mask: MaskMod | None = None


def _check_shapes(q_BHSD: Tensor, chunks: Sequence[KVChunk]) -> None:
    if q_BHSD.dim() != 4:
        raise ValueError(
            f"attention: q must be [batch, heads, seq, head_dim], got {tuple(q_BHSD.shape)}"
        )
    if not chunks:
        raise ValueError("attention_over_chunks needs at least one KV chunk")
    batch, heads, _, head_dim = q_BHSD.shape
    for index, chunk in enumerate(chunks):
        k, v = chunk.k_BGKD, chunk.v_BGKD
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"attention: chunk {index} k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                "[batch, kv_heads, keys, head_dim]"
            )
        if k.shape[0] != batch or k.shape[3] != head_dim or heads % k.shape[1]:
            raise ValueError(
                f"attention: chunk {index} k {tuple(k.shape)} does not fit "
                f"q {tuple(q_BHSD.shape)}: batch and head_dim must match and query heads must "
                "be a multiple of kv heads"
            )
        if k.dtype != q_BHSD.dtype or v.dtype != q_BHSD.dtype:
            raise ValueError(
                f"attention: chunk {index} dtype {k.dtype}/{v.dtype} differs from q {q_BHSD.dtype}"
            )


def ring_backward(
    backend: RingBackend,
    grad_out_BHSD: Tensor,
    q_BHSD: Tensor,
    out_BHSD: Tensor,
    lse_BHS: Tensor,
    chunks: Sequence[tuple[Tensor, Tensor, MaskMod | None]],
    scale: float,
) -> tuple[Tensor, list[Tensor]]:
    """The ring identity: with the merged `(out, lse)`, each chunk's kernel backward gives its
    share of dQ and its own dK, dV. Returns (dQ summed over chunks, [dK, dV] per chunk)."""
    grad_q_BHSD = torch.zeros_like(q_BHSD)
    kv_grads: list[Tensor] = []
    for k, v, mask in chunks:
        grad_q, grad_k, grad_v = backend.backward_chunk(
            grad_out_BHSD, q_BHSD, k, v, out_BHSD, lse_BHS, mask, scale
        )
        grad_q_BHSD += grad_q
        kv_grads += [grad_k, grad_v]
    return grad_q_BHSD, kv_grads


class _RingIdentityAttention(torch.autograd.Function):
    """Forward: each chunk's kernel, then the LSE merge. Backward: each chunk's kernel backward
    with the merged (out, lse), summed over chunks. The lse output has no gradient."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        backend: RingBackend,
        masks: tuple[MaskMod | None, ...],
        scale: float,
        sinks_H: Tensor | None,
        q_BHSD: Tensor,
        *kv_tensors: Tensor,
    ) -> tuple[Tensor, Tensor]:
        keys, values = kv_tensors[0::2], kv_tensors[1::2]
        partials = [
            backend.forward_chunk(q_BHSD, k, v, mask, scale)
            for k, v, mask in zip(keys, values, masks, strict=True)
        ]
        out_BHSD, lse_BHS = merge_attention(partials, sinks_H)
        ctx.backend, ctx.masks, ctx.scale, ctx.sinks_H = backend, masks, scale, sinks_H
        ctx.save_for_backward(q_BHSD, out_BHSD, lse_BHS, *kv_tensors)
        ctx.mark_non_differentiable(lse_BHS)
        return out_BHSD, lse_BHS

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out_BHSD: Tensor, _grad_lse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q_BHSD, out_BHSD, lse_BHS, *kv_tensors = ctx.saved_tensors
        chunks = zip(kv_tensors[0::2], kv_tensors[1::2], ctx.masks, strict=True)
        grad_q_BHSD, kv_grads = ring_backward(
            ctx.backend, grad_out_BHSD, q_BHSD, out_BHSD, lse_BHS, list(chunks), ctx.scale
        )
        grad_sinks = None
        if ctx.sinks_H is not None and ctx.needs_input_grad[3]:
            grad_sinks = sink_gradient(grad_out_BHSD, out_BHSD, lse_BHS, ctx.sinks_H)
        return None, None, None, grad_sinks, grad_q_BHSD, *kv_grads


def attention_over_chunks(
    q_BHSD: Tensor,
    chunks: Sequence[KVChunk],
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    sinks_H: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of `q` over the union of the chunks: `(out_BHSD, lse_BHS)`, exact gradients.

    Rows with no allowed key in any chunk give `out = 0`, `lse = -inf` (without sinks).
    GQA: chunks may have fewer heads than `q` (a divisor of them). `sinks_H`: attention sinks,
    one logit per query head, counted once in the merge.
    """
    _check_shapes(q_BHSD, chunks)
    check_sinks(sinks_H, q_BHSD)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    kv_tensors = [t for chunk in chunks for t in (chunk.k_BGKD, chunk.v_BGKD)]
    if isinstance(backend, str):
        backend = select_backend(backend, q_BHSD, *kv_tensors)
    if backend.lse_has_grad:
        return merge_attention(
            [backend.forward_chunk(q_BHSD, c.k_BGKD, c.v_BGKD, c.mask, scale) for c in chunks],
            sinks_H,
        )
    if not isinstance(backend, RingBackend):
        raise TypeError(f"backend {backend.name!r} has lse_has_grad=False but no backward_chunk")
    masks = tuple(chunk.mask for chunk in chunks)
    return _RingIdentityAttention.apply(backend, masks, scale, sinks_H, q_BHSD, *kv_tensors)


def attention(
    q_BHSD: Tensor,
    k_BGKD: Tensor,
    v_BGKD: Tensor,
    mask: MaskMod | None = None,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
) -> tuple[Tensor, Tensor]:
    """`(out_BHSD, lse_BHS)` of one query block against one KV chunk under a mask_mod."""
    return attention_over_chunks(q_BHSD, [KVChunk(k_BGKD, v_BGKD, mask)], scale, backend)
