"""A loss joined to the backward pass through a tensor of the forward, wherever that tensor's
backward runs.

A pipeline stage or a gradient-accumulation micro-step returns one loss tensor; a layer deep
inside (an MoE router's balance loss, multi-token prediction beside the output layer) cannot add
its own loss to it. `attach_loss(y, loss, scale)` is the identity on `y` in forward, and in
backward also hands `loss` the gradient `scale`, so `loss` contributes `scale x loss` to the
total loss's gradient (Megatron-Core's MoEAuxLossAutoScaler does the same).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attach_loss"]


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.loss_dtype = loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:
        loss_grad = torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=grad_output.device)
        return grad_output, loss_grad, None


def attach_loss(output: Tensor, loss: Tensor | None, scale: float) -> Tensor:
    """`output`, with `loss x scale` added to the loss its backward minimises (the identity
    without gradients)."""
    if loss is None or not torch.is_grad_enabled() or not loss.requires_grad:
        return output
    return _AttachLoss.apply(output, loss, scale)
