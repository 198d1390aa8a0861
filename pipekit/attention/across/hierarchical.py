"""Hierarchical context parallelism: Ulysses inside groups of cp ranks, another variant across.

The cp ranks form `cp / u` groups of `u` adjacent ranks (`cp_ulysses = u`; on GPUs, a node's
fast links). Inside a group, Ulysses' all-to-all gives each rank every group token of `heads /
u` heads; across the groups, the ranks holding the same heads attend to each other's tokens by
`cp_across` (K/V passing, ring, commutated, or per slice whichever moves fewer bytes), exactly as
plain context parallelism does over `cp / u` ranks whose shards are the groups' tokens. A second
all-to-all returns each rank its own tokens for all heads. The heads split only `u` ways, so a
model with fewer heads than cp ranks can still use them all (Megatron-Core's hierarchical
context parallelism; DeepSpeed-Ulysses inside, a ring across).

Legend: B batch, H query heads, G kv heads, S tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.token_shards import TokenShard
from pipekit.attention.across.ulysses import (
    group_shard,
    local_pattern,
    local_sinks,
    reshard_to_sequence,
    to_head_shards,
)
from pipekit.attention.merge import check_sinks
from pipekit.attention.patterns import AttentionPattern

__all__ = [
    "HierarchicalGroups",
    "hierarchical_context_attention",
]

AcrossAttention = Callable[
    [Tensor, Tensor, Tensor, TokenShard, Tensor | None, AttentionPattern | None], Tensor
]
"""q, k, v of the group's tokens on this rank's heads, their shard, the heads' sinks, the
layer's pattern on the heads -> out."""


@dataclass(frozen=True)
class HierarchicalGroups:
    """This rank's two groups: `ulysses` (the `u` ranks whose tokens it gathers for its heads)
    and `across` (the ranks of the other groups holding the same heads), and the variant that
    runs across."""

    ulysses: dist.ProcessGroup
    across: dist.ProcessGroup
    across_variant: str = "auto"

    @property
    def ulysses_size(self) -> int:
        return dist.get_world_size(self.ulysses)

    @property
    def group_index(self) -> int:
        """Which group of `u` adjacent cp ranks this rank is in (its rank across)."""
        return dist.get_rank(self.across)


def hierarchical_context_attention(
    q_BHSD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    shard: TokenShard,
    groups: HierarchicalGroups,
    attend_across: AcrossAttention,
    sinks_H: Tensor | None = None,
    pattern: AttentionPattern | None = None,
) -> Tensor:
    """This rank's tokens' (`shard`) attention output `[B, H, S, D]`: resharded to heads over
    `groups.ulysses`, attended across the groups by `attend_across` (context parallelism over
    `groups.across` on the group's tokens, with the heads' sinks and `pattern`), resharded
    back."""
    check_sinks(sinks_H, q_BHSD)
    q_BHSD, k_BGSD, v_BGSD = to_head_shards(q_BHSD, k_BGSD, v_BGSD, groups.ulysses)
    whole_group = group_shard(shard, groups.ulysses)
    out_BHSD = attend_across(
        q_BHSD, k_BGSD, v_BGSD, whole_group, local_sinks(sinks_H, groups.ulysses),
        local_pattern(pattern, groups.ulysses),
    )  # fmt: skip
    return reshard_to_sequence(out_BHSD, groups.ulysses)
