"""A layout's step time, predicted: the schedule simulator fed with each action's FLOPs at the
device's sustained rate, the bytes each link moves, and the recomputation paid.

Per microbatch of the whole model, on one rank (the simulator gives a stage its share):
- compute: `2 N` matmul FLOPs per token forward and causal attention's `2 N r` (r: attention
  over matmul FLOPs at the job's length), split over tp (weights) and cp (tokens), at
  `peak x efficiency`; backward twice the forward. On packed documents (`[data]
  document_lengths`) attention is the drawn rows' share of causal attention, and a pipeline's
  slices are priced per drawn microbatch (`pipekit.memory_plan.documents`), steps averaged;
- recomputation: full checkpointing runs the forward again in the backward (+1 forward),
  every-k checkpointing 1/k of it, selective checkpointing the profile's stated share;
- fixed costs: every pass pays each block's measured overhead (on a CPU) and each
  collective's latency, whatever its tokens;
- tensor parallelism (Megatron's sequence-parallel pattern): two all-gathers and two
  reduce-scatters of a block's tokens x dim per block forward, on the critical path;
- context parallelism (K/V passed around the cp ranks): each rank receives the other ranks'
  K/V for each block, overlapped with the block's attention, the excess exposed (with the
  tokens: a slice passes its own K/V);
- expert parallelism: the all-to-all of each MoE block's routed tokens (dispatch and combine),
  on the critical path;
- pipeline transfers: the stage boundary's hidden states, per unit, latency plus bytes over
  the link between stages;
- per step, off the simulator: FSDP's gathers and gradient reduce-scatter overlap the
  compute except their last unit's share; activation offload's copies to the host and back
  overlap the compute, what exceeds it exposed.
On a CPU the passes' rate is measured on the job's block under the layout's tp and cp, with
their collectives running (`block_timing`), so tp's and cp's terms are in it, not added.
A group's link is within a node when its ranks span no more than a node (mesh order
`pp, dp_replicate, dp_shard, cp, tp`, tp innermost).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES
from pipekit.layout_search.candidates import Layout
from pipekit.layout_search.devices import DeviceProfile
from pipekit.memory_plan.documents import per_step_costs
from pipekit.memory_plan.layout import RankLayout
from pipekit.pipelining.features.registry import simulated_attention
from pipekit.pipelining.schedules.document_costs import UnitShares
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.train.job import Job

__all__ = ["ModelCosts", "StepPrediction", "predict_step"]


@dataclass(frozen=True)
class ModelCosts:
    """What a model costs per token, whatever the layout."""

    matmul_params: float
    """N: weight-matrix parameters a token runs through (experts at their active share)."""
    attention_to_linear: float
    """r: causal attention's FLOPs over the matmuls' at the job's length."""
    moe_blocks: int
    top_k: int
    """Experts a token is routed to (0 without MoE)."""
    attention_share: float = 1.0
    """The planned rows' attention work over one causal document per row's, in the kernel's
    tiles (`[data] document_lengths`; 1: one document per row)."""

    def training_flops_per_token(self, packed: bool = True) -> float:
        """FLOPs per token trained: on the planned rows (`packed`), or on causal rows."""
        share = self.attention_share if packed else 1.0
        return 6.0 * self.matmul_params * (1.0 + self.attention_to_linear * share)


@dataclass(frozen=True)
class StepPrediction:
    """One step on the slowest rank, in seconds, and what it yields."""

    step_s: float
    compute_s: float
    """Forward and backward FLOPs at the sustained rate."""
    recompute_s: float
    exposed_communication_s: float
    """Communication on the critical path: tp, ep, cp beyond its overlap, FSDP's and
    offload's excess."""
    bubble_s: float
    """Idle time of the busiest rank (pipeline fill, drain and imbalance, transfers)."""
    overhead_s: float
    """Passes' fixed costs: blocks' dispatch (measured on a CPU) and collectives' latency."""
    tokens_per_s: float
    mfu: float


def _recompute_share(job: Job, device: DeviceProfile) -> float:
    training = job.config.training
    return {
        "none": 0.0,
        "selective": device.selective_recompute_share,
        "every_k": 1.0 / training.activation_checkpoint_every,
        "full": 1.0,
    }[training.activation_checkpoint]


