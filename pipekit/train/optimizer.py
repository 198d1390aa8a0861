"""Optimizer construction: torch's AdamW, torchao's low-bit AdamW (imported only if asked), or
Muon for the matrices with AdamW for the rest (`pipekit.train.muon`), with the parameters
`[optimizer] no_decay` names left undecayed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from pipekit.train.muon import Muon, muon_parameter_names
from pipekit.train.weight_decay import undecayed_names

if TYPE_CHECKING:  # pipekit.config imports this module's choices: no import back at run time
    from pipekit.config.job_config import OptimizerConfig
    from pipekit.models.spec import ModelStructure

__all__ = ["OPTIMIZERS", "build_optimizer"]

OPTIMIZERS = ("AdamW", "AdamW8bit", "AdamW4bit", "Muon")
"""`[optimizer] name`'s choices: torch's AdamW, torchao's class of that name, or Muon."""


def build_optimizer(
    model: torch.nn.Module, config: OptimizerConfig, structure: ModelStructure | None = None
) -> torch.optim.Optimizer:
    """The configured optimizer over `model`'s parameters; weight decay applies to every
    parameter but those `[optimizer] no_decay` names (`pipekit.train.weight_decay`). Muon takes
    the model's matrices outside the embedding and output layer that `structure` names.
    Parameters are grouped by where they live (plain tensors, DTensors on each mesh): a foreach
    update cannot mix them, as a tensor-parallel model without FSDP2 does."""
    if config.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {config.name!r}; use one of {', '.join(OPTIMIZERS)}")
    undecayed = undecayed_names(model, config.no_decay)
    muon = set()
    if config.name == "Muon":
        assert structure is not None  # the trainer passes the model's
        muon = muon_parameter_names(model, structure.embedding, structure.output)
    groups: dict[tuple[object, bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        groups.setdefault((mesh, name not in undecayed, name in muon), []).append(param)
    params = [
        {"params": group, "weight_decay": config.weight_decay if decayed else 0.0}
        | ({"muon": True} if in_muon else {})
        for (_, decayed, in_muon), group in groups.items()
    ]
    kwargs = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    if config.name == "AdamW":
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    if config.name == "Muon":
        return Muon(
            params, weight_decay=config.weight_decay, momentum=config.muon_momentum,
            adjust_lr_fn=config.muon_adjust_lr, **kwargs,
        )  # fmt: skip
    # torchao prints warnings about its CUDA extensions on import, so it is imported on demand.
    import torchao.optim

    return getattr(torchao.optim, config.name)(params, **kwargs)
