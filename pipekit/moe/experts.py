"""SwiGLU experts with 3-D weights, and their forward and backward math written out.

`GroupedExperts` holds E experts as three stacked weights in Hugging Face's per-expert layout
(`w1_EFD`, `w3_EFD` gate/up `[F, D]`, `w2_EDF` down `[D, F]`), so expert e is exactly a Llama
FFN and upcycling copies tensors without transposes. Under expert parallelism the weights are
DTensors sharded on dim 0 over the `ep` mesh and each rank computes with its local experts. The
module's forward runs the layer's expert execution on them, so FSDP2 can shard the experts
further (over the ep groups holding the same experts) and gather them around that call.

The backward is written by hand (`swiglu_backward`) rather than left to autograd because the
pipelined MoE (`pipekit.moe.pipelined`) runs it per token partition with activations it
restores itself (MPipeMoE's memory reuse); both paths share these functions.

Legend: A assignments (rows grouped by expert), E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.layers.init import trunc_normal_
from pipekit.layers.swiglu import swiglu, swiglu_grads
from pipekit.moe.grouped_mm import grouped_matmul, grouped_weight_grad

if TYPE_CHECKING:
    from pipekit.moe.execution import ExpertExecution
    from pipekit.moe.routing import Routing

__all__ = ["ExpertGrads", "GroupedExperts", "swiglu_backward", "swiglu_middle", "swiglu_output"]


class GroupedExperts(nn.Module):
    """E SwiGLU FFNs `w2(silu(w1 x) * w3 x)`, stacked on a leading expert dim."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """As `FeedForward.reset_parameters`, for every expert."""
        output_std = init_std if output_std is None else output_std
        for weight, std in (
            (self.w1_EFD, init_std),
            (self.w3_EFD, init_std),
            (self.w2_EDF, output_std),
        ):
            trunc_normal_(weight, std)

    def forward(self, x_TD: Tensor, routing: Routing, execution: ExpertExecution) -> Tensor:
        """The routed tokens through their experts, by `execution` (one rank, or the
        all-to-all over the ep group), combined per token."""
        return execution.run(x_TD, routing, self.local_weights())

    def local_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """(w1, w3, w2) of the experts this rank computes: the local shards of DTensors."""
        return tuple(
            weight.to_local() if isinstance(weight, DTensor) else weight
            for weight in (self.w1_EFD, self.w3_EFD, self.w2_EDF)
        )


def swiglu_middle(
    x_AD: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor,
    counts_E: list[int],
    out: Tensor | None = None,
) -> Tensor:
    """MPipeMoE's T_M: the gate and up projections, stacked `[2, A, F]` (into `out`)."""
    if out is None:
        out = x_AD.new_empty(2, x_AD.shape[0], w1_EFD.shape[1])
    grouped_matmul(x_AD, w1_EFD.transpose(-2, -1), counts_E, out=out[0])
    grouped_matmul(x_AD, w3_EFD.transpose(-2, -1), counts_E, out=out[1])
    return out


def swiglu_output(middle_2AF: Tensor, w2_EDF: Tensor, counts_E: list[int]) -> Tensor:
    """T_DO: `w2(silu(gate) * up)` per expert."""
    hidden_AF = swiglu(middle_2AF[0], middle_2AF[1])
    return grouped_matmul(hidden_AF, w2_EDF.transpose(-2, -1), counts_E)


@dataclass
class ExpertGrads:
    """Gradients of the three expert weights, accumulated over token partitions."""

    w1_EFD: Tensor
    w3_EFD: Tensor
    w2_EDF: Tensor

    @classmethod
    def zeros_like(cls, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor) -> ExpertGrads:
        return cls(torch.zeros_like(w1_EFD), torch.zeros_like(w3_EFD), torch.zeros_like(w2_EDF))


def swiglu_backward(
    x_AD: Tensor,
    middle_2AF: Tensor,
    grad_out_AD: Tensor,
    weights: tuple[Tensor, Tensor, Tensor],
    counts_E: list[int],
    grads: ExpertGrads,
) -> Tensor:
    """Accumulate the weight gradients into `grads`; return the gradient of `x_AD`.

    With g = gate, u = up, h = silu(g) u, y = h w2^T: dh = dy w2, dw2 = dy^T h,
    dg = dh u silu'(g), du = dh silu(g), dx = dg w1 + du w3, dw1 = dg^T x, dw3 = du^T x.
    """
    w1_EFD, w3_EFD, w2_EDF = weights
    gate_AF, up_AF = middle_2AF[0], middle_2AF[1]
    grad_hidden_AF = grouped_matmul(grad_out_AD, w2_EDF, counts_E)
    grad_gate_AF, grad_up_AF, silu_AF = swiglu_grads(grad_hidden_AF, gate_AF, up_AF)
    grads.w2_EDF += grouped_weight_grad(grad_out_AD, silu_AF * up_AF, counts_E)
    grads.w1_EFD += grouped_weight_grad(grad_gate_AF, x_AD, counts_E)
    grads.w3_EFD += grouped_weight_grad(grad_up_AF, x_AD, counts_E)
    return grouped_matmul(grad_gate_AF, w1_EFD, counts_E) + grouped_matmul(
        grad_up_AF, w3_EFD, counts_E
    )
