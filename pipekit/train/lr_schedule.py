"""Learning-rate schedule: linear warm-up, then cosine, linear or no decay to a floor, over
the rest of the run or (warmup-stable-decay) over its last `decay_ratio` only."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:  # pipekit.config imports this module's choices: no import back at run time
    from pipekit.config.job_config import LRSchedulerConfig

__all__ = ["DECAY_TYPES", "StepLambdaLR", "build_lr_scheduler", "lr_multiplier"]

DECAY_TYPES = ("cosine", "linear", "constant")
"""`[lr_scheduler] decay_type`'s choices: the decays `lr_multiplier` computes."""


def lr_multiplier(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """Fraction of the peak LR used for optimizer step `step` (0-based): warm-up, then (with
    `decay_ratio` > 0, warmup-stable-decay) the peak until the last `decay_ratio` of the
    steps, then the decay to the floor."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.decay_type == "constant" or total_steps <= warmup:
        return 1.0
    decay_start = warmup
    if config.decay_ratio:
        decay_start = max(warmup, total_steps - round(config.decay_ratio * total_steps))
        if step < decay_start:
            return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start - 1))
    floor = config.min_lr_ratio
    if config.decay_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StepLambdaLR(LambdaLR):
    """A LambdaLR whose checkpoint holds its step alone.

    The rate is a function of the step, and the base rates come from the config, one per
    parameter group. Groups follow the layout (tensor parallelism groups parameters by mesh),
    so a checkpoint that kept them would not load into a job of another layout."""

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        pairs = zip(self.base_lrs, self.lr_lambdas, strict=True)
        rates = [base * multiplier(self.last_epoch) for base, multiplier in pairs]
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        self._last_lr = list(rates)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: LRSchedulerConfig
) -> StepLambdaLR:
    """A LambdaLR stepping once per optimizer step (its step goes into checkpoints)."""
    return StepLambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, config))
