"""Context parallelism inside pipeline stages: SlimPipe's commutated attention on the KV cache,
or KV passing, chosen per slice; or Ulysses (`UlyssesSliceAttention`: each slice resharded to
heads, the cache holding every token of this rank's heads), or hierarchical (Ulysses within
groups of `cp_ulysses` ranks, the cache holding the group's tokens of this rank's heads, and
commutated or KV passing across the groups, chosen per slice).

With `cp` context-parallel ranks per pipeline rank, every slice of a sequence is split over the
cp ranks, load-balanced within the slice (`context_parallel_tokens`): each cp rank runs the
same pipeline schedule on its share of every slice, so the stages, the messages between them and
the KV cache hold `1/cp` of the tokens. A slice's queries must still attend to all earlier
tokens, which lie in the other cp ranks' caches. `PipelineContextParallel` wraps each unit's
KV-cache context in `ContextParallelSliceAttention`, which caches the rank's K/V as usual and
then runs, per slice, `commutated_context_attention` (the queries travel, the cache stays home)
or `kv_passing_context_attention` (the cache travels): "auto" takes whichever moves fewer bytes
for the slice (`choose_context_parallel`: with grouped-query attention KV passing is cheaper
for the first slices, whose caches are small). Either way the gradients the other ranks'
queries leave on this rank's cached chunks accumulate where the cache is, and reach the owning
slice's projections in its backward, as without context parallelism. The choice depends on
shapes only, so every cp rank makes the same one.

The cp ranks of a stage call their collectives in the same order, since they run the same
action lists; they use the mesh's `cp` group, which no other feature or FSDP2 uses.

Legend: B batch, H query heads, G kv heads, S local slice length, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch.distributed as dist
from torch import Tensor

from pipekit.attention.backends import AttentionBackend
from pipekit.attention.chunked import KVChunk
from pipekit.attention.context import AttentionContext
from pipekit.attention.context_parallel import (
    CACHED_SHARD_ATTENTION,
    CachedShard,
    TokenShard,
    commutated_context_attention,
    load_balanced_indices,
)
from pipekit.attention.context_parallel_choice import (
    context_parallel_variant,
)
from pipekit.attention.exchange import Lending, LentChunk
from pipekit.attention.hierarchical import HierarchicalGroups
from pipekit.attention.kv_cache import CachedSlice, SliceAttention
from pipekit.attention.patterns import AttentionPattern
from pipekit.attention.ulysses import UlyssesSliceAttention
from pipekit.pipelining._torch_runtime import Action
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["ContextParallelSliceAttention", "PipelineContextParallel"]


class ContextParallelSliceAttention:
    """A slice's attention context under context parallelism: `inner` (the stage's KV-cache
    context of the unit) caches this rank's K/V; attention runs over every cp rank's cache.
    Under context exchange (which wraps this context) a lending slice runs commutated: the
    chunks it lends are this rank's shares of earlier slices, computed by the pipeline peer
    for every cp rank's queries."""

    def __init__(
        self,
        inner: SliceAttention,
        extension: PipelineContextParallel | _AcrossGroups,
        slice_index: int,
    ) -> None:
        self.inner, self.extension, self.slice_index = inner, extension, slice_index

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
        variant = self.extension.variant_of(
            self.slice_index, q_BHSD, own.k_BGKD, keys_are_values=own.v_BGKD is own.k_BGKD
        )
        indices = self.visible_indices(earlier, pattern)
        lendable = [
            LentChunk(earlier[i].k_BGSD, earlier[i].v_BGSD, earlier[i].document_ids_BS)
            for i in indices
        ]
        attention = functools.partial(
            CACHED_SHARD_ATTENTION[variant], pattern=pattern, sinks_H=sinks_H
        )
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
        length = self.extension.slice_length
        indices = [cached.start // length for cached in lendable_slices]  # one per lent chunk
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
        tokens = self.extension.slice_tokens
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
            self.extension.group,
            scale=scale,
            backend=self.backend,
            drop_remote=self.extension.drop_remote,
        )
        return out_BHSD


