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
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from pipekit.distributed.tensor_parallel_styles import (
    gathered_input,
    routes_own_tokens,
    row_split,
)
from pipekit.layers.swiglu import FeedForward
from pipekit.moe import MoE

__all__ = ["decoder_tensor_parallel_plan"]


def decoder_tensor_parallel_plan(
    block: nn.Module, sequence_parallel: bool
) -> Mapping[str, ParallelStyle]:
    """The plan of one `TransformerBlock`: attention always, the FFN if it is dense (an MoE
    layer is left to expert parallelism). Inputs are gathered once per attention and FFN
    (`pipekit.distributed.tensor_parallel_styles`)."""
    back_to_residual = row_split(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        # attention(x, rope_cos_sin, layer_id, context): only x is a DTensor
        "attention": gathered_input(sequence_parallel, other_args=3),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": back_to_residual,
    }
    if sequence_parallel:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    feed_forward = block.get_submodule("feed_forward")
    if isinstance(feed_forward, MoE) and sequence_parallel:
        plan["feed_forward"] = routes_own_tokens()
    if isinstance(feed_forward, FeedForward):
        plan |= {
            "feed_forward": gathered_input(sequence_parallel),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": back_to_residual,
        }
    return plan
