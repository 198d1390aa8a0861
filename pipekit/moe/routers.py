"""Routers: a linear gate scores each token against each expert and picks assignments.

Six routers, one class each, named in `ROUTERS` (the name a config uses):

- `topk_softmax`  (Mixtral; the default): top-k of the logits, then a softmax over those k.
  The weights of a token sum to 1, so experts that are copies of one FFN (upcycling) give
  exactly that FFN's output.
- `softmax_topk`  (GShard/DeepSeek style): softmax over all experts, then the top-k
  probabilities as weights (they sum to less than 1).
- `noisy_topk`    (Shazeer et al. 2017): in training, Gaussian noise scaled by a learned
  softplus(x W_noise) is added to the logits; then as `topk_softmax`.
- `switch`        (Switch Transformer): softmax, then top-1 with its probability as weight.
- `expert_choice` (Zhou et al. 2022): each expert picks its top-c tokens by probability,
  c = ceil(capacity_factor x T / E); perfectly balanced, a token may get 0..E experts.
- `sigmoid_topk`  (DeepSeek-V3): sigmoid scores; the top-k of score + a per-expert bias (moved
  outside autograd toward even loads: `pipekit.moe.bias_balance`), optionally within the best
  `topk_groups` of `num_groups` expert groups; weights are the chosen scores normalised over
  the k, times `routed_scaling`.

Every router's gate is bias-free unless built with `bias=True` (`MoEArgs.router_bias`; gpt-oss,
whose routing is `topk_softmax` with that bias). Token-choice routers take `capacity_factor`
(None: dropless); over-capacity assignments are the
ones of lowest probability (`routing_from_choices`). Scores are computed in at least float32
(Switch's selective precision) whatever the model's dtype.

Legend: T tokens, E experts, K experts per token, D model dim.
"""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipekit._torch_private import BufferDtypesKept
from pipekit.layers.init import trunc_normal_
from pipekit.moe.routing import Routing, expert_capacity, routing_from_choices

__all__ = [
    "ROUTERS",
    "ExpertChoiceRouter",
    "NoisyTopKRouter",
    "Router",
    "SigmoidTopKRouter",
    "SoftmaxTopKRouter",
    "SwitchRouter",
    "TopKSoftmaxRouter",
    "build_router",
]


class Router(nn.Module, abc.ABC):
    """A gate `D -> E` (with a bias only when `bias`); subclasses turn its logits into a
    `Routing`."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        *,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor={capacity_factor} must be positive, or None for dropless"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.gate = nn.Linear(dim, num_experts, bias=bias)

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Truncated-normal gate, zero bias (a router writes nothing back: `output_std` does
        not apply)."""
        trunc_normal_(self.gate.weight, init_std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)

    def logits(self, x_TD: Tensor) -> Tensor:
        """In at least float32, under autocast too (which would run the linear in bf16)."""
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        bias = self.gate.bias
        with torch.autocast(x_TD.device.type, enabled=False):
            return F.linear(
                x_TD.to(dtype), self.gate.weight.to(dtype), None if bias is None else bias.to(dtype)
            )

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, self.num_experts, self.top_k, self.capacity_factor)

    @abc.abstractmethod
    def forward(self, x_TD: Tensor) -> Routing:
        """The assignments of the tokens `x_TD`."""


class TopKSoftmaxRouter(Router):
    """Mixtral: softmax over the top-k logits, so a token's weights sum to 1."""

    def forward(self, x_TD: Tensor) -> Routing:
        logits_TE = self.logits(x_TD)
        return self._route(x_TD, logits_TE, logits_TE)

    def _route(self, x_TD: Tensor, logits_TE: Tensor, scores_TE: Tensor) -> Routing:
        top_scores_TK, expert_index_TK = torch.topk(scores_TE, self.top_k, dim=-1)
        return routing_from_choices(
            expert_index_TK,
            torch.softmax(top_scores_TK, dim=-1),
            logits_TE=logits_TE,
            probs_TE=torch.softmax(scores_TE, dim=-1),
            capacity=self.capacity(x_TD.shape[0]),
        )


