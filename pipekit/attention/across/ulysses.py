"""Ulysses context parallelism: an all-to-all from sequence shards to head shards and back.

Each cp rank holds its load-balanced share of every sequence's tokens for all heads. Before
attention one all-to-all per tensor gives each rank every token of `heads / cp` query heads (and
their key/value heads); attention runs over the whole sequence, masked by the tokens' indices in
it (the pattern and the documents they belong to), and a second all-to-all returns each rank its
own tokens for all heads (DeepSpeed-Ulysses). It moves `(cp-1)/cp x tokens / cp x (2 x query
heads + 2 x kv heads) x head_dim` elements per rank and layer forward
(the Ulysses entry's bytes rule), whatever the sequence length, and needs the query
heads (after tensor parallelism) to split over the cp ranks. Key/value heads fewer than the
ranks (a divisor of them: grouped-query attention with few kv heads, or multi-head latent
attention's one latent) are all-gathered along the sequence instead, each rank keeping the one
its query heads read: one copy of each, never a repeat per query head. Gradients go back by the
inverse collectives.

Inside a sliced pipeline (`UlyssesSliceAttention`) each slice is resharded the same way, its
tokens put back in sequence order, and the stage's chunked KV cache keeps, per slice, every
token of this rank's heads: the slice attends to the cache exactly as without context
parallelism (contiguous slices, the layer's pattern, documents), on `heads / cp` heads.

Legend: B batch, H query heads, G kv heads, N heads of either, S tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.token_shards import (
    TokenShard,
    gather_keys_values,
    gather_token_shards,
    shard_mask,
)
from pipekit.attention.chunked import KVChunk, attention_over_chunks
from pipekit.attention.context_protocol import AttentionContext
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.kv_cache import SliceAttention
from pipekit.attention.merge import check_sinks
from pipekit.attention.patterns import AttentionPattern

__all__ = [
    "UlyssesSliceAttention",
    "check_ulysses_heads",
    "heads_split",
    "local_pattern",
    "local_sinks",
    "ulysses_context_attention",
]


def check_ulysses_heads(query_heads: int, cp: int, kv_heads: int | None = None) -> None:
    """ValueError naming the fix unless the (tensor-parallel rank's) query heads split over
    the cp ranks, and its kv heads split over them or divide them."""
    if query_heads % cp:
        raise ValueError(
            f"Ulysses gives each of the cp={cp} ranks heads / cp query heads, but a rank holds "
            f"{query_heads}; choose cp dividing them (after tp), or another context-parallel "
            "variant"
        )
    if kv_heads is not None and kv_heads % cp and cp % kv_heads:
        raise ValueError(
            f"Ulysses with {kv_heads} kv heads per rank on cp={cp} ranks: the kv heads must "
            "split over the ranks or divide them; choose such a cp, or another context-parallel "
            "variant"
        )


def heads_split(query_heads: int, kv_heads: int, ranks: int) -> bool:
    """Whether Ulysses can reshard these heads over `ranks` (`check_ulysses_heads`' rule)."""
    return query_heads % ranks == 0 and (kv_heads % ranks == 0 or ranks % kv_heads == 0)


def _sequence_to_heads(x_BNSD: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """`[B, N, S, D]` of this rank's tokens -> `[B, N / cp, cp x S, D]`: every rank's tokens
    (by source rank) of this rank's heads."""
    cp = dist.get_world_size(group)
    batch, heads, tokens, dim = x_BNSD.shape
    send = x_BNSD.reshape(batch, cp, heads // cp, tokens, dim).movedim(1, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.movedim(0, 2).reshape(batch, heads // cp, cp * tokens, dim)


def _heads_to_sequence(x_BNSD: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The inverse: `[B, N / cp, cp x S, D]` -> `[B, N, S, D]` of this rank's tokens."""
    cp = dist.get_world_size(group)
    batch, heads, tokens, dim = x_BNSD.shape
    send = x_BNSD.reshape(batch, heads, cp, tokens // cp, dim).movedim(2, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.movedim(0, 1).reshape(batch, cp * heads, tokens // cp, dim)


class _Reshard(torch.autograd.Function):
    """`_sequence_to_heads` (or, `to_heads=False`, its inverse); the backward is the other."""

    @staticmethod
    def forward(ctx, x_BNSD: Tensor, group: dist.ProcessGroup | None, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x_BNSD, group)

    @staticmethod
    def backward(ctx, grad_BNSD: Tensor) -> tuple[Tensor, None, None]:
        inverse = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return inverse(grad_BNSD.contiguous(), ctx.group), None, None


def reshard_to_sequence(out_BHSD: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """A head shard's output of every rank's tokens -> this rank's tokens of all heads."""
    return _Reshard.apply(out_BHSD, group, False)


def to_head_shards(
    q_BHSD: Tensor, k_BGSD: Tensor, v_BGSD: Tensor, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of this rank's tokens, all heads -> every rank's tokens (by source rank) of this
    rank's heads. Kv heads fewer than the ranks are all-gathered whole and the one this rank's
    query heads read is kept; keys that are their own values (latent attention) travel once."""
    cp = dist.get_world_size(group)
    query_heads, kv_heads = q_BHSD.shape[1], k_BGSD.shape[1]
    check_ulysses_heads(query_heads, cp, kv_heads)
    q_BHSD = _Reshard.apply(q_BHSD, group, True)
    if kv_heads % cp == 0:
        k_BGSD = _Reshard.apply(k_BGSD, group, True)
        v_BGSD = k_BGSD if v_BGSD is k_BGSD else _Reshard.apply(v_BGSD, group, True)
        return q_BHSD, k_BGSD, v_BGSD
    keys, values = gather_keys_values(k_BGSD, v_BGSD, group)
    head = dist.get_rank(group) // (cp // kv_heads)  # the kv head of this rank's query heads
    k_BGSD = torch.cat(keys, dim=2)[:, head : head + 1]
    v_BGSD = k_BGSD if values is keys else torch.cat(values, dim=2)[:, head : head + 1]
    return q_BHSD, k_BGSD, v_BGSD


def local_sinks(sinks_H: Tensor | None, group: dist.ProcessGroup | None) -> Tensor | None:
    """The attention sinks of the heads this rank computes after the all-to-all."""
    if sinks_H is None:
        return None
    return sinks_H.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def local_pattern(
    pattern: AttentionPattern | None, group: dist.ProcessGroup | None
) -> AttentionPattern | None:
    """The layer's pattern on the heads this rank computes after the all-to-all: its heads'
    values of a score bias (ALiBi's slopes)."""
    if pattern is None:
        return None
    return pattern.on_head_shard(dist.get_rank(group), dist.get_world_size(group))


def group_shard(shard: TokenShard, group: dist.ProcessGroup | None) -> TokenShard:
    """The tokens (and document ids) of every rank of `group`, by rank: what a rank holds of
    its heads after the all-to-all."""
    shards = gather_token_shards(shard, group)
    documents = (
        None
        if shard.document_ids_BS is None
        else torch.cat([s.document_ids_BS for s in shards], dim=1)
    )
    return TokenShard(torch.cat([s.tokens_S for s in shards]), documents)


def ulysses_context_attention(
    q_BHSD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    shard: TokenShard,
    group: dist.ProcessGroup | None,
    *,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    pattern: AttentionPattern | None = None,
    sinks_H: Tensor | None = None,
) -> Tensor:
    """This rank's tokens' (`shard`) attention output `[B, H, S, D]` over the whole sequence by
    `pattern` (None: causal), computed head-sharded (see the module docstring); each rank
    counts the attention sinks `sinks_H` (and the score bias's values) of the heads it
    computes."""
    check_sinks(sinks_H, q_BHSD)
    q_BHSD, k_BGSD, v_BGSD = to_head_shards(q_BHSD, k_BGSD, v_BGSD, group)
    whole = group_shard(shard, group)
    mask = shard_mask(whole, whole, local_pattern(pattern, group))
    out_BHSD, _ = attention_over_chunks(
        q_BHSD, [KVChunk(k_BGSD, v_BGSD, mask)], scale, backend, local_sinks(sinks_H, group)
    )
    return reshard_to_sequence(out_BHSD, group)


class UlyssesSliceAttention:
    """A slice's attention context under Ulysses context parallelism inside a sliced pipeline.

    `inner` is the stage's KV-cache context of the unit (this rank's tokens of the slice);
    `rank_tokens_RS` the slice's token indices on every rank of `group`, by rank. The slice's q,
    k, v go to head shards, are put in sequence order, attend through the stage's cache as one
    whole slice (`SliceAttention` with the slice's document ids), and come back to this rank's
    tokens. Under hierarchical context parallelism `group` is a Ulysses group, its tokens a part
    of the slice, and `across` wraps the cache's context in context parallelism across the
    groups."""

    def __init__(
        self,
        inner: SliceAttention,
        group: dist.ProcessGroup | None,
        rank_tokens_RS: Tensor,
        across: Callable[[SliceAttention], AttentionContext] | None = None,
    ) -> None:
        self.inner, self.group, self.across = inner, group, across
        self.order_S = torch.argsort(rank_tokens_RS.flatten())
        """Gathered (by source rank) -> sequence order."""
        self.unorder_S = torch.argsort(self.order_S)
        self._whole: AttentionContext | None = None

    def __repr__(self) -> str:
        return f"UlyssesSliceAttention({self.inner!r})"

    @property
    def recomputing(self) -> bool:
        """Whether this forward is activation checkpointing's recompute (the inner context's)."""
        return self.inner.recomputing

    def _whole_slice(self) -> AttentionContext:
        """The stage cache's context of the group's tokens of the slice (in order: under plain
        Ulysses the whole slice; hierarchically wrapped by `across`), built on the first layer
        and kept for the slice's other layers."""
        if self._whole is None:
            inner = self.inner
            whole = SliceAttention(
                inner.cache, inner.microbatch, inner.slice_index, self._slice_documents()
            )
            self._whole = whole if self.across is None else self.across(whole)
        return self._whole

    def _slice_documents(self) -> Tensor | None:
        documents_BS = self.inner.document_ids_BS
        if documents_BS is None:
            return None
        parts = [torch.empty_like(documents_BS) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, documents_BS.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, self.order_S]

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
        """This rank's tokens' attention output, computed on its heads of the whole slice."""
        keys_are_values = v_BGSD is k_BGSD
        q_BHSD, k_BGSD, v_BGSD = to_head_shards(q_BHSD, k_BGSD, v_BGSD, self.group)
        self.order_S = self.order_S.to(q_BHSD.device)
        self.unorder_S = self.unorder_S.to(q_BHSD.device)
        q_BHSD, k_BGSD = q_BHSD[:, :, self.order_S], k_BGSD[:, :, self.order_S]
        v_BGSD = k_BGSD if keys_are_values else v_BGSD[:, :, self.order_S]
        out_BHSD = self._whole_slice().attend(
            layer_id, q_BHSD, k_BGSD, v_BGSD, scale, local_pattern(pattern, self.group),
            local_sinks(sinks_H, self.group),
        )  # fmt: skip
        return reshard_to_sequence(out_BHSD[:, :, self.unorder_S], self.group)
