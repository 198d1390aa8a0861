"""Grouped experts with 3-D weights and any `ExpertActivation`, their forward and backward
math written out.

`GroupedExperts` holds E experts as stacked weights in Hugging Face's per-expert layout
(`w1_EFD` gate `[F, D]`, `w3_EFD` up `[F, D]`, `w2_EDF` down `[D, F]`), so expert e is exactly a
dense FFN and upcycling copies tensors without transposes. The activation
(`pipekit.moe.activations`) picks the form: gated "swiglu" (the default, `w2(silu(w1 x) * w3 x)`)
or "geglu", or plain "gelu" `w2(gelu(w1 x))`, which has no `w3_EFD` at all. With `biases`
(`MoEArgs.expert_biases`, gpt-oss) each projection adds its expert's bias: `b1_EF` to the gate,
`b3_EF` to the up (gated only), `b2_ED` to the output; each is a row of the expert's stack, so it
shards and moves exactly as the weights do. Under expert parallelism the weights are DTensors
sharded on dim 0 over the `ep` mesh and each rank computes with its local experts. The module's
forward runs the layer's expert execution on them, so FSDP2 can shard the experts further (over
the ep groups holding the same experts) and gather them around that call.

The backward is written by hand (`expert_backward`) rather than left to autograd because the
pipelined MoE (`pipekit.moe.pipelined`) runs it per token partition with activations it
restores itself (MPipeMoE's memory reuse); both paths share these functions.

Legend: A assignments (rows grouped by expert), E experts, D model dim, F expert hidden dim,
K middle tensors (2 gated: gate and up; 1 plain: gate), X a bias's width (F or D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.layers.init import trunc_normal_
from pipekit.layers.swiglu import gated_grads
from pipekit.moe.activations import ExpertActivation, expert_activation
from pipekit.moe.expert_tensors import ExpertBiases, ExpertRunner, ExpertWeights
from pipekit.moe.grouped_mm import (
    grouped_bias_add_,
    grouped_matmul,
    grouped_row_sum,
    grouped_weight_grad,
)
from pipekit.moe.routing import Routing

__all__ = [
    "ExpertBiases",
    "ExpertGrads",
    "ExpertWeights",
    "GroupedExperts",
    "expert_backward",
    "expert_middle",
    "expert_output",
]


class GroupedExperts(nn.Module):
    """E FFNs of one activation, `w2(act(w1 x) * w3 x)` or `w2(act(w1 x))` (each projection
    with its bias when `biases`), stacked on a leading expert dim."""

    bias_parameter_names = ("b1_EF", "b3_EF", "b2_ED")
    """The biases, named by their shapes: what `[optimizer] no_decay = ["bias"]` spares."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        activation: str = "swiglu",
        *,
        biases: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = expert_activation(activation)
        gated = self.activation.gated
        # Registered as None when absent: no unused tensor, and the same parameter names.
        for name, shape, present in (
            ("w1_EFD", (hidden_dim, dim), True),
            ("w3_EFD", (hidden_dim, dim), gated),
            ("w2_EDF", (dim, hidden_dim), True),
            ("b1_EF", (hidden_dim,), biases),
            ("b3_EF", (hidden_dim,), biases and gated),
            ("b2_ED", (dim,), biases),
        ):
            param = nn.Parameter(torch.empty(num_experts, *shape)) if present else None
            self.register_parameter(name, param)

    @property
    def has_biases(self) -> bool:
        return self.b1_EF is not None

    def extra_repr(self) -> str:
        biases = ", biases=True" if self.has_biases else ""
        return f"num_experts={self.num_experts}, activation={self.activation.name!r}{biases}"

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
        for bias in (self.b1_EF, self.b3_EF, self.b2_ED):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x_TD: Tensor, routing: Routing, execution: ExpertRunner) -> Tensor:
        """The routed tokens through their experts, by `execution` (one rank, or the
        all-to-all over the ep group), combined per token."""
        return execution.run(
            x_TD, routing, self.local_weights(), self.activation, biases=self.local_biases()
        )

    def local_weights(self) -> ExpertWeights:
        """(w1, w3, w2) of the experts this rank computes: the local shards of DTensors."""
        return _local(self.w1_EFD, self.w3_EFD, self.w2_EDF)

    def local_biases(self) -> ExpertBiases | None:
        """(b1, b3, b2) of the experts this rank computes (local shards); None: no biases."""
        return _local(self.b1_EF, self.b3_EF, self.b2_ED) if self.has_biases else None


