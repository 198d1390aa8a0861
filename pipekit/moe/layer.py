"""The MoE feed-forward layer: router, experts, and how the experts run.

`MoE` replaces a dense FFN: `forward(x_BSD)` routes every token, runs the experts through
its `ExpertExecution` (single-process by default; expert-parallel and pipelined once
`apply_expert_parallel` has swapped it), and returns the weighted sum of each token's expert
outputs. A token the router drops gets zero here, and keeps its residual in the block. The
experts' activation (`MoEArgs.activation`, one of `pipekit.moe.EXPERT_ACTIVATIONS`) matches the
dense FFN they replace: SwiGLU for Llama-style models, GeGLU for Gemma, plain GELU for GPT-2.

In training, the configured auxiliary losses are attached to the output through autograd
(`attach_aux_loss`), so they reach the router's gradient under pipelining and gradient
accumulation without the caller adding them to its loss.

Legend: B batch, S sequence, T = B x S tokens, D model dim, F expert hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from pipekit.moe.activations import expert_activation
from pipekit.moe.aux_loss import BALANCE_LOSSES, attach_aux_loss, balance_loss
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.experts import GroupedExperts
from pipekit.moe.routers import ROUTERS, build_router

__all__ = ["MoE", "MoEArgs"]


@dataclass(kw_only=True, frozen=True)
class MoEArgs:
    """Shape and routing of the MoE layers of a model."""

    num_experts: int = 8
    """Experts per MoE layer (E)."""
    top_k: int = 2
    """Experts per token (K) for token-choice routers."""
    router: str = "topk_softmax"
    """One of `pipekit.moe.ROUTERS`; topk_softmax is Mixtral's."""
    capacity_factor: float | None = None
    """Capacity ceil(factor x T x K / E) per expert, least probable dropped; None: dropless."""
    load_balance: str = "switch"
    """Load-balancing loss: "switch" or "importance"."""
    load_balance_weight: float = 0.01
    """Weight of the load-balancing loss (0 turns it off)."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss (0 turns it off)."""
    router_init_std: float = 0.02
    """Std of the router's truncated-normal init."""
    activation: str = "swiglu"
    """Expert activation, one of `pipekit.moe.EXPERT_ACTIVATIONS`: swiglu, geglu or gelu (no w3)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"MoEArgs.num_experts={self.num_experts} must be positive")
        if self.router not in ROUTERS:
            raise ValueError(f"MoEArgs.router={self.router!r}; known routers: {sorted(ROUTERS)}")
        if self.load_balance not in BALANCE_LOSSES:
            raise ValueError(
                f"MoEArgs.load_balance={self.load_balance!r}; known: {sorted(BALANCE_LOSSES)}"
            )
        expert_activation(self.activation)  # validates the name, listing the known ones


class MoE(nn.Module):
    """Router + `GroupedExperts`, run by an `ExpertExecution`.

    `activation`, when given, replaces `args.activation` (for a model that builds its MoE
    layers by hand); `self.args` then holds it, so the args stay the one description.
    """

    def __init__(
        self, dim: int, hidden_dim: int, args: MoEArgs, *, activation: str | None = None
    ) -> None:
        super().__init__()
        if activation is not None:
            args = replace(args, activation=activation)
        self.args = args
        self.router = build_router(
            args.router, dim, args.num_experts, args.top_k, args.capacity_factor
        )
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts, args.activation)
        self.execution = ExpertExecution()

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """The experts as a dense FFN would be; the router with `args.router_init_std`."""
        self.router.reset_parameters(self.args.router_init_std)
        self.experts.reset_parameters(init_std, output_std)

    @torch.compiler.disable  # data-dependent routing: compiled blocks run it eagerly
    def forward(self, x_BSD: Tensor) -> Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD)
        out_TD = self.experts(x_TD, routing, self.execution)
        if self.training:
            aux_loss = balance_loss(
                routing,
                self.args.load_balance,
                self.args.load_balance_weight,
                self.args.z_loss_weight,
                owner=self,
            )
            out_TD = attach_aux_loss(out_TD, aux_loss)
        return out_TD.view_as(x_BSD)
