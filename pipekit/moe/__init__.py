"""Mixture of experts: routers, grouped experts, expert parallelism, pipelined all-to-all."""

from pipekit.moe.activations import EXPERT_ACTIVATIONS, ExpertActivation
from pipekit.moe.aux_loss import (
    BALANCE_LOSSES,
    attach_aux_loss,
    aux_loss_scale,
    importance_cv2_loss,
    router_z_loss,
    sequence_balance_loss,
    switch_balance_loss,
)
from pipekit.moe.bias_balance import (
    balanced_routers,
    discard_expert_loads,
    update_expert_biases,
)
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.experts import GroupedExperts
from pipekit.moe.granularity import GranularitySearch
from pipekit.moe.layer import MoE, MoEArgs
from pipekit.moe.restore import RESTORE_STRATEGIES, choose_restore_strategy, restore_cost
from pipekit.moe.routers import ROUTERS, Router, SigmoidTopKRouter, build_router
from pipekit.moe.routing import Routing
from pipekit.moe.shared_experts import SharedExperts

__all__ = [
    "BALANCE_LOSSES",
    "EXPERT_ACTIVATIONS",
    "RESTORE_STRATEGIES",
    "ROUTERS",
    "ExpertActivation",
    "ExpertExecution",
    "GranularitySearch",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "Router",
    "Routing",
    "SharedExperts",
    "SigmoidTopKRouter",
    "attach_aux_loss",
    "aux_loss_scale",
    "balanced_routers",
    "build_router",
    "choose_restore_strategy",
    "discard_expert_loads",
    "importance_cv2_loss",
    "restore_cost",
    "router_z_loss",
    "sequence_balance_loss",
    "switch_balance_loss",
    "update_expert_biases",
]
