"""Activation checkpointing of transformer blocks: none, every block, or every k-th block."""

from __future__ import annotations

from torch import nn

from pipekit._torch_private import checkpoint_module_activations
from pipekit.config.job_config import TrainingConfig

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(blocks: list[nn.Module], config: TrainingConfig) -> int:
    """Checkpoint the blocks the config selects; returns how many were checkpointed."""
    if config.activation_checkpoint == "none":
        return 0
    every = 1 if config.activation_checkpoint == "full" else config.activation_checkpoint_every
    chosen = [block for index, block in enumerate(blocks) if index % every == every - 1]
    for block in chosen:
        checkpoint_module_activations(block)
    return len(chosen)
