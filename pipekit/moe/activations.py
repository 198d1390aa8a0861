"""The activations an MoE expert can use, each with its exact gradient.

The expert backward is written by hand (`pipekit.moe.experts.expert_backward`: the pipelined
MoE runs it per token partition on activations it restores itself), so an activation is more
than a function: it brings the chain rule through itself, on torch's fused backward kernels
(no temporaries beyond the gradient). An expert is one of two forms:

- gated, `w2(act(w1 x) * w3 x)`: "swiglu" (act = silu; Llama, Mixtral, Qwen) and "geglu"
  (act = tanh-approximated gelu; Gemma);
- plain, `w2(act(w1 x))` with no w3: "gelu" (the erf gelu of BERT and GPT-style MLPs).

A gated form may also transform the up projection before the product, `act(g) * up(u)`:
"swiglu_clamped" is gpt-oss's, `(clamp(u, -l, l) + 1) * c * sigmoid(alpha c)` with
`c = clamp(g, max=l)`; its gradient is 0 where a clamp holds, as torch's clamp gives.

Adding one is one entry in `EXPERT_ACTIVATIONS`.

Legend: A assignments (rows), F expert hidden dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "EXPERT_ACTIVATIONS",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "ExpertActivation",
    "expert_activation",
]


@dataclass(frozen=True)
class ExpertActivation:
    """One expert form: `w2(act(w1 x) * up(w3 x))` when gated (`up` the identity unless
    `up_value` is given), `w2(act(w1 x))` when not."""

    name: str
    gated: bool
    """Whether the expert has an up projection w3 that multiplies the activation."""
    value: Callable[[Tensor], Tensor]
    """act(gate), element-wise."""
    backward: Callable[[Tensor, Tensor], Tensor]
    """(d act(gate), gate) -> d gate: the gradient times act'(gate)."""
    up_value: Callable[[Tensor], Tensor] | None = None
    """Element-wise transform of the up projection before the product (gated only); None:
    the up projection as is."""
    up_backward: Callable[[Tensor, Tensor], Tensor] | None = None
    """(d up_value(up), up) -> d up: the chain rule through `up_value`."""

    def transformed_up(self, up_AF: Tensor) -> Tensor:
        """What multiplies act(gate): `up_value(up)`, or `up` itself."""
        return up_AF if self.up_value is None else self.up_value(up_AF)

    def up_grad(self, grad_AF: Tensor, up_AF: Tensor) -> Tensor:
        """d up from the gradient of `transformed_up(up)`."""
        return grad_AF if self.up_backward is None else self.up_backward(grad_AF, up_AF)

    def hidden(self, gate_AF: Tensor, up_AF: Tensor | None) -> Tensor:
        """The expert's hidden activation from its middle tensors (`up_AF` None when plain):
        one place for every module that runs this form (grouped and shared experts)."""
        activated_AF = self.value(gate_AF)
        if not self.gated:
            return activated_AF
        return activated_AF * self.transformed_up(up_AF)

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


SWIGLU_ALPHA = 1.702
"""gpt-oss's sigmoid scale in its clamped SwiGLU (its config's `swiglu_alpha`)."""
SWIGLU_LIMIT = 7.0
"""gpt-oss's clamp of the gate (above) and the up projection (both sides), its config's
`swiglu_limit`."""


def _clamped_swish(gate_AF: Tensor) -> Tensor:
    """`c sigmoid(alpha c)`, `c = clamp(gate, max=limit)`: silu(alpha c) / alpha."""
    clamped_AF = gate_AF.clamp(max=SWIGLU_LIMIT)
    return clamped_AF * torch.sigmoid(SWIGLU_ALPHA * clamped_AF)


def _clamped_swish_backward(grad_AF: Tensor, gate_AF: Tensor) -> Tensor:
    # d/dc [silu(alpha c) / alpha] = silu'(alpha c); 0 above the limit (torch's clamp passes
    # the gradient at the limit itself).
    scaled_AF = SWIGLU_ALPHA * gate_AF.clamp(max=SWIGLU_LIMIT)
    return torch.ops.aten.silu_backward(grad_AF, scaled_AF).masked_fill_(gate_AF > SWIGLU_LIMIT, 0)


def _clamped_up(up_AF: Tensor) -> Tensor:
    return up_AF.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT) + 1


def _clamped_up_backward(grad_AF: Tensor, up_AF: Tensor) -> Tensor:
    return grad_AF.masked_fill(up_AF.abs() > SWIGLU_LIMIT, 0)


EXPERT_ACTIVATIONS: dict[str, ExpertActivation] = {
    activation.name: activation
    for activation in (
        ExpertActivation("swiglu", True, F.silu, _silu_backward),
        ExpertActivation("geglu", True, _gelu_tanh, _gelu_tanh_backward),
        ExpertActivation("gelu", False, F.gelu, _gelu_backward),
        ExpertActivation(
            "swiglu_clamped",
            True,
            _clamped_swish,
            _clamped_swish_backward,
            up_value=_clamped_up,
            up_backward=_clamped_up_backward,
        ),
    )
}


def expert_activation(name: str) -> ExpertActivation:
    """The registered activation `name`; ValueError naming the known ones otherwise."""
    if name not in EXPERT_ACTIVATIONS:
        raise ValueError(
            f"unknown expert activation {name!r}; choose one of {sorted(EXPERT_ACTIVATIONS)} "
            '("gelu" has no w3; the others are gated)'
        )
    return EXPERT_ACTIVATIONS[name]
