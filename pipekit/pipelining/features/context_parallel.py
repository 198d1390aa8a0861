"""Context parallelism inside pipeline stages, as a pipeline feature.

With `cp` context-parallel ranks per pipeline rank, every slice of a sequence is split over the
cp ranks, load-balanced within the slice (`context_parallel_tokens`): each cp rank runs the
same pipeline schedule on its share of every slice, so the stages, the messages between them and
the KV cache hold `1/cp` of the tokens. A slice's queries must still attend to all earlier
tokens, which lie in the other cp ranks' caches. `PipelineContextParallel` wraps each unit's
KV-cache context by the variant's entry (`pipekit.attention.across`): over token-shard caches
(commutated and K/V passing, "auto" choosing per slice by bytes), or resharded to heads
(Ulysses, hierarchical). The gradients other ranks' queries leave on this rank's cached chunks
accumulate where the cache is, and reach the owning slice's projections in its backward, as
without context parallelism. The choice depends on shapes only, so every cp rank makes the
same one.

The cp ranks of a stage call their collectives in the same order, since they run the same
action lists; they use the mesh's `cp` group, which no other feature or FSDP2 uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across import context_parallel_variant_entry, slice_variant
from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.token_shards import load_balanced_indices
from pipekit.attention.context import AttentionContext
from pipekit.attention.kv_cache import SliceAttention
from pipekit.pipelining.actions import Action
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.schedules.slice_layout import SliceLayout
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["PipelineContextParallel"]


class PipelineContextParallel(PipelineExtension):
    """Context parallelism over `group` (the mesh's `cp` dim) for the plan's equal-length
    `slices` (`slice_length`: the whole slice, all cp ranks' shares), by `variant` (an entry
    of the variant table, `pipekit.attention.across`, whose `slice_context` wraps each unit's
    KV-cache context). The `SliceSharding` its entries see."""

    name = "context_parallel"
    equal_length_slices = True  # every slice is cut into 2 x cp equal pieces

    def __init__(
        self,
        group: dist.ProcessGroup,
        slices: SliceLayout,
        variant: str = "auto",
        drop_remote: bool = False,
        hierarchy: HierarchicalGroups | None = None,
    ) -> None:
        slice_context = context_parallel_variant_entry(variant).slice_context
        if slice_context is None:
            raise ValueError(f"cp_variant={variant!r} does not run inside a sliced pipeline")
        self._slice_context = slice_context
        self.group, self.variant, self.hierarchy = group, variant, hierarchy
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if len(set(slices.lengths)) > 1:
            raise ValueError(f"context parallelism needs slices of equal length, not {slices}")
        self.slices, self.slice_length = slices, slices.bounds[1]
        self.drop_remote = drop_remote
        """Ablation: attend to this rank's cache only."""
        self._slice_tokens: dict[int, Tensor] = {}

    def prepare(self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int) -> None:
        if num_slices != self.slices.num_slices:
            raise ValueError(
                f"context parallelism was built for {self.slices.num_slices} slices, the "
                f"schedule runs {num_slices}; build the feature from the schedule's plan"
            )

    variant_of = slice_variant
    """The variant slice `slice_index` uses."""

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
        _, slice_index = unit_microbatch_and_slice(unit, self.slices.num_slices)
        return self._slice_context(context, self, slice_index)
