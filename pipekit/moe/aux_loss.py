"""Load-balancing and router z-losses, injected into the backward pass through autograd.

A pipeline stage or a gradient-accumulation micro-step returns one loss tensor; an MoE layer deep
inside cannot add its auxiliary loss to it. Instead the layer attaches the loss to its output:
`attach_aux_loss(y, aux)` is the identity on `y` in forward, and in backward it also hands `aux`
the gradient `scale`, so `aux` contributes `scale x aux` to the total loss's gradient wherever
and whenever the backward runs (Megatron-Core's MoEAuxLossAutoScaler does the same).

`scale` is read when the forward runs, from `aux_loss_scale(...)`: the trainer sets it to the
share of the step's tokens that the micro-batch holds, so the auxiliary losses are averaged
over the step exactly as the token losses are; without a context it is 1.

Losses (T tokens, E experts, K per token):
- `switch`:     E x sum_i f_i P_i; f_i the fraction of the T x K choices that went to expert i,
                P_i the mean router probability of expert i (Switch Transformer);
- `importance`: CV(importance)^2, importance_i the sum of expert i's combine weights (Shazeer);
- z-loss:       mean over tokens of logsumexp(logits)^2 (ST-MoE), keeps logits small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from pipekit.moe.routing import Routing

__all__ = [
    "BALANCE_LOSSES",
    "attach_aux_loss",
    "aux_loss_scale",
    "balance_loss",
    "current_aux_loss_scale",
    "importance_cv2_loss",
    "router_z_loss",
    "switch_balance_loss",
]

_AUX_LOSS_SCALE: ContextVar[float] = ContextVar("aux_loss_scale", default=1.0)


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Weight of the auxiliary losses of the MoE forwards run inside this context."""
    token = _AUX_LOSS_SCALE.set(scale)
    try:
        yield
    finally:
        _AUX_LOSS_SCALE.reset(token)


def current_aux_loss_scale() -> float:
    """The scale `aux_loss_scale` set around this point (1 outside any)."""
    return _AUX_LOSS_SCALE.get()


def switch_balance_loss(routing: Routing) -> Tensor:
    """E x sum_i f_i P_i; equals 1 when choices and probabilities are uniform."""
    num_tokens, num_experts = routing.probs_TE.shape
    choices = routing.chosen_TE.sum().clamp(min=1)
    fraction_E = routing.chosen_TE.sum(0) / choices
    mean_prob_E = routing.probs_TE.sum(0) / max(num_tokens, 1)
    return num_experts * torch.dot(fraction_E, mean_prob_E)


def importance_cv2_loss(routing: Routing) -> Tensor:
    """Squared coefficient of variation of the experts' summed combine weights."""
    importance_E = torch.zeros(
        routing.num_experts, dtype=routing.weight_A.dtype, device=routing.weight_A.device
    ).index_add(0, routing.expert_index_A, routing.weight_A)
    mean = importance_E.mean()
    return importance_E.var(unbiased=False) / (mean * mean).clamp(min=1e-20)


def router_z_loss(routing: Routing) -> Tensor:
    return torch.logsumexp(routing.logits_TE, dim=-1).square().mean()


BALANCE_LOSSES = {"switch": switch_balance_loss, "importance": importance_cv2_loss}
"""Load-balancing loss name (as a config spells it) -> function of a Routing."""


def balance_loss(
    routing: Routing, kind: str, balance_weight: float, z_loss_weight: float
) -> Tensor | None:
    """The weighted sum of the configured losses, or None when both weights are 0."""
    total: Tensor | None = None
    if balance_weight:
        if kind not in BALANCE_LOSSES:
            raise ValueError(
                f"unknown load-balancing loss {kind!r}; known: {sorted(BALANCE_LOSSES)}"
            )
        total = balance_weight * BALANCE_LOSSES[kind](routing)
    if z_loss_weight:
        z_loss = z_loss_weight * router_z_loss(routing)
        total = z_loss if total is None else total + z_loss
    return total


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux_loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:
        aux_grad = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, aux_grad, None


def attach_aux_loss(output: Tensor, aux_loss: Tensor | None) -> Tensor:
    """`output`, with `aux_loss x aux_loss_scale()` added to the loss its backward minimises."""
    if aux_loss is None or not torch.is_grad_enabled() or not aux_loss.requires_grad:
        return output
    return _AttachAuxLoss.apply(output, aux_loss, _AUX_LOSS_SCALE.get())
