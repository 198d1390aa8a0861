"""Shared experts: the always-on FFN beside the routed experts (DeepSeek-V3, Qwen-MoE).

Every token goes through it, unweighted, and its output is added to the routed experts'. `n`
shared experts of hidden size F are one dense FFN of hidden size n x F (their sum is exactly
that FFN), with the routed experts' activation. It is an ordinary dense module: data parallel
like the block around it, and under tensor parallelism data parallel over the tp ranks like
the router (each tp rank computes it on its own tokens).

Legend: T tokens, D model dim, H shared hidden dim (n x F).
"""

from __future__ import annotations

from torch import Tensor, nn

from pipekit.layers.init import trunc_normal_
from pipekit.moe.activations import expert_activation

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """`w2(act(w1 x) * w3 x)` (gated activations) or `w2(act(w1 x))`, on every token."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "swiglu") -> None:
        super().__init__()
        self.activation = expert_activation(activation)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if self.activation.gated else None

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """As a dense FFN: inputs at `init_std`, the output projection at `output_std`."""
        trunc_normal_(self.w1.weight, init_std)
        if self.w3 is not None:
            trunc_normal_(self.w3.weight, init_std)
        trunc_normal_(self.w2.weight, init_std if output_std is None else output_std)

    def forward(self, x_TD: Tensor) -> Tensor:
        hidden_TH = self.activation.value(self.w1(x_TD))
        if self.w3 is not None:
            hidden_TH = hidden_TH * self.w3(x_TD)
        return self.w2(hidden_TH)
