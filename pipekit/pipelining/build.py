"""Build one rank's pipeline: split the model, materialise this rank's stages, wrap them.

The model arrives on the meta device; each stage is a pruned copy holding only its modules, so a
rank never allocates another rank's weights. `materialize` moves a stage off meta and
initialises it (or loads it); with `Llama.init_weights(seed)` a stage initialised alone holds
exactly the full model's weights.
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

__all__ = ["build_rank_stages"]


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
) -> list[SlicedPipelineStage]:
    """This rank's stages (ascending stage index) of a `len(module_names_per_stage)`-stage split."""
    num_stages = len(module_names_per_stage)
    if num_stages % num_ranks:
        raise ValueError(
            f"{num_stages} stages do not spread evenly over pipeline_parallel_degree={num_ranks}"
        )
    validate_stage_module_names(model, module_names_per_stage)
    stages = []
    for stage_index in stages_of_rank(rank, num_ranks, num_stages // num_ranks, stage_style):
        stage_module = build_stage_module(model, module_names_per_stage[stage_index])
        materialize(stage_module)
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
