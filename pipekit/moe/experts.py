"""Grouped experts with 3-D weights and any `ExpertActivation`, their forward and backward
math written out.

`GroupedExperts` holds E experts as stacked weights in Hugging Face's per-expert layout
(`w1_EFD` gate `[F, D]`, `w3_EFD` up `[F, D]`, `w2_EDF` down `[D, F]`), so expert e is exactly a
dense FFN and upcycling copies tensors without transposes. The activation
(`pipekit.moe.activations`) picks the form: gated "swiglu" (the default, `w2(silu(w1 x) * w3 x)`)
or "geglu", or plain "gelu" `w2(gelu(w1 x))`, which has no `w3_EFD` at all. Under expert
parallelism the weights are DTensors sharded on dim 0 over the `ep` mesh and each rank computes
with its local experts. The module's forward runs the layer's expert execution on them, so FSDP2
can shard the experts further (over the ep groups holding the same experts) and gather them
around that call.

The backward is written by hand (`expert_backward`) rather than left to autograd because the
pipelined MoE (`pipekit.moe.pipelined`) runs it per token partition with activations it
restores itself (MPipeMoE's memory reuse); both paths share these functions.

Legend: A assignments (rows grouped by expert), E experts, D model dim, F expert hidden dim,
K middle tensors (2 gated: gate and up; 1 plain: gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.layers.init import trunc_normal_
from pipekit.layers.swiglu import gated_grads
from pipekit.moe.activations import ExpertActivation, expert_activation
from pipekit.moe.grouped_mm import grouped_matmul, grouped_weight_grad

if TYPE_CHECKING:
    from pipekit.moe.execution import ExpertExecution
    from pipekit.moe.routing import Routing

__all__ = [
    "ExpertGrads",
    "ExpertWeights",
    "GroupedExperts",
    "expert_backward",
    "expert_middle",
    "expert_output",
]

ExpertWeights = tuple[Tensor, Tensor | None, Tensor]
"""(w1_EFD, w3_EFD, w2_EDF); w3_EFD is None for a plain (non-gated) activation."""


class GroupedExperts(nn.Module):
    """E FFNs of one activation, `w2(act(w1 x) * w3 x)` or `w2(act(w1 x))`, stacked on a
    leading expert dim."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, activation: str = "swiglu"
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = expert_activation(activation)
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Registered as None when plain: no unused weight, and the same parameter names.
        up = torch.empty(num_experts, hidden_dim, dim) if self.activation.gated else None
        self.register_parameter("w3_EFD", None if up is None else nn.Parameter(up))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, activation={self.activation.name!r}"

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """As `FeedForward.reset_parameters`, for every expert."""
        output_std = init_std if output_std is None else output_std
        for weight, std in (
            (self.w1_EFD, init_std),
            (self.w3_EFD, init_std),
            (self.w2_EDF, output_std),
        ):
            if weight is not None:
                trunc_normal_(weight, std)

    def forward(self, x_TD: Tensor, routing: Routing, execution: ExpertExecution) -> Tensor:
        """The routed tokens through their experts, by `execution` (one rank, or the
        all-to-all over the ep group), combined per token."""
        return execution.run(x_TD, routing, self.local_weights(), self.activation)

    def local_weights(self) -> ExpertWeights:
        """(w1, w3, w2) of the experts this rank computes: the local shards of DTensors."""
        return tuple(
            weight.to_local() if isinstance(weight, DTensor) else weight
            for weight in (self.w1_EFD, self.w3_EFD, self.w2_EDF)
        )


def expert_middle(
    x_AD: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor | None,
    counts_E: list[int],
    out: Tensor | None = None,
) -> Tensor:
    """MPipeMoE's T_M: the gate (and, when gated, up) projections, stacked `[K, A, F]`."""
    projections = (w1_EFD,) if w3_EFD is None else (w1_EFD, w3_EFD)
    if out is None:
        out = x_AD.new_empty(len(projections), x_AD.shape[0], w1_EFD.shape[1])
    for k, weight_EFD in enumerate(projections):
        grouped_matmul(x_AD, weight_EFD.transpose(-2, -1), counts_E, out=out[k])
    return out


def expert_output(
    middle_KAF: Tensor, w2_EDF: Tensor, counts_E: list[int], activation: ExpertActivation
) -> Tensor:
    """T_DO: `w2(act(gate) * up)` (gated) or `w2(act(gate))` per expert."""
    hidden_AF = activation.value(middle_KAF[0])
    if activation.gated:
        hidden_AF = hidden_AF * middle_KAF[1]
    return grouped_matmul(hidden_AF, w2_EDF.transpose(-2, -1), counts_E)


@dataclass
class ExpertGrads:
    """Gradients of the expert weights, accumulated over token partitions (w3: None if plain)."""

    w1_EFD: Tensor
    w3_EFD: Tensor | None
    w2_EDF: Tensor

    @classmethod
    def zeros_like(cls, w1_EFD: Tensor, w3_EFD: Tensor | None, w2_EDF: Tensor) -> ExpertGrads:
        w3_grad = None if w3_EFD is None else torch.zeros_like(w3_EFD)
        return cls(torch.zeros_like(w1_EFD), w3_grad, torch.zeros_like(w2_EDF))


def expert_backward(
    x_AD: Tensor,
    middle_KAF: Tensor,
    grad_out_AD: Tensor,
    weights: ExpertWeights,
    counts_E: list[int],
    grads: ExpertGrads,
    activation: ExpertActivation,
) -> Tensor:
    """Accumulate the weight gradients into `grads`; return the gradient of `x_AD`.

    With g = gate, u = up, h = act(g) u (gated) or act(g) (plain), y = h w2^T: dh = dy w2,
    dw2 = dy^T h, dg = dh u act'(g) (plain: dh act'(g)), du = dh act(g), dx = dg w1 + du w3,
    dw1 = dg^T x, dw3 = du^T x.
    """
    w1_EFD, w3_EFD, w2_EDF = weights
    gate_AF = middle_KAF[0]
    grad_hidden_AF = grouped_matmul(grad_out_AD, w2_EDF, counts_E)
    if activation.gated:
        up_AF = middle_KAF[1]
        grad_gate_AF, grad_up_AF, activated_AF = gated_grads(
            grad_hidden_AF, gate_AF, up_AF, activation.value, activation.backward
        )
        hidden_AF = activated_AF * up_AF
    else:
        grad_gate_AF = activation.backward(grad_hidden_AF, gate_AF)
        hidden_AF = activation.value(gate_AF)
    grads.w2_EDF += grouped_weight_grad(grad_out_AD, hidden_AF, counts_E)
    grads.w1_EFD += grouped_weight_grad(grad_gate_AF, x_AD, counts_E)
    grad_x_AD = grouped_matmul(grad_gate_AF, w1_EFD, counts_E)
    if activation.gated:
        grads.w3_EFD += grouped_weight_grad(grad_up_AF, x_AD, counts_E)
        grad_x_AD = grad_x_AD + grouped_matmul(grad_up_AF, w3_EFD, counts_E)
    return grad_x_AD
