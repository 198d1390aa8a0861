"""Ulysses (DeepSpeed-Ulysses): an all-to-all from token shards to head shards and back
(`pipekit.attention.across.ulysses`); in a sliced pipeline every slice, the cache holding this
rank's heads of every token. The (tensor-parallel rank's) query heads must split over the cp
ranks."""

from __future__ import annotations

from torch import Tensor

from pipekit.attention.across.ulysses import (
    UlyssesSliceAttention,
    check_ulysses_heads,
    heads_split,
    ulysses_context_attention,
)
from pipekit.attention.across.variant_table import (
    ContextParallelVariant,
    SliceSharding,
    VariantRules,
    WholeSequenceCall,
)
from pipekit.attention.across.variants._shares import kv_tensor_count, sent_share
from pipekit.attention.context_protocol import AttentionContext
from pipekit.attention.kv_cache import SliceAttention

__all__ = ["ULYSSES", "ulysses_bytes"]


def ulysses_bytes(
    *, slice_tokens: float, cp: int, q_heads: int, kv_heads: int, head_dim: int,
    element_bytes: int, keys_are_values: bool, **_: float,
) -> float:  # fmt: skip
    """`(cp-1)/cp · T/cp · (2·h_q + 2·h_kv)·d` elements: its tokens' q, k, v out to the head
    owners and their outputs back; kv heads fewer than the ranks are all-gathered instead,
    `(cp-1)/cp · T · 2·h_kv·d` of them."""
    share = sent_share(slice_tokens, cp, element_bytes)
    kv_share = share / cp if kv_heads % cp == 0 else share  # all-to-all, or all-gather
    kv_bytes = kv_share * kv_tensor_count(keys_are_values) * kv_heads
    return (share / cp * 2 * q_heads + kv_bytes) * head_dim


def _whole_sequence(call: WholeSequenceCall) -> Tensor:
    return ulysses_context_attention(
        call.q_BHSD, call.k_BGSD, call.v_BGSD, call.shard, call.group, scale=call.scale,
        backend=call.backend, pattern=call.pattern, sinks_H=call.sinks_H,
    )  # fmt: skip


def _slice_context(
    context: SliceAttention, sharding: SliceSharding, slice_index: int
) -> AttentionContext:
    """The cache holds head shards of whole slices."""
    return UlyssesSliceAttention(context, sharding.group, sharding.rank_tokens(slice_index))


def _check(rules: VariantRules) -> None:
    check_ulysses_heads(rules.query_heads, rules.cp, rules.kv_heads)


ULYSSES = ContextParallelVariant(
    name="ulysses",
    summary="all-to-all from token shards to head shards and back (heads split over cp)",
    sent_bytes=ulysses_bytes,
    whole_sequence=_whole_sequence,
    slice_context=_slice_context,
    check=_check,
    auto_candidate=lambda query_heads, kv_heads, cp, ulysses_size, whole_sequence: (
        whole_sequence and heads_split(query_heads, kv_heads, cp)
    ),
    head_ranks=lambda rules: rules.cp,
)
