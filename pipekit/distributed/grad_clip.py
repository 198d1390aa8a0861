"""Gradient clipping by the global norm, for plain, sharded (DTensor) or mixed gradients.

With FSDP2 a rank holds only shards of the gradients; the norm of a DTensor gradient is a
DTensor whose placement says it is partial, and `full_tensor()` reduces it across the mesh.
Gradients on different meshes (e.g. dense layers on the dp mesh, experts on an ep mesh) cannot
be stacked into one norm, so each mesh's group is reduced on its own and the group norms are
combined: the p-norm of a concatenation is the p-norm of its parts' p-norms (max for inf).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
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
) -> Tensor:
    """Scale gradients in place so their global `norm_type`-norm is at most `max_norm`.

    Returns the global norm before clipping as a plain scalar tensor, the same on every rank.
    Parameters without a gradient are skipped.
    """
    parameters = list(parameters)
    grads = [param.grad for param in parameters if param.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[object, list[Tensor]] = {}
    for grad in grads:
        key = grad.device_mesh if isinstance(grad, DTensor) else grad.device
        groups.setdefault(key, []).append(grad)
    group_norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite)
        group_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = group_norms[0].device
    total_norm = torch.linalg.vector_norm(
        torch.stack([norm.to(device) for norm in group_norms]), norm_type
    )
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm
