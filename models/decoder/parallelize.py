"""Tensor (and sequence) parallelism of the decoder family (Llama, Qwen3): Megatron's split.

Queries, keys, values and the FFN's gate and up projections are split by output rows
(`ColwiseParallel`): each tensor-parallel rank holds whole heads (query heads and their
key/value heads together, so grouped-query attention pairs them as one process would) and a
share of the FFN's hidden units. The attention output and the FFN's down projection are split
by input columns (`RowwiseParallel`), whose partial outputs are summed over the ranks.

With sequence parallelism the residual stream between the projections is a DTensor sharded on
the sequence (dim 1): the norms run on a rank's tokens (`SequenceParallel`), the attention's and
the FFN's inputs are all-gathered (`PrepareModuleInput`), and the row-split projections
reduce-scatter onto the sequence instead of all-reducing. Without it, norms and the residual
stream are whole on every rank.

An MoE layer is not split (expert-TP 1, Megatron's default): under sequence parallelism each
rank routes its own tokens, and expert parallelism may fold over the tp ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from pipekit.layers.swiglu import FeedForward
from pipekit.moe import MoE

__all__ = ["decoder_tensor_parallel_plan"]


def decoder_tensor_parallel_plan(
    block: nn.Module, sequence_parallel: bool
) -> Mapping[str, ParallelStyle]:
    """The plan of one `TransformerBlock`: attention always, the FFN if it is dense (an MoE
    layer is left to expert parallelism).

    The attention's and the FFN's inputs become a replicated DTensor once, before their
    column-split projections (gathered from the rank's tokens under sequence parallelism): the
    projections' input gradients then add up as partial sums, and one reduce-scatter (or one
    all-reduce) per layer sums them over the ranks, not one per projection."""
    residual = Shard(1) if sequence_parallel else Replicate()
    row_split = RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        # attention(x, rope_cos_sin, layer_id, context): only x is a DTensor
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": row_split,
    }
    if sequence_parallel:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    feed_forward = block.get_submodule("feed_forward")
    if isinstance(feed_forward, MoE) and sequence_parallel:
        # expert-TP 1: each rank routes its own tokens; experts and router are data parallel
        # over the ranks that hold tokens (tp included), by expert parallelism and FSDP2
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False,
        )  # fmt: skip
    if isinstance(feed_forward, FeedForward):
        plan |= {
            "feed_forward": PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": row_split,
        }
    return plan
