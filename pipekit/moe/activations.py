"""The activations an MoE expert can use, each with its exact gradient.

The expert backward is written by hand (`pipekit.moe.experts.expert_backward`: the pipelined
MoE runs it per token partition on activations it restores itself), so an activation is more
than a function: it brings the chain rule through itself, on torch's fused backward kernels
(no temporaries beyond the gradient). An expert is one of two forms:

- gated, `w2(act(w1 x) * w3 x)`: "swiglu" (act = silu; Llama, Mixtral, Qwen) and "geglu"
  (act = tanh-approximated gelu; Gemma);
- plain, `w2(act(w1 x))` with no w3: "gelu" (the erf gelu of BERT and GPT-style MLPs).

Adding one is one entry in `EXPERT_ACTIVATIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["EXPERT_ACTIVATIONS", "ExpertActivation", "expert_activation"]


@dataclass(frozen=True)
class ExpertActivation:
    """One expert form: `w2(act(w1 x) * w3 x)` when gated, `w2(act(w1 x))` when not."""

    name: str
    gated: bool
    """Whether the expert has an up projection w3 that multiplies the activation."""
    value: Callable[[Tensor], Tensor]
    """act(gate), element-wise."""
    backward: Callable[[Tensor, Tensor], Tensor]
    """(d act(gate), gate) -> d gate: the gradient times act'(gate)."""

    @property
    def middle_tensors(self) -> int:
        """Tensors of T_M, the pre-activation middle (gate, and up when gated), `[A, F]` each."""
        return 2 if self.gated else 1

    @property
    def forward_gemms(self) -> int:
        """GEMMs of the expert's forward: one per middle tensor, and the down projection."""
        return self.middle_tensors + 1


def _silu_backward(grad_AF: Tensor, gate_AF: Tensor) -> Tensor:
    return torch.ops.aten.silu_backward(grad_AF, gate_AF)


def _gelu_tanh(gate_AF: Tensor) -> Tensor:
    return F.gelu(gate_AF, approximate="tanh")


def _gelu_tanh_backward(grad_AF: Tensor, gate_AF: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad_AF, gate_AF, approximate="tanh")


def _gelu_backward(grad_AF: Tensor, gate_AF: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad_AF, gate_AF)


EXPERT_ACTIVATIONS: dict[str, ExpertActivation] = {
    activation.name: activation
    for activation in (
        ExpertActivation("swiglu", True, F.silu, _silu_backward),
        ExpertActivation("geglu", True, _gelu_tanh, _gelu_tanh_backward),
        ExpertActivation("gelu", False, F.gelu, _gelu_backward),
    )
}


def expert_activation(name: str) -> ExpertActivation:
    """The registered activation `name`; ValueError naming the known ones otherwise."""
    if name not in EXPERT_ACTIVATIONS:
        raise ValueError(
            f"unknown expert activation {name!r}; choose one of {sorted(EXPERT_ACTIVATIONS)} "
            '("swiglu" and "geglu" are gated, "gelu" has no w3)'
        )
    return EXPERT_ACTIVATIONS[name]
