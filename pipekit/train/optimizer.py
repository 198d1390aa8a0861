"""Optimizer construction: torch's AdamW, or torchao's low-bit AdamW (imported only if asked)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:  # pipekit.config imports this module's choices: no import back at run time
    from pipekit.config.job_config import OptimizerConfig

__all__ = ["OPTIMIZERS", "build_optimizer"]

OPTIMIZERS = ("AdamW", "AdamW8bit", "AdamW4bit")
"""`[optimizer] name`'s choices: torch's AdamW, or torchao's class of that name."""


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimizerConfig
) -> torch.optim.Optimizer:
    """AdamW with the config's hyper-parameters; weight decay applies to every parameter.
    Parameters are grouped by where they live (plain tensors, DTensors on each mesh): a foreach
    update cannot mix them, as a tensor-parallel model without FSDP2 does."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in params:
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        groups.setdefault(mesh, []).append(param)
    params = [{"params": group} for group in groups.values()]
    kwargs = dict(
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    if config.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.name!r}; use one of {', '.join(OPTIMIZERS)}")
    if config.name == "AdamW":
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    # torchao prints warnings about its CUDA extensions on import, so it is imported on demand.
    import torchao.optim

    return getattr(torchao.optim, config.name)(params, **kwargs)
