"""`PipelinePlan`: everything that fixes the shape of one rank group's pipeline, as a value
that planning (`pipelining.plan`) makes and the feature table, the builder, the runner and the
tools read, below all of them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipekit.models.spec import ModelShape, ModelStructure
from pipekit.pipelining.actions import INPUT_BACKWARD, WEIGHT_BACKWARD, Action
from pipekit.pipelining.model_split.partition import stages_of_rank
from pipekit.pipelining.schedules.slice_layout import SliceLayout

__all__ = ["PipelinePlan"]


@dataclass(frozen=True)
class PipelinePlan:
    """Everything that fixes the shape of one rank group's pipeline."""

    schedule: str
    """A name of the schedule registry ("user" for a schedule file)."""
    num_ranks: int
    stages_per_rank: int
    num_microbatches: int
    stage_style: str
    """Stage placement: "loop", "v", or "user" (where the user schedule runs each stage)."""
    module_names_per_stage: list[list[str]]
    actions_by_rank: dict[int, list[Action]]
    """Every rank's compute-only lists (the file's for a user schedule)."""
    structure: ModelStructure
    model: ModelShape
    unit_rows: int
    """Sequences in one unit (a microbatch)."""
    slices: SliceLayout
    """How every sequence is cut into slices (and shared by context-parallel ranks)."""
    features: tuple[str, ...] = ()
    """The pipeline features the job turns on (feature table names), in build order."""
    feature_plans: Mapping[str, Any] = field(default_factory=dict)
    """What each feature fixed at planning (its entry's `plan`), by name."""
    modules_outside_stages: tuple[str, ...] = ()
    """Modules no stage holds (a feature holds them: vocabulary parallelism's)."""
    sequence_shards: int = 1
    """Sequence parallelism's tp ranks: hidden states between stages hold `slice_length /
    sequence_shards` tokens."""
    attention_to_linear: float = 0.0
    """The model's causal-attention over matmul FLOPs on whole sequences, as planning was told
    (what equal-cost slices are placed by; 0 when not given)."""
    layouts: tuple[PipelinePlan, ...] = ()
    """`num_slices` or `slicing = "auto"`: the slice layouts the first steps time, this plan
    (the default layout) first, each a whole plan (`MeasuredChoice`); empty: this one only."""

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Whether some rank's list splits a backward into I and W."""
        return any(
            action.computation_type in (INPUT_BACKWARD, WEIGHT_BACKWARD)
            for actions in self.actions_by_rank.values()
            for action in actions
            if action is not None
        )

    @property
    def num_slices(self) -> int:
        return self.slices.num_slices

    @property
    def context_parallel(self) -> int:
        """cp ranks sharing every slice (`slice_length` is one rank's share)."""
        return self.slices.context_parallel

    @property
    def slice_bounds(self) -> tuple[int, ...]:
        """Token offsets, from 0 to seq_len, where a whole sequence's slices start and end."""
        return self.slices.bounds

    @property
    def slice_lengths(self) -> tuple[int, ...]:
        """Tokens of one sequence in each slice, per context-parallel rank."""
        return self.slices.lengths

    @property
    def slice_length(self) -> int:
        """Tokens of one sequence in the longest slice, per context-parallel rank."""
        return self.slices.longest

    def without_feature(self, name: str) -> PipelinePlan:
        """This plan with feature `name` off: the what-if of a feature that leaves the stages
        and lists as they are (activation offload's, in the memory plan)."""
        return dataclasses.replace(
            self,
            features=tuple(feature for feature in self.features if feature != name),
            feature_plans={key: value for key, value in self.feature_plans.items() if key != name},
        )

    @property
    def embedding_outside(self) -> bool:
        """A feature holds the embedding: the first stage takes hidden states."""
        return self.structure.embedding in self.modules_outside_stages

    @property
    def output_outside(self) -> bool:
        """A feature holds the output layer: the last stage gives hidden states."""
        return self.structure.output in self.modules_outside_stages

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def stage_indices(self, rank: int) -> list[int]:
        """The stages `rank` holds, ascending: where the user schedule runs them, else by
        `stage_style`."""
        if self.stage_style == "user":
            return sorted({action.stage_index for action in self.actions_by_rank[rank]})
        return stages_of_rank(rank, self.num_ranks, self.stages_per_rank, self.stage_style)

    def stage_rank(self, stage: int) -> int:
        """The rank holding `stage`."""
        return next(r for r in range(self.num_ranks) if stage in self.stage_indices(r))
