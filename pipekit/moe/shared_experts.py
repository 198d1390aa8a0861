"""Shared experts: the always-on FFN beside the routed experts (DeepSeek-V3, Qwen-MoE).

Every token goes through it, unweighted, and its output is added to the routed experts'. `n`
shared experts of hidden size F are one dense FFN of hidden size n x F (their sum is exactly
that FFN), with the routed experts' activation and, with `MoEArgs.expert_biases`, biases as
theirs. It is an ordinary dense module: data parallel like the block around it, and under
tensor parallelism data parallel over the tp ranks like the router (each tp rank computes it
on its own tokens).

Legend: T tokens, D model dim, H shared hidden dim (n x F).
"""

from __future__ import annotations

from torch import Tensor, nn

from pipekit.layers.init import trunc_normal_
from pipekit.moe.activations import expert_activation

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """`w2(act(w1 x) * up(w3 x))` (gated activations) or `w2(act(w1 x))`, on every token;
    autograd differentiates the activation (it is differentiable torch ops)."""

    def __init__(
        self, dim: int, hidden_dim: int, activation: str = "swiglu", *, biases: bool = False
    ) -> None:
        super().__init__()
        self.activation = expert_activation(activation)
        self.w1 = nn.Linear(dim, hidden_dim, bias=biases)
        self.w2 = nn.Linear(hidden_dim, dim, bias=biases)
        self.w3 = nn.Linear(dim, hidden_dim, bias=biases) if self.activation.gated else None

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """As a dense FFN: inputs at `init_std`, the output projection at `output_std`, biases
        at zero."""
        output_std = init_std if output_std is None else output_std
        for linear, std in ((self.w1, init_std), (self.w3, init_std), (self.w2, output_std)):
            if linear is None:
                continue
            trunc_normal_(linear.weight, std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, x_TD: Tensor) -> Tensor:
        up_TH = None if self.w3 is None else self.w3(x_TD)
        return self.w2(self.activation.hidden(self.w1(x_TD), up_TH))
