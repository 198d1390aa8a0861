"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias steers selection.

A `SigmoidTopKRouter` with `bias_update_rate` > 0 adds `expert_bias` to its scores when it
picks experts (never to the weights), and counts every choice of every training forward in
`expert_load`. After each optimizer step

    update_expert_biases(model, group)

moves each router's bias by the rate toward even loads, b_e += rate x sign(mean load - load_e),
and clears the counts. The loads are summed over `group`, every rank holding tokens of the
router's pipeline stage (the data-, context- and tensor-parallel ranks, expert parallelism
among them), and over all the step's microbatches and slices: the update is the one a single
process would make on the whole global batch, whatever the layout. A layout that counts a
token more than once counts every token so (tensor parallelism without sequence parallelism,
activation recompute of a whole layer): a uniform factor, which the sign ignores. The bias is a
persistent buffer, so checkpoints carry it and a resumed run continues with it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipekit.moe.routers import SigmoidTopKRouter

__all__ = ["ROUTER_BIAS_NAMES", "balanced_routers", "discard_expert_loads", "update_expert_biases"]

ROUTER_BIAS_NAMES = (".expert_bias",)
"""How the routers' balancing biases end in a model's state dict (what `[checkpoint]
exclude_from_loading = ["router_biases"]` leaves as built: balancing starts over)."""


def balanced_routers(model: nn.Module) -> list[SigmoidTopKRouter]:
    """The model's routers whose bias moves (in module order: the same on every rank of a
    stage)."""
    return [
        module
        for module in model.modules()
        if isinstance(module, SigmoidTopKRouter) and module.bias_update_rate > 0
    ]


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """One balancing update of every bias-balanced router of `model` (see the module
    docstring); every rank of `group` calls it together. A no-op without such routers."""
    routers = balanced_routers(model)
    if not routers:
        return
    loads_RE = torch.stack([router.expert_load for router in routers])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads_RE, group=group)
    for router, load_E in zip(routers, loads_RE, strict=True):
        step_E = torch.sign(load_E.mean() - load_E) * router.bias_update_rate
        router.expert_bias += step_E.to(router.expert_bias.dtype)
        router.expert_load.zero_()


def discard_expert_loads(model: nn.Module) -> None:
    """Forget the choices counted since the last update (forwards that train nothing, e.g. a
    pipeline's validation, which runs its training schedule)."""
    for router in balanced_routers(model):
        router.expert_load.zero_()
