"""`[optimizer] name = "Muon"`: Muon for the model's matrices, AdamW for everything else, under
every layout.

Muon (momentum orthogonalised by Newton-Schulz iterations; Kimi K2 and Moonlight train with it)
updates each weight matrix by the orthogonalised momentum. The recipe's split: the hidden
matrices (attention and MLP projections, routers, each expert's matrices one by one) take Muon;
the embedding, the output layer, norms, biases and any other parameter take AdamW, both at the
schedule's learning rate (`muon_adjust_lr = "match_rms_adamw"` scales Muon's update to
AdamW's RMS, so one rate serves both).

The update of a matrix is exactly `torch.optim.Muon`'s (its Newton-Schulz iteration and learning
rate adjustment are called, not rewritten). Newton-Schulz needs the whole matrix, which FSDP2
and tensor parallelism split: each rank gathers the matrix's momentum-corrected gradient (one
all-gather over the dims that split it), runs the iteration on it, and keeps its own shard of
the result. Gathering was chosen over a distributed iteration because the iteration is a few
small matmuls per matrix while a distributed one needs an all-reduce per matmul (15 per matrix
at 5 steps); every rank repeats the same iteration, which costs time but not messages. Experts
split over expert parallelism are whole on their rank: each is orthogonalised where it lives,
without messages. Momentum buffers stay sharded like their parameters.

Legend: E experts; a matrix is the last two dims.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pipekit._torch_private import muon_adjusted_lr, muon_defaults, muon_orthogonalise

__all__ = ["MUON_LR_ADJUSTMENTS", "Muon", "muon_parameter_names"]

MUON_LR_ADJUSTMENTS = ("match_rms_adamw", "original")
"""`torch.optim.Muon`'s `adjust_lr_fn` choices, `[optimizer] muon_adjust_lr`."""


def muon_parameter_names(model: nn.Module, embedding: str, output: str) -> set[str]:
    """Names of the parameters Muon updates: every parameter of 2 or more dims (matrices, or
    experts' stacked matrices) outside the embedding and the output layer."""
    outside = (f"{embedding}.", f"{output}.")
    names = set()
    for name, param in model.named_parameters():
        bare = ".".join(part for part in name.split(".") if part != "_checkpoint_wrapped_module")
        if param.ndim >= 2 and not bare.startswith(outside):
            names.add(name)
    return names


def _experts_whole_here(tensor: DTensor) -> bool:
    """Whether every split of `tensor` is along the leading (expert) dim of a stack of
    matrices: each rank then holds whole matrices."""
    return tensor.ndim == 3 and all(
        not isinstance(placement, Shard) or placement.dim == 0 for placement in tensor.placements
    )


def _orthogonalised(update: Tensor, group: dict[str, Any]) -> Tensor:
    """Newton-Schulz of each matrix of `update` (a matrix, or a stack of them), as
    `torch.optim.Muon` computes it; a DTensor through the whole matrices (module docstring)."""
    ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if isinstance(update, DTensor):
        if _experts_whole_here(update):
            local = _orthogonalised(update.to_local(), group)
            return DTensor.from_local(
                local, update.device_mesh, update.placements,
                shape=update.shape, stride=update.stride(),
            )  # fmt: skip
        whole = _orthogonalised(update.full_tensor(), group)
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    if update.ndim == 2:
        return muon_orthogonalise(update, *ns)
    return torch.stack([muon_orthogonalise(matrix, *ns) for matrix in update])


class Muon(torch.optim.Optimizer):
    """Muon for groups with `muon=True`, AdamW (torch's, decoupled weight decay) for the
    others; each group's `weight_decay` applies as its own."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
    ) -> None:
        coefficients, muon_eps = muon_defaults()
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps, "muon": False,
            "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
            "ns_coefficients": coefficients, "muon_eps": muon_eps,
            "adjust_lr_fn": adjust_lr_fn,
        }  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)

    def _muon_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        ns_group = {**group, "eps": group["muon_eps"]}
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - group["momentum"])
            update = param.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
            update = _orthogonalised(update, ns_group)
            matrix_shape = param.shape[-2:]  # an expert's matrix, for a stack of them
            adjusted = muon_adjusted_lr(group["lr"], group["adjust_lr_fn"], matrix_shape)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(update, alpha=-adjusted)

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        from torch.optim.adamw import adamw

        moments, squares, steps = [], [], []
        for param in params:
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            moments.append(state["exp_avg"])
            squares.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(
            params, [p.grad for p in params], moments, squares, [], steps, foreach=False,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip
