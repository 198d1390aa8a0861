"""K/V passing: every rank gathers the keys and values of the slice and of every cached one
(`kv_passing_context_attention`), so the bytes grow with the slice's index; cheapest for early
slices under grouped-query attention."""

from __future__ import annotations

from pipekit.attention.across.slice_attention import ContextParallelSliceAttention
from pipekit.attention.across.token_shards import kv_passing_context_attention
from pipekit.attention.across.variant_table import ContextParallelVariant
from pipekit.attention.across.variants._shares import kv_tensor_count, sent_share

__all__ = ["KV_PASSING", "kv_passing_bytes"]


def kv_passing_bytes(
    *, slice_index: int, slice_tokens: float, cp: int, kv_heads: int, head_dim: int,
    element_bytes: int, keys_are_values: bool, **_: float,
) -> float:  # fmt: skip
    """`(cp-1)/cp · (j+1) · T · 2·h_kv·d` elements: slice j's keys and values and every
    cached slice's."""
    share = sent_share(slice_tokens, cp, element_bytes)
    return share * (slice_index + 1) * kv_tensor_count(keys_are_values) * kv_heads * head_dim


KV_PASSING = ContextParallelVariant(
    name="kv_passing",
    summary="keys and values gathered from every rank (the cache travels)",
    sent_bytes=kv_passing_bytes,
    cached_shards=kv_passing_context_attention,
    slice_context=ContextParallelSliceAttention,
    auto_candidate=lambda query_heads, kv_heads, cp, ulysses_size, whole_sequence: True,
)