def _local(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    return tuple(t.to_local() if isinstance(t, DTensor) else t for t in tensors)


def expert_middle(
    x_AD: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor | None,
    counts_E: list[int],
    out: Tensor | None = None,
    biases: ExpertBiases | None = None,
) -> Tensor:
    """MPipeMoE's T_M: the gate (and, when gated, up) projections with their biases, stacked
    `[K, A, F]` (the pre-activations: recomputing T_M recomputes the biases too)."""
    projections = (w1_EFD,) if w3_EFD is None else (w1_EFD, w3_EFD)
    if out is None:
        out = x_AD.new_empty(len(projections), x_AD.shape[0], w1_EFD.shape[1])
    for k, weight_EFD in enumerate(projections):
        grouped_matmul(x_AD, weight_EFD.transpose(-2, -1), counts_E, out=out[k])
        if biases is not None:
            grouped_bias_add_(out[k], biases[k], counts_E)
    return out


def expert_output(
    middle_KAF: Tensor,
    w2_EDF: Tensor,
    counts_E: list[int],
    activation: ExpertActivation,
    biases: ExpertBiases | None = None,
) -> Tensor:
    """T_DO: `w2(act(gate) * up)` (gated) or `w2(act(gate))` per expert, plus b2."""
    up_AF = middle_KAF[1] if activation.gated else None
    hidden_AF = activation.hidden(middle_KAF[0], up_AF)
    out_AD = grouped_matmul(hidden_AF, w2_EDF.transpose(-2, -1), counts_E)
    return out_AD if biases is None else grouped_bias_add_(out_AD, biases[2], counts_E)


@dataclass
class ExpertGrads:
    """Gradients of the expert weights and biases, accumulated over token partitions (None
    where the tensor is absent: w3 and b3 if plain, the biases without `biases`)."""

    w1_EFD: Tensor
    w3_EFD: Tensor | None
    w2_EDF: Tensor
    b1_EF: Tensor | None = None
    b3_EF: Tensor | None = None
    b2_ED: Tensor | None = None

    @classmethod
    def zeros_like(
        cls,
        w1_EFD: Tensor,
        w3_EFD: Tensor | None,
        w2_EDF: Tensor,
        biases: ExpertBiases | None = None,
    ) -> ExpertGrads:
        tensors = (w1_EFD, w3_EFD, w2_EDF, *(biases or ()))
        return cls(*(None if t is None else torch.zeros_like(t) for t in tensors))


def expert_backward(
    x_AD: Tensor,
    middle_KAF: Tensor,
    grad_out_AD: Tensor,
    weights: ExpertWeights,
    counts_E: list[int],
    grads: ExpertGrads,
    activation: ExpertActivation,
) -> Tensor:
    """Accumulate the weight (and bias) gradients into `grads`; return the gradient of `x_AD`.

    With g = gate, u = up (biases included), v = up_value(u) (u unless the activation
    transforms it), h = act(g) v (gated) or act(g) (plain), y = h w2^T + b2: dh = dy w2,
    dw2 = dy^T h, dg = dh v act'(g) (plain: dh act'(g)), du = dh act(g) v'(u),
    dx = dg w1 + du w3, dw1 = dg^T x, dw3 = du^T x; each bias's gradient is its expert's row
    sum of dy, dg, du.
    """
    w1_EFD, w3_EFD, w2_EDF = weights
    gate_AF = middle_KAF[0]
    grad_hidden_AF = grouped_matmul(grad_out_AD, w2_EDF, counts_E)
    if activation.gated:
        up_AF = middle_KAF[1]
        transformed_up_AF = activation.transformed_up(up_AF)
        grad_gate_AF, grad_transformed_AF, activated_AF = gated_grads(
            grad_hidden_AF, gate_AF, transformed_up_AF, activation.value, activation.backward
        )
        grad_up_AF = activation.up_grad(grad_transformed_AF, up_AF)
        hidden_AF = activated_AF * transformed_up_AF
    else:
        grad_gate_AF = activation.backward(grad_hidden_AF, gate_AF)
        hidden_AF = activation.value(gate_AF)
    grads.w2_EDF += grouped_weight_grad(grad_out_AD, hidden_AF, counts_E)
    grads.w1_EFD += grouped_weight_grad(grad_gate_AF, x_AD, counts_E)
    grad_x_AD = grouped_matmul(grad_gate_AF, w1_EFD, counts_E)
    if activation.gated:
        grads.w3_EFD += grouped_weight_grad(grad_up_AF, x_AD, counts_E)
        grad_x_AD = grad_x_AD + grouped_matmul(grad_up_AF, w3_EFD, counts_E)
    for grad_EX, grad_AX in (
        (grads.b2_ED, grad_out_AD),
        (grads.b1_EF, grad_gate_AF),
        (grads.b3_EF, grad_up_AF if activation.gated else None),
    ):
        if grad_EX is not None:
            grad_EX += grouped_row_sum(grad_AX, counts_E)
    return grad_x_AD