class NoisyTopKRouter(TopKSoftmaxRouter):
    """Shazeer et al.: logits + N(0,1) x softplus(x W_noise) while training, then top-k softmax."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        *,
        bias: bool = False,
    ) -> None:
        super().__init__(dim, num_experts, top_k, capacity_factor, bias=bias)
        self.noise_gate = nn.Linear(dim, num_experts, bias=False)

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        super().reset_parameters(init_std)
        # Zero noise weights start at softplus(0) = ln 2 noise scale, learned from there.
        nn.init.zeros_(self.noise_gate.weight)

    def forward(self, x_TD: Tensor) -> Routing:
        logits_TE = self.logits(x_TD)
        scores_TE = logits_TE
        if self.training:
            noise_scale_TE = F.softplus(
                F.linear(x_TD.to(logits_TE.dtype), self.noise_gate.weight.to(logits_TE.dtype))
            )
            scores_TE = logits_TE + torch.randn_like(logits_TE) * noise_scale_TE
        return self._route(x_TD, logits_TE, scores_TE)


class SoftmaxTopKRouter(Router):
    """Softmax over all experts, then the k largest probabilities as weights."""

    def forward(self, x_TD: Tensor) -> Routing:
        logits_TE = self.logits(x_TD)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        weight_TK, expert_index_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        return routing_from_choices(
            expert_index_TK,
            weight_TK,
            logits_TE=logits_TE,
            probs_TE=probs_TE,
            capacity=self.capacity(x_TD.shape[0]),
        )


class SwitchRouter(SoftmaxTopKRouter):
    """Switch Transformer: top-1 of the softmax, weighted by its probability."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        *,
        bias: bool = False,
    ) -> None:
        if top_k != 1:
            raise ValueError(f"the switch router routes each token to 1 expert; got top_k={top_k}")
        super().__init__(dim, num_experts, top_k, capacity_factor, bias=bias)


