"""RMSNorm, computed in float32 whatever the activation dtype (as Llama was trained), with a
memory-efficient backward.

Written as autograd ops, RMSNorm saves its input (upcast to float32 under bf16), the normalised
input and the statistics. `rms_norm` saves its output instead, with the per-token `1/rms`: the
next layer's projections save that same output for their own backward (one storage, counted
once), so the norm itself keeps only one float per token. The backward recovers the normalised
input as `output / weight` (SlimPipe §5, as Apex's memory-efficient norms do). A weight
element that is exactly zero loses the gradient it would get from that division (its
feature's normalised input cannot be recovered); norms start at one and do not reach zero in
practice. `rms_norm_reference` is the autograd-op form, kept as the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm", "rms_norm", "rms_norm_reference"]


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _RMSNorm(torch.autograd.Function):
    """`weight * x / rms(x)`, saving the output and `1/rms` per token."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x_BSD: Tensor, weight_D: Tensor, eps: float
    ) -> Tensor:
        x_wide = x_BSD.to(_statistics_dtype(x_BSD.dtype))
        rstd_BS1 = torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + eps)
        out_BSD = weight_D * (x_wide * rstd_BS1).to(x_BSD.dtype)
        ctx.save_for_backward(out_BSD, rstd_BS1, weight_D)
        ctx.input_dtype = x_BSD.dtype
        return out_BSD

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out_BSD: Tensor
    ) -> tuple[Tensor, Tensor, None]:
        out_BSD, rstd_BS1, weight_D = ctx.saved_tensors
        wide = rstd_BS1.dtype
        weight_wide = weight_D.to(wide)
        grad_wide_BSD = grad_out_BSD.to(wide)
        # in place where possible: a block's backward peak is its norms' temporaries
        normed_BSD = out_BSD.to(wide).div(weight_wide).nan_to_num_(nan=0.0)  # 0/0 at weight 0
        leading = tuple(range(grad_out_BSD.ndim - 1))
        grad_weight = (grad_wide_BSD * normed_BSD).sum(dim=leading)
        grad_normed_BSD = grad_wide_BSD * weight_wide
        mean_BS1 = (grad_normed_BSD * normed_BSD).mean(-1, keepdim=True)
        grad_x_BSD = grad_normed_BSD.sub_(normed_BSD.mul_(mean_BS1)).mul_(rstd_BS1)
        return grad_x_BSD.to(ctx.input_dtype), grad_weight.to(weight_D.dtype), None


def rms_norm(x_BSD: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim, statistics in float32; saves its
    output and one float per token for the backward."""
    return _RMSNorm.apply(x_BSD, weight_D, eps)


def rms_norm_reference(x_BSD: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """`rms_norm` as autograd ops (saves the float32 input and the normalised input)."""
    x_wide = x_BSD.to(_statistics_dtype(x_BSD.dtype))
    normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * normed.to(x_BSD.dtype)


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, with the statistics in float32 and the result in x's dtype, by
    `rms_norm` (`pipekit.layers.reference.set_memory_efficient` switches to the reference)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.norm = rms_norm

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Weight one (the stds do not apply to a norm; the signature is every module's)."""
        nn.init.ones_(self.weight)

    def forward(self, x_BSD: Tensor) -> Tensor:
        return self.norm(x_BSD, self.weight, self.eps)
