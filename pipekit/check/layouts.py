"""The layouts `python -m pipekit.check` runs a job's model under, and how each one runs.

Each layout is one parallel feature on 2 ranks, the rest of the world size going to FSDP2
(`dp_shard`): FSDP alone, tensor parallelism, context parallelism, the sliced pipeline, the
sliced pipeline with context exchange and vocabulary parallelism, and expert parallelism. A
layout is planned from the job's config with its `[parallelism]` replaced and checked by the
rules training applies (`pipekit.train.job.validate_job`), so what the check refuses, training
refuses too; it runs one step through `pipekit.testing` and is compared with one process on the
same microbatches (MoE auxiliary losses take their statistics per microbatch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from pipekit._torch_private import REDISTRIBUTE_LOGGER
from pipekit.config.job_config import ParallelismConfig
from pipekit.models.spec import ModelSpec
from pipekit.testing import (
    RankFailedError,
    Result,
    data_parallel_step,
    pipeline_step,
    run_on_ranks,
)
from pipekit.train.job import Job, validate_job

__all__ = ["LAYOUTS", "Layout", "PlannedLayout", "plan_layout", "run_layouts"]

_SLICED = {
    "pipeline_parallel_degree": 2,
    "pipeline_schedule": "sliced",
    "num_slices": 4,
    "microbatches": 2,  # per data rank; the reference runs as many row blocks
}


@dataclass(frozen=True)
class Layout:
    """One parallel layout: its `[parallelism]` keys (dp_shard takes the rest of the ranks)."""

    name: str
    parallelism: Mapping[str, Any] = field(default_factory=dict)
    needs_tensor_parallel_plan: bool = False
    """The family must give `ModelSpec.tensor_parallel_plan`."""
    needs_experts: bool = False
    """The model must have MoE layers (its args a `moe`)."""

    @property
    def pipeline(self) -> bool:
        """Whether the layout is a pipeline (run by `pipeline_step`)."""
        return self.parallelism.get("pipeline_parallel_degree", 1) > 1

    def unsupported(self, spec: ModelSpec, args: Any) -> str:
        """Why the model cannot express this layout ("" when it can)."""
        if self.needs_tensor_parallel_plan and spec.tensor_parallel_plan is None:
            return "the family has no tensor_parallel_plan"
        if self.needs_experts and getattr(args, "moe", None) is None:
            return "the model has no MoE layers"
        return ""


LAYOUTS = (
    Layout("fsdp"),
    Layout("tp", {"tp": 2}, needs_tensor_parallel_plan=True),
    Layout("cp", {"cp": 2}),
    Layout("pp_sliced", _SLICED),
    Layout("pp_exchange_vocab", {**_SLICED, "context_exchange": True, "vocab_parallel": True}),
    Layout("ep", {"ep": 2}, needs_experts=True),
)
"""Every layout, in the order the check runs them."""


@dataclass(frozen=True)
class PlannedLayout:
    """A layout checked for a world size: the job it is, and how one step of it runs."""

    layout: Layout
    job: Job

    @property
    def mesh(self) -> str:
        """The degrees above 1, e.g. "pp 2 x dp_shard 2"."""
        dims = self.job.dims
        degrees = [f"{name} {getattr(dims, name)}" for name in ("pp", "dp_shard", "cp", "tp")]
        text = " x ".join(d for d in degrees if not d.endswith(" 1")) or "1 rank"
        return f"{text}, ep {dims.ep}" if dims.ep > 1 else text

    @property
    def reference_microbatches(self) -> int:
        """The row blocks the reference runs: each data rank's microbatches."""
        microbatches = self.layout.parallelism.get("microbatches", 1)
        return self.job.dims.dp_degree * microbatches

    def step_keywords(self) -> dict[str, Any]:
        """Keywords of `pipeline_step` or `data_parallel_step` for this layout."""
        dims, parallelism = self.job.dims, self.job.config.parallelism
        degrees = {"ep": dims.ep, "cp": dims.cp, "tp": dims.tp}
        tensor_parallel = {
            "sequence_parallel": parallelism.sequence_parallel,
            "loss_parallel": self.job.loss_parallel,
        }
        if self.layout.pipeline:
            pipeline = {k: v for k, v in self.layout.parallelism.items() if k not in degrees}
            pipeline.pop("pipeline_parallel_degree")
            return {"dp_shard": dims.dp_shard, **degrees, **tensor_parallel, **pipeline}
        return {**degrees, **tensor_parallel}


