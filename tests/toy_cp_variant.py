"""Context-parallel variants registered from outside pipekit, as a user's would be: importing
this module adds them to the variant table.

- "toy_kv_passing" attends over token-shard caches by delegating to K/V passing's kernel, with
  a bytes rule of its own (a constant, so "auto" would never pick it; it is not a candidate
  anyway);
- "toy_local_keys", the ablation: the same, each rank attending to its own chunks only;
- "toy_whole_only": whole sequences only (no per-slice attention), to be refused in pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from pipekit.attention import kv_passing_context_attention
from pipekit.attention.across import (
    ContextParallelSliceAttention,
    ContextParallelVariant,
    context_parallel_variant_names,
    register_context_parallel_variant,
)
from pipekit.attention.across.token_shards import CachedShard, TokenShard

__all__ = ["TOY", "TOY_LOCAL", "TOY_WHOLE_ONLY"]


def _local_keys_only(
    q_BHSD: Tensor,
    shard: TokenShard,
    cache: Sequence[CachedShard],
    group: dist.ProcessGroup | None,
    **options: object,
) -> tuple[Tensor, Tensor]:
    return kv_passing_context_attention(
        q_BHSD, shard, cache, group, **{**options, "drop_remote": True}
    )


TOY = ContextParallelVariant(
    name="toy_kv_passing",
    summary="K/V passing under another name (a test's variant)",
    sent_bytes=lambda **shape: 1.0,
    cached_shards=kv_passing_context_attention,
    slice_context=ContextParallelSliceAttention,
)
TOY_LOCAL = ContextParallelVariant(
    name="toy_local_keys",
    summary="each rank attends to its own keys only (an ablation)",
    cached_shards=_local_keys_only,
    slice_context=ContextParallelSliceAttention,
)
TOY_WHOLE_ONLY = ContextParallelVariant(
    name="toy_whole_only",
    summary="K/V passing on whole sequences only",
    cached_shards=kv_passing_context_attention,
)

if TOY.name not in context_parallel_variant_names():  # once per process
    for _variant in (TOY, TOY_LOCAL, TOY_WHOLE_ONLY):
        register_context_parallel_variant(_variant)
