"""What each rank holds: its model built and parallelized on the meta device in a simulated
process group, exactly as training builds it.

For one representative rank per pipeline rank (data-parallel coordinates 0), the job's model
(or pipeline) is built by the trainer's own code under torch's "fake" process group, leaving
every parameter on the meta device: the local shard shapes, the stages and the FSDP2 units are
the real ones, for any world size, on any machine, in seconds. Ranks of one pipeline rank hold
equal shares (FSDP2 rows differ by at most one row), so one stands for all. Each simulated rank
lives in a forked child process: the process groups and meshes it creates leave global state
in torch.distributed that a later real job in the same process must not inherit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from pipekit._torch_private import simulated_rank
from pipekit.memory_plan.forked import in_forked_child
from pipekit.models.materialize import local_tensor
from pipekit.train.job import Job
from pipekit.train.model_setup import build_job_model

__all__ = ["RankLayout", "rank_layouts"]


@dataclass(frozen=True)
class RankLayout:
    """One rank's share of the model."""

    rank: int
    pipeline_rank: int
    stages: tuple[int, ...]
    """Pipeline stages the rank runs (empty without a pipeline)."""
    param_numel: int
    """Elements of the rank's local parameter shards (tied copies counted: they are stored)."""
    param_bytes: int
    """Bytes of those shards in their storage dtype."""
    largest_unit_numel: int
    """Elements of the largest FSDP2 unit unsharded (what one all-gather materialises); 0
    without FSDP2."""
    block_names: tuple[str, ...]
    """Blocks the rank runs (all of them without a pipeline)."""
    output_rows: int
    """Vocabulary rows whose logits the rank computes (0: it has no output layer)."""


def rank_layouts(job: Job) -> list[RankLayout]:
    """One layout per pipeline rank (one for a job without a pipeline)."""
    world = job.dims.world_size
    ranks = in_forked_child(_representative_ranks, job)
    return [in_forked_child(_layout, job, rank, world) for rank in ranks]


def _representative_ranks(job: Job) -> list[int]:
    """The global rank of each pipeline rank with every other coordinate 0."""
    if job.dims.pp == 1 or job.dims.world_size == 1:
        return [0]
    with simulated_rank(0, job.dims.world_size):
        mesh = job.dims.build_mesh("cpu")
        grid = mesh.mesh
        names = list(mesh.mesh_dim_names or ())
        pp_dim = names.index("pp")
        return grid.movedim(pp_dim, 0).reshape(job.dims.pp, -1)[:, 0].tolist()


def _layout(job: Job, rank: int, world: int) -> RankLayout:
    if world == 1:
        built = build_job_model(job, None, torch.device("cpu"), load_hf=False, on_meta=True)
        return _measure(job, rank, built)
    with simulated_rank(rank, world):
        mesh = job.dims.build_mesh("cpu")
        built = build_job_model(job, mesh, torch.device("cpu"), load_hf=False, on_meta=True)
        return _measure(job, rank, built)


def _measure(job: Job, rank: int, built) -> RankLayout:
    model, pipeline = built.model, built.pipeline
    params = list(model.parameters())
    local = [local_tensor(p) for p in params]
    structure = job.spec.structure
    blocks = tuple(
        name
        for name, _ in model.named_modules()
        if structure.is_block(name) and name.count(".") == 1
    )
    stages: tuple[int, ...] = ()
    pipeline_rank = 0
    if pipeline is not None:
        stages = tuple(sorted(stage.stage_index for stage in pipeline.stages))
        pipeline_rank = pipeline.stages[0].group_rank
    return RankLayout(
        rank=rank,
        pipeline_rank=pipeline_rank,
        stages=stages,
        param_numel=sum(t.numel() for t in local),
        param_bytes=sum(t.numel() * t.element_size() for t in local),
        largest_unit_numel=_largest_fsdp_unit(model),
        block_names=blocks,
        output_rows=_output_rows(model, structure.output),
    )


def _largest_fsdp_unit(model: nn.Module) -> int:
    """Elements of the largest FSDP2 unit as FSDP2 gathers it: the parameters each FSDP module
    manages (those not under a nested FSDP module), unsharded over FSDP's mesh dims but not
    over the tp and ep dims that shard them too (a unit gathers one tp rank's part, one ep
    rank's experts)."""
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not units:
        return 0
    sizes = dict.fromkeys([*units, ""], 0)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        owners = [unit for unit in units if unit == "" or name.startswith(f"{unit}.")]
        # none: a stage's own root manages it (a stage built as a view of the rank's model is
        # not among the model's modules), counted as the unit ""
        owner = max(owners, key=len, default="")
        sizes[owner] += param.numel() // _model_parallel_shards(param)
    return max(sizes.values())


def _model_parallel_shards(param: DTensor) -> int:
    """Ranks that hold different parts of `param` outside FSDP's dims (tp, ep, etp): an FSDP2
    gather restores one such part, not the DTensor's global tensor."""
    mesh, shards = param.device_mesh, 1
    for index, name in enumerate(mesh.mesh_dim_names or ()):
        if name in ("tp", "ep", "etp") and isinstance(param.placements[index], Shard):
            shards *= mesh.size(index)
    return shards


def _output_rows(model: nn.Module, output_name: str) -> int:
    """Rows of the rank's output layer (a DTensor's global rows: its data ranks split the
    weight, not the logits)."""
    output = getattr(model, output_name, None)
    return 0 if output is None else int(output.weight.shape[0])
