"""Gradient clipping by the global norm, for plain, sharded (DTensor) or mixed gradients.

With FSDP2 a rank holds only shards of the gradients; the norm of a DTensor gradient is a
DTensor whose placement says it is partial, and `full_tensor()` reduces it across the mesh.
Gradients on different meshes (e.g. dense layers on the dp mesh, experts on an ep mesh) cannot
be stacked into one norm, so each mesh's group is reduced on its own and the group norms are
combined: the p-norm of a concatenation is the p-norm of its parts' p-norms (max for inf).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    pipeline_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[Tensor] = (),
    tensor_split: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None,
) -> Tensor:
    """Scale gradients in place so their global `norm_type`-norm is at most `max_norm`.

    Returns the global norm before clipping as a plain scalar tensor, the same on every rank.
    Parameters without a gradient are skipped. With `pipeline_group`, the norm also covers the
    parameters of the other pipeline ranks (every rank of the group must call this).
    `duplicates` (copies of a tied weight counted elsewhere) are clipped but not counted.
    `tensor_split`: plain parameters of which the ranks of the group hold disjoint parts
    (vocabulary rows over tp), whose norm is combined over it (every rank must call this).
    """
    with_grads = [param for param in parameters if param.grad is not None]
    skipped = {id(param) for param in duplicates}
    split_params, split_group = tensor_split if tensor_split is not None else ((), None)
    split_ids = {id(param) for param in split_params}
    counted = _by_mesh(param for param in with_grads if id(param) not in skipped | split_ids)
    group_norms = [_norm(group, norm_type, error_if_nonfinite) for group in counted.values()]
    if split_group is not None:
        split = [p for p in with_grads if id(p) in split_ids and id(p) not in skipped]
        norm = _norm(split, norm_type, error_if_nonfinite) if split else torch.tensor(0.0)
        group_norms.append(_combine_across(norm, norm_type, split_group))
    if group_norms:
        device = group_norms[0].device
        total_norm = torch.linalg.vector_norm(
            torch.stack([norm.to(device) for norm in group_norms]), norm_type
        )
    else:
        total_norm = torch.tensor(0.0)
    if pipeline_group is not None:  # each pipeline rank holds other parameters
        total_norm = _combine_across(total_norm, norm_type, pipeline_group)
    for group in _by_mesh(with_grads).values():  # foreach ops cannot mix meshes
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def _norm(params: list[Tensor], norm_type: float, error_if_nonfinite: bool) -> Tensor:
    """The norm of the gradients of `params` (all on one mesh), reduced over that mesh."""
    grads = [param.grad for param in params if param.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _by_mesh(parameters: Iterable[Tensor]) -> dict[object, list[Tensor]]:
    """Parameters grouped by their gradient's mesh (or device), in order of first appearance."""
    groups: dict[object, list[Tensor]] = {}
    for param in parameters:
        assert param.grad is not None
        groups.setdefault(_mesh_key(param.grad), []).append(param)
    return groups


def _mesh_key(grad: Tensor) -> object:
    return grad.device_mesh if isinstance(grad, DTensor) else grad.device


def _combine_across(norm: Tensor, norm_type: float, group: dist.ProcessGroup) -> Tensor:
    """The norm over the union of the ranks' disjoint parameter sets."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)
