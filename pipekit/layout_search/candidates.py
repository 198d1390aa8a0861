"""The layouts a search considers: every way to place a job on a world size that its rules
might allow, written as the config fields a user would set by hand.

A layout fixes the degrees (pp, dp_replicate, dp_shard, cp, tp, ep), the schedule with its
stages per rank, slices and slicing, and the activation policy (checkpointing or offload). The
enumeration is deliberately plain (products of divisors): the job's own rules (the memory
plan's and the planner's checks) reject what cannot run, so a rule is written once, where the
job checks it.

Held to the job's config (not searched): the model, context length, global batch, dtypes,
optimizer, the pipeline features the job turns on (each off where a layout cannot run it: no
pipeline, or no slices for a sliced-only one), the context-parallel variant (its own choice, by
bytes, per layout), sequence and loss parallelism.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipekit.config.job_config import JobConfig
from pipekit.pipelining.features.registry import features_off_without
from pipekit.pipelining.schedules.registry import SCHEDULES

__all__ = [
    "ACTIVATION_POLICIES",
    "OFFLOAD_RATIOS",
    "Layout",
    "SearchSpace",
    "apply_layout",
    "enumerate_layouts",
]

ACTIVATION_POLICIES = ("none", "selective", "every_k", "full")
"""Activation checkpointing, cheapest recomputation first."""
OFFLOAD_RATIOS = (0.25, 0.5, 0.75, 1.0)
"""Activation offload ratios tried (pipelines without checkpointing only)."""


@dataclass(frozen=True)
class Layout:
    """One placement of a job: what a user would write in `[parallelism]` and
    `training.activation_checkpoint`."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    schedule: str = "sliced"
    stages_per_rank: int = 1
    num_slices: int = 1
    slicing: str = "equal_length"
    activation_checkpoint: str = "none"
    activation_offload: float = 0.0
    accumulation: int = 1
    """Gradient accumulation steps (without a pipeline: one sequence per pass or all of a
    rank's at once; a pipeline cuts its microbatches itself)."""

    @property
    def structure(self) -> Layout:
        """The layout without its activation policy (what the policy is chosen for)."""
        return dataclasses.replace(self, activation_checkpoint="none", activation_offload=0.0)

    @property
    def policy(self) -> str:
        if self.activation_offload:
            return f"offload {self.activation_offload:g}"
        return self.activation_checkpoint

    def label(self) -> str:
        """A compact line: `pp4 v1 sliced n16 | cp2 tp2 | dp1 | none`."""
        if self.pp > 1:
            slicing = {"equal_cost": " equal-cost", "documents": " documents"}.get(self.slicing, "")
            slices = f" n{self.num_slices}{slicing}" if self.num_slices > 1 else ""
            pipe = f"pp{self.pp} v{self.stages_per_rank} {self.schedule}{slices}"
        else:
            pipe = "pp1"
        data = f"dp{self.dp_shard}" + (f"x{self.dp_replicate}r" if self.dp_replicate > 1 else "")
        if self.accumulation > 1:
            data += f" acc{self.accumulation}"
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        return f"{pipe} | cp{self.cp} tp{self.tp}{experts} | {data} | {self.policy}"


@dataclass(frozen=True)
class SearchSpace:
    """What the enumeration may choose from."""

    world_size: int
    devices_per_node: int
    schedules: tuple[str, ...] = ()
    """Schedules to try (empty: every registered one but hand-written files)."""
    max_cp: int = 64
    slice_multiples: tuple[int, ...] = (1, 2, 4)
    """Sliced schedules try num_slices = each of these x pp."""


def enumerate_layouts(
    config: JobConfig, space: SearchSpace, shape: Any, num_experts: int = 0
) -> Iterator[Layout]:
    """Every structure (policy "none") the degrees and schedules allow by divisibility; the
    job's rules then judge each (`pipekit.layout_search.search`). Slices are cut equal in
    length or in causal cost, and on packed documents (`[data] document_lengths`) also per
    microbatch by its documents."""
    world = space.world_size
    slicings = ("equal_length", "equal_cost")
    if config.data.document_lengths:
        slicings += ("documents",)
    schedules = space.schedules or tuple(name for name in SCHEDULES if name != "user")
    global_batch = config.training.global_batch_size
    for tp in _divisors(world):
        if tp > space.devices_per_node or shape.num_heads % tp or shape.num_kv_heads % tp:
            continue
        for cp in _powers_of_two(world // tp, space.max_cp):
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for ep in _expert_degrees(num_experts, dp * cp * tp):
                    for dp_replicate in sorted({1, dp}):
                        degrees = {
                            "pp": pp, "dp_replicate": dp_replicate,
                            "dp_shard": dp // dp_replicate, "cp": cp, "tp": tp, "ep": ep,
                        }  # fmt: skip
                        if pp == 1:
                            yield from _unpipelined(degrees, global_batch // dp)
                        else:
                            yield from _pipelines(
                                degrees, schedules, space, shape.num_layers, slicings
                            )


def _unpipelined(degrees: dict[str, int], rows_per_rank: int) -> Iterator[Layout]:
    """Without a pipeline: a rank's sequences in one pass, or one per pass, accumulated."""
    for accumulation in sorted({1, rows_per_rank}):
        yield Layout(**degrees, schedule="1F1B", accumulation=accumulation)


def _pipelines(
    degrees: dict[str, int],
    schedules: tuple[str, ...],
    space: SearchSpace,
    layers: int,
    slicings: tuple[str, ...],
) -> Iterator[Layout]:
    pp = degrees["pp"]
    for name in schedules:
        entry = SCHEDULES[name]
        for stages in (entry.stages_per_rank,) if entry.stages_per_rank else (1, 2):
            if pp * stages > layers:
                continue
            if not entry.sliced:
                yield Layout(**degrees, schedule=name, stages_per_rank=stages, num_slices=1)
                continue
            for multiple, slicing in itertools.product(space.slice_multiples, slicings):
                yield Layout(
                    **degrees, schedule=name, stages_per_rank=stages,
                    num_slices=multiple * pp, slicing=slicing,
                )  # fmt: skip


def apply_layout(config: JobConfig, layout: Layout) -> JobConfig:
    """`config` with `layout`'s fields, as if written by hand."""
    parallelism = config.parallelism
    pipelined = layout.pp > 1
    sliced = pipelined and SCHEDULES[layout.schedule].sliced
    fields: dict[str, Any] = {
        "pipeline_parallel_degree": layout.pp,
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "cp": layout.cp,
        "tp": layout.tp,
        "ep": layout.ep,
        "pipeline_schedule": layout.schedule if pipelined else parallelism.pipeline_schedule,
        "pipeline_schedule_file": "",
        "stages_per_rank": layout.stages_per_rank,
        "num_slices": layout.num_slices if sliced else 0,
        "slicing": layout.slicing if sliced else "equal_length",
        "microbatches": 0,
        "activation_offload": layout.activation_offload,
        "layout": "manual",
        **features_off_without(parallelism, pipelined, sliced),
    }
    training = dataclasses.replace(
        config.training,
        activation_checkpoint=layout.activation_checkpoint,
        gradient_accumulation_steps=layout.accumulation,
    )
    return dataclasses.replace(
        config, parallelism=dataclasses.replace(parallelism, **fields), training=training
    )


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _powers_of_two(limit: int, cap: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= cap and limit % 2**k == 0]


def _expert_degrees(num_experts: int, token_ranks: int) -> list[int]:
    if not num_experts:
        return [1]
    return [d for d in _divisors(token_ranks) if num_experts % d == 0]
