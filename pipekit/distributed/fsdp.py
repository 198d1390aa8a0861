"""Data parallelism with FSDP2: sharded (FSDP), hybrid (HSDP) or replicated (DDP-like).

Gradient convention (the whole library relies on it): every rank's loss is the *sum* of its
token losses divided by the *global* token count of the step (all data-parallel ranks, all
micro-batches). The global gradient is then the sum of the ranks' gradients, so gradients are
reduced by SUM over the data-parallel ranks, not by FSDP's default mean. Why not mean-reduce a
per-rank mean loss: with uneven token counts (padding, packed documents, ignored labels) a mean
of means weights tokens unequally, while sum / global count is exactly the single-process loss.
Reducing with a plain SUM (divide factor 1, sum-only collectives) also works on gloo, which
supports neither AVG nor PREMUL_SUM.

Experts under expert parallelism are their own FSDP2 units on a mesh of their own: the `ep`
ranks already split the experts, so each expert tensor is sharded further only over the ep
groups that hold the same experts (`ep_replicate`), FSDP2 composing with the `ep` placement as it
does with tensor parallelism. It shards the experts' second dim (`Shard(1)`: hidden rows of the
gate and up projections, model-dim rows of the down projection), so a rank's block of an expert
tensor stays one rectangle of whole experts; under expert tensor parallelism, which splits the
hidden dim, the model dim instead.

Under tensor parallelism with sequence parallelism every tp rank routes its own tokens, so the
experts and the routers are data parallel over the tp ranks too: the expert mesh then spans
them (expert parallelism may fold over them), and each router (and shared-experts FFN) is a
unit of its own sharded over all the ranks that hold tokens of the stage (`routers_mesh`),
whose reduce-scatter sums its gradients over the tp ranks the block's other units do not span.

A unit may return a view without meaning to: `nn.Linear` with a bias on a 3-D input (a biased
output projection, a block ending in one) multiplies the flattened rows and views the result
back. FSDP2 hooks every output for the all-gather that backward needs, and an in-place op on a
view (`h += x` downstream) drops that hook: a sharded unit's backward then fails on resharded
parameters, a replicated one's gradients go unreduced. So every unit hands FSDP2 each view
output as an alias that is no view (same storage and version counter, an identity in
autograd): no copy, and an in-place op on it is an ordinary one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from pipekit._torch_private import (
    collect_grad_tensors,
    concatenate_meshes,
    fsdp_replicate,
    is_autograd_view,
    replace_grad_tensors,
)
from pipekit.moe.layer import MoE

if TYPE_CHECKING:  # pipekit.config imports this module's dtypes: no import back at run time
    from pipekit.distributed.parallel_dims import ParallelDims

__all__ = ["MIXED_PRECISION_DTYPES", "apply_data_parallel", "data_parallel_mesh"]

MIXED_PRECISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes `[training] mixed_precision_param` and `mixed_precision_reduce` name, for FSDP2's
`MixedPrecisionPolicy` (`apply_data_parallel`'s `param_dtype` and `reduce_dtype`)."""


def _expert_placement(param: nn.Parameter) -> Shard:
    """FSDP2's dim of an expert tensor: its second (`Shard(1)`), or under expert tensor
    parallelism (which splits the hidden dim) its first dim after the expert dim that no other
    placement splits, so every rank's block stays one rectangle."""
    taken = {p.dim for p in getattr(param, "placements", ()) if isinstance(p, Shard)}
    return Shard(next(dim for dim in range(1, param.ndim) if dim not in taken))


class _AliasNotView(torch.autograd.Function):
    """The identity, returning a tensor that shares its input's storage and version counter
    (`detach`) without being a view of it: an in-place op on it is then tracked like one on any
    fresh tensor, and one that invalidates a tensor saved for backward still fails there."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor) -> torch.Tensor:
        return view.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _outputs_without_views(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook run before FSDP2's: each grad-requiring output that is a view, as an
    `_AliasNotView` of it (None, keeping `output`, when none is)."""
    if not torch.is_grad_enabled():
        return None
    tensors = collect_grad_tensors(output)
    if not any(is_autograd_view(tensor) for tensor in tensors):
        return None
    aliases = (_AliasNotView.apply(t) if is_autograd_view(t) else t for t in tensors)
    return replace_grad_tensors(output, aliases)


