"""The layout search: every layout a job's rules allow on a world size, its per-rank peak and
its step time predicted, the fastest that fit first.

For each structure (degrees, schedule, stages per rank, slices, slicing) the job's own rules
judge it first (`check_parallel_layout`, the pipeline planner): a structure they refuse is
counted with the reason. Then each activation policy, the cheapest recomputation first (none,
activation offload at rising ratios, selective, every-k, full checkpointing), gets the memory
plan's peak (`pipekit.memory_plan.memory.rank_memory` on every pipeline rank, with shares
counted by `ShareCounter` and bytes per token measured once per tensor split and
checkpointing policy); the fastest policy that fits is the structure's. A structure that no
policy fits is kept with its smallest shortfall, for the report of what does not fit. The
layouts printed are validated as a job (`validate_job`) before they are.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from pipekit.attention.kernels.backends import attention_work_block
from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.layout_search.block_timing import (
    measure_block_overhead,
    measure_placed_block_pass_s,
)
from pipekit.layout_search.candidates import (
    ACTIVATION_POLICIES,
    OFFLOAD_RATIOS,
    Layout,
    SearchSpace,
    apply_layout,
    enumerate_layouts,
)
from pipekit.layout_search.devices import DeviceProfile
from pipekit.layout_search.shards import ShareCounter
from pipekit.layout_search.step_time import ModelCosts, StepPrediction, predict_step
from pipekit.memory_plan.__main__ import refusal
from pipekit.memory_plan.activations import ActivationProfile, TensorSplit
from pipekit.memory_plan.documents import (
    attention_share,
    drawn_unit_shares,
    planning_document_ids,
)
from pipekit.memory_plan.forked import map_in_forked_children
from pipekit.memory_plan.layout import RankLayout
from pipekit.memory_plan.memory import (
    RankMemory,
    activation_profile,
    pipeline_units_in_flight,
    rank_memory,
)
from pipekit.moe.layer import MoE
from pipekit.pipelining.features.offload_plan import resolve_offload_ratios
from pipekit.pipelining.plan import PipelinePlan
from pipekit.train.activation_checkpoint import check_checkpoint_with_schedule
from pipekit.train.job import Job, job_model, job_pipeline, validate_job
from pipekit.train.metrics import attention_to_linear_flops, training_flops_per_token
from pipekit.train.parallel_rules import check_parallel_layout

__all__ = ["Candidate", "LayoutSearch", "SearchResult", "nothing_fits", "search_layouts"]

_SHARE_ROWS = 16
"""Rows per drawn step whose attention share prices packed documents (a mean: a few steps of
16 rows settle it)."""


@dataclass(frozen=True)
class Candidate:
    """A layout with its predicted peak (the worst pipeline rank) and step."""

    layout: Layout
    peak_bytes: int
    worst_rank: RankMemory
    step: StepPrediction


@dataclass
class SearchResult:
    """What a search found."""

    fitting: list[Candidate]
    """Layouts that fit, fastest first (one per structure: its fastest policy)."""
    excluded: list[Candidate]
    """Structures no policy fits, at their smallest peak, fastest first."""
    refused: Counter[str] = field(default_factory=Counter)
    """Why the job's rules refused structures, with how many."""
    structures: int = 0
    seconds: float = 0.0
    invalid: list[tuple[Layout, str]] = field(default_factory=list)
    """Fitting layouts that `validate_job` then refused (never printed as fitting)."""


