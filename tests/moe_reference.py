"""A plain-autograd MoE forward, one gathered matmul per assignment: the reference of the tests.

It reuses the layer's router (routers are tested against their definitions separately) and
computes every (SwiGLU) expert output from the full expert weights with ordinary differentiable
ops, so its gradients come from autograd, not from the hand-written `expert_backward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipekit.moe import MoE, MoEArgs
from pipekit.moe.aux_loss import attach_aux_loss, balance_loss

DIM, HIDDEN, EXPERTS = 8, 12, 4
"""The tests' MoE shape: small enough for float64 loops, 4 experts to split over 2 or 4 ranks."""


def small_moe(
    router: str, top_k: int, capacity: float | None, *, z_loss_weight: float = 0.001, **changes
) -> MoE:
    """A float64 MoE of the tests' shape, seeded, with weights large enough to route unevenly."""
    torch.manual_seed(0)
    args = MoEArgs(
        num_experts=EXPERTS,
        top_k=top_k,
        router=router,
        capacity_factor=capacity,
        z_loss_weight=z_loss_weight,
        **changes,
    )
    moe = MoE(DIM, HIDDEN, args).double()
    moe.reset_parameters(0.3, 0.3)
    if router == "noisy_topk":
        torch.nn.init.normal_(moe.router.noise_gate.weight, std=0.3)
    return moe


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
