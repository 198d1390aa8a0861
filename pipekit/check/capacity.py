"""Capacity drops: the one way a correct layout can differ from one process.

A router with a `capacity_factor` gives each expert at most ceil(factor x T x K / E) of the T
tokens of one forward and drops the rest (docs/moe.md). A layout's forwards see other tokens
than the reference's (a slice, a context-parallel shard, a tensor-parallel rank's share), so
they drop other tokens, and the step differs without any bug. The check names this as the
likely cause of a failure, and `dropless` gives the args to check the layouts without drops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pipekit.models.spec import ModelSpec
from pipekit.moe import MoEArgs, Router

__all__ = ["capacity_note", "capacity_routers", "dropless"]


def capacity_routers(model: nn.Module) -> dict[str, float]:
    """The routers of `model` that drop tokens over an expert's capacity: name -> factor."""
    return {
        name: module.capacity_factor
        for name, module in model.named_modules()
        if isinstance(module, Router) and module.capacity_factor is not None
    }


def capacity_note(routers: dict[str, float]) -> str:
    """The line the check prints when a layout failed and `routers` drop tokens."""
    factors = ", ".join(f"{factor:g}" for factor in sorted(set(routers.values())))
    return (
        f"capacity drops: {len(routers)} MoE routers have capacity_factor {factors}, so which "
        "tokens an expert drops depends on how a layout splits the batch (docs/moe.md); the "
        "failures marked (capacity drops?) are likely that, not a wrong layout. Check without "
        "drops: run again with --dropless"
    )


def dropless(spec: ModelSpec, args: Any) -> Any:
    """`args` with every `MoEArgs` among its fields routing without capacity limits
    (ValueError naming why when the model keeps a capacity router after that)."""
    if not dataclasses.is_dataclass(args):
        raise ValueError(
            f"--dropless: the model args ({type(args).__name__}) are not a dataclass holding "
            "MoEArgs; check a flavor whose MoE layers have capacity_factor = None"
        )
    moe = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    moe = {name: value for name, value in moe.items() if isinstance(value, MoEArgs)}
    if any(value.router == "expert_choice" for value in moe.values()):
        raise ValueError(
            "--dropless: the expert_choice router picks each expert's tokens by its capacity "
            "and has no dropless form, so its layouts differ from one process by design"
        )
    changed = dataclasses.replace(
        args,
        **{name: dataclasses.replace(value, capacity_factor=None) for name, value in moe.items()},
    )
    with torch.device("meta"):
        left = capacity_routers(spec.build(changed))
    if left:
        raise ValueError(
            f"--dropless: {len(left)} routers (first {min(left)}) keep a capacity_factor that "
            f"no MoEArgs field of {type(args).__name__} sets; check a flavor whose MoE layers "
            "have capacity_factor = None"
        )
    return changed