class LayoutSearch:
    """Searches the layouts of one job config on one world size and device."""

    def __init__(
        self, config: JobConfig, world_size: int, device: DeviceProfile, space: SearchSpace
    ) -> None:
        self.config, self.world_size, self.space = config, world_size, space
        self.spec, self.args, self.upcycle, self.meta_model = job_model(config, check_files=False)
        self.shape = self.spec.shape(self.args)
        if device.name == "cpu" and not device.block_overhead_s:
            overhead = measure_block_overhead(self.spec, self.meta_model, self.shape.dim)
            device = dataclasses.replace(device, block_overhead_s=overhead)
        self.device = device
        seq_len = self.seq_len = config.training.seq_len
        structure = self.spec.structure
        ratio = attention_to_linear_flops(self.meta_model, self.shape, structure, seq_len)
        per_token = training_flops_per_token(self.meta_model, self.shape, structure, seq_len)
        moe = [module for module in self.meta_model.modules() if isinstance(module, MoE)]
        self.num_experts = moe[0].args.num_experts if moe else 0
        self.costs = ModelCosts(
            matmul_params=per_token / (6.0 * (1.0 + ratio)),
            attention_to_linear=ratio,
            moe_blocks=len(moe),
            top_k=moe[0].args.top_k if moe else 0,
            attention_share=self._attention_share(),
        )
        self._profiles: dict[tuple, ActivationProfile] = {}
        self._plans: dict[tuple, PipelinePlan | str] = {}
        self._units: dict[tuple, dict[int, float]] = {}
        self.pass_seconds: dict[tuple[int, int, int], float] = {}
        """On a CPU: a block's measured forward and backward on the slowest rank, by pass
        shape (rows of whole sequences, tp, cp)."""
        self._counter: ShareCounter | None = None

    def _attention_share(self) -> float:
        """The drawn packed rows' attention over causal rows' (`[data] document_lengths`),
        counted in the tiles of the attention kernel the device runs; 1 without a
        distribution."""
        document_ids_BS = planning_document_ids(self.config, _SHARE_ROWS)
        if document_ids_BS is None:
            return 1.0
        device_type = "cpu" if self.device.name == "cpu" else "cuda"
        block = attention_work_block(self.config.model.attention_backend, device_type)
        return attention_share(document_ids_BS, block)

    def run(self) -> SearchResult:
        start = time.perf_counter()
        result = SearchResult(fitting=[], excluded=[])
        structures = list(enumerate_layouts(self.config, self.space, self.shape, self.num_experts))
        self.measure_profiles(
            sorted({layout.tp for layout in structures}), len(os.sched_getaffinity(0))
        )
        for structure in structures:
            result.structures += 1
            try:
                fitting, smallest = self.evaluate(structure)
            except ConfigError as error:
                result.refused[_reason(str(error))] += 1
                continue
            if fitting is not None:
                result.fitting.append(fitting)
            elif smallest is not None:
                result.excluded.append(smallest)
        result.fitting.sort(key=lambda c: c.step.step_s)
        result.excluded.sort(key=lambda c: c.step.step_s)
        result.seconds = time.perf_counter() - start
        return result

    def validated(
        self,
        result: SearchResult,
        count: int = 10,
        kind: Callable[[Layout], Hashable] | None = None,
    ) -> list[Candidate]:
        """The `count` fastest fitting layouts that `validate_job` accepts (with `kind`: the
        fastest of each kind only); the others move to `result.invalid` with the reason."""
        kept: list[Candidate] = []
        kinds: set[Hashable] = set()
        for candidate in result.fitting:
            if len(kept) == count:
                break
            if kind is not None and kind(candidate.layout) in kinds:
                continue
            try:
                validate_job(self.job_config(candidate.layout), self.world_size, check_files=False)
            except ConfigError as error:
                result.invalid.append((candidate.layout, str(error)))
                continue
            kept.append(candidate)
            if kind is not None:
                kinds.add(kind(candidate.layout))
        return kept

    def job_config(self, layout: Layout) -> JobConfig:
        return apply_layout(self.config, layout)

    def job(self, layout: Layout) -> Job:
        """The job `layout` makes of the config (its rules checked, not its files): the Job
        `validate_job` resolves, its pipeline planned once per structure (an offload ratio
        adds the offload feature's plan, `resolve_offload_ratios`, to the structure's)."""
        config = self.job_config(layout)
        dims = check_parallel_layout(
            config.parallelism, self.world_size, self.spec, self.args,
            seq_len=config.training.seq_len, model=config.model.name, meta_model=self.meta_model,
        )  # fmt: skip
        training = config.training
        per_step = dims.dp_degree * training.gradient_accumulation_steps
        if training.global_batch_size % per_step:
            raise ConfigError(
                f"[training] global_batch_size={training.global_batch_size} must be divisible "
                f"by {per_step}"
            )
        local_batch = training.global_batch_size // per_step
        plan = None
        if dims.pp > 1:
            structure = layout.structure
            plan = self._plan(structure, self.job_config(structure), dims, local_batch)
            if layout.activation_offload:
                plan = dataclasses.replace(
                    plan,
                    features=(*plan.features, "activation_offload"),
                    feature_plans={
                        **plan.feature_plans,
                        "activation_offload": resolve_offload_ratios(
                            layout.activation_offload, plan.actions_by_rank
                        ),
                    },
                )
            try:
                check_checkpoint_with_schedule(
                    training.activation_checkpoint, plan.schedule, plan.splits_backward
                )
            except ValueError as error:
                raise ConfigError(f"[training] {error}") from None
        return Job(config, self.spec, self.args, self.shape, self.upcycle, dims, plan, local_batch)

    def _plan(
        self, structure: Layout, config: JobConfig, dims: ParallelDims, local_batch: int
    ) -> PipelinePlan:
        key = (structure, local_batch)
        if key not in self._plans:
            try:
                self._plans[key] = job_pipeline(
                    config, self.spec, self.meta_model, self.shape, dims, local_batch
                )
            except ConfigError as error:
                self._plans[key] = str(error)
        cached = self._plans[key]
        if isinstance(cached, str):
            raise ConfigError(cached)
        return cached

    def memory(self, job: Job, layouts: list[RankLayout]) -> RankMemory:
        """The worst pipeline rank's memory of `job`."""
        units = None
        plan = job.pipeline
        if plan is not None:
            # the schedule's shape fixes what is in flight, whatever the degrees beside it
            features = tuple(f for f in plan.features if f != "activation_offload")
            key = (
                plan.schedule, plan.num_ranks, plan.stages_per_rank, plan.num_slices,
                plan.num_microbatches, plan.slices, job.local_batch_size, features,
            )  # fmt: skip
            if key not in self._units:
                self._units[key] = pipeline_units_in_flight(plan, drawn_unit_shares(job))
            units = self._units[key]
        profile = self.profile(job)
        ranks = [rank_memory(job, layout, profile, units) for layout in layouts]
        return max(ranks, key=lambda rank: rank.peak)

    def profile(self, job: Job) -> ActivationProfile:
        """Bytes per token for the job's tensor split and checkpointing, measured once."""
        split = TensorSplit(job.tensor_parallel, job.sequence_parallel, job.loss_parallel)
        key = (split, job.config.training.activation_checkpoint == "selective")
        if key not in self._profiles:
            self._profiles[key] = activation_profile(job, split=key[0], selective=key[1])
        return self._profiles[key]

    def measure_profiles(
        self, tensor_degrees: list[int], processes: int, selective_too: tuple[bool, ...] = (False,)
    ) -> None:
        """Measure the profiles of every tp degree (and with selective checkpointing, where
        `selective_too` says so), `processes` at a time, each in a child of its own."""
        parallelism = self.config.parallelism
        keys = [
            (TensorSplit(tp, tp > 1 and parallelism.sequence_parallel,
                         tp > 1 and parallelism.loss_parallel), selective)
            for tp in tensor_degrees
            for selective in selective_too
        ]  # fmt: skip
        keys = [key for key in keys if key not in self._profiles]
        world = self.world_size
        dims = ParallelDims(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world
        )
        job = Job(self.config, self.spec, self.args, self.shape, self.upcycle, dims, None, 1)
        calls = [(job, (2, 6), split, selective) for split, selective in keys]
        profiles = map_in_forked_children(activation_profile, calls, processes)
        self._profiles.update(zip(keys, profiles, strict=True))

    def evaluate(self, structure: Layout) -> tuple[Candidate | None, Candidate | None]:
        """(the fastest fitting policy of `structure`, or None; the policy with the smallest
        peak when none fits, or None). ConfigError when the job's rules refuse it."""
        base = self.job(structure)
        layouts = self.share_layouts(base)
        best: Candidate | None = None
        smallest: tuple[Job, Layout, RankMemory] | None = None
        for layout in self._policies(structure):
            if best is not None and layout.activation_offload and best.layout.activation_offload:
                continue  # a larger offload ratio than one that fits only moves more
            try:
                job = self.job(layout) if layout != structure else base
            except ConfigError:
                continue
            worst = self.memory(job, layouts)
            if worst.peak > self.device.memory_bytes:
                if smallest is None or worst.peak < smallest[2].peak:
                    smallest = (job, layout, worst)
                if layout.activation_checkpoint == "full":
                    break  # every other checkpointing keeps more
                continue
            candidate = self.candidate(job, layout, worst, layouts)
            if best is None or candidate.step.step_s < best.step.step_s:
                best = candidate
            if layout.policy == "none":
                break  # every other policy adds work to the same structure
        if best is not None or smallest is None:
            return best, None
        return None, self.candidate(*smallest, layouts)

    def share_layouts(self, job: Job) -> list[RankLayout]:
        """Every pipeline rank's share of the model under `job`'s degrees (counted)."""
        if self._counter is None:
            self._counter = ShareCounter(job, self.meta_model)
        return self._counter.layouts(job)

    def candidate(
        self, job: Job, layout: Layout, worst: RankMemory, layouts: list[RankLayout]
    ) -> Candidate:
        """`layout` (making `job`, whose worst rank is `worst`) with its predicted step."""
        offloaded = _offloaded_bytes_per_step(job, worst, self.profile(job), layout)
        device = self.priced_device(job)
        step = predict_step(
            job, layout, self.costs, device, layouts, offloaded, drawn_unit_shares(job)
        )
        return Candidate(layout, worst.peak, worst, step)

    def priced_device(self, job: Job) -> DeviceProfile:
        """The device `job`'s passes are priced on. On a CPU its efficiency is what the job's
        own block reached over one microbatch's whole sequences, split over the job's tp and
        cp with every rank running (`block_timing`): the rate at which the model's FLOPs of
        that microbatch on one rank take the measured block's time, beyond its fixed cost,
        once per block; tp's and cp's collectives are inside that time, not priced again.
        Slices run at their whole sequence's rate (a slice attends to the KV cache before it,
        which a bare block at its length would leave out), plus the fixed cost of each pass,
        which ranks beyond the machine's cores share (it was timed on one)."""
        if self.device.name != "cpu":
            return self.device
        plan, dims = job.pipeline, job.dims
        rows = plan.unit_rows if plan is not None else job.local_batch_size
        shape = (rows, dims.tp, dims.cp)
        if shape not in self.pass_seconds:
            self.pass_seconds[shape] = measure_placed_block_pass_s(job, self.meta_model, rows)
        oversubscribed = max(1.0, self.device.devices_per_node / len(os.sched_getaffinity(0)))
        overhead_s = self.device.block_overhead_s * oversubscribed
        beyond_fixed_s = max(self.pass_seconds[shape] - overhead_s, 1e-9)
        per_token = self.costs.training_flops_per_token(packed=False)  # timed on causal rows
        flops = per_token * rows * self.seq_len / (dims.tp * dims.cp)
        rate = flops / (beyond_fixed_s * self.shape.num_layers)
        return dataclasses.replace(
            self.device,
            efficiency=rate / self.device.peak_flops,
            block_overhead_s=overhead_s,
            collectives_in_pass=True,
        )

    def _policies(self, structure: Layout) -> list[Layout]:
        """`structure` under every activation policy the job may run, cheapest first, but
        full checkpointing before the others: what it does not fit, none of them fits (it
        keeps the least), so they are skipped (and selective's profile not measured)."""
        policies = [structure]
        if structure.pp > 1:
            policies += [
                dataclasses.replace(structure, activation_offload=ratio) for ratio in OFFLOAD_RATIOS
            ]
        return policies + [
            dataclasses.replace(structure, activation_checkpoint=policy)
            for policy in ("full", *ACTIVATION_POLICIES[1:-1])
        ]