def plan_layout(
    job: Job, layout: Layout, world_size: int, rows: int, seq_len: int
) -> PlannedLayout:
    """`layout` on `world_size` ranks for the model of `job`, one global batch of `rows` x
    `seq_len` tokens, checked by every rule training applies (ConfigError naming the one it
    breaks). The job's other sections stay; its degrees and pipeline settings are the
    layout's."""
    config, base = job.config, job.config.parallelism
    parallelism = ParallelismConfig(
        dp_shard=-1,
        sequence_parallel=base.sequence_parallel,
        loss_parallel=base.loss_parallel,
        collective_timeout_s=base.collective_timeout_s,
        **layout.parallelism,
    )
    training = dataclasses.replace(
        config.training, global_batch_size=rows, seq_len=seq_len, gradient_accumulation_steps=1
    )
    model = config.model
    if _has_field(job.args, "vocab_size"):  # the size the job resolved (e.g. the tokenizer's)
        model = dataclasses.replace(model, vocab_size=job.shape.vocab_size)
    derived = dataclasses.replace(config, model=model, training=training, parallelism=parallelism)
    return PlannedLayout(layout, validate_job(derived, world_size, check_files=False))


def run_layouts(
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    planned: list[PlannedLayout],
    world_size: int,
    timeout: float,
) -> list[list[Result] | str]:
    """Every planned layout's step on `world_size` gloo ranks: per layout, every rank's result,
    or the report (traceback) of the rank whose error stopped it. All run in one process
    group; when it fails, each layout runs again in its own, so one broken layout does not hide
    the others."""
    try:
        per_rank = run_on_ranks(_steps, world_size, spec, args, batch, planned, timeout=timeout)
        return [[results[index] for results in per_rank] for index in range(len(planned))]
    except RankFailedError:
        pass
    outcomes: list[list[Result] | str] = []
    for entry in planned:
        try:
            per_rank = run_on_ranks(_steps, world_size, spec, args, batch, [entry], timeout=timeout)
            outcomes.append([results[0] for results in per_rank])
        except RankFailedError as error:
            outcomes.append(_first_error(error))
    return outcomes


def _steps(
    rank: int,
    world_size: int,
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    planned: list[PlannedLayout],
) -> list[Result]:
    """This rank's step of every planned layout, in order."""
    # Gathering a gradient sharded over two mesh dims (FSDP x tp) for the comparison takes two
    # all-gathers, which torch reports as a warning per rank; it is the check's gather only.
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    results = []
    for entry in planned:
        step = pipeline_step if entry.layout.pipeline else data_parallel_step
        results.append(step(rank, world_size, spec, args, batch, **entry.step_keywords()))
    return results


def _first_error(error: RankFailedError) -> str:
    """The report of the rank that failed first: the first whose error is not a gloo connection
    dropped by a peer (what the peers of a rank that raised report)."""
    reports: list[list[str]] = []
    for line in str(error).splitlines():
        if line.startswith("rank") or not reports:
            reports.append([])
        reports[-1].append(line)
    texts = ["\n".join(report).strip() for report in reports]
    own = [text for text in texts if "gloo" not in text.splitlines()[-1]]
    return (own or texts)[0]


def _has_field(args: Any, name: str) -> bool:
    return dataclasses.is_dataclass(args) and name in {f.name for f in dataclasses.fields(args)}
