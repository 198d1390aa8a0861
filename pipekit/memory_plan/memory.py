"""Each rank's memory for one training step, before launch: the terms, the peak, and whether it
fits.

Terms per rank (bytes):
- parameters: the local shards, in their storage dtype (float32 master weights), from the
  rank's real layout (`pipekit.memory_plan.layout`);
- gradients: the same shards' gradients (FSDP2 reduces into sharded float32 gradients);
- optimizer: AdamW's two moments per element in the parameters' dtype (torchao's 8-bit and
  4-bit AdamW: 1 and 0.5 bytes per moment, plus a float32 scale per 256 / 128 elements);
- activations: what the step keeps for backward at its fullest, from measured bytes per token
  (`pipekit.memory_plan.activations`): without a pipeline, every block's activations for the
  micro-step's tokens (a checkpointed block keeps its input), one block's backward (its working
  set, after rebuilding its activations if it is checkpointed) and the head's logits and their
  gradient (under context parallelism, for the rank's share of the tokens, each block also
  keeping the other ranks' gathered keys and values); with a pipeline, the units the schedule
  keeps in flight on the rank (simulated from its action lists), each holding, for one unit of
  tokens, its stage's activations (a stage's first block keeps the received input), its K/V
  cache and its output until the unit's backward (the hidden state sent on; on the last stage
  the logits, with what the head and the loss save, unless the output layer is
  vocabulary-parallel, whose passes run forward and backward at once), plus one block's backward
  and one head pass for a unit, and under slicing the K/V gradients the cache accumulates for
  the microbatch in backward. Activation offload takes the moved share of each offloaded unit's
  blocks' saved bytes (not the K/V the cache holds) off the units in flight, as the schedule's
  replay of its offloads and reloads says (`pipekit.pipelining.features.offload_plan`).

Not counted yet (so the plan is low by what they take): expert parallelism's all-to-all
buffers and the pipeline's gradient messages; routing is assumed even over the expert ranks.
The plan-accuracy bench measures the difference on the debug configs;
- buffers: FSDP2's unsharded parameters of the largest unit, twice (the unit in use and the
  one prefetched) in the compute dtype, and its unsharded gradients in the reduce dtype (under
  expert parallelism without the experts, which FSDP2 leaves sharded).

Peak: parameters + optimizer + the larger of (activations + buffers) and (gradients + the
optimizer step's temporaries, one parameter-sized list for foreach AdamW). Gradients add to the
activations where they coexist: under a pipeline (a stage's gradients accumulate while later
units are in flight) or gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipekit.attention.across import VariantRules, context_parallel_variant_entry
from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES
from pipekit.memory_plan.activations import ActivationProfile, TensorSplit, profile_activations
from pipekit.memory_plan.documents import (
    drawn_unit_shares,
    longest_drawn_slice,
    per_step_costs,
)
from pipekit.memory_plan.layout import RankLayout, rank_layouts
from pipekit.moe.expert_parallel import set_expert_execution
from pipekit.pipelining.features.offload_plan import resident_peak
from pipekit.pipelining.plan import PipelinePlan
from pipekit.pipelining.schedules.document_costs import UnitShares
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.train.activation_checkpoint import checkpoints_block
from pipekit.train.job import Job

__all__ = [
    "MemoryPlan",
    "RankMemory",
    "activation_profile",
    "pipeline_units_in_flight",
    "plan_memory",
    "rank_memory",
]

_LOW_BIT = {"AdamW8bit": (1.0, 256), "AdamW4bit": (0.5, 128)}
"""Optimizer -> (bytes per moment element, elements per float32 scale)."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's terms, in bytes."""

    layout: RankLayout
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    optimizer_step: int
    gradients_overlap_activations: bool

    @property
    def peak(self) -> int:
        backward = self.activations + self.buffers
        if self.gradients_overlap_activations:
            backward += self.gradients
        update = self.gradients + self.optimizer_step
        return self.parameters + self.optimizer + max(backward, update)

    def terms(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer states": self.optimizer,
            "activations": self.activations,
            "communication buffers": self.buffers,
        }


@dataclass(frozen=True)
class MemoryPlan:
    """Every representative rank's memory, and the profile it came from."""

    ranks: list[RankMemory]
    profile: ActivationProfile

    @property
    def peak(self) -> int:
        return max(rank.peak for rank in self.ranks)


def plan_memory(
    job: Job, probe_tokens: tuple[int, int] = (2, 6), profile: ActivationProfile | None = None
) -> MemoryPlan:
    """The memory plan of a validated `job` (planned for a world size); `profile`: one measured
    for the same model and options (a plan that differs only in its offload)."""
    if profile is None:
        profile = activation_profile(job, probe_tokens)
    units = None
    if job.pipeline is not None:
        units = pipeline_units_in_flight(job.pipeline, drawn_unit_shares(job))
    ranks = [rank_memory(job, layout, profile, units) for layout in rank_layouts(job)]
    return MemoryPlan(ranks, profile)


