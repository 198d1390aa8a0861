"""SwiGLU feed-forward network `w2(silu(w1 x) * w3 x)`, with a memory-efficient gate.

`silu(g) * u` written as two ops saves three `[tokens, hidden]` tensors for the backward: `g`
(for silu), `silu(g)` and `u` (for the product). `swiglu` saves only `g` and `u` and
recomputes the swish in the backward (SlimPipe §5, as Megatron's fused SwiGLU does): one
element-wise sigmoid per element instead of a third stored tensor. The down projection saves
its input `silu(g) * u` either way. `swiglu_reference` is the two-op form, kept to test
against. `gated_grads` is that backward for any gate activation: the gated grouped experts
(`pipekit.moe.activations`: SwiGLU, GeGLU) share it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipekit.layers.init import trunc_normal_

__all__ = ["FeedForward", "gated_grads", "swiglu", "swiglu_grads", "swiglu_reference"]


class _SwiGLU(torch.autograd.Function):
    """`silu(g) * u`, saving g and u only."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        grad_gate, grad_up, _ = swiglu_grads(grad_out, gate, up)
        return grad_gate, grad_up


def swiglu_grads(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(d gate, d up, silu(gate))` of `silu(gate) * up` from its output gradient, the swish
    recomputed from the gate."""
    return gated_grads(grad_out, gate, up, F.silu, torch.ops.aten.silu_backward)


def gated_grads(
    grad_out: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Callable[[Tensor], Tensor],
    act_backward: Callable[[Tensor, Tensor], Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """`(d gate, d up, act(gate))` of `act(gate) * up` from its output gradient, `act(gate)`
    recomputed; `act_backward(d act, gate)` is the fused chain rule through `act` (no
    temporaries). The dense SwiGLU and every gated grouped expert share it."""
    grad_gate = act_backward(grad_out * up, gate)
    activated = act(gate)
    return grad_gate, grad_out * activated, activated


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up`; its backward recomputes the swish from the saved gate."""
    return _SwiGLU.apply(gate, up)


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` as two autograd ops (saves `silu(gate)` too)."""
    return F.silu(gate) * up


class FeedForward(nn.Module):
    """Gate (w1), down (w2) and up (w3) projections without biases, as in Llama; the gate is
    `swiglu` (`pipekit.layers.reference.set_memory_efficient` switches to the reference)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.gate = swiglu

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Truncated-normal init; `output_std` for w2 lets deep models scale it down."""
        output_std = init_std if output_std is None else output_std
        for linear, std in ((self.w1, init_std), (self.w3, init_std), (self.w2, output_std)):
            trunc_normal_(linear.weight, std)

    def forward(self, x_BSD: Tensor) -> Tensor:
        return self.w2(self.gate(self.w1(x_BSD), self.w3(x_BSD)))
