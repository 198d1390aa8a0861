"""Learning-rate schedule: linear warm-up, then cosine, linear or no decay to a floor."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipekit.config.job_config import LRSchedulerConfig

__all__ = ["build_lr_scheduler", "lr_multiplier"]


def lr_multiplier(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """Fraction of the peak LR used for optimizer step `step` (0-based)."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.decay_type == "constant" or total_steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    floor = config.min_lr_ratio
    if config.decay_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: LRSchedulerConfig
) -> LambdaLR:
    """A LambdaLR stepping once per optimizer step (its state goes into checkpoints)."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, config))