def activation_profile(
    job: Job,
    probe_tokens: tuple[int, int] = (2, 6),
    split: TensorSplit | None = None,
    selective: bool | None = None,
) -> ActivationProfile:
    """The measured bytes per token of the job's blocks and head, under its tensor split and
    checkpointing, or under `split` and `selective` checkpointing where given (every layout of
    the same split and policy shares it)."""
    training, moe = job.config.training, job.config.moe
    compute = MIXED_PRECISION_DTYPES[training.mixed_precision_param]
    if split is None:
        split = TensorSplit(job.tensor_parallel, job.sequence_parallel, job.loss_parallel)
    if selective is None:
        selective = training.activation_checkpoint == "selective"
    return profile_activations(
        job.spec,
        job.args,
        compute,
        probe_tokens,
        configure=lambda block: set_expert_execution(block, moe.partitions, moe.memory_reuse),
        split=split,
        selective=selective,
    )


def pipeline_units_in_flight(
    plan: PipelinePlan, step_shares: tuple[UnitShares, ...] = ()
) -> dict[int, float]:
    """Per pipeline rank, the most of one whole model's microbatch its schedule keeps between
    forward and backward at once (the simulator's peak at one byte per microbatch): every
    rank's bytes in flight are this times its bytes per microbatch, so one simulation serves
    every rank (and every layout of the same schedule shape). `step_shares`: drawn packed
    steps' `unit_shares` (`pipekit.memory_plan.documents`); the worst of them and of the
    planned shape is taken."""
    peaks: dict[int, float] = {}
    planned = CostModel(activation_bytes=1.0, slice_bounds=plan.slices.fractions)
    for cost in [planned, *per_step_costs(planned, step_shares)]:
        result = simulate(plan.actions_by_rank, num_slices=plan.num_slices, cost=cost)
        for rank, peak in result.peak_memory.items():
            peaks[rank] = max(peaks.get(rank, 0.0), peak["total"])
    return peaks


def rank_memory(
    job: Job,
    layout: RankLayout,
    profile: ActivationProfile,
    units_in_flight: dict[int, float] | None = None,
) -> RankMemory:
    """One rank's terms; `units_in_flight`: `pipeline_units_in_flight` of the job's pipeline
    and drawn steps (computed here when not given)."""
    training, optimizer = job.config.training, job.config.optimizer
    compute = MIXED_PRECISION_DTYPES[training.mixed_precision_param]
    reduce = MIXED_PRECISION_DTYPES[training.mixed_precision_reduce]
    element = layout.param_bytes // max(layout.param_numel, 1)
    if optimizer.name in _LOW_BIT:
        moment, block = _LOW_BIT[optimizer.name]
        states = int(2 * layout.param_numel * (moment + 4 / block))
        step = 0
    else:
        states = 2 * layout.param_numel * element
        step = layout.param_bytes
    unit = layout.largest_unit_numel
    buffers = unit * (2 * compute.itemsize + reduce.itemsize)
    pipelined = job.pipeline is not None
    if pipelined:
        assert job.pipeline is not None
        units = units_in_flight or pipeline_units_in_flight(job.pipeline, drawn_unit_shares(job))
        activations = _pipeline_activations(job, layout, profile, compute, units)
    else:
        activations = _step_activations(job, layout, profile)
    return RankMemory(
        layout=layout,
        parameters=layout.param_bytes,
        gradients=layout.param_bytes,
        optimizer=states,
        activations=int(activations),
        buffers=buffers,
        optimizer_step=step,
        gradients_overlap_activations=pipelined or training.gradient_accumulation_steps > 1,
    )


def _block_bytes(job: Job, names: tuple[str, ...], profile: ActivationProfile) -> float:
    """Bytes per token the blocks keep for backward, checkpointed ones keeping their input;
    under context parallelism a block also keeps the other cp ranks' keys and values."""
    gathered = job.dims.cp - 1
    kept = 0.0
    for position, name in enumerate(names):  # selective: the profile measured what blocks keep
        if checkpoints_block(name.rsplit(".", 1)[1], position, job.config.training):
            kept += profile.input_bytes
        else:
            kept += profile.block_bytes[name] + gathered * profile.kv_bytes[name]
    return kept


def _backward_bytes(job: Job, names: tuple[str, ...], profile: ActivationProfile) -> float:
    """Per token, what one block's backward adds: its working set, and its activations rebuilt
    first if it is checkpointed."""
    if not names:
        return 0.0
    # a selectively checkpointed block's probe ran its recompute already
    rebuilt = [
        profile.block_bytes[name]
        for position, name in enumerate(names)
        if checkpoints_block(name.rsplit(".", 1)[1], position, job.config.training)
    ]
    return profile.backward_bytes + max(rebuilt, default=0.0)


def _step_activations(job: Job, layout: RankLayout, profile: ActivationProfile) -> float:
    cp = job.dims.cp
    tokens = job.local_batch_size * job.config.training.seq_len // cp
    names = layout.block_names
    # the head's forward and backward end before the first block's backward begins: the two
    # working sets never coexist, each on top of what the blocks saved
    head = profile.head_bytes_per_row * layout.output_rows
    working = max(_backward_bytes(job, names, profile), head)
    return (_block_bytes(job, names, profile) + working) * tokens


