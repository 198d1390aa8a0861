"""A routing decision as a flat list of (token, expert, weight) assignments, sorted by expert.

Token-choice routers (each token picks k experts) and expert-choice routers (each expert picks c
tokens) both reduce to this list, so dispatch, expert compute and combine never ask which router
made it. An assignment is one copy of a token sent to one expert; the MoE output of a token is
the weighted sum of its assignments' expert outputs. A token with no assignment (dropped by the
capacity limit, or picked by no expert) gets zero from the MoE layer and keeps only its residual.

Assignments are sorted by expert, then by token, so the tokens of expert e are one contiguous
run of `tokens_per_expert[e]` rows: experts of one rank are one contiguous block, which is what
the expert-parallel all-to-all sends.

Legend: T tokens, E experts, K experts per token, A assignments, D model dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Routing", "expert_capacity", "routing_from_choices", "split_experts"]


@dataclass(frozen=True)
class Routing:
    """Which token goes to which expert with what weight; the router's scores for the losses."""

    token_index_A: Tensor
    """Row of the token (in the flattened [T, D] input) of each assignment; int64."""
    expert_index_A: Tensor
    """Expert of each assignment; non-decreasing; int64."""
    weight_A: Tensor
    """Combine weight of each assignment (differentiable w.r.t. the router)."""
    tokens_per_expert_E: Tensor
    """Number of assignments of each expert; int64, sums to A."""
    logits_TE: Tensor
    """Router logits, before any noise: the z-loss reads them."""
    probs_TE: Tensor
    """Softmax of the (noisy) logits over all experts: the balancing losses read them."""
    chosen_TE: Tensor
    """1 where the router chose (token, expert) before capacity drops, else 0: the f_i of the
    switch loss counts these."""

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert_E.numel()


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Most tokens one expert takes: ceil(capacity_factor x T x K / E) (GShard, Switch)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def routing_from_choices(
    expert_index_TK: Tensor,
    weight_TK: Tensor,
    *,
    logits_TE: Tensor,
    probs_TE: Tensor,
    capacity: int | None,
) -> Routing:
    """Flatten token-choice top-k picks into a `Routing`, dropping over-capacity assignments.

    With `capacity`, each expert keeps its `capacity` assignments of highest router probability
    (`probs_TE`, ties to the earlier token) and drops the rest; None keeps all (dropless).
    """
    num_tokens, top_k = expert_index_TK.shape
    num_experts = logits_TE.shape[-1]
    expert_index_A = expert_index_TK.reshape(-1)
    token_index_A = torch.arange(num_tokens, device=expert_index_A.device).repeat_interleave(top_k)
    weight_A = weight_TK.reshape(-1)
    chosen_TE = torch.zeros_like(probs_TE).scatter_(1, expert_index_TK, 1.0)
    if capacity is not None:
        keep_A = _within_capacity(expert_index_A, token_index_A, probs_TE, capacity)
        expert_index_A, token_index_A, weight_A = (
            expert_index_A[keep_A],
            token_index_A[keep_A],
            weight_A[keep_A],
        )
    # A stable sort by expert keeps each expert's tokens in token order.
    order_A = torch.sort(expert_index_A, stable=True).indices
    expert_index_A = expert_index_A[order_A]
    return Routing(
        token_index_A=token_index_A[order_A],
        expert_index_A=expert_index_A,
        weight_A=weight_A[order_A],
        tokens_per_expert_E=torch.bincount(expert_index_A, minlength=num_experts),
        logits_TE=logits_TE,
        probs_TE=probs_TE,
        chosen_TE=chosen_TE,
    )


def _within_capacity(
    expert_index_A: Tensor, token_index_A: Tensor, probs_TE: Tensor, capacity: int
) -> Tensor:
    """Mask of the assignments each expert keeps: its `capacity` most probable ones."""
    prob_A = probs_TE.detach()[token_index_A, expert_index_A]
    # Order by expert, then by probability descending, then by token: sort on the finest key
    # first, and stable sorts on coarser keys keep the finer order within ties.
    order_A = torch.sort(token_index_A, stable=True).indices
    order_A = order_A[torch.sort(prob_A[order_A], descending=True, stable=True).indices]
    order_A = order_A[torch.sort(expert_index_A[order_A], stable=True).indices]
    sorted_experts_A = expert_index_A[order_A]
    counts_E = torch.bincount(sorted_experts_A, minlength=probs_TE.shape[-1])
    group_start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_A = (
        torch.arange(order_A.numel(), device=order_A.device) - group_start_E[sorted_experts_A]
    )
    keep_A = torch.empty_like(order_A, dtype=torch.bool)
    keep_A[order_A] = rank_in_expert_A < capacity
    return keep_A


def split_experts(routing: Routing, pieces: int) -> Routing:
    """The same decision over `pieces` x E expert pieces (expert tensor parallelism): each
    assignment (token, e, weight) becomes one per piece j, to piece expert j x E + e with the
    same weight. An expert's FFN split on its hidden dim is the sum of its pieces, so combining
    the pieces' outputs gives the expert's; pieces are ordered piece-major, so the ranks of one
    piece hold it for a contiguous block of experts, like expert parallelism's. The losses'
    fields (logits, probabilities, choices) stay the router's."""
    if pieces == 1:
        return routing
    num_experts = routing.num_experts
    offsets = [routing.expert_index_A + piece * num_experts for piece in range(pieces)]
    return Routing(
        token_index_A=routing.token_index_A.repeat(pieces),
        expert_index_A=torch.cat(offsets),
        weight_A=routing.weight_A.repeat(pieces),
        tokens_per_expert_E=routing.tokens_per_expert_E.repeat(pieces),
        logits_TE=routing.logits_TE,
        probs_TE=routing.probs_TE,
        chosen_TE=routing.chosen_TE,
    )
