"""A rank's context parallelism, set up once from the mesh and the settings: its load-balanced
tokens of every sequence, its cp group, the hierarchical groups where the variant takes them,
and the attention context of a batch. The trainer, the data-parallel parity harness and the
layout search's block timing all start context parallelism through `context_parallel_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.token_shards import context_parallel_tokens
from pipekit.attention.context import ContextParallelAttention
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.process_group import hierarchical_groups

__all__ = ["ContextParallelRanks", "context_parallel_ranks"]


@dataclass(frozen=True)
class ContextParallelRanks:
    """This rank's tokens of every sequence (`tokens_S`, slice by slice in a pipeline), its cp
    `group`, the `variant` and, outside pipelines, the hierarchical groups (None if unset)."""

    tokens_S: Tensor
    group: dist.ProcessGroup
    variant: str
    hierarchy: HierarchicalGroups | None

    def attention(
        self, document_ids_BS: Tensor | None, backend: str | AttentionBackend = "auto"
    ) -> ContextParallelAttention:
        """The attention context of a batch of whole sequences (this rank's tokens' document
        ids)."""
        return ContextParallelAttention(
            self.tokens_S, document_ids_BS, self.group, backend, self.variant, self.hierarchy
        )


def context_parallel_ranks(
    mesh: DeviceMesh,
    parallelism: ParallelismConfig,
    seq_len: int,
    num_slices: int = 1,
    pipeline: bool = False,
    device: torch.device | str = "cpu",
) -> ContextParallelRanks:
    """Context parallelism over `mesh`'s `cp` dim for sequences of `seq_len` tokens (cut into
    `num_slices` slices in a `pipeline`, whose feature builds its own hierarchical groups).
    Every rank of the mesh must call it (hierarchical groups are new process groups)."""
    cp_mesh = mesh["cp"]
    tokens_S = context_parallel_tokens(
        seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), num_slices
    ).to(device)
    hierarchy = None
    if parallelism.cp_ulysses and not pipeline:
        hierarchy = hierarchical_groups(mesh, parallelism.cp_ulysses, parallelism.cp_across)
    return ContextParallelRanks(tokens_S, cp_mesh.get_group(), parallelism.cp_variant, hierarchy)
