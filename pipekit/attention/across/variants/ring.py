"""Ring attention: K/V passed around the ranks with the transfers overlapping the attention
(`ring_context_attention`); whole sequences only. It moves what K/V passing moves."""

from __future__ import annotations

from torch import Tensor

from pipekit.attention.across.ring import ring_context_attention
from pipekit.attention.across.variant_table import ContextParallelVariant, WholeSequenceCall
from pipekit.attention.across.variants.kv_passing import kv_passing_bytes

__all__ = ["RING"]


def _ring_whole_sequence(call: WholeSequenceCall) -> Tensor:
    return ring_context_attention(
        call.q_BHSD, call.k_BGSD, call.v_BGSD, call.shard, call.group, scale=call.scale,
        backend=call.backend, pattern=call.pattern, sinks_H=call.sinks_H,
    )[0]  # fmt: skip


RING = ContextParallelVariant(
    name="ring",
    summary="K/V passed around the ranks, overlapped with attention (whole sequences only)",
    sent_bytes=kv_passing_bytes,
    whole_sequence=_ring_whole_sequence,
)