def _stage_output_bytes(
    job: Job, stage: int, layout: RankLayout, profile: ActivationProfile, compute: torch.dtype
) -> float:
    """Per token, what a unit's forward leaves on the stage until its backward besides the
    blocks' saved activations: the output it sent (kept for the backward's gradient); on a
    last stage that computes its logits, those and what the head and the loss save."""
    plan = job.pipeline
    assert plan is not None
    if stage < plan.num_stages - 1 or plan.output_outside:
        return job.shape.dim * compute.itemsize / plan.sequence_shards
    rows = layout.output_rows
    return rows * (compute.itemsize + profile.head_saved_bytes_per_row)


def _pipeline_activations(
    job: Job,
    layout: RankLayout,
    profile: ActivationProfile,
    compute: torch.dtype,
    units_in_flight: dict[int, float],
) -> float:
    """Units in flight on the rank (simulated from the plan's action lists) times its stages'
    bytes per unit, plus one head pass and one block's backward."""
    plan = job.pipeline
    assert plan is not None
    unit_tokens = plan.unit_rows * longest_drawn_slice(job)  # the longest slice's unit
    sequence_tokens = plan.unit_rows * sum(plan.slice_lengths)
    stages = max(len(layout.stages), 1)
    outputs = sum(_stage_output_bytes(job, s, layout, profile, compute) for s in layout.stages)
    per_token = (_block_bytes(job, layout.block_names, profile) + outputs) / stages
    kv_per_token = (
        sum(
            profile.kv_bytes[name] * _head_shard_gathered_kv(job, profile.kv_heads[name])
            for name in layout.block_names
        )
        / stages
    )
    if plan.num_slices == 1:
        kv_per_token = 0.0  # no cache: K/V are among the saved activations
    scale = plan.num_stages * sequence_tokens  # the simulator takes a whole model's microbatch
    if kv_per_token and plan.splits_backward:  # the cache leaves at I, activations at W
        cost = CostModel(
            activation_bytes=per_token * scale,
            kv_cache_bytes=kv_per_token * scale,
            slice_bounds=plan.slices.fractions,
        )
        in_flight = max(
            simulate(plan.actions_by_rank, num_slices=plan.num_slices, cost=step).peak_memory[
                layout.pipeline_rank
            ]["total"]
            for step in [cost, *per_step_costs(cost, drawn_unit_shares(job))]
        )
    else:  # activations and cache live from a unit's F to its B: one curve, scaled
        in_flight = units_in_flight[layout.pipeline_rank] * (per_token + kv_per_token) * scale
    head_pass = profile.head_bytes_per_row
    if not plan.output_outside:  # what the head saved is held with the unit (above)
        head_pass -= profile.head_saved_bytes_per_row
    head = head_pass * layout.output_rows * unit_tokens
    in_flight -= _offloaded_bytes(job, layout, profile, unit_tokens / stages)
    backward = _backward_bytes(job, layout.block_names, profile) * unit_tokens
    # the KV cache's gradient accumulators: later slices' backwards leave dK/dV on the cached
    # slices of the microbatch in backward, up to the whole microbatch's K/V
    kv_gradients = kv_per_token * sequence_tokens
    return in_flight + head + backward + kv_gradients


def _head_shard_gathered_kv(job: Job, kv_heads: int) -> float:
    """How many times a token's K/V a rank caches in a pipeline, over its share without, under
    a cp variant whose cache holds head shards (Ulysses, hierarchical: its entry's
    `head_ranks`): kv heads fewer than those ranks are gathered whole (every token of one
    head, `ranks / kv_heads` times the token shard's bytes); otherwise each rank holds its
    heads of the ranks' tokens, the same bytes."""
    parallelism = job.config.parallelism
    head_ranks = context_parallel_variant_entry(parallelism.cp_variant).head_ranks
    if head_ranks is None:
        return 1.0
    rules = VariantRules(
        cp=job.dims.cp, query_heads=job.shape.num_heads, kv_heads=kv_heads,
        ulysses_size=parallelism.cp_ulysses, across=parallelism.cp_across, pipeline=True,
    )  # fmt: skip
    ranks = head_ranks(rules)
    if not kv_heads or kv_heads % ranks == 0:
        return 1.0
    return ranks / kv_heads


def _offloaded_bytes(
    job: Job, layout: RankLayout, profile: ActivationProfile, stage_unit_tokens: float
) -> float:
    """What activation offload takes off the rank's peak: the blocks' saved bytes of one unit
    but their K/V (the cache holds those), times the units' worth the schedule's replay
    (`offload_plan.resident_peak`) moves away at the rank's ratio."""
    plan = job.pipeline
    assert plan is not None
    offload = plan.feature_plans.get("activation_offload", ())
    if not offload:
        return 0.0
    ratio = offload[layout.pipeline_rank]
    names = layout.block_names
    kv = sum(profile.kv_bytes[name] for name in names) if plan.num_slices > 1 else 0.0
    movable = (_block_bytes(job, names, profile) - kv) * stage_unit_tokens
    actions = plan.actions_by_rank[layout.pipeline_rank]
    return movable * (resident_peak(actions, 0.0) - resident_peak(actions, ratio))
