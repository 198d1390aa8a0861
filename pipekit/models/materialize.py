"""Give a model that was parallelized on the meta device its storage and values, shard by shard.

pipekit parallelizes first (expert parallelism, FSDP2, pipeline stages: all on the meta
device), so no rank ever allocates more than its own shards. Values still have to equal what
one process would draw from the job seed, whatever the layout; a model's `init_weights` draws
each *init unit* (the embedding, each block, the norm, the head) from (seed, unit name) alone
(`pipekit.layers.init.seeded`). So `materialize_sharded` gives every shard storage, then for
one unit at a time stands a full, plain tensor in for each of the unit's sharded parameters,
runs the initialisation (or a checkpoint read) on a view of the model holding that unit only,
and copies each rank's block of the full values into its shard. A rank holds its shards plus
one unit's full tensors at a time: for a dense model the largest unit is the embedding or a
block; an MoE block's experts count in full for that moment.

Legend: a unit's name is the model's own (`tok_embeddings`, `layers.3`, `norm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit._torch_private import local_shape_and_offset
from pipekit.memory.prefault import prefaulting
from pipekit.models.stage_module import build_stage_module, model_units

__all__ = [
    "full_parameters",
    "init_units",
    "local_block",
    "local_tensor",
    "materialize_sharded",
    "seeded_materializer",
    "to_empty_keeping_ties",
]


def materialize_sharded(
    model: nn.Module, device: torch.device | str, init: Callable[[nn.Module], None]
) -> None:
    """Storage on `device` for `model`'s (local) parameters, then `init(view)` for each init
    unit, with the unit's parameters standing in full (`init_weights(seed)`, a checkpoint
    read, or both). A plain (unsharded) model gets the same values, unit by unit."""
    to_empty_keeping_ties(model, device)
    with prefaulting(model):
        for names in init_units(model):
            view = build_stage_module(model, names, share_modules=True)
            with full_parameters(view):
                init(view)


def to_empty_keeping_ties(model: nn.Module, device: torch.device | str) -> None:
    """`model.to_empty(device=device)` with every parameter that two modules share (tied
    embeddings) still one parameter afterwards.

    `to_empty` gives each registration its own tensor, so a plain tied model would come out
    untied: two weights with two optimizer states that drift apart while every sharded layout
    (FSDP2 keeps a tie itself) trains the tied model.
    """
    first_owner: dict[int, tuple[nn.Module, str]] = {}
    ties: list[tuple[nn.Module, str, nn.Module, str]] = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            owner = first_owner.setdefault(id(param), (module, name))
            if owner != (module, name):
                ties.append((module, name, *owner))
    model.to_empty(device=device)
    for module, name, owner, owner_name in ties:
        setattr(module, name, getattr(owner, owner_name))


def seeded_materializer(device: torch.device | str, seed: int) -> Callable[[nn.Module], None]:
    """`materialize(module)`: storage on `device`, values from `init_weights(seed)`, shard by
    shard (what a job without a checkpoint does; the benches and tests use it)."""
    return lambda module: materialize_sharded(module, device, lambda unit: unit.init_weights(seed))


def init_units(model: nn.Module) -> list[list[str]]:
    """The model's stateful units in order, those sharing a parameter (tied embeddings) in one
    group: a shared weight is drawn once, for both."""
    groups: list[list[str]] = []
    group_of_param: dict[int, list[str]] = {}
    for unit in model_units(model):
        params = list(model.get_submodule(unit).parameters())
        group = next((group_of_param[id(p)] for p in params if id(p) in group_of_param), None)
        if group is None:
            group = []
            groups.append(group)
        group.append(unit)
        group_of_param.update({id(p): group for p in params})
    return groups


@contextlib.contextmanager
def full_parameters(module: nn.Module) -> Iterator[None]:
    """Inside: each DTensor parameter of `module` is a plain parameter of its global shape (a
    parameter registered twice, tied, gets one). On exit each rank copies its block of the
    full values into its shard, the sharded parameters are back, and the full tensors go."""
    swapped: list[tuple[nn.Module, str, DTensor]] = []
    full_of: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            if id(param) not in full_of:
                local = param.to_local()
                full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
                full_of[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
            submodule._parameters[name] = full_of[id(param)]
            swapped.append((submodule, name, param))
    try:
        yield
    finally:
        with torch.no_grad():
            for submodule, name, param in swapped:
                local = param.to_local()
                if local.numel():
                    local.copy_(full_of[id(param)][local_block(param)])
                submodule._parameters[name] = param


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_block(param: Tensor) -> tuple[slice, ...]:
    """The block of the global tensor that this rank holds: a slice per dim."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
