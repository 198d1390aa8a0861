"""Expert parallelism, applied from outside the model: shard experts, swap in the all-to-all.

`apply_expert_parallel(model, ep_mesh, ...)` turns every `MoE` layer of `model` expert-parallel:
its expert weights (and biases, `MoEArgs.expert_biases`) become DTensors sharded on the expert
dim over the 1-D `ep_mesh` (rank r keeps experts [r E/ep, (r+1) E/ep)), and its
`ExpertExecution` becomes the pipelined all-to-all over that mesh's group. The layer's router
stays replicated: FSDP treats it like any dense weight. Call it before data parallelism, on the
meta device (then each rank materialises only its experts) or on a materialised model whose
ranks hold the same full weights.

The all-to-all's backward brings each expert the gradient of every token its ep group routed
to it. With fewer ep ranks than data ranks, each ep group holds all experts and the groups hold
the same experts (`expert_mesh`: dims `ep_replicate` x `ep`, EP borrowing from the data ranks):
data parallelism then shards every expert tensor over `ep_replicate` too and reduce-scatters its
gradients there (`apply_data_parallel(..., experts_mesh=mesh["ep_replicate"])`), so no rank holds
more than 1 / (ep x ep_replicate) of the experts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Shard

from pipekit._torch_private import flatten_mesh
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.experts import GroupedExperts
from pipekit.moe.layer import MoE, MoEArgs
from pipekit.moe.token_exchange import CollectiveExchange, TokenExchange

__all__ = [
    "apply_expert_parallel",
    "check_expert_parallel",
    "check_expert_tensor_parallel",
    "expert_mesh",
    "expert_parallel_mesh",
    "expert_parameters",
    "set_expert_execution",
]


def check_expert_parallel(moe: MoEArgs | None, ep: int, model: str) -> None:
    """ValueError (naming the fix) unless `ep` ranks can split the experts of `moe` (the MoE
    args of the model described by `model`; None for a dense model)."""
    if moe is None:
        raise ValueError(
            f"ep={ep} needs a mixture-of-experts model; model {model} has no experts (use an "
            "MoE family, or set ep = 1)"
        )
    if moe.num_experts % ep:
        raise ValueError(
            f"ep={ep} must divide the {moe.num_experts} experts of {model}; choose a divisor of "
            f"{moe.num_experts}"
        )


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    partitions: int | str = 1,
    memory_reuse: str = "none",
    exchange: TokenExchange | None = None,
) -> nn.Module:
    """Shard the experts of every MoE layer over `ep_mesh`; returns `model` (changed in place).

    A 2-D `ep_mesh` with dims ("etp", "ep") adds expert tensor parallelism: each expert's
    hidden dim split over the etp ranks (w1, w3 by rows, w2 by columns), the all-to-all over
    all etp x ep ranks sending every assignment to each piece of its expert (`split_experts`).
    `exchange` replaces the default all-to-all on the mesh's group (the bench's emulated link).
    """
    if ep_mesh.ndim not in (1, 2) or (ep_mesh.ndim == 2 and ep_mesh.mesh_dim_names != _ETP_DIMS):
        raise ValueError(
            f"apply_expert_parallel needs a 1-D ep mesh or a 2-D {_ETP_DIMS} mesh; got dims "
            f"{ep_mesh.mesh_dim_names}"
        )
    pieces = ep_mesh.size(0) if ep_mesh.ndim == 2 else 1
    group = flatten_mesh(ep_mesh, "ep_etp").get_group() if pieces > 1 else ep_mesh.get_group()
    exchange = exchange or CollectiveExchange(group)
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            _shard_experts(name, module.experts, ep_mesh)
    set_expert_execution(model, partitions, memory_reuse, exchange, tensor_parallel=pieces)
    return model


_ETP_DIMS = ("etp", "ep")
_HIDDEN_DIM = {"w1_EFD": 1, "w3_EFD": 1, "w2_EDF": 2}
"""The expert hidden (F) dim of each weight: expert tensor parallelism splits it."""


def _shard_experts(name: str, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """Replace `experts`' tensors by DTensors on `ep_mesh`: this rank's experts (and, under
    expert tensor parallelism, its slice of their hidden dim)."""
    ep_size, ep_rank = ep_mesh.size(-1), ep_mesh.get_local_rank(ep_mesh.ndim - 1)
    if experts.num_experts % ep_size:
        raise ValueError(
            f"{name}: {experts.num_experts} experts cannot be split over ep={ep_size} ranks; "
            "choose ep among the divisors of num_experts"
        )
    if ep_mesh.ndim == 2:
        check_expert_tensor_parallel(experts.w1_EFD.shape[1], experts.has_biases, ep_mesh.size(0))
    per_rank = experts.num_experts // ep_size
    for param_name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"{name}.experts.{param_name} is already a DTensor; shard once")
        local = param.detach()[ep_rank * per_rank : (ep_rank + 1) * per_rank]
        placements: list[Placement] = [Shard(0)]
        if ep_mesh.ndim == 2:
            hidden = _HIDDEN_DIM[param_name]
            local = local.chunk(ep_mesh.size(0), dim=hidden)[ep_mesh.get_local_rank(0)]
            placements.insert(0, Shard(hidden))
        sharded = DTensor.from_local(local.clone(), ep_mesh, placements, run_check=False)
        setattr(experts, param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def check_expert_tensor_parallel(hidden_dim: int, biases: bool, etp: int) -> None:
    """ValueError naming the fix unless `etp` ranks can split experts of `hidden_dim` hidden
    units (without biases: an output bias would be added once per piece)."""
    if hidden_dim % etp:
        raise ValueError(
            f"etp={etp} must divide the experts' hidden dim {hidden_dim}; choose a divisor"
        )
    if biases:
        raise ValueError(
            f"etp={etp} with expert biases (gpt-oss): each piece would add the output bias; "
            "set etp = 1"
        )


def set_expert_execution(
    model: nn.Module,
    partitions: int | str,
    memory_reuse: str,
    exchange: TokenExchange | None = None,
    tensor_parallel: int = 1,
) -> nn.Module:
    """Give every MoE layer of `model` an `ExpertExecution` (one rank when `exchange` is None;
    each expert in `tensor_parallel` pieces under expert tensor parallelism).

    Each layer gets its own: Algorithm 1's ranges and the chosen strategy are per layer.
    """
    for module in model.modules():
        if isinstance(module, MoE):
            module.execution = ExpertExecution(exchange, partitions, memory_reuse, tensor_parallel)
    return model


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights (and expert biases) of every MoE layer."""
    return {
        param
        for module in model.modules()
        if isinstance(module, MoE)
        for param in module.experts.parameters()
    }


