"""Attention across ranks: the context-parallel variant table and its entries, and a slice's
attention over token-shard caches in a sliced pipeline.

Importing this package registers pipekit's own variants (`variants`); a new variant is one
module that builds a `ContextParallelVariant` and registers it.
"""

from pipekit.attention.across import variants
from pipekit.attention.across.slice_attention import (
    AcrossGroups,
    ContextParallelSliceAttention,
    slice_variant,
)
from pipekit.attention.across.variant_table import (
    CachedShardAttention,
    ContextParallelVariant,
    SliceSharding,
    VariantRules,
    WholeSequenceCall,
    auto_candidates,
    check_context_parallel,
    check_context_parallel_split,
    choose_context_parallel,
    context_parallel_bytes,
    context_parallel_variant,
    context_parallel_variant_entry,
    context_parallel_variant_names,
    register_context_parallel_variant,
)

__all__ = [
    "AcrossGroups",
    "CachedShardAttention",
    "ContextParallelSliceAttention",
    "ContextParallelVariant",
    "SliceSharding",
    "VariantRules",
    "WholeSequenceCall",
    "auto_candidates",
    "check_context_parallel",
    "check_context_parallel_split",
    "choose_context_parallel",
    "context_parallel_bytes",
    "context_parallel_variant",
    "context_parallel_variant_entry",
    "context_parallel_variant_names",
    "register_context_parallel_variant",
    "slice_variant",
    "variants",
]
