"""Tensor parallelism of Qwen3: the decoder's split, plus its per-head query and key norms.

The norms' weights are shared by all heads, and each tensor-parallel rank normalises only its
own heads, so each rank's weight gradient is a partial sum. Applying `SequenceParallel` along the
heads dim (dim 2 of `[batch, seq, heads, head_dim]`) makes each weight a replicated DTensor over
heads sharded over the ranks, and DTensor sums the partial gradients over the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from pipekit.families.decoder.parallelize import decoder_tensor_parallel_plan

__all__ = ["qwen3_tensor_parallel_plan"]


def qwen3_tensor_parallel_plan(
    block: nn.Module, sequence_parallel: bool
) -> Mapping[str, ParallelStyle]:
    """The decoder plan of a Qwen3 block, with its QK-norms split along the heads."""
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {
        **decoder_tensor_parallel_plan(block, sequence_parallel),
        "attention.q_norm": heads,
        "attention.k_norm": heads,
    }
