"""Multi-token prediction in a pipeline: each unit's targets on the last stage, and the
embedding the extra modules share with the first stage.

The MTP depths sit on the last stage with the output layer (`pipekit.layers.
multi_token_prediction`). Depth k of a unit (a slice of a microbatch) needs the tokens, labels
and document ids of the k positions after the slice, which lie in the next slice: the trainer
states the whole local batch's targets around the step (`multi_token_targets`, padded past each
row), and around each unit's forward on the last stage this extension states that unit's part
of them, its rows and its slice plus the D positions that follow. The unit's loss sums go back
to the batch's targets, where the trainer reads the step's `mtp_loss`.

The extra modules embed the tokens ahead with the main embedding, which is on the first stage:
the last stage holds a copy under the same name (a cross-stage tie, as a tied output layer
is), and `TiedWeights` keeps the copies equal by summing their gradients after every step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

from tensordict import TensorDict
from torch import Tensor, nn

from pipekit.layers.multi_token_prediction import current_targets, multi_token_targets
from pipekit.models.spec import ModelStructure
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["MultiTokenUnits", "check_multi_token_stage"]


def check_multi_token_stage(
    model: nn.Module, structure: ModelStructure, names_per_stage: Sequence[Sequence[str]]
) -> None:
    """ValueError unless `model`'s multi-token prediction modules sit on the last stage with
    the output layer: anywhere else they would never run, and never train."""
    present = [name for name in structure.multi_token_prediction if getattr(model, name, None)]
    last = set(names_per_stage[-1])
    misplaced = [name for name in present if name not in last]
    if present and (misplaced or structure.output not in last):
        raise ValueError(
            f"multi-token prediction ({', '.join(present)}) runs beside the output layer; put "
            f"{', '.join(present)} and {structure.output} in the last stage's modules"
        )


class MultiTokenUnits(PipelineExtension):
    """States each unit's multi-token targets around its forward on the last stage."""

    name = "multi_token_prediction"

    def __init__(self, last_stage_index: int, num_microbatches: int, depth: int) -> None:
        self.last_stage_index, self.depth = last_stage_index, depth
        self.num_microbatches = num_microbatches
        self.num_slices = 1
        """This step's slices per microbatch (a measured choice of slice layouts may change it
        between steps)."""
        self._rows: list[slice] = []
        self._columns: list[slice] = []

    def begin_step(
        self, units: Sequence[TensorDict], normaliser: Tensor | float
    ) -> list[tuple[Tensor, ...]] | None:
        """Where each unit lies in the local batch: its microbatch's rows, its slice's tokens
        and the D positions after them."""
        self.num_slices = len(units) // self.num_microbatches
        self._rows, self._columns = [], []
        for first in range(0, len(units), self.num_slices):
            microbatch = units[first : first + self.num_slices]
            rows = microbatch[0].batch_size[0]
            row_start = first // self.num_slices * rows
            lengths = [unit.batch_size[1] for unit in microbatch]
            for start, end in itertools.pairwise(itertools.accumulate(lengths, initial=0)):
                self._rows.append(slice(row_start, row_start + rows))
                self._columns.append(slice(start, end + self.depth))
        return None

    def forward_scope(
        self, stage_index: int, unit: int, training: bool
    ) -> AbstractContextManager[None]:
        if stage_index != self.last_stage_index:
            return contextlib.nullcontext()
        return self._unit_targets(unit)

    @contextlib.contextmanager
    def _unit_targets(self, unit: int) -> Iterator[None]:
        batch = current_targets()
        if batch is None:  # evaluation, or a caller training the main model alone
            yield
            return
        microbatch, slice_index = unit_microbatch_and_slice(unit, self.num_slices)
        index = microbatch * self.num_slices + slice_index
        rows, columns = self._rows[index], self._columns[index]
        documents = batch.document_ids_BT
        with multi_token_targets(
            batch.tokens_BT[rows, columns],
            batch.labels_BT[rows, columns],
            None if documents is None else documents[rows, columns],
            batch.loss_scale,
        ) as targets:
            yield
        batch.loss_sums.extend(targets.loss_sums)
