"""Ring context parallelism: K/V chunks travel around the cp ranks while each one is used.

At step s of c, rank r holds the keys and values of rank r-s (mod c). It posts the send of that
chunk to rank r+1 and the receive of the next from rank r-1, then attends its queries to the
chunk it holds while the transfer runs, so communication overlaps compute. The partial results
are merged by log-sum-exp. At any time a rank holds two chunks, not c: the memory of the
all-gather variant (`kv_passing_context_attention`) without its peak.

The backward runs the same ring again with the ring identity (each chunk's kernel backward with
the merged output and lse). Each chunk travels with its dK/dV accumulators, which every rank adds
its share to. After c steps the accumulators are back at the chunk's owner.

Legend: B batch, H query heads, G kv heads, S local tokens, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.token_shards import TokenShard, gather_token_shards, shard_mask
from pipekit.attention.kernels.backends import AttentionBackend, ring_backend, select_backend
from pipekit.attention.merge import check_sinks, merge_attention, sink_gradient
from pipekit.attention.patterns import AttentionPattern

__all__ = ["ring_context_attention"]


def _start_rotation(tensors: list[Tensor], group: dist.ProcessGroup | None) -> tuple[list, list]:
    """Send `tensors` to the next rank and receive the previous rank's; returns (works,
    buffers)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    after = dist.get_global_rank(group, (rank + 1) % size) if group else (rank + 1) % size
    before = dist.get_global_rank(group, (rank - 1) % size) if group else (rank - 1) % size
    tensors = [t.contiguous() for t in tensors]
    buffers = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, after, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, before, group) for b in buffers]
    return dist.batch_isend_irecv(ops), buffers


def _finish(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, settings: tuple, sinks_H: Tensor | None, q_BHSD: Tensor, k_BGSD: Tensor, v_BGSD: Tensor
    ):
        backend, group, scale, shard, isolated, pattern = settings
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        shards = gather_token_shards(shard, group)
        held = [k_BGSD, v_BGSD]
        partials = []
        for step in range(size):
            rotating = step + 1 < size and not isolated
            works, incoming = _start_rotation(held, group) if rotating else ([], held)
            source = (rank - step) % size
            mask = shard_mask(shard, shards[source], pattern)
            partials.append(backend.forward_chunk(q_BHSD, held[0], held[1], mask, scale))
            _finish(works)
            if isolated:  # ablation: only this rank's own chunk
                break
            held = incoming
        out_BHSD, lse_BHS = merge_attention(partials, sinks_H)
        ctx.settings, ctx.shards, ctx.sinks_H = settings, shards, sinks_H
        ctx.save_for_backward(q_BHSD, k_BGSD, v_BGSD, out_BHSD, lse_BHS)
        ctx.mark_non_differentiable(lse_BHS)
        return out_BHSD, lse_BHS

    @staticmethod
    def backward(ctx, grad_out_BHSD: Tensor, _grad_lse: Tensor | None):
        backend, group, scale, shard, isolated, pattern = ctx.settings
        q_BHSD, k_BGSD, v_BGSD, out_BHSD, lse_BHS = ctx.saved_tensors
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad_out_BHSD = grad_out_BHSD.contiguous()
        grad_q_BHSD = torch.zeros_like(q_BHSD)
        held = [k_BGSD, v_BGSD, torch.zeros_like(k_BGSD), torch.zeros_like(v_BGSD)]
        steps = 1 if isolated else size
        for step in range(steps):
            source = (rank - step) % size
            mask = shard_mask(shard, ctx.shards[source], pattern)
            dq, dk, dv = backend.backward_chunk(
                grad_out_BHSD, q_BHSD, held[0], held[1], out_BHSD, lse_BHS, mask, scale
            )
            grad_q_BHSD += dq
            held[2], held[3] = held[2] + dk, held[3] + dv
            if not isolated and size > 1:  # on to the next; after `size` moves sums are home
                works, held = _start_rotation(held, group)
                _finish(works)
        grad_sinks = None
        if ctx.sinks_H is not None and ctx.needs_input_grad[1]:
            grad_sinks = sink_gradient(grad_out_BHSD, out_BHSD, lse_BHS, ctx.sinks_H)
        return None, grad_sinks, grad_q_BHSD, held[2], held[3]


def ring_context_attention(
    q_BHSD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    shard: TokenShard,
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    isolated: bool = False,
    pattern: AttentionPattern | None = None,
    sinks_H: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries (`shard`) over every rank's keys by `pattern` (None:
    causal), passed around the ring with the transfers overlapping the attention:
    `(out_BHSD, lse_BHS)`, exact gradients for q, k and v. `isolated` (an ablation) attends to
    this rank's chunk only. `sinks_H`: attention sinks, counted once in the merge."""
    check_sinks(sinks_H, q_BHSD)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    if isinstance(backend, str):
        backend = select_backend(backend, q_BHSD, k_BGSD, v_BGSD)
    settings = (ring_backend(backend), group, scale, shard, isolated, pattern)
    return _RingAttention.apply(settings, sinks_H, q_BHSD, k_BGSD, v_BGSD)
