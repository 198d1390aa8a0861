"""A slice's attention under context parallelism inside a sliced pipeline, over token-shard
caches: each cp rank caches its share of every slice's K/V, and a slice's queries attend to
every rank's cache by the slice's variant (per slice for "auto": whichever moves fewer bytes),
the gradients other ranks' queries leave on this rank's chunks accumulating where the cache is.
Hierarchical variants run this across their Ulysses groups (`AcrossGroups`).

Legend: B batch, H query heads, G kv heads, S local slice length, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.lending import Lending, LentChunk
from pipekit.attention.across.token_shards import (
    CachedShard,
    TokenShard,
    commutated_context_attention,
)
from pipekit.attention.across.variant_table import (
    SliceSharding,
    context_parallel_variant,
    context_parallel_variant_entry,
)
from pipekit.attention.chunked import KVChunk
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.kv_cache import CachedSlice, SliceAttention
from pipekit.attention.patterns import AttentionPattern

__all__ = ["AcrossGroups", "ContextParallelSliceAttention", "slice_variant"]


def slice_variant(
    sharding: SliceSharding,
    slice_index: int,
    q_BHSD: Tensor,
    k_BGSD: Tensor,
    keys_are_values: bool = False,
) -> str:
    """The variant slice `slice_index` runs by under `sharding` (`SliceSharding.variant_of`)."""
    bounds = sharding.slice_bounds
    return context_parallel_variant(
        sharding.variant, q_BHSD, k_BGSD, slice_index=slice_index,
        slice_tokens=bounds[slice_index + 1] - bounds[slice_index], cp=sharding.cp,
        keys_are_values=keys_are_values,
    )  # fmt: skip


class ContextParallelSliceAttention:
    """A slice's attention context under context parallelism: `inner` (the stage's KV-cache
    context of the unit) caches this rank's K/V; attention runs over every cp rank's cache.
    Under context exchange (which wraps this context) a lending slice runs commutated: the
    chunks it lends are this rank's shares of earlier slices, computed by the pipeline peer
    for every cp rank's queries."""

    def __init__(self, inner: SliceAttention, sharding: SliceSharding, slice_index: int) -> None:
        self.inner, self.sharding, self.slice_index = inner, sharding, slice_index

    @property
    def recomputing(self) -> bool:
        return self.inner.recomputing

    @property
    def backend(self) -> str | AttentionBackend:
        return self.inner.backend

    def chunks(
        self,
        layer_id: str,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        pattern: AttentionPattern | None = None,
    ) -> tuple[list[CachedSlice], KVChunk]:
        return self.inner.chunks(layer_id, k_BGSD, v_BGSD, pattern)

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
        earlier, own = self.chunks(layer_id, k_BGSD, v_BGSD, pattern)
        return self.attention(q_BHSD, earlier, own, scale, pattern, sinks_H)

    def attention(
        self,
        q_BHSD: Tensor,
        earlier: list[CachedSlice],
        own: KVChunk,
        scale: float,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> Tensor:
        """Over every cp rank's earlier slices that `pattern` lets the slice see, and this
        slice, by the slice's variant; every cp rank skips the same slices (the whole slice's
        tokens decide), so their collectives match."""
        variant = self.sharding.variant_of(
            self.slice_index, q_BHSD, own.k_BGKD, keys_are_values=own.v_BGKD is own.k_BGKD
        )
        cached_shards = context_parallel_variant_entry(variant).cached_shards
        if cached_shards is None:
            raise ValueError(
                f"cp_variant={variant!r} does not attend over token-shard caches; a sliced "
                "pipeline's per-slice choice may name only variants that do"
            )
        indices = self.visible_indices(earlier, pattern)
        lendable = [
            LentChunk(earlier[i].k_BGSD, earlier[i].v_BGSD, earlier[i].document_ids_BS)
            for i in indices
        ]
        attention = functools.partial(cached_shards, pattern=pattern, sinks_H=sinks_H)
        return self._attention(attention, q_BHSD, lendable, own, scale, indices)

    def visible_indices(
        self, earlier: list[CachedSlice], pattern: AttentionPattern | None
    ) -> list[int]:
        """The earlier slices some query of the slice (all cp ranks' tokens) may see: every cp
        rank skips the same ones, so their collectives match."""
        return self.inner.visible_indices(earlier, pattern)

    def lent_attention(
        self,
        q_BHSD: Tensor,
        lendable: list[LentChunk],
        own: KVChunk,
        lendings: tuple[Lending, Lending],
        scale: float,
        pattern: AttentionPattern | None = None,
        lendable_slices: Sequence[CachedSlice] = (),
        sinks_H: Tensor | None = None,
    ) -> Tensor:
        """Commutated, the peers computing the lent earlier slices (context exchange)."""
        attention = functools.partial(
            commutated_context_attention,
            lendings=lendings,
            lendable=len(lendable),
            pattern=pattern,
            sinks_H=sinks_H,
        )
        starts = self.sharding.slice_bounds
        indices = [starts.index(cached.start) for cached in lendable_slices]  # one per lent chunk
        return self._attention(attention, q_BHSD, lendable, own, scale, indices)

    def _attention(
        self,
        attention: Callable[..., tuple[Tensor, Tensor]],
        q_BHSD: Tensor,
        earlier: list[LentChunk],
        own: KVChunk,
        scale: float,
        slice_indices: Sequence[int],
    ) -> Tensor:
        """`earlier` are the cached slices `slice_indices`, then the slice's own chunk."""
        tokens = self.sharding.slice_tokens
        cache = [
            CachedShard(c.k_BGKD, c.v_BGKD, TokenShard(tokens(index), c.document_ids_BK))
            for index, c in zip(slice_indices, earlier, strict=True)
        ]
        shard = TokenShard(tokens(self.slice_index), self.inner.document_ids_BS)
        cache.append(CachedShard(own.k_BGKD, own.v_BGKD, shard))
        out_BHSD, _ = attention(
            q_BHSD,
            shard,
            cache,
            self.sharding.group,
            scale=scale,
            backend=self.backend,
            drop_remote=self.sharding.drop_remote,
        )
        return out_BHSD


class AcrossGroups:
    """Hierarchical context parallelism's level across the Ulysses groups, as a
    `SliceSharding`: the ranks holding the same heads of the other groups' tokens, this rank's
    shard being its group's tokens, in sequence order, attending by the variant across."""

    def __init__(self, parallel: SliceSharding) -> None:
        if parallel.hierarchy is None:
            raise ValueError("hierarchical context parallelism needs its groups (hierarchy=)")
        self.parallel, self.hierarchy = parallel, parallel.hierarchy
        self.group, self.variant = self.hierarchy.across, self.hierarchy.across_variant
        self.cp, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.slice_bounds = parallel.slice_bounds

    @property
    def drop_remote(self) -> bool:
        """The pipeline's ablation switch, read when a slice attends."""
        return self.parallel.drop_remote

    def rank_tokens(self, slice_index: int) -> Tensor:
        """`[u, S]`: the token indices of slice `slice_index` on each rank of this rank's
        Ulysses group, by rank."""
        size = self.hierarchy.ulysses_size
        start = self.hierarchy.group_index * size
        return self.parallel.rank_tokens(slice_index)[start : start + size]

    def slice_tokens(self, slice_index: int) -> Tensor:
        """This rank's group's tokens of slice `slice_index`, in sequence order (as its
        Ulysses context caches them)."""
        return self.rank_tokens(slice_index).flatten().sort().values

    variant_of = slice_variant
