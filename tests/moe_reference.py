"""A plain-autograd MoE forward, one gathered matmul per assignment: the reference of the tests.

It reuses the layer's router (routers are tested against their definitions separately) and
computes every expert output from the full expert weights with ordinary differentiable ops, so
its gradients come from autograd, not from `swiglu_backward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipekit.moe import MoE
from pipekit.moe.aux_loss import attach_aux_loss, balance_loss


def reference_moe_forward(
    moe: MoE, x_BSD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor
) -> Tensor:
    """The MoE layer's output computed assignment by assignment, with the aux loss attached."""
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    routing = moe.router(x_TD)
    rows_AD = x_TD[routing.token_index_A]
    expert_A = routing.expert_index_A
    gate_AF = torch.einsum("ad,afd->af", rows_AD, w1_EFD[expert_A])
    up_AF = torch.einsum("ad,afd->af", rows_AD, w3_EFD[expert_A])
    out_AD = torch.einsum("af,adf->ad", F.silu(gate_AF) * up_AF, w2_EDF[expert_A])
    out_TD = torch.zeros_like(x_TD).index_add(
        0, routing.token_index_A, out_AD * routing.weight_A[:, None]
    )
    if moe.training:
        args = moe.args
        aux = balance_loss(routing, args.load_balance, args.load_balance_weight, args.z_loss_weight)
        out_TD = attach_aux_loss(out_TD, aux)
    return out_TD.view_as(x_BSD)