class PipelineContextParallel(PipelineExtension):
    """Context parallelism over `group` (the mesh's `cp` dim) for slices of `slice_length`
    tokens (the whole slice, all cp ranks' shares), by `variant` ("auto" chooses per slice
    between commutated and KV passing; "ulysses" for every slice, the caches being head
    shards)."""

    name = "context_parallel"
    equal_length_slices = True  # every slice is cut into 2 x cp equal pieces

    def __init__(
        self,
        group: dist.ProcessGroup,
        slice_length: int,
        variant: str = "auto",
        drop_remote: bool = False,
        hierarchy: HierarchicalGroups | None = None,
    ) -> None:
        if variant == "hierarchical" and hierarchy is None:
            raise ValueError(
                "cp_variant='hierarchical' needs the Ulysses and across groups (hierarchy=); "
                "set cp_ulysses"
            )
        self.group, self.variant, self.hierarchy = group, variant, hierarchy
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slice_length = slice_length
        self.drop_remote = drop_remote
        """Ablation: attend to this rank's cache only."""
        self.num_slices = 1
        self._slice_tokens: dict[int, Tensor] = {}

    def prepare(self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int) -> None:
        self.num_slices = num_slices

    def variant_of(
        self, slice_index: int, q_BHSD: Tensor, k_BGSD: Tensor, keys_are_values: bool = False
    ) -> str:
        """The variant slice `slice_index` uses."""
        return context_parallel_variant(
            self.variant,
            q_BHSD,
            k_BGSD,
            slice_index=slice_index,
            slice_tokens=self.slice_length,
            cp=self.cp,
            keys_are_values=keys_are_values,
        )

    def rank_tokens(self, slice_index: int) -> Tensor:
        """`[cp, S]`: every cp rank's sequence indices in slice `slice_index`, by rank."""
        start = slice_index * self.slice_length
        return load_balanced_indices(self.slice_length, self.cp, start=start)

    def slice_tokens(self, slice_index: int) -> Tensor:
        """This rank's sequence indices in slice `slice_index` (computed once per slice, not
        per layer)."""
        if slice_index not in self._slice_tokens:
            self._slice_tokens[slice_index] = self.rank_tokens(slice_index)[self.rank]
        return self._slice_tokens[slice_index]

    def stage_context(
        self, stage_index: int, unit: int, training: bool, context: AttentionContext
    ) -> AttentionContext:
        if not isinstance(context, SliceAttention):
            raise TypeError(
                f"context parallelism wraps the stage's KV-cache context, got {context!r}; "
                "give the pipeline its context_parallel extension before context_exchange"
            )
        _, slice_index = unit_microbatch_and_slice(unit, self.num_slices)
        if self.variant == "ulysses":  # the cache holds head shards of whole slices
            return UlyssesSliceAttention(context, self.group, self.rank_tokens(slice_index))
        if self.variant == "hierarchical":  # head shards of the group's tokens, cp across
            across = _AcrossGroups(self)
            return UlyssesSliceAttention(
                context,
                across.hierarchy.ulysses,
                across.group_rank_tokens(slice_index),
                across=lambda whole: ContextParallelSliceAttention(whole, across, slice_index),
            )
        return ContextParallelSliceAttention(context, self, slice_index)


class _AcrossGroups:
    """Hierarchical context parallelism's level across the Ulysses groups, as
    `ContextParallelSliceAttention` sees its extension: the ranks holding the same heads of the
    other groups' tokens, this rank's shard being its group's tokens, in sequence order."""

    def __init__(self, parallel: PipelineContextParallel) -> None:
        assert parallel.hierarchy is not None
        self.parallel, self.hierarchy = parallel, parallel.hierarchy
        self.group, self.variant = self.hierarchy.across, self.hierarchy.across_variant
        self.cp = dist.get_world_size(self.group)
        self.slice_length, self.drop_remote = parallel.slice_length, parallel.drop_remote

    def group_rank_tokens(self, slice_index: int) -> Tensor:
        """`[u, S]`: the token indices of slice `slice_index` on each rank of this rank's
        Ulysses group, by rank."""
        size = self.hierarchy.ulysses_size
        start = self.hierarchy.group_index * size
        return self.parallel.rank_tokens(slice_index)[start : start + size]

    def slice_tokens(self, slice_index: int) -> Tensor:
        """This rank's group's tokens of slice `slice_index`, in sequence order (as its
        Ulysses context caches them)."""
        return self.group_rank_tokens(slice_index).flatten().sort().values

    variant_of = PipelineContextParallel.variant_of
    """The variant across the groups for a slice (by `variant`: the one across)."""
