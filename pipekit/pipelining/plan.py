"""From the `[parallelism]` section to a concrete pipeline: schedule, slices, stages, placement.

Pure and cheap, so config validation runs it before any process group exists and the trainer
runs the same code to build the pipeline: every rule is checked in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.config.job_config import ParallelismConfig
from pipekit.pipelining._torch_runtime import Action
from pipekit.pipelining.actions import sliced_pipeline_actions
from pipekit.pipelining.exchange_plan import plan_context_exchange
from pipekit.pipelining.output_passes import with_output_passes
from pipekit.pipelining.schedule import (
    SINGLE_STAGE_SCHEDULES,
    TORCH_SCHEDULES,
    V_SHAPED_SCHEDULES,
)
from pipekit.pipelining.stage_split import (
    llama_layers_per_stage,
    llama_stage_module_names,
    stages_of_rank,
)
from pipekit.pipelining.torch_actions import torch_schedule_actions
from pipekit.pipelining.user_schedule import check_schedule, load_schedule_file
from pipekit.pipelining.vocab_parallel import VOCAB_MODULE_NAMES

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
    """Stage placement: "loop", "v", or "user" (where the user schedule runs each stage)."""
    module_names_per_stage: list[list[str]]
    actions_by_rank: dict[int, list[Action]] | None = None
    """The checked compute-only lists of a user schedule (`schedule == "user"`), else None."""
    vocab_parallel: bool = False
    context_exchange: bool = False
    """The embedding and output layer are split across the pipeline ranks, outside the stages."""

    @property
    def modules_outside_stages(self) -> tuple[str, ...]:
        """Modules no stage holds (vocabulary parallelism's)."""
        return VOCAB_MODULE_NAMES if self.vocab_parallel else ()

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def stage_indices(self, rank: int) -> list[int]:
        """The stages `rank` holds, ascending: where the user schedule runs them, else by
        `stage_style`."""
        if self.actions_by_rank is not None:
            return sorted({action.stage_index for action in self.actions_by_rank[rank]})
        return stages_of_rank(rank, self.num_ranks, self.stages_per_rank, self.stage_style)

    def stage_rank(self, stage: int) -> int:
        """The rank holding `stage`."""
        return next(r for r in range(self.num_ranks) if stage in self.stage_indices(r))


def plan_pipeline(
    parallelism: ParallelismConfig, num_layers: int, local_batch_size: int, seq_len: int
) -> PipelinePlan:
    """Resolve the defaults (0 = auto) and check every pipeline rule; ValueError names the fix.

    A `pipeline_schedule_file` overrides `pipeline_schedule`: the plan's schedule is "user", and
    the file is read and checked here (`pipekit.pipelining.user_schedule.check_schedule`).
    """
    schedule_file = parallelism.pipeline_schedule_file
    schedule = "user" if schedule_file else parallelism.pipeline_schedule
    num_ranks, stages_per_rank = parallelism.pipeline_parallel_degree, parallelism.stages_per_rank
    if schedule not in ("sliced", "user") and schedule not in TORCH_SCHEDULES:
        raise ValueError(
            f"pipeline_schedule={schedule!r} is not known; choose 'sliced' or one of "
            f"{', '.join(TORCH_SCHEDULES)}, or give a pipeline_schedule_file"
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
    if schedule not in ("sliced", "user") and num_slices != 1:
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
    lists = None
    if schedule == "sliced":  # checks num_slices against the degree, with the paper's rule
        lists = sliced_pipeline_actions(num_ranks, num_microbatches, num_slices, stages_per_rank)
    elif schedule in TORCH_SCHEDULES:  # torch's own shape rules, without a process group
        try:
            lists = torch_schedule_actions(schedule, num_ranks, num_microbatches, stages_per_rank)
        except (AssertionError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"pipeline_schedule={schedule!r} rejects pipeline_parallel_degree={num_ranks}, "
                f"stages_per_rank={stages_per_rank}, microbatches={num_microbatches}: {error}"
            ) from None
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
            vocab_parallel=parallelism.vocab_parallel,
        )
    actions_by_rank = None
    if schedule_file:
        actions_by_rank = _user_schedule(
            schedule_file, num_ranks, stages_per_rank, num_microbatches, num_slices
        )
    if parallelism.context_exchange:
        _check_context_exchange(schedule, names, actions_by_rank or lists, num_slices)
    if parallelism.vocab_parallel:  # the output passes must fit the schedule without deadlock
        with_output_passes(
            actions_by_rank or lists, num_slices, lockstep=parallelism.context_exchange
        )
    return PipelinePlan(
        schedule=schedule,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        num_slices=num_slices,
        num_microbatches=num_microbatches,
        stage_style="user" if schedule_file else "v" if schedule in V_SHAPED_SCHEDULES else "loop",
        module_names_per_stage=names,
        actions_by_rank=actions_by_rank,
        vocab_parallel=parallelism.vocab_parallel,
        context_exchange=parallelism.context_exchange,
    )


def _check_context_exchange(
    schedule: str,
    names: list[list[str]],
    actions_by_rank: dict[int, list[Action]],
    num_slices: int,
) -> None:
    """Context exchange moves attention between slices' passes: it needs sliced passes with
    full backwards, and every stage must hold an attention layer to serve with."""
    if schedule not in ("sliced", "user") or num_slices < 2:
        raise ValueError(
            f"context_exchange = true needs sliced passes: pipeline_schedule='sliced' (or a user "
            f"schedule) with num_slices >= 2, not {schedule!r} with num_slices={num_slices}"
        )
    empty = [stage for stage, layers in llama_layers_per_stage(names).items() if not layers]
    if empty:
        raise ValueError(
            f"context_exchange = true: stages {empty} hold no transformer layer to serve "
            "attention with; change the stage split or set context_exchange = false"
        )
    plan_context_exchange(actions_by_rank, num_slices)


def _user_schedule(
    path: str, num_ranks: int, stages_per_rank: int, num_microbatches: int, num_slices: int
) -> dict[int, list[Action]]:
    """The file's action lists, checked against the plan's p, v, m and n."""
    actions_by_rank = load_schedule_file(path, num_slices)  # its errors name the file
    where = f"pipeline_schedule_file={path!r}"
    if len(actions_by_rank) != num_ranks:
        raise ValueError(
            f"{where} has lists for {len(actions_by_rank)} ranks but pipeline_parallel_degree="
            f"{num_ranks}; give one list (CSV row, [[rank]] table) per pipeline rank"
        )
    file_stages = _index_count(actions_by_rank, "stage_index")
    if file_stages != num_ranks * stages_per_rank:
        fix = (
            f"set stages_per_rank = {file_stages // num_ranks}"
            if file_stages and file_stages % num_ranks == 0
            else f"run a multiple of {num_ranks} stages"
        )
        raise ValueError(
            f"{where} runs {file_stages} stages but pipeline_parallel_degree={num_ranks} x "
            f"stages_per_rank={stages_per_rank} = {num_ranks * stages_per_rank}; {fix}"
        )
    file_units = _index_count(actions_by_rank, "microbatch_index")
    if file_units != num_microbatches * num_slices and file_units % num_slices == 0:
        raise ValueError(
            f"{where} runs {file_units // num_slices} microbatches of num_slices={num_slices} "
            f"but microbatches={num_microbatches}; set microbatches = {file_units // num_slices}"
        )
    try:
        check_schedule(
            actions_by_rank,
            num_stages=file_stages,
            num_microbatches=num_microbatches,
            num_slices=num_slices,
        )
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return actions_by_rank


def _index_count(actions_by_rank: dict[int, list[Action]], field: str) -> int:
    """1 + the largest stage or unit index the lists use."""
    indices = (
        getattr(action, field) or 0 for actions in actions_by_rank.values() for action in actions
    )
    return 1 + max(indices, default=-1)