def search_layouts(
    config: JobConfig, world_size: int, device: DeviceProfile, space: SearchSpace | None = None
) -> tuple[LayoutSearch, SearchResult]:
    """Run a search; the searcher is returned too (to validate and describe its layouts)."""
    space = space or SearchSpace(world_size=world_size, devices_per_node=device.devices_per_node)
    searcher = LayoutSearch(config, world_size, device, space)
    return searcher, searcher.run()


def _offloaded_bytes_per_step(
    job: Job, worst: RankMemory, profile: ActivationProfile, layout: Layout
) -> float:
    """Bytes one rank's offload moves to the host per step: its share of its blocks' saved
    bytes (without the K/V the cache holds) for every token it runs."""
    if not layout.activation_offload or job.pipeline is None:
        return 0.0
    names = worst.layout.block_names
    kv = sum(profile.kv_bytes[name] for name in names) if job.pipeline.num_slices > 1 else 0.0
    saved = sum(profile.block_bytes[name] for name in names) - kv
    tokens = job.local_batch_size * job.config.training.seq_len // job.dims.cp
    return layout.activation_offload * saved * tokens


def nothing_fits(result: SearchResult, device: DeviceProfile) -> str:
    """One line: no layout fits; the smallest shortfall and what would fix it."""
    if not result.excluded:
        reasons = "; ".join(reason for reason, _ in result.refused.most_common(2))
        return f"no layout of the {result.structures} tried passes the job's rules: {reasons}"
    closest = min(result.excluded, key=lambda candidate: candidate.peak_bytes)
    return (
        f"no layout fits one device; the closest, {closest.layout.label()}: "
        f"{refusal(closest.worst_rank, device.memory_bytes)}; or launch more ranks"
    )


def _reason(message: str) -> str:
    """A refusal's message without its numbers' particulars, so alike refusals count as one."""
    return message.split(";")[0][:120]
