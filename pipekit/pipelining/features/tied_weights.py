"""Tied embeddings across pipeline stages: two copies of one weight, kept equal.

A tied model (Llama 3.2 1B/3B, the small Qwen3s) uses one matrix as the embedding on the first
stage and as the output projection on the last, which sit on different ranks. Each of the two
ranks holds a copy; both copies start equal (the model initialises a tied weight by the
embedding's name wherever it sits, and a checkpoint load reads the same tensor for both), and
after every step each copy's gradient is replaced by their sum, so the optimizer moves both
the same way and they stay bit-equal: that sum is the single-process gradient of the shared
weight. Under vocabulary parallelism both shards sit on every rank (the same rows), as two
separately sharded modules; their gradients are summed on the rank.

One copy is the "duplicate" that a global gradient norm must not count twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipekit.models.materialize import local_tensor
from pipekit.models.spec import ModelStructure
from pipekit.pipelining.runtime.extension import PipelineExtension

__all__ = ["TiedWeights", "untie_vocabulary"]


class TiedWeights(PipelineExtension):
    """Sum the gradients of this rank's copies of a tied weight, and of the other copy's rank
    (`group`: the two owning ranks of each data-parallel replica), after every step."""

    name = "tied_weights"

    def __init__(
        self,
        copies: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        counted_here: bool,
    ) -> None:
        """`copies`: this rank's copies (none on a rank without either module); `counted_here`:
        whether the first copy counts in a global gradient norm (on one of the two ranks)."""
        self.copies, self.group, self.counted_here = list(copies), group, counted_here

    @torch.no_grad()
    def end_step(self) -> None:
        grads = [local_tensor(param.grad) for param in self.copies if param.grad is not None]
        if len(grads) != len(self.copies):
            missing = len(self.copies) - len(grads)
            raise RuntimeError(f"tied weights: {missing} of this rank's copies got no gradient")
        if not grads:
            return
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)

    def duplicate_parameters(self) -> list[nn.Parameter]:
        return self.copies[1:] if self.counted_here else self.copies


def untie_vocabulary(model: nn.Module, structure: ModelStructure) -> None:
    """Give the output module a copy of the embedding's weight as its own (on the meta device,
    before the stage split): the pipeline keeps the two copies equal itself."""
    embedding_name, output_name = structure.vocabulary_modules
    embedding = getattr(model, embedding_name, None)
    output = getattr(model, output_name, None)
    if embedding is not None and output is not None and output.weight is embedding.weight:
        output.weight = nn.Parameter(embedding.weight.detach().clone())
