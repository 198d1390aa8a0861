"""Load-balancing and router z-losses, injected into the backward pass through autograd.

An MoE layer deep inside a pipeline stage or micro-step cannot add its auxiliary loss to the
loss tensor they return; it attaches the loss to its output instead (`attach_aux_loss(y, aux)`,
through `pipekit.layers.attached_loss`), so `aux` contributes `scale x aux` to the total loss's
gradient wherever and whenever the backward runs.

`scale` is read when the forward runs, from `aux_loss_scale(...)`: the trainer sets it to the
share of the step's tokens that the micro-batch holds, so the auxiliary losses are averaged
over the step exactly as the token losses are; without a context it is 1.

Losses (T tokens, E experts, K per token):
- `switch`:     E x sum_i f_i P_i; f_i the fraction of the T x K choices that went to expert i,
                P_i the mean router probability of expert i (Switch Transformer);
- `importance`: CV(importance)^2, importance_i the sum of expert i's combine weights (Shazeer);
- `sequence`:   the switch loss of each sequence (row) alone, averaged over the rows
                (DeepSeek-V3's sequence-wise balance loss; its routers' P_i are normalised
                scores);
- z-loss:       mean over tokens of logsumexp(logits)^2 (ST-MoE), keeps logits small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from pipekit.layers.attached_loss import attach_loss
from pipekit.layers.sequence_statistics import loss_of_sums
from pipekit.moe.routing import Routing

__all__ = [
    "BALANCE_LOSSES",
    "attach_aux_loss",
    "aux_loss_scale",
    "balance_loss",
    "current_aux_loss_scale",
    "importance_cv2_loss",
    "router_z_loss",
    "sequence_balance_loss",
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
    return _switch_of_sums(_switch_sums(routing))


def sequence_balance_loss(routing: Routing, rows: int = 1) -> Tensor:
    """The switch loss of each of the `rows` sequences alone (the tokens are rows x S in row
    order), averaged over the rows."""
    return _sequence_of_sums(_sequence_sums(routing, rows))


def importance_cv2_loss(routing: Routing) -> Tensor:
    """Squared coefficient of variation of the experts' summed combine weights."""
    return _cv2_of_sums(_importance_sums(routing))


def router_z_loss(routing: Routing) -> Tensor:
    return _mean_of_sums(_z_sums(routing))


def _sum_dtype(routing: Routing) -> torch.dtype:
    """Counts and sums in at least float32: a bf16 count stops being exact at 256."""
    return torch.promote_types(routing.probs_TE.dtype, torch.float32)


def _switch_sums(routing: Routing) -> Tensor:
    """[choices per expert (E), router probability per expert (E), tokens (1)], summed."""
    dtype = _sum_dtype(routing)
    num_tokens = routing.probs_TE.new_full((1,), routing.probs_TE.shape[0], dtype=dtype)
    return torch.cat(
        [routing.chosen_TE.sum(0).to(dtype), routing.probs_TE.sum(0).to(dtype), num_tokens]
    )


def _switch_of_sums(sums: Tensor) -> Tensor:
    num_experts = (sums.numel() - 1) // 2
    choices_E, probs_E, num_tokens = sums[:num_experts], sums[num_experts:-1], sums[-1]
    fraction_E = choices_E / choices_E.sum().clamp(min=1)
    return num_experts * torch.dot(fraction_E, probs_E / num_tokens.clamp(min=1))


def _sequence_sums(routing: Routing, rows: int) -> Tensor:
    """`[rows, 2E + 1]`: each sequence's switch sums (choices, probabilities, tokens)."""
    dtype = _sum_dtype(routing)
    chosen_BSE = routing.chosen_TE.to(dtype).view(rows, -1, routing.num_experts)
    probs_BSE = routing.probs_TE.to(dtype).view(rows, -1, routing.num_experts)
    tokens_B1 = chosen_BSE.new_full((rows, 1), chosen_BSE.shape[1])
    return torch.cat([chosen_BSE.sum(1), probs_BSE.sum(1), tokens_B1], dim=1)


def _sequence_of_sums(sums_BK: Tensor) -> Tensor:
    num_experts = (sums_BK.shape[1] - 1) // 2
    choices_BE, probs_BE = sums_BK[:, :num_experts], sums_BK[:, num_experts:-1]
    tokens_B1 = sums_BK[:, -1:].clamp(min=1)
    fraction_BE = choices_BE / choices_BE.sum(1, keepdim=True).clamp(min=1)
    return num_experts * (fraction_BE * probs_BE / tokens_B1).sum(1).mean()


def _importance_sums(routing: Routing) -> Tensor:
    """Each expert's summed combine weights."""
    weight_A = routing.weight_A.to(_sum_dtype(routing))
    zeros_E = weight_A.new_zeros(routing.num_experts)
    return zeros_E.index_add(0, routing.expert_index_A, weight_A)


def _cv2_of_sums(importance_E: Tensor) -> Tensor:
    mean = importance_E.mean()
    return importance_E.var(unbiased=False) / (mean * mean).clamp(min=1e-20)


def _z_sums(routing: Routing) -> Tensor:
    """[sum over tokens of logsumexp(logits)^2, tokens]."""
    squares_T = torch.logsumexp(routing.logits_TE.to(_sum_dtype(routing)), dim=-1).square()
    return torch.stack([squares_T.sum(), squares_T.new_tensor(float(squares_T.numel()))])


def _mean_of_sums(sums: Tensor) -> Tensor:
    return sums[0] / sums[1].clamp(min=1)


_BALANCE_TERMS = {
    "switch": (lambda routing, rows: _switch_sums(routing), _switch_of_sums),
    "importance": (lambda routing, rows: _importance_sums(routing), _cv2_of_sums),
    "sequence": (_sequence_sums, _sequence_of_sums),
}

BALANCE_LOSSES = {
    "switch": switch_balance_loss,
    "importance": importance_cv2_loss,
    "sequence": sequence_balance_loss,
}
"""Load-balancing loss name (as a config spells it) -> function of a Routing."""


def balance_loss(
    routing: Routing,
    kind: str,
    balance_weight: float,
    z_loss_weight: float,
    owner: object = None,
    rows: int = 1,
) -> Tensor | None:
    """The weighted sum of the configured losses, or None when both weights are 0.

    Each is a function of sums over the tokens (`pipekit.layers.sequence_statistics`): when the
    forward runs as one slice of a sequence, its gradient is the whole sequence's, kept apart
    per `owner` (the MoE layer). `rows`: the sequences the tokens are, in row order (the
    sequence-wise loss keeps them apart)."""
    total: Tensor | None = None
    if balance_weight:
        if kind not in _BALANCE_TERMS:
            raise ValueError(
                f"unknown load-balancing loss {kind!r}; known: {sorted(BALANCE_LOSSES)}"
            )
        sums_of, loss_fn = _BALANCE_TERMS[kind]
        total = balance_weight * loss_of_sums(sums_of(routing, rows), loss_fn, (owner, kind))
    if z_loss_weight:
        z_loss = z_loss_weight * loss_of_sums(_z_sums(routing), _mean_of_sums, (owner, "z"))
        total = z_loss if total is None else total + z_loss
    return total


def attach_aux_loss(output: Tensor, aux_loss: Tensor | None) -> Tensor:
    """`output`, with `aux_loss x aux_loss_scale()` added to the loss its backward minimises."""
    return attach_loss(output, aux_loss, _AUX_LOSS_SCALE.get())
