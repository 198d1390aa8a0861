"""What a step with a non-finite loss or gradient norm does: stop, or skip its update.

The loss and the gradient norm are reduced over every rank before they are checked, so every
rank sees the same value and takes the same branch in the same step. "stop" ends the run before
the update and before anything of that step is saved (train.py exits 1): the last checkpoint
stays the last good one. "skip_step" leaves the weights and the optimizer as they were, counts
the step (the data and the schedule move on) and logs it. Either way the message names what
went bad: the loss, or the norm and this rank's parameters whose gradients are not finite.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from pipekit.models.materialize import local_tensor
from pipekit.moe.bias_balance import discard_expert_loads

__all__ = ["NON_FINITE_CHOICES", "NonFiniteLossError", "handle_non_finite"]

NON_FINITE_CHOICES = ("stop", "skip_step")
"""`[training] on_nonfinite`'s choices."""

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN or infinite; the run stops before that step is
    applied or saved."""


def handle_non_finite(
    model: nn.Module, policy: str, loss: float, grad_norm: float, step: int, rank: int
) -> None:
    """Raise NonFiniteLossError ("stop"), or log the skipped step ("skip_step") and forget
    its expert loads; `step` is 1-based."""
    what = f"loss is {loss}"
    if math.isfinite(loss):
        bad = [
            name
            for name, param in model.named_parameters()
            if param.grad is not None and not torch.isfinite(local_tensor(param.grad)).all()
        ]
        listed = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        what = f"gradient norm is {grad_norm} (rank {rank}: {listed or 'none here'})"
    if policy == "stop":
        raise NonFiniteLossError(
            f"{what} at step {step}; stopping before the update. Lower optimizer.lr, raise "
            "lr_scheduler.warmup_steps, set training.max_norm, or training.on_nonfinite = "
            "'skip_step'"
        )
    logger.warning("%s at step %d; skipped the update", what, step)
    discard_expert_loads(model)