def predict_step(
    job: Job,
    layout: Layout,
    costs: ModelCosts,
    device: DeviceProfile,
    rank_layouts: list[RankLayout],
    offloaded_bytes_per_step: float = 0.0,
    step_shares: tuple[UnitShares, ...] = (),
) -> StepPrediction:
    """The predicted step of `job` (placed by `layout`) on `device`; `step_shares`: drawn
    packed steps' `CostModel.unit_shares` (`pipekit.memory_plan.documents`), whose simulated
    steps are averaged."""
    dims, shape = job.dims, job.shape
    training = job.config.training
    itemsize = MIXED_PRECISION_DTYPES[training.mixed_precision_param].itemsize
    seq_len = training.seq_len
    plan = job.pipeline
    rows = plan.unit_rows if plan is not None else job.local_batch_size
    units = (
        plan.num_microbatches if plan is not None else 1
    ) * training.gradient_accumulation_steps
    tokens = rows * seq_len // dims.cp  # a rank's tokens of one microbatch (all its tp ranks)
    rate = device.sustained_flops
    linear_s = 2 * costs.matmul_params * tokens / dims.tp / rate
    causal_attention_s = linear_s * costs.attention_to_linear
    attention_s = causal_attention_s * costs.attention_share
    layers = shape.num_layers
    tp_s = cp_exposed_s = ep_s = 0.0
    priced_tp, priced_cp = (1, 1) if device.collectives_in_pass else (dims.tp, dims.cp)
    # per pass whatever its tokens: the blocks' fixed costs and every collective's latency
    collectives = (4 if priced_tp > 1 else 0) + (priced_cp - 1) + (2 if dims.ep > 1 else 0)
    overhead_s = layers * (device.block_overhead_s / 3 + collectives * device.link_latency_s)
    if priced_tp > 1:
        volume = 4 * layers * (dims.tp - 1) / dims.tp * tokens * shape.dim * itemsize
        tp_s = volume / device.bandwidth(dims.tp)
    if priced_cp > 1:
        kv_heads = max(1, shape.num_kv_heads // dims.tp)
        kv_bytes = (dims.cp - 1) * tokens * 2 * kv_heads * shape.head_dim * itemsize
        per_block = kv_bytes / device.bandwidth(dims.tp * dims.cp)
        cp_exposed_s = layers * max(0.0, per_block - attention_s / layers)
    if costs.moe_blocks and dims.ep > 1:
        routed = tokens / (dims.tp if job.sequence_parallel else 1) * costs.top_k
        volume = 2 * costs.moe_blocks * (dims.ep - 1) / dims.ep * routed * shape.dim * itemsize
        ep_s = volume / device.bandwidth(dims.ep)
    recompute = _recompute_share(job, device)
    forward_linear = linear_s + tp_s + ep_s + cp_exposed_s  # cp: K/V bytes go with the tokens
    if plan is None:
        forward = forward_linear + attention_s + overhead_s
        makespan = units * forward * (3.0 + recompute)
        busy = makespan
    else:
        boundary = tokens / (dims.tp if job.sequence_parallel else 1) * shape.dim * itemsize
        span = dims.world_size // dims.pp
        cost = CostModel(
            forward_linear=forward_linear,
            forward_attention=causal_attention_s if step_shares else attention_s,
            backward_ratio=2.0 + recompute,
            action_overhead=overhead_s,
            p2p_latency=device.link_latency_s,
            p2p_bandwidth=device.bandwidth(span + 1),
            boundary_bytes=boundary,
            activation_bytes=0.0,
            slice_bounds=plan.slices.fractions,
        )
        results = [
            simulate(
                plan.actions_by_rank,
                num_slices=plan.num_slices,
                cost=step,
                attended_slices=simulated_attention(plan, 2.0),
                track_memory=False,
            )
            for step in per_step_costs(cost, step_shares) or [cost]
        ]
        accumulation = training.gradient_accumulation_steps  # one pipeline step each
        makespan = statistics.fmean(result.makespan for result in results) * accumulation
        busy = statistics.fmean(max(result.busy_time.values()) for result in results)
        busy *= accumulation
    share = 1.0 / dims.pp  # of the whole model's work, on one pipeline rank
    compute_s = 3.0 * (linear_s + attention_s) * units * share
    recompute_s = recompute * (linear_s + attention_s) * units * share
    in_action_s = (3.0 + recompute) * (tp_s + ep_s + cp_exposed_s) * units * share
    dp_s = _data_parallel_s(job, rank_layouts, device, itemsize)
    exposed_dp = max(dp_s - busy, dp_s / max(units, 1)) if dp_s else 0.0
    offload_s = 2 * offloaded_bytes_per_step / device.host_bandwidth
    exposed_offload = max(0.0, offload_s - busy)
    step_s = makespan + exposed_dp + exposed_offload
    fixed_s = max(0.0, busy - compute_s - recompute_s - in_action_s)
    global_tokens = training.global_batch_size * seq_len
    return StepPrediction(
        step_s=step_s,
        compute_s=compute_s,
        recompute_s=recompute_s,
        exposed_communication_s=in_action_s + exposed_dp + exposed_offload,
        bubble_s=max(0.0, makespan - busy),
        overhead_s=fixed_s,
        tokens_per_s=global_tokens / step_s,
        mfu=costs.training_flops_per_token()
        * global_tokens
        / (dims.world_size * device.peak_flops * step_s),
    )


def _data_parallel_s(
    job: Job, rank_layouts: list[RankLayout], device: DeviceProfile, itemsize: int
) -> float:
    """Seconds of one step's FSDP traffic on the busiest rank: its parameters gathered for
    forward and again for backward in the compute dtype, its gradients reduce-scattered in
    the reduce dtype; replicas all-reduce the gradients."""
    dims = job.dims
    shard, replicas = dims.dp_shard * dims.cp, dims.dp_replicate
    if shard * replicas == 1:
        return 0.0
    reduce = MIXED_PRECISION_DTYPES[job.config.training.mixed_precision_reduce].itemsize
    numel = max(layout.param_numel for layout in rank_layouts)  # local shards
    seconds = 0.0
    if shard > 1:
        volume = numel * (shard - 1) * (2 * itemsize + reduce)
        seconds += volume / device.bandwidth(shard * dims.tp)
    if replicas > 1:
        volume = 2 * numel * (replicas - 1) / replicas * reduce
        seconds += volume / device.bandwidth(dims.world_size // dims.pp)
    return seconds
