"""Tensor parallelism of the decoder family (Llama, Qwen3): Megatron's column/row split.

Queries, keys, values and the FFN's gate and up projections are split by output rows
(`ColwiseParallel`): each tensor-parallel rank holds whole heads (query heads and their
key/value heads together, so grouped-query attention pairs them as one process would) and a
share of the FFN's hidden units. The attention output and the FFN's down projection are split
by input columns (`RowwiseParallel`), whose partial outputs are summed over the ranks. Norms,
embeddings and the output layer stay whole on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from pipekit.layers.swiglu import FeedForward

__all__ = ["decoder_tensor_parallel_plan"]


def decoder_tensor_parallel_plan(block: nn.Module) -> Mapping[str, ParallelStyle]:
    """The plan of one `TransformerBlock`: attention always, the FFN if it is dense (an MoE
    layer is left to expert parallelism)."""
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    if isinstance(block.get_submodule("feed_forward"), FeedForward):
        plan |= {
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
    return plan