def expert_mesh(
    device_type: str, data_ranks: int, ep: int, *, pipeline_ranks: int = 1, etp: int = 1
) -> DeviceMesh:
    """The mesh `ep_replicate x ep` (with expert tensor parallelism `ep_replicate x etp x ep`)
    over this pipeline rank's `data_ranks` ranks.

    The world is `pipeline_ranks x data_ranks` ranks, pipeline-major (`ParallelDims`' order
    without tensor parallelism): each pipeline rank's stages get their own expert meshes, over
    the data ranks that hold the same stages. Neighbouring ranks share an ep group (the
    all-to-all stays within a node when it can); every ep (x etp) group holds all experts.
    """
    if data_ranks % (ep * etp):
        raise ValueError(f"ep x etp = {ep * etp} must divide the {data_ranks} data-parallel ranks")
    shape, names = (data_ranks // (ep * etp), etp, ep), ("ep_replicate", "etp", "ep")
    if etp == 1:
        shape, names = (shape[0], ep), ("ep_replicate", "ep")
    if pipeline_ranks == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    world = init_device_mesh(
        device_type, (pipeline_ranks, *shape), mesh_dim_names=("ep_pp", *names)
    )
    return world[names]


def expert_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The part of an `expert_mesh` that `apply_expert_parallel` shards over: "ep", or
    ("etp", "ep") under expert tensor parallelism."""
    names = mesh.mesh_dim_names or ()
    return mesh[_ETP_DIMS] if "etp" in names else mesh["ep"]
