"""Commutated attention (SlimPipe's): the queries travel to every rank's cache and the
partial outputs and LSEs come back (`commutated_context_attention`), so the bytes stay the
same for every slice and the cache stays home, which context exchange's lending needs."""

from __future__ import annotations

from pipekit.attention.across.slice_attention import ContextParallelSliceAttention
from pipekit.attention.across.token_shards import commutated_context_attention
from pipekit.attention.across.variant_table import ContextParallelVariant
from pipekit.attention.across.variants._shares import sent_share

__all__ = ["COMMUTATED", "commutated_bytes"]


def commutated_bytes(
    *, slice_tokens: float, cp: int, q_heads: int, head_dim: int, element_bytes: int,
    **_: float,
) -> float:  # fmt: skip
    """`(cp-1)/cp · T · (2·h_q·d + h_q)` elements: the queries out, outputs and LSEs back."""
    return sent_share(slice_tokens, cp, element_bytes) * (2 * q_heads * head_dim + q_heads)


COMMUTATED = ContextParallelVariant(
    name="commutated",
    summary="queries travel to every rank's cache, partial outputs come back (the cache stays)",
    sent_bytes=commutated_bytes,
    cached_shards=commutated_context_attention,
    slice_context=ContextParallelSliceAttention,
    auto_candidate=lambda query_heads, kv_heads, cp, ulysses_size, whole_sequence: True,
    lends=True,
)