class ExpertChoiceRouter(Router):
    """Each expert takes its c most probable tokens, c = ceil(capacity_factor x T / E)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        *,
        bias: bool = False,
    ) -> None:
        if capacity_factor is None:
            raise ValueError(
                "the expert_choice router needs a capacity_factor (the mean number of experts "
                "per token; c = capacity_factor x tokens / experts); set e.g. 2.0"
            )
        super().__init__(dim, num_experts, top_k, capacity_factor, bias=bias)

    def forward(self, x_TD: Tensor) -> Routing:
        num_tokens = x_TD.shape[0]
        logits_TE = self.logits(x_TD)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        per_expert = min(
            num_tokens, math.ceil(self.capacity_factor * num_tokens / self.num_experts)
        )
        weight_EC, token_index_EC = torch.topk(probs_TE.t(), per_expert, dim=-1)
        # Each expert's tokens in token order, as token-choice routing produces them.
        token_index_EC, order_EC = torch.sort(token_index_EC, dim=-1)
        weight_EC = torch.gather(weight_EC, 1, order_EC)
        expert_index_EC = torch.arange(self.num_experts, device=x_TD.device)[:, None].expand_as(
            token_index_EC
        )
        chosen_TE = torch.zeros_like(probs_TE)
        chosen_TE[token_index_EC, expert_index_EC] = 1.0
        return Routing(
            token_index_A=token_index_EC.reshape(-1),
            expert_index_A=expert_index_EC.reshape(-1),
            weight_A=weight_EC.reshape(-1),
            tokens_per_expert_E=torch.full(
                (self.num_experts,), per_expert, dtype=torch.long, device=x_TD.device
            ),
            logits_TE=logits_TE,
            probs_TE=probs_TE,
            chosen_TE=chosen_TE,
        )


class SigmoidTopKRouter(BufferDtypesKept, Router):
    """DeepSeek-V3: sigmoid scores, top-k of score + bias (within the best groups), weights the
    chosen scores over their sum times `routed_scaling`.

    `expert_bias` (float32 whatever the model's dtype; persistent: checkpoints carry it) only
    steers which experts are
    chosen, never the weights. In training, with `bias_update_rate` > 0, `expert_load` counts
    the choices of every forward until `pipekit.moe.bias_balance.update_expert_biases` moves
    the bias after the optimizer step and clears it. `probs_TE` of the routing are the scores
    normalised over all experts (the sequence-wise balance loss reads them)."""

    kept_dtype_buffers = ("expert_bias", "expert_load")
    """A cast leaves them float32 / float64 with their values: a bf16 bias could not take
    steps of 1e-3 near 1."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        *,
        bias: bool = False,
        num_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling: float = 1.0,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__(dim, num_experts, top_k, capacity_factor, bias=bias)
        check_group_limits(num_experts, top_k, num_groups, topk_groups)
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling, self.bias_update_rate = routed_scaling, bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        # float64: the step's counts stay exact at any scale (float32 stops at 2^24)
        self.register_buffer(
            "expert_load", torch.zeros(num_experts, dtype=torch.float64), persistent=False
        )

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        super().reset_parameters(init_std)
        self.expert_bias.zero_()
        self.expert_load.zero_()

    def forward(self, x_TD: Tensor) -> Routing:
        logits_TE = self.logits(x_TD)
        scores_TE = torch.sigmoid(logits_TE)
        choice_TE = scores_TE.detach() + self.expert_bias
        if self.num_groups > 1:
            choice_TE = _within_best_groups(choice_TE, self.num_groups, self.topk_groups)
        expert_index_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
        weight_TK = scores_TE.gather(1, expert_index_TK)
        weight_TK = weight_TK / (weight_TK.sum(-1, keepdim=True) + 1e-20) * self.routed_scaling
        if self.training and self.bias_update_rate:
            self.expert_load += torch.bincount(
                expert_index_TK.reshape(-1), minlength=self.num_experts
            ).to(self.expert_load.dtype)
        return routing_from_choices(
            expert_index_TK,
            weight_TK,
            logits_TE=logits_TE,
            probs_TE=scores_TE / scores_TE.sum(-1, keepdim=True),
            capacity=self.capacity(x_TD.shape[0]),
        )


def check_group_limits(num_experts: int, top_k: int, num_groups: int, topk_groups: int) -> None:
    """ValueError naming the fix unless group-limited routing can pick `top_k` experts."""
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_groups={num_groups} must divide num_experts={num_experts} (experts are "
            "grouped in equal runs, e.g. one group per node)"
        )
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be between 1 and num_groups={num_groups}")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"top_k={top_k} experts cannot be picked from topk_groups={topk_groups} groups of "
            f"{num_experts // num_groups}; raise topk_groups or lower top_k"
        )


def _within_best_groups(choice_TE: Tensor, num_groups: int, topk_groups: int) -> Tensor:
    """`choice_TE` with the experts outside each token's best `topk_groups` groups set to -inf
    (DeepSeek-V3's node-limited routing: a group's score is the sum of its two best). Not 0: a
    choice is score + bias, negative once a bias is below -score, and a masked 0 would then
    win over it, picking an expert of a group the token may not use."""
    num_tokens, num_experts = choice_TE.shape
    grouped_TGX = choice_TE.view(num_tokens, num_groups, num_experts // num_groups)
    best = min(2, grouped_TGX.shape[-1])
    group_score_TG = grouped_TGX.topk(best, dim=-1).values.sum(-1)
    group_index_TG = group_score_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, group_index_TG, True)
    keep_TE = keep_TG[:, :, None].expand_as(grouped_TGX).reshape(num_tokens, num_experts)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


ROUTERS: dict[str, type[Router]] = {
    "topk_softmax": TopKSoftmaxRouter,
    "softmax_topk": SoftmaxTopKRouter,
    "noisy_topk": NoisyTopKRouter,
    "switch": SwitchRouter,
    "expert_choice": ExpertChoiceRouter,
    "sigmoid_topk": SigmoidTopKRouter,
}
"""Router name (as a config spells it) -> class."""


def build_router(
    name: str,
    dim: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float | None,
    *,
    bias: bool = False,
    **options: float,
) -> Router:
    """The router called `name`, with an error listing the known names; `bias` gives its gate
    a bias (any router); `options` go to routers that take them (`sigmoid_topk`'s groups,
    scaling and bias rate)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; known routers: {sorted(ROUTERS)}")
    return ROUTERS[name](dim, num_experts, top_k, capacity_factor, bias=bias, **options)