def _hand_over_outputs_without_views(unit: nn.Module) -> None:
    """Give FSDP2's post-forward hook of `unit` its outputs without views (module docstring).

    Called before FSDP2 wraps `unit`: FSDP2 appends its hook, so this one runs after the hooks
    already there (tensor parallelism's output layouts, which may return views) and right
    before FSDP2's."""
    unit.register_forward_hook(_outputs_without_views)


def data_parallel_mesh(mesh: DeviceMesh, parallel_dims: ParallelDims) -> DeviceMesh | None:
    """The part of the world `mesh` that parameters are distributed over; None without dp.

    `dp_shard` for FSDP, (`dp_replicate`, `dp_shard`) for HSDP, `dp_replicate` for replication;
    with context parallelism the shard dim is the flattened `dp_shard_cp` (cp ranks hold the
    same parameters, so they share the shards).
    """
    needed = [dim for dim in ("dp_replicate", "dp_shard", "cp") if getattr(parallel_dims, dim) > 1]
    missing = [name for name in needed if name not in (mesh.mesh_dim_names or ())]
    if missing:
        raise ValueError(
            f"mesh with dims {mesh.mesh_dim_names} lacks {missing}, which {parallel_dims} has; "
            "pass the mesh that parallel_dims.build_mesh() returned"
        )
    replicate = ("dp_replicate",) if parallel_dims.dp_replicate_enabled else ()
    if parallel_dims.cp_enabled:
        shard_mesh = parallel_dims.mesh("dp_shard_cp")
        return concatenate_meshes([mesh[replicate], shard_mesh]) if replicate else shard_mesh
    dims = replicate + (("dp_shard",) if parallel_dims.dp_shard_enabled else ())
    return mesh[dims] if dims else None


def apply_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    *,
    blocks: Sequence[nn.Module] = (),
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    sum_gradients: bool = True,
    experts_mesh: DeviceMesh | None = None,
    routers_mesh: DeviceMesh | None = None,
    precision_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Wrap each of `blocks` (the model's transformer blocks, `ModelStructure.blocks_of`) and
    then the root (embedding, norm, output) in place.

    `mesh` is the world mesh from `parallel_dims.build_mesh`. Sharded when dp_shard x cp > 1
    (HSDP if dp_replicate > 1 too); replicated with FSDP2's `replicate` when only dp_replicate
    > 1; unchanged without data parallelism. Tied weights (the output's weight is the
    embedding's) sit in the root's group, so they stay one parameter.
    `sum_gradients=False` keeps FSDP's mean reduction, for losses normalised per rank (see the
    module docstring). Under expert parallelism `experts_mesh` is the expert mesh's
    `ep_replicate` dim: every MoE layer's experts (sharded over `ep` already) become a unit
    sharded over it, and with `routers_mesh` every router a unit sharded over that (see the
    module docstring). Without data parallelism, a `precision_mesh`
    (`single_rank_mesh`) still gives the model FSDP2's mixed precision when `param_dtype` is not
    float32: a pipeline stage then computes and sends in `param_dtype` as it would with FSDP.
    Returns `model`, now of an FSDP subclass.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        # experts keep whole experts per rank (`_expert_placement`); routers and shared
        # experts shard as FSDP2 does (Shard(0))
        for unit, unit_mesh, placement_of in (
            (module.experts, experts_mesh, _expert_placement),
            (module.router, routers_mesh, lambda _: Shard(0)),
            (module.shared_experts, routers_mesh, lambda _: Shard(0)),
        ):
            if unit is not None and unit_mesh is not None:
                _hand_over_outputs_without_views(unit)
                fully_shard(
                    unit,
                    mesh=unit_mesh,
                    mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=placement_of,
                )
    dp_mesh = data_parallel_mesh(mesh, parallel_dims)
    precision_only = dp_mesh is None and precision_mesh is not None
    if precision_only and param_dtype != torch.float32:
        dp_mesh = precision_mesh
    if dp_mesh is None:
        _sum_gradients(model, sum_gradients)
        return model
    if parallel_dims.fsdp_enabled or precision_only:
        for unit in [*blocks, model]:
            _hand_over_outputs_without_views(unit)
            fully_shard(
                unit, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
            )
    else:
        for unit in [*blocks, model]:
            _hand_over_outputs_without_views(unit)
            fsdp_replicate(unit, mesh=dp_mesh, mp_policy=mp_policy)
    _sum_gradients(model, sum_gradients)
    return model


def _sum_gradients(model: nn.Module, enabled: bool) -> None:
    """Every FSDP2 unit of `model` reduces by plain sum (the module docstring's convention)."""
    if not enabled:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
