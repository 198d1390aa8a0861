"""Where each token partition's assignments go: splits, counts and the reorder after receipt.

MPipeMoE splits a rank's tokens into n partitions along the token dimension and gives each
partition a complete, smaller all-to-all (its Fig. 5b), not a share of the ranks. Partition p
holds tokens [p T / n, (p + 1) T / n) and every assignment of those tokens.

Experts are laid out in contiguous blocks: rank r of the `R`-rank exchange owns experts
[r E_l, (r + 1) E_l). Assignments are sorted by expert, so rank r's rows are one contiguous block
of the send buffer. Rows arrive grouped by source rank; the experts want them grouped by expert,
so `to_expert_major` reorders them (and its inverse scatters the expert outputs back).

All partitions' counts are exchanged in one small all-to-all before any token moves.

Legend: A assignments, E experts (global), L experts on this rank, R ranks, P partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pipekit.moe.routing import Routing
from pipekit.moe.token_exchange import TokenExchange

__all__ = ["PartitionPlan", "plan_partitions"]


@dataclass(frozen=True)
class PartitionPlan:
    """One token partition's assignments and how their rows travel."""

    assignments: slice
    """This partition's rows in the partition-ordered assignment list."""
    token_index_A: Tensor
    """Input row (token) of each of its assignments, sorted by expert."""
    send_splits: list[int]
    """Rows sent to each rank."""
    recv_splits: list[int]
    """Rows received from each rank."""
    local_counts_L: list[int]
    """Rows per local expert after the reorder (summed over sources)."""
    to_expert_major: Tensor | None
    """Received-order row of each expert-major row; None when the orders agree."""

    @property
    def received_rows(self) -> int:
        return sum(self.recv_splits)


def plan_partitions(
    routing: Routing, num_partitions: int, exchange: TokenExchange
) -> tuple[list[PartitionPlan], Tensor]:
    """Plans of the `num_partitions` token partitions, and the assignment order they use.

    The second value lists, for each partition-ordered assignment, its index in `routing`,
    so `routing.weight_A[order]` are the combine weights in plan order.
    """
    num_tokens = routing.probs_TE.shape[0]
    num_experts = routing.num_experts
    ranks = exchange.size
    if num_experts % ranks:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over {ranks} expert-parallel ranks; "
            "make num_experts a multiple of ep"
        )
    local_experts = num_experts // ranks
    bounds = [p * num_tokens // num_partitions for p in range(num_partitions + 1)]
    # Partition of each assignment; a stable sort by it keeps the expert order within each.
    partition_A = torch.bucketize(
        routing.token_index_A,
        torch.tensor(bounds[1:-1], device=routing.token_index_A.device),
        right=True,
    )
    order_A = torch.sort(partition_A, stable=True).indices
    counts_PE = torch.zeros(
        num_partitions, num_experts, dtype=torch.long, device=partition_A.device
    )
    counts_PE.index_put_(
        (partition_A, routing.expert_index_A),
        torch.ones_like(partition_A),
        accumulate=True,
    )
    send_PRL = counts_PE.view(num_partitions, ranks, local_experts)
    recv_PRL = exchange.exchange_counts(send_PRL).cpu()
    send_PRL = send_PRL.cpu()
    token_index_A = routing.token_index_A[order_A]
    plans = []
    start = 0
    for partition in range(num_partitions):
        send_RL, recv_RL = send_PRL[partition], recv_PRL[partition]
        size = int(send_RL.sum())
        plans.append(
            PartitionPlan(
                assignments=slice(start, start + size),
                token_index_A=token_index_A[start : start + size],
                send_splits=send_RL.sum(1).tolist(),
                recv_splits=recv_RL.sum(1).tolist(),
                local_counts_L=recv_RL.sum(0).tolist(),
                to_expert_major=_expert_major_order(recv_RL, token_index_A.device),
            )
        )
        start += size
    return plans, order_A


def _expert_major_order(recv_RL: Tensor, device: torch.device) -> Tensor | None:
    """For rows received grouped by (source, expert), the index that groups them by expert."""
    ranks = recv_RL.shape[0]
    if ranks == 1:
        return None
    block_sizes_LR = recv_RL.t().reshape(-1)
    received_start_RL = (recv_RL.reshape(-1).cumsum(0) - recv_RL.reshape(-1)).view_as(recv_RL)
    expert_major_start = block_sizes_LR.cumsum(0) - block_sizes_LR
    shift = received_start_RL.t().reshape(-1) - expert_major_start
    total = int(block_sizes_LR.sum())
    return (torch.arange(total) + torch.repeat_interleave(shift, block_sizes_LR)).to(device)
