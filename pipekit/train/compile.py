"""`[compile] enable`: each transformer block, and the loss, compiled with `torch.compile`.

A block is compiled in place (`nn.Module.compile`), after activation checkpointing and expert
parallelism and before FSDP, as torchtitan orders it, so parameter names and FSDP's per-block
units stay as they are. Inside a block two calls stay eager, on purpose:
- the attention call (`pipekit.attention.context.attend`): a context is stateful Python (a
  sliced KV cache, an exchange between pipeline ranks, a context-parallel ring), and its kernels
  are compiled on their own (FlexAttention);
- a mixture-of-experts layer: its routing has data-dependent sizes (tokens per expert, the
  all-to-all's splits), which would recompile at every step.
So a block compiles to two graphs, before and after attention, shared by every layer of one
shape; the attention call returns its heads merged and contiguous, so every context gives the
graph after it one layout. Equal-length slices all have one length, so slicing adds no
recompiles; the KV cache grows, but only inside the eager attention call. Equal-cost slices
have several lengths: the second length recompiles each graph once with a dynamic sequence
length (torch.compile's automatic dynamic shapes), and later lengths reuse it. Each type of
attention context compiles once more (dynamo guards on the type of the object it passes
through): a pipeline with context exchange, whose lending units use a second type, compiles
twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipekit.layers.loss import token_sum_cross_entropy
from pipekit.pipelining.runtime.extension import LossFn

__all__ = ["compile_blocks", "job_loss_fn"]


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """Compile every block's forward in place (its module and parameters stay the same)."""
    for block in blocks:
        block.compile()


def job_loss_fn(compile_loss: bool, loss_parallel: bool) -> LossFn:
    """The token-sum cross-entropy, compiled when `compile_loss` and the logits are plain
    tensors (loss parallelism's vocabulary-sharded DTensors run torch's eager loss-parallel
    rules). The normaliser is a tensor, so one graph serves every step."""
    if compile_loss and not loss_parallel:
        return torch.compile(token_sum_cross_entropy)
    return token_sum_cross_entropy
