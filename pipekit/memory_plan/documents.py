"""The packed rows the planners price: a few steps of a job's rows drawn from `[data]
document_lengths`, and what they cost (the memory plan, the layout search, `layout = "auto"`).

A job without a distribution is planned as one causal document per row, as before. With one,
`PLANNING_STEPS` micro-steps of one data-parallel rank's rows are drawn (seeded by the job's
seed, so a plan is reproducible) and priced as the trainer would run them:
- each microbatch's slices as the layout cuts them (`SliceLayout.microbatch_bounds`: its own
  documents under `slicing = "documents"`, the planned bounds otherwise), with their shares of
  tokens and of one causal sequence's attention (`document_unit_shares`), for the simulator;
- the longest slice any drawn microbatch is cut into, which sizes a unit's working set (when
  longer than the planned ones: a kernel's tiles can make a document's cut longer);
- the rows' attention work over one causal document per row's, in the kernel's tiles.
Drawn steps vary: the memory plan takes the worst of them and of the planned shape, the step
time their mean.

Legend: B rows, S tokens per row.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from torch import Tensor

from pipekit.attention.document_lengths import (
    DocumentLengths,
    packed_document_ids,
    parse_document_lengths,
)
from pipekit.attention.work import attention_work
from pipekit.config.job_config import JobConfig
from pipekit.pipelining.schedules.document_costs import UnitShares, document_unit_shares
from pipekit.pipelining.schedules.simulate import CostModel
from pipekit.pipelining.schedules.slice_layout import SliceLayout
from pipekit.train.job import Job

__all__ = [
    "PLANNING_STEPS",
    "attention_share",
    "drawn_unit_shares",
    "longest_drawn_slice",
    "per_step_costs",
    "planning_document_ids",
]

PLANNING_STEPS = 8
"""Micro-steps of rows drawn to plan a job on packed documents."""


def planning_document_ids(config: JobConfig, rows: int) -> Tensor | None:
    """Document ids `[PLANNING_STEPS x rows, seq_len]` drawn from `config`'s distribution
    (`rows`: one micro-step's); None without one."""
    lengths = parse_document_lengths(config.data.document_lengths)
    if lengths is None:
        return None
    seq_len = config.training.seq_len
    return _drawn_rows(lengths, PLANNING_STEPS * rows, seq_len, config.job.seed)


@functools.lru_cache(maxsize=16)
def _drawn_rows(lengths: DocumentLengths, rows: int, seq_len: int, seed: int) -> Tensor:
    return packed_document_ids(lengths, rows, seq_len, seed)


def attention_share(document_ids_BS: Tensor, block: int) -> float:
    """The rows' attention work over as many causal rows' (each a single document), counted
    in the kernel's `block`-token tiles."""
    rows, seq_len = document_ids_BS.shape
    causal = float(attention_work(None, [None], seq_len, block).sum()) * rows
    return float(attention_work(document_ids_BS, [None], block=block).sum()) / causal


def drawn_unit_shares(job: Job) -> tuple[UnitShares, ...]:
    """Per drawn step of a pipelined job, `CostModel.unit_shares` (empty without a
    distribution or a pipeline)."""
    plan = job.pipeline
    document_ids_BS = planning_document_ids(job.config, job.local_batch_size)
    if plan is None or document_ids_BS is None:
        return ()
    return _step_shares(plan.slices, document_ids_BS, job.local_batch_size, plan.num_microbatches)


def longest_drawn_slice(job: Job) -> int:
    """Tokens of one sequence, per context-parallel rank, in the longest of the planned
    slices and of any drawn microbatch's cuts (a memory plan must hold either)."""
    plan = job.pipeline
    assert plan is not None
    document_ids_BS = planning_document_ids(job.config, job.local_batch_size)
    if document_ids_BS is None or not plan.slices.per_microbatch:
        return plan.slice_length
    return max(plan.slice_length, _longest_slice(plan.slices, document_ids_BS, plan.unit_rows))


@functools.lru_cache(maxsize=64)
def _step_shares(
    layout: SliceLayout, document_ids_BS: Tensor, step_rows: int, microbatches: int
) -> tuple[UnitShares, ...]:
    return tuple(
        document_unit_shares(layout, step_BS, microbatches)
        for step_BS in document_ids_BS.split(step_rows)
    )


@functools.lru_cache(maxsize=64)
def _longest_slice(layout: SliceLayout, document_ids_BS: Tensor, unit_rows: int) -> int:
    longest = 0
    for ids_BS in document_ids_BS.split(unit_rows):
        bounds = layout.microbatch_bounds(ids_BS)
        longest = max(longest, *(end - start for start, end in itertools.pairwise(bounds)))
    return longest // layout.context_parallel


def per_step_costs(cost: CostModel, step_shares: tuple[UnitShares, ...]) -> list[CostModel]:
    """`cost` for each drawn step (none without a distribution)."""
    return [dataclasses.replace(cost, unit_shares=shares) for shares in step_shares]
