"""How a rank's part of the model becomes stages (`StageSetup`): the value the builder, the
feature table and the trainer share, below all of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from pipekit.attention.across.loan_wire import DEFAULT_LOAN_TIMEOUT
from pipekit.layers.loss import token_sum_cross_entropy
from pipekit.pipelining.runtime.extension import LossFn

__all__ = ["StageSetup"]


def _unchanged(*_: nn.Module) -> None:
    """The default of the parallelize hooks: leave the modules as they are."""


@dataclass(frozen=True)
class StageSetup:
    """How this rank's part of the model becomes stages."""

    device: torch.device
    materialize: Callable[[nn.Module], None]
    """Give a module storage on `device` and its values: a stage, already parallelized on the
    meta device (its parameters may be DTensors), or an unsharded vocabulary module whose rows
    the shards copy. `pipekit.models.materialize_sharded(module, device, init)` does it unit by
    unit for a seeded init or a checkpoint read. Any subset of the model's modules must come
    out as the whole model's would: every split then starts from the same weights."""
    parallelize: Callable[[nn.Module], None] = _unchanged
    """Applied to each stage's module on the meta device, before `materialize` (activation
    checkpointing, EP, FSDP), so no rank allocates more than its shards: under FSDP each stage
    is its own root, which torch's runtime unshards, reshards and reduces."""
    parallelize_vocab: Callable[[nn.Module, nn.Module], None] = _unchanged
    """Applied to the vocabulary shards (embedding, output) under vocabulary parallelism."""
    attention_backend: str = "auto"
    message_dtype: torch.dtype = torch.float32
    """Dtype of the activations and gradients stages send each other."""
    collective_timeout: timedelta = DEFAULT_LOAN_TIMEOUT
    """How long a feature's receive waits for a peer before it names the pair and fails."""
    offload_dir: str = ""
    """Folder of the activation offload file on CPU (empty: the system's temporary folder)."""
    loss_fn: LossFn = token_sum_cross_entropy
    """The last stage's loss of (logits, labels, normaliser) (e.g. a compiled one)."""
