"""A rank's context parallelism, set up once from the mesh and the settings: how it deals each
batch's tokens (by attention work within documents, or head and tail), its cp group, the
hierarchical groups where the variant takes them, and the attention context of a batch. The
trainer, the parity harnesses and the layout search's block timing all start context
parallelism through `context_parallel_ranks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.token_shards import context_parallel_tokens
from pipekit.attention.context import ContextParallelAttention
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.process_group import hierarchical_groups

__all__ = ["ContextParallelRanks", "SliceCut", "context_parallel_ranks"]


SliceCut = Callable[[Tensor | None], Sequence[int]]
"""A pipeline's slice bounds (n + 1 token offsets of the whole sequence) for a microbatch whose
rows carry these document ids (`SliceLayout.microbatch_bounds`)."""


@dataclass(frozen=True)
class ContextParallelRanks:
    """This rank (`rank` of `cp`) of the cp `group`, for sequences of `seq_len` tokens cut
    into `num_slices` slices in a pipeline (equal ones, or where `slice_cut` says for each
    microbatch): how it deals tokens (`balance`, in `pieces_per_rank` pieces), the `variant`
    and, outside pipelines, the hierarchical groups (None if unset)."""

    rank: int
    cp: int
    seq_len: int
    num_slices: int
    balance: str
    pieces_per_rank: int
    group: dist.ProcessGroup
    variant: str
    hierarchy: HierarchicalGroups | None
    slice_cut: SliceCut | None = None

    def rank_tokens(self, document_ids_BS: Tensor | None) -> Tensor:
        """`[cp, S / cp]`: every cp rank's sequence indices of a batch whose rows carry
        `document_ids_BS` and share the shards (slice by slice in a pipeline), by rank: dealt
        by their attention work under `balance = "documents"`, else (or without ids) head and
        tail, the same for every batch."""
        return self._deal(document_ids_BS, self._bounds(document_ids_BS))

    def _bounds(self, document_ids_BS: Tensor | None) -> Sequence[int] | None:
        """Where the pipeline cuts these rows (None: `num_slices` equal slices)."""
        return None if self.slice_cut is None else self.slice_cut(document_ids_BS)

    def _deal(self, document_ids_BS: Tensor | None, bounds: Sequence[int] | None) -> Tensor:
        documents = document_ids_BS if self.balance == "documents" else None
        table_CS = context_parallel_tokens(
            self.seq_len, self.cp, self.num_slices, documents, self.pieces_per_rank, bounds
        )
        return table_CS.to(document_ids_BS.device if document_ids_BS is not None else "cpu")

    def shard(self, batch: TensorDict, microbatches: int = 1) -> TensorDict:
        """This rank's tokens of `batch`'s rows, each of its `microbatches` (a pipeline's: the
        rows that share slices) dealt by its own documents. Adds `cp_tokens` `[B, S / cp, cp]`:
        at each local position, the sequence index every cp rank holds there (the attention
        contexts read it, so they follow the same deal), and with `slice_cut`, `cp_slice`
        `[B, S / cp]`: the slice each local position belongs to (where the pipeline cuts)."""
        parts = []
        for part in batch.tensor_split(microbatches):
            document_ids_BS = part.get("document_ids", None)
            bounds = self._bounds(document_ids_BS)
            table_CS = self._deal(document_ids_BS, bounds)
            local = part[:, table_CS[self.rank]]
            local["cp_tokens"] = table_CS.T.expand(*local.batch_size, self.cp).contiguous()
            if bounds is not None:
                bounds_N = torch.tensor(bounds, device=table_CS.device)
                slice_S = torch.bucketize(table_CS[self.rank], bounds_N[1:], right=True)
                local["cp_slice"] = slice_S.expand(*local.batch_size).contiguous()
            parts.append(local)
        return torch.cat(parts)

    def attention(
        self, shard: TensorDict, backend: str | AttentionBackend = "auto"
    ) -> ContextParallelAttention:
        """The attention context of a batch of whole sequences `shard` (as `shard` made it,
        with one deal: one attention context serves all its rows)."""
        deal_BSC = shard["cp_tokens"]
        if not bool((deal_BSC == deal_BSC[:1]).all()):
            raise ValueError(
                "the batch's rows were dealt to the cp ranks in different ways; one attention "
                "context serves rows of one deal: shard whole sequences with microbatches=1"
            )
        tokens_S = deal_BSC[0, :, self.rank]
        return ContextParallelAttention(
            tokens_S, shard.get("document_ids", None), self.group, backend, self.variant,
            self.hierarchy,
        )  # fmt: skip


def context_parallel_ranks(
    mesh: DeviceMesh,
    parallelism: ParallelismConfig,
    seq_len: int,
    num_slices: int = 1,
    pipeline: bool = False,
    slice_cut: SliceCut | None = None,
) -> ContextParallelRanks:
    """Context parallelism over `mesh`'s `cp` dim for sequences of `seq_len` tokens (cut into
    `num_slices` slices in a `pipeline`, whose feature builds its own hierarchical groups;
    `slice_cut`: where, per microbatch, when not equal). Every rank of the mesh must call it
    (hierarchical groups are new process groups)."""
    cp_mesh = mesh["cp"]
    hierarchy = None
    if parallelism.cp_ulysses and not pipeline:
        hierarchy = hierarchical_groups(mesh, parallelism.cp_ulysses, parallelism.cp_across)
    return ContextParallelRanks(
        cp_mesh.get_local_rank(), cp_mesh.size(), seq_len, num_slices, parallelism.cp_balance,
        parallelism.cp_balance_pieces, cp_mesh.get_group(), parallelism.cp_variant, hierarchy,
        slice_cut,
    )  # fmt: skip
