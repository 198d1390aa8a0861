"""Context parallelism inside pipeline stages, as a pipeline feature.

With `cp` context-parallel ranks per pipeline rank, every slice of a sequence is split over the
cp ranks, balanced within the slice (`context_parallel_tokens`: by each microbatch's attention
work within its documents, or head and tail; the batch carries the deal): each cp rank runs the
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

import itertools
from collections.abc import Mapping, Sequence

import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor

from pipekit.attention.across import context_parallel_variant_entry, slice_variant
from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.context import AttentionContext
from pipekit.attention.kv_cache import SliceAttention
from pipekit.pipelining.actions import Action
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.schedules.slice_layout import SliceLayout
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["MicrobatchShards", "PipelineContextParallel"]


class MicrobatchShards:
    """One microbatch's context parallelism as its slices' attention sees it (a
    `SliceSharding`): the pipeline's group and variant, and which tokens of each slice every
    cp rank holds in this microbatch (its rows' deal, read from the batch)."""

    def __init__(self, parallel: PipelineContextParallel, microbatch: int) -> None:
        self.parallel, self.microbatch = parallel, microbatch
        self.group, self.variant = parallel.group, parallel.variant
        self.cp, self.rank, self.hierarchy = parallel.cp, parallel.rank, parallel.hierarchy
        self.slice_bounds = parallel.microbatch_bounds[microbatch]

    @property
    def drop_remote(self) -> bool:
        """The pipeline's ablation switch, read when a slice attends."""
        return self.parallel.drop_remote

    variant_of = slice_variant
    """The variant slice `slice_index` uses."""

    def rank_tokens(self, slice_index: int) -> Tensor:
        """`[cp, S]`: every cp rank's sequence indices in slice `slice_index`, by rank."""
        return self.parallel.rank_tokens(self.microbatch, slice_index)

    def slice_tokens(self, slice_index: int) -> Tensor:
        """This rank's sequence indices in slice `slice_index`."""
        return self.rank_tokens(slice_index)[self.rank]


class PipelineContextParallel(PipelineExtension):
    """Context parallelism over `group` (the mesh's `cp` dim) for the plan's `slices`, by
    `variant` (an entry of the variant table, `pipekit.attention.across`, whose
    `slice_context` wraps each unit's KV-cache context). Which tokens each cp rank holds, and
    so where each microbatch's slices start and end, comes with the batch (`cp_tokens`, as
    `pipekit.distributed.ContextParallelRanks.shard` deals each microbatch's slices: equal,
    equal-cost or cut by its documents), read at the start of every step; each unit's slice
    attention sees its microbatch's (`MicrobatchShards`)."""

    name = "context_parallel"

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
        self.slices = slices
        self.drop_remote = drop_remote
        """Ablation: attend to this rank's cache only."""
        self._tables: list[Tensor] = []
        self.microbatch_bounds: list[tuple[int, ...]] = []
        """This step's slice bounds per microbatch in the whole sequence (every rank's
        tokens), as the deal cut them."""

    def prepare(self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int) -> None:
        if num_slices != self.slices.num_slices:
            raise ValueError(
                f"context parallelism was built for {self.slices.num_slices} slices, the "
                f"schedule runs {num_slices}; build the feature from the schedule's plan"
            )

    def begin_step(
        self, units: Sequence[TensorDict], normaliser: Tensor | float
    ) -> list[tuple[Tensor, ...]] | None:
        """Reads each unit's deal (`cp_tokens` `[B, S, cp]`, the same for a microbatch's
        rows); every unit must hold exactly its slice's tokens, as the deal cut them."""
        if any(unit.get("cp_tokens", None) is None for unit in units):
            raise ValueError(
                "context parallelism in a pipeline needs each cp rank's tokens with the batch "
                "(cp_tokens); shard the batch with ContextParallelRanks.shard"
            )
        self._tables = [unit["cp_tokens"][0].T for unit in units]
        n = self.slices.num_slices
        self.microbatch_bounds = []
        for first in range(0, len(self._tables), n):
            tables = self._tables[first : first + n]
            bounds = tuple(itertools.accumulate((t.numel() for t in tables), initial=0))
            for table, start, end in zip(tables, bounds, bounds[1:], strict=False):
                if int(table.min()) != start or int(table.max()) != end - 1:
                    raise ValueError(
                        f"a cp rank's unit holds tokens {int(table.min())}..{int(table.max())} "
                        f"for the slice [{start}, {end}): the batch was dealt on other slices "
                        "than the pipeline cuts; shard it with ContextParallelRanks given "
                        "slice_cut=plan.slices.microbatch_bounds"
                    )
            self.microbatch_bounds.append(bounds)
        return None

    def rank_tokens(self, microbatch: int, slice_index: int) -> Tensor:
        """`[cp, S]`: every cp rank's sequence indices in slice `slice_index` of `microbatch`
        this step, by rank."""
        return self._tables[microbatch * self.slices.num_slices + slice_index]

    def stage_context(
        self, stage_index: int, unit: int, training: bool, context: AttentionContext
    ) -> AttentionContext:
        if not isinstance(context, SliceAttention):
            raise TypeError(
                f"context parallelism wraps the stage's KV-cache context, got {context!r}; "
                "give the pipeline its context_parallel extension before context_exchange"
            )
        microbatch, slice_index = unit_microbatch_and_slice(unit, self.slices.num_slices)
        return self._slice_context(context, MicrobatchShards(self, microbatch), slice_index)
