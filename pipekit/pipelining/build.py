"""Build one rank's pipeline: split the model, materialise this rank's stages, wrap them.

The model arrives on the meta device; a rank keeps a pruned copy holding only its stages'
modules, so it never allocates another rank's weights. Materialising moves it off meta and
initialises (or loads) it; with `Llama.init_weights(seed)` a part initialised alone holds exactly
the full model's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipekit.attention.backends import AttentionBackend
from pipekit.pipelining.stage import SlicedPipelineStage, StageShapes
from pipekit.pipelining.stage_split import (
    build_stage_module,
    stages_of_rank,
    validate_stage_module_names,
)

__all__ = ["build_rank_model", "build_rank_stages", "wrap_rank_stages"]


def build_rank_model(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    *,
    rank: int,
    num_ranks: int,
    stage_style: str,
    stage_indices: Sequence[int] | None = None,
    outside_stages: Sequence[str] = (),
) -> nn.Module:
    """The modules of every stage `rank` holds, as one pruned copy of `model` (full-model names).

    Materialise it, then `wrap_rank_stages` shares it out into stages: the optimizer,
    checkpoints and gradient clipping work on this one module. The stages are those of
    `stage_style` placement, or `stage_indices` when given (a user schedule's placement).
    `outside_stages` names modules no stage holds (vocabulary parallelism's).
    """
    validate_stage_module_names(model, module_names_per_stage, outside_stages)
    indices = _rank_stage_indices(
        rank, num_ranks, len(module_names_per_stage), stage_style, stage_indices
    )
    names = [name for index in indices for name in module_names_per_stage[index]]
    return build_stage_module(model, names)


def wrap_rank_stages(
    rank_model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    *,
    rank: int,
    num_ranks: int,
    stage_style: str,
    shapes: StageShapes,
    num_slices: int,
    device: torch.device,
    parallelize: Callable[[nn.Module], None] | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | AttentionBackend = "auto",
    stage_indices: Sequence[int] | None = None,
) -> list[SlicedPipelineStage]:
    """This rank's stages (ascending stage index), each a view sharing `rank_model`'s modules.

    `parallelize` (activation checkpointing, FSDP) is applied to each stage's module: under
    FSDP each stage is its own root, which torch's runtime unshards, reshards and reduces.
    """
    num_stages = len(module_names_per_stage)
    indices = _rank_stage_indices(rank, num_ranks, num_stages, stage_style, stage_indices)
    stages = []
    for stage_index in indices:
        if len(indices) == 1 and not shapes.vocab_parallel:  # the rank model is the stage
            stage_module = rank_model
        else:
            stage_module = build_stage_module(
                rank_model, module_names_per_stage[stage_index], share_modules=True
            )
        if parallelize is not None:
            parallelize(stage_module)
        stages.append(
            SlicedPipelineStage(
                stage_module,
                stage_index,
                num_stages,
                device,
                shapes,
                num_slices=num_slices,
                group=group,
                backend=backend,
            )
        )
    return stages


def build_rank_stages(
    model: nn.Module,
    module_names_per_stage: Sequence[Sequence[str]],
    *,
    rank: int,
    num_ranks: int,
    stage_style: str,
    shapes: StageShapes,
    num_slices: int,
    device: torch.device,
    materialize: Callable[[nn.Module], None],
    group: dist.ProcessGroup | None = None,
    backend: str | AttentionBackend = "auto",
    stage_indices: Sequence[int] | None = None,
    outside_stages: Sequence[str] = (),
) -> list[SlicedPipelineStage]:
    """`build_rank_model`, `materialize` (e.g. `to_empty` + `init_weights`), `wrap_rank_stages`."""
    placement = {
        "rank": rank,
        "num_ranks": num_ranks,
        "stage_style": stage_style,
        "stage_indices": stage_indices,
    }
    rank_model = build_rank_model(
        model, module_names_per_stage, **placement, outside_stages=outside_stages
    )
    materialize(rank_model)
    return wrap_rank_stages(
        rank_model,
        module_names_per_stage,
        **placement,
        shapes=shapes,
        num_slices=num_slices,
        device=device,
        group=group,
        backend=backend,
    )


def _rank_stage_indices(
    rank: int,
    num_ranks: int,
    num_stages: int,
    stage_style: str,
    stage_indices: Sequence[int] | None,
) -> list[int]:
    """`stage_indices` (ascending) if given, else the stages `stage_style` puts on `rank`."""
    if stage_indices is not None:
        indices = sorted(stage_indices)
        if not indices or indices[0] < 0 or indices[-1] >= num_stages:
            raise ValueError(
                f"stage_indices={indices} must be a non-empty subset of 0..{num_stages - 1}"
            )
        return indices
    if num_stages % num_ranks:
        raise ValueError(
            f"{num_stages} stages do not spread evenly over pipeline_parallel_degree={num_ranks}"
        )
    return stages_of_rank(rank, num_ranks, num_stages // num_ranks, stage_style)
