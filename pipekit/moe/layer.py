"""The MoE feed-forward layer: router, experts, and how the experts run.

`MoE` replaces a dense FFN: `forward(x_BSD)` routes every token, runs the experts through
its `ExpertExecution` (single-process by default; expert-parallel and pipelined once
`apply_expert_parallel` has swapped it), and returns the weighted sum of each token's expert
outputs. A token the router drops gets zero here, and keeps its residual in the block. The
experts' activation (`MoEArgs.activation`, one of `pipekit.moe.EXPERT_ACTIVATIONS`) matches the
dense FFN they replace: SwiGLU for Llama-style models, GeGLU for Gemma, plain GELU for GPT-2.
gpt-oss's MoE is `expert_biases`, `router_bias`, activation "swiglu_clamped" and the default
"topk_softmax" router (softmax over the top-k logits, as gpt-oss routes).

With `num_shared_experts` > 0 an always-on FFN (`SharedExperts`) runs beside the routed
experts, its output added to theirs (DeepSeek-V3, Qwen-MoE).

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
from pipekit.moe.routers import ROUTERS, build_router, check_group_limits
from pipekit.moe.shared_experts import SharedExperts

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
    """Load-balancing loss, one of `pipekit.moe.BALANCE_LOSSES`: "switch", "importance", or
    "sequence" (DeepSeek-V3's, per sequence)."""
    load_balance_weight: float = 0.01
    """Weight of the load-balancing loss (0 turns it off)."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss (0 turns it off)."""
    router_init_std: float = 0.02
    """Std of the router's truncated-normal init."""
    activation: str = "swiglu"
    """Expert activation, one of `pipekit.moe.EXPERT_ACTIVATIONS`: swiglu, geglu, gelu (no w3),
    or gpt-oss's swiglu_clamped."""
    expert_biases: bool = False
    """Biases on every expert projection (gpt-oss), zero-initialised; not the router's."""
    router_bias: bool = False
    """A bias on the router's gate (gpt-oss), zero-initialised."""
    num_shared_experts: int = 0
    """Always-on experts beside the routed ones (one FFN of this many times the expert hidden
    dim); 0: none."""
    num_groups: int = 1
    """sigmoid_topk: expert groups (e.g. one per node) for group-limited routing; 1: none."""
    topk_groups: int = 1
    """sigmoid_topk: groups a token's experts may come from."""
    routed_scaling: float = 1.0
    """sigmoid_topk: factor on the routed experts' normalised weights."""
    bias_update_rate: float = 0.0
    """sigmoid_topk: auxiliary-loss-free balancing, the step of the per-expert selection bias
    after each optimizer step (DeepSeek-V3: 1e-3); 0: the bias stays as it is."""

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
        if self.num_shared_experts < 0:
            raise ValueError(f"MoEArgs.num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.router == "sigmoid_topk":
            check_group_limits(self.num_experts, self.top_k, self.num_groups, self.topk_groups)
            if self.bias_update_rate < 0:
                raise ValueError(f"MoEArgs.bias_update_rate={self.bias_update_rate} must be >= 0")
            return
        options = {key: getattr(self, key) for key in _SIGMOID_OPTIONS}
        changed = [key for key, value in options.items() if value != _SIGMOID_OPTIONS[key]]
        if changed:
            raise ValueError(
                f"MoEArgs {', '.join(changed)} apply to router='sigmoid_topk' only; router="
                f"{self.router!r} takes none of them"
            )

    def router_options(self) -> dict[str, float]:
        """The options `build_router` passes to the router (sigmoid_topk's only)."""
        if self.router != "sigmoid_topk":
            return {}
        return {key: getattr(self, key) for key in _SIGMOID_OPTIONS}


_SIGMOID_OPTIONS = {
    "num_groups": 1,
    "topk_groups": 1,
    "routed_scaling": 1.0,
    "bias_update_rate": 0.0,
}
"""sigmoid_topk's options and their defaults (what every other router leaves as is)."""


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
            args.router,
            dim,
            args.num_experts,
            args.top_k,
            args.capacity_factor,
            bias=args.router_bias,
            **args.router_options(),
        )
        self.experts = GroupedExperts(
            dim, hidden_dim, args.num_experts, args.activation, biases=args.expert_biases
        )
        self.shared_experts = (
            SharedExperts(
                dim,
                args.num_shared_experts * hidden_dim,
                args.activation,
                biases=args.expert_biases,
            )
            if args.num_shared_experts
            else None
        )
        self.execution = ExpertExecution()

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """The experts as a dense FFN would be; the router with `args.router_init_std`."""
        self.router.reset_parameters(self.args.router_init_std)
        self.experts.reset_parameters(init_std, output_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(init_std, output_std)

    @torch.compiler.disable  # data-dependent routing: compiled blocks run it eagerly
    def forward(self, x_BSD: Tensor) -> Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD)
        out_TD = self.experts(x_TD, routing, self.execution)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        if self.training:
            aux_loss = balance_loss(
                routing,
                self.args.load_balance,
                self.args.load_balance_weight,
                self.args.z_loss_weight,
                owner=self,
                rows=x_BSD.shape[0],
            )
            out_TD = attach_aux_loss(out_TD, aux_loss)
        return out_TD.view_as(x_BSD)
