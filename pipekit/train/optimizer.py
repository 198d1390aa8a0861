"""Optimizer construction: torch's AdamW, or torchao's low-bit AdamW (imported only if asked),
with the parameters `[optimizer] no_decay` names left undecayed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from pipekit.train.weight_decay import undecayed_names

if TYPE_CHECKING:  # pipekit.config imports this module's choices: no import back at run time
    from pipekit.config.job_config import OptimizerConfig

__all__ = ["OPTIMIZERS", "build_optimizer"]

OPTIMIZERS = ("AdamW", "AdamW8bit", "AdamW4bit")
"""`[optimizer] name`'s choices: torch's AdamW, or torchao's class of that name."""


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW with the config's hyper-parameters over `model`'s parameters; weight decay applies
    to every parameter but those `[optimizer] no_decay` names (`pipekit.train.weight_decay`).
    Parameters are grouped by where they live (plain tensors, DTensors on each mesh): a foreach
    update cannot mix them, as a tensor-parallel model without FSDP2 does."""
    undecayed = undecayed_names(model, config.no_decay)
    groups: dict[tuple[object, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        groups.setdefault((mesh, name not in undecayed), []).append(param)
    params = [
        {"params": group, "weight_decay": config.weight_decay if decayed else 0.0}
        for (_, decayed), group in groups.items()
    ]
    kwargs = dict(
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
    )
    if config.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.name!r}; use one of {', '.join(OPTIMIZERS)}")
    if config.name == "AdamW":
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    # torchao prints warnings about its CUDA extensions on import, so it is imported on demand.
    import torchao.optim

    return getattr(torchao.optim, config.name)(params, **kwargs)
