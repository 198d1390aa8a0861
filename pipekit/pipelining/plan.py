"""From the `[parallelism]` section to a concrete pipeline: schedule, slices, stages, placement.

Pure and cheap, so config validation runs it before any process group exists and the trainer
runs the same code to build the pipeline: every rule is checked in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.config.job_config import ParallelismConfig
from pipekit.pipelining.actions import sliced_pipeline_actions
from pipekit.pipelining.schedule import (
    SINGLE_STAGE_SCHEDULES,
    TORCH_SCHEDULES,
    V_SHAPED_SCHEDULES,
)
from pipekit.pipelining.stage_split import llama_stage_module_names

__all__ = ["PipelinePlan", "plan_pipeline"]


@dataclass(frozen=True)
class PipelinePlan:
    """Everything that fixes the shape of one rank group's pipeline."""

    schedule: str
    num_ranks: int
    stages_per_rank: int
    num_slices: int
    num_microbatches: int
    stage_style: str
    module_names_per_stage: list[list[str]]

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank


def plan_pipeline(
    parallelism: ParallelismConfig, num_layers: int, local_batch_size: int, seq_len: int
) -> PipelinePlan:
    """Resolve the defaults (0 = auto) and check every pipeline rule; ValueError names the fix."""
    schedule, num_ranks = parallelism.pipeline_schedule, parallelism.pipeline_parallel_degree
    stages_per_rank = parallelism.stages_per_rank
    if schedule != "sliced" and schedule not in TORCH_SCHEDULES:
        raise ValueError(
            f"pipeline_schedule={schedule!r} is not known; choose 'sliced' or one of "
            f"{', '.join(TORCH_SCHEDULES)}"
        )
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank} must be at least 1")
    if schedule in V_SHAPED_SCHEDULES and stages_per_rank != 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} places 2 stages per rank in a V; set stages_per_rank=2"
        )
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs one stage per rank; set stages_per_rank=1"
        )
    num_slices = parallelism.num_slices or (2 * num_ranks if schedule == "sliced" else 1)
    if schedule != "sliced" and num_slices != 1:
        raise ValueError(
            f"num_slices={num_slices} needs pipeline_schedule='sliced'; torch's {schedule!r} runs "
            "whole microbatches (set num_slices=0 or 1)"
        )
    num_microbatches = parallelism.microbatches or local_batch_size
    if num_microbatches < 1 or local_batch_size % num_microbatches:
        raise ValueError(
            f"microbatches={num_microbatches} must divide the local batch of {local_batch_size} "
            "sequences (global_batch_size / (data-parallel degree x gradient_accumulation_steps))"
        )
    if schedule == "sliced":  # checks num_slices against the degree, with the paper's rule
        sliced_pipeline_actions(num_ranks, num_microbatches, num_slices, stages_per_rank)
    if seq_len % num_slices:
        raise ValueError(
            f"training.seq_len={seq_len} does not split into num_slices={num_slices} equal slices; "
            "choose num_slices dividing seq_len"
        )
    num_stages = num_ranks * stages_per_rank
    if parallelism.pipeline_stage_modules:
        names = [
            [name.strip() for name in entry.split(",") if name.strip()]
            for entry in parallelism.pipeline_stage_modules
        ]
        if len(names) != num_stages:
            raise ValueError(
                f"pipeline_stage_modules has {len(names)} stages but pipeline_parallel_degree="
                f"{num_ranks} x stages_per_rank={stages_per_rank} = {num_stages}; give one entry "
                "per stage"
            )
    else:
        names = llama_stage_module_names(
            num_layers,
            num_stages,
            parallelism.pipeline_embedding_cost,
            parallelism.pipeline_output_cost,
        )
    return PipelinePlan(
        schedule=schedule,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        num_slices=num_slices,
        num_microbatches=num_microbatches,
        stage_style="v" if schedule in V_SHAPED_SCHEDULES else "loop",
        module_names_per_stage=names,
    )
