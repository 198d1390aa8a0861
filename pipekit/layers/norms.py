"""RMSNorm, computed in float32 whatever the activation dtype (as Llama was trained)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, with the statistics in float32 and the result in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Weight one (the stds do not apply to a norm; the signature is every module's)."""
        nn.init.ones_(self.weight)

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_fp32 = x_BSD.to(torch.promote_types(x_BSD.dtype, torch.float32))
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x_BSD.dtype)
