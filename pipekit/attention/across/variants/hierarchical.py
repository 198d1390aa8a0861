"""Hierarchical context parallelism: Ulysses inside groups of `cp_ulysses` adjacent cp ranks,
a token-shard variant (`cp_across`) across the groups (`pipekit.attention.across.hierarchical`); the
heads split only over a group, so models with fewer heads than cp ranks use them all."""

from __future__ import annotations

from torch import Tensor

from pipekit.attention.across.hierarchical import hierarchical_context_attention
from pipekit.attention.across.slice_attention import AcrossGroups, ContextParallelSliceAttention
from pipekit.attention.across.token_shards import TokenShard
from pipekit.attention.across.ulysses import UlyssesSliceAttention, check_ulysses_heads, heads_split
from pipekit.attention.across.variant_table import (
    ContextParallelVariant,
    SliceSharding,
    VariantRules,
    WholeSequenceCall,
    auto_candidates,
    context_parallel_bytes,
    context_parallel_variant_entry,
    context_parallel_variant_names,
    resolve_over_group,
)
from pipekit.attention.context_protocol import AttentionContext
from pipekit.attention.kv_cache import SliceAttention
from pipekit.attention.patterns import AttentionPattern

__all__ = ["HIERARCHICAL", "across_variants", "check_hierarchical", "hierarchical_bytes"]


def across_variants(pipeline: bool) -> list[str]:
    """What may run across the groups: the variants over token shards (in a pipeline, those a
    pipeline runs)."""
    names = []
    for name in context_parallel_variant_names():
        entry = context_parallel_variant_entry(name)
        if entry.head_ranks is None and (entry.in_pipelines or not pipeline):
            names.append(name)
    return names


def check_hierarchical(
    cp: int,
    ulysses_size: int,
    across_variant: str,
    query_heads: int,
    kv_heads: int,
    pipeline: bool = False,
) -> None:
    """ValueError naming the fix unless `ulysses_size` ranks per group split the cp ranks into
    two groups or more, the (tensor-parallel rank's) heads split over a group, and
    `across_variant` can run here."""
    if not 1 < ulysses_size < cp or cp % ulysses_size:
        raise ValueError(
            f"cp_variant='hierarchical' needs cp_ulysses, the ranks per Ulysses group, to "
            f"divide cp={cp} into two groups or more; got cp_ulysses={ulysses_size}: choose a "
            f"divisor of {cp} between 2 and {cp // 2}"
        )
    allowed = across_variants(pipeline)
    if across_variant not in allowed:
        where = "inside a pipeline " if pipeline else ""
        raise ValueError(f"cp_across={across_variant!r} {where}is not one of {', '.join(allowed)}")
    check_ulysses_heads(query_heads, ulysses_size, kv_heads)


def hierarchical_bytes(across: str, *, ulysses_size: int, cp: int, **shape: float) -> float:
    """Bytes one rank sends (`context_parallel_bytes`' keywords): Ulysses over its group of
    `ulysses_size` ranks on the group's `slice_tokens x u / cp` tokens, then `across` (one
    that chooses: the cheapest of its candidates) over the `cp / u` groups on `1 / u` of the
    heads (the kv heads fewer than a group: one, gathered whole)."""
    groups, kv_heads = cp // ulysses_size, int(shape["kv_heads"])
    group_tokens = shape["slice_tokens"] * ulysses_size // cp
    within = context_parallel_bytes(
        "ulysses", **{**shape, "slice_tokens": group_tokens}, cp=ulysses_size
    )
    heads = {
        "q_heads": shape["q_heads"] // ulysses_size,
        "kv_heads": kv_heads // ulysses_size if kv_heads % ulysses_size == 0 else 1,
    }
    if context_parallel_variant_entry(across).chooses:
        candidates = auto_candidates(0, 0, groups, 1, whole_sequence=False)
    else:
        candidates = [across]
    return within + min(
        context_parallel_bytes(variant, **{**shape, **heads}, cp=groups) for variant in candidates
    )


def _bytes(*, ulysses_size: int = 1, cp: int, **shape: float) -> float:
    return hierarchical_bytes("auto", ulysses_size=ulysses_size, cp=cp, **shape)


def _whole_sequence(call: WholeSequenceCall) -> Tensor:
    hierarchy = call.hierarchy
    if hierarchy is None:
        raise ValueError(
            "cp_variant='hierarchical' needs the Ulysses and across groups (hierarchy=); "
            "set cp_ulysses"
        )

    def across(q_BHSD: Tensor, k_BGSD: Tensor, v_BGSD: Tensor, shard: TokenShard,
               sinks_H: Tensor | None, pattern: AttentionPattern | None) -> Tensor:  # fmt: skip
        over = WholeSequenceCall(
            q_BHSD, k_BGSD, v_BGSD, shard, hierarchy.across, call.scale, call.backend,
            pattern, sinks_H,
        )  # fmt: skip
        entry = resolve_over_group(hierarchy.across_variant, over, whole_sequence=False)
        return entry.attend_whole_sequence(over)

    return hierarchical_context_attention(
        call.q_BHSD, call.k_BGSD, call.v_BGSD, call.shard, hierarchy, across, call.sinks_H,
        call.pattern,
    )  # fmt: skip


def _slice_context(
    context: SliceAttention, sharding: SliceSharding, slice_index: int
) -> AttentionContext:
    """The cache holds head shards of the group's tokens; cp across the groups."""
    across = AcrossGroups(sharding)
    return UlyssesSliceAttention(
        context,
        across.hierarchy.ulysses,
        across.rank_tokens(slice_index),
        across=lambda whole: ContextParallelSliceAttention(whole, across, slice_index),
    )


def _auto_candidate(
    query_heads: int, kv_heads: int, cp: int, ulysses_size: int, whole_sequence: bool
) -> bool:
    """On whole sequences, where the groups split the ranks and the heads split over a group."""
    return (
        whole_sequence
        and 1 < ulysses_size < cp
        and heads_split(query_heads, kv_heads, ulysses_size)
    )


def check_groups(rules: VariantRules) -> None:
    """The groups' rules, for this variant and for any other that takes them."""
    check_hierarchical(
        rules.cp, rules.ulysses_size, rules.across, rules.query_heads, rules.kv_heads,
        pipeline=rules.pipeline,
    )  # fmt: skip


HIERARCHICAL = ContextParallelVariant(
    name="hierarchical",
    summary="Ulysses inside groups of cp_ulysses ranks, cp_across across the groups",
    sent_bytes=_bytes,
    whole_sequence=_whole_sequence,
    slice_context=_slice_context,
    check=check_groups,
    auto_candidate=_auto_candidate,
    head_ranks=lambda rules: rules.ulysses_size,
    takes_groups=lambda rules: True,
)
