"""SwiGLU feed-forward network: `w2(silu(w1 x) * w3 x)`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from pipekit.layers.init import trunc_normal_

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """Gate (w1), down (w2) and up (w3) projections without biases, as in Llama."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Truncated-normal init; `output_std` for w2 lets deep models scale it down."""
        output_std = init_std if output_std is None else output_std
        for linear, std in ((self.w1, init_std), (self.w3, init_std), (self.w2, output_std)):
            trunc_normal_(linear.weight, std)

    def forward(self, x_BSD: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))
