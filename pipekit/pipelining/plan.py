"""From the `[parallelism]` section to a concrete pipeline: schedule, slices, stages, placement.

Pure and cheap, so config validation runs it before any process group exists and the trainer
runs the same code to build the pipeline: every rule is checked in one place.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipekit.attention.context_parallel import check_context_parallel_variant
from pipekit.config.job_config import ParallelismConfig
from pipekit.models.spec import ModelShape, ModelStructure
from pipekit.pipelining._torch_runtime import INPUT_BACKWARD, WEIGHT_BACKWARD, Action
from pipekit.pipelining.features.exchange_plan import plan_context_exchange
from pipekit.pipelining.features.offload_plan import resolve_offload_ratios
from pipekit.pipelining.features.output_passes import with_output_passes
from pipekit.pipelining.model_split.partition import (
    blocks_per_stage,
    modules_outside_stages,
    stage_module_names,
    stages_of_rank,
    with_shared_modules,
)
from pipekit.pipelining.schedules.check import check_schedule
from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
from pipekit.pipelining.schedules.slice_bounds import SLICINGS, slice_bounds
from pipekit.pipelining.schedules.user import load_schedule_file

__all__ = ["PipelinePlan", "plan_pipeline"]

_SLICE_GRANULARITY = 64
"""Tokens equal-cost slice bounds round to (when seq_len / num_slices allows)."""


@dataclass(frozen=True)
class PipelinePlan:
    """Everything that fixes the shape of one rank group's pipeline."""

    schedule: str
    """A name of the schedule registry ("user" for a schedule file)."""
    num_ranks: int
    stages_per_rank: int
    num_slices: int
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
    slice_bounds: tuple[int, ...]
    """Token offsets, from 0 to seq_len, where a sequence's slices start and end (the whole
    sequence's, before context parallelism splits each slice)."""
    vocab_parallel: bool = False
    """The embedding and output layer are split across the pipeline ranks, outside the stages."""
    context_exchange: bool = False
    context_parallel: int = 1
    """cp ranks sharing every slice (`slice_length` is one rank's share)."""
    context_parallel_variant: str = "auto"
    """"commutated", "kv_passing" or "auto" (per slice, by bytes)."""
    sequence_shards: int = 1
    """Sequence parallelism's tp ranks: hidden states between stages hold `slice_length /
    sequence_shards` tokens."""
    attention_to_linear: float = 0.0
    """The model's causal-attention over matmul FLOPs on whole sequences, as planning was told
    (what equal-cost slices are placed by; 0 when not given)."""
    activation_offload: tuple[float, ...] = ()
    """Per pipeline rank, the share of an offloaded unit's activations moved off the device
    (`features.offload_plan`); () when nothing is offloaded."""

    @property
    def features(self) -> frozenset[str]:
        """The pipeline features the plan turns on (registry names)."""
        return _features(
            self.vocab_parallel,
            self.context_exchange,
            self.context_parallel,
            bool(self.activation_offload),
        )

    @property
    def slice_lengths(self) -> tuple[int, ...]:
        """Tokens of one sequence in each slice, per context-parallel rank."""
        bounds = self.slice_bounds
        return tuple(
            (end - start) // self.context_parallel for start, end in itertools.pairwise(bounds)
        )

    @property
    def rank_slice_bounds(self) -> tuple[int, ...]:
        """Token offsets of the slices in the sequence one context-parallel rank holds (its
        load-balanced share of every slice, in slice order): what the runner cuts."""
        return tuple(itertools.accumulate(self.slice_lengths, initial=0))

    @property
    def slice_fractions(self) -> tuple[float, ...]:
        """`slice_bounds` as fractions of the sequence (for `CostModel.slice_bounds`)."""
        return tuple(bound / self.slice_bounds[-1] for bound in self.slice_bounds)

    @property
    def slice_length(self) -> int:
        """Tokens of one sequence in the longest slice, per context-parallel rank."""
        return max(self.slice_lengths)

    @property
    def modules_outside_stages(self) -> tuple[str, ...]:
        """Modules no stage holds (vocabulary parallelism's)."""
        return modules_outside_stages(self.structure, self.vocab_parallel)

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


def plan_pipeline(
    parallelism: ParallelismConfig,
    structure: ModelStructure,
    model: ModelShape,
    local_batch_size: int,
    seq_len: int,
    *,
    user_actions: Mapping[int, Sequence[Action]] | None = None,
    attention_to_linear: float = 0.0,
) -> PipelinePlan:
    """Resolve the defaults (0 = auto) and check every pipeline rule; ValueError names the fix.

    A user schedule (`pipeline_schedule_file`, or every rank's compute-only `user_actions`
    given in Python, e.g. from `tasks_to_actions`) overrides `pipeline_schedule`: the plan's
    schedule is "user", and the lists are checked here (`schedules.check.check_schedule`). The
    schedule's own rules come from its registry entry. `attention_to_linear` (the model's
    causal-attention forward FLOPs over its linear ones, whole sequences) places equal-cost
    slices.
    """
    schedule_file = parallelism.pipeline_schedule_file
    user = bool(schedule_file) or user_actions is not None
    entry = get_schedule("user" if user else parallelism.pipeline_schedule)
    num_ranks, stages_per_rank = parallelism.pipeline_parallel_degree, parallelism.stages_per_rank
    num_slices = parallelism.num_slices or (2 * num_ranks if entry.name == "sliced" else 1)
    num_microbatches = parallelism.microbatches or local_batch_size
    if num_microbatches < 1 or local_batch_size % num_microbatches:
        raise ValueError(
            f"microbatches={num_microbatches} must divide the local batch of {local_batch_size} "
            "sequences (global_batch_size / (data-parallel degree x gradient_accumulation_steps))"
        )
    shape = ScheduleShape(num_ranks, num_microbatches, num_slices, stages_per_rank)
    features = _features(
        parallelism.vocab_parallel,
        parallelism.context_exchange,
        parallelism.cp,
        bool(parallelism.activation_offload),
    )
    entry.check(shape, features)
    if entry.actions is None:
        where = f"pipeline_schedule_file={schedule_file!r}" if schedule_file else "the schedule"
        lists = load_schedule_file(schedule_file, num_slices) if schedule_file else user_actions
        assert lists is not None
        actions_by_rank = _check_user_lists(
            {rank: list(actions) for rank, actions in lists.items()},
            where,
            num_ranks,
            stages_per_rank,
            num_microbatches,
            num_slices,
        )
    elif entry.torch_class is None:  # pipekit's lists: their errors name the fix
        actions_by_rank = entry.actions(shape)
    else:
        try:  # torch's own shape rules
            actions_by_rank = entry.actions(shape)
        except (AssertionError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"pipeline_schedule={entry.name!r} rejects pipeline_parallel_degree={num_ranks}, "
                f"stages_per_rank={stages_per_rank}, microbatches={num_microbatches}, "
                f"num_slices={num_slices}: {error}"
            ) from None
    _check_split_backward_without_data_parallel(actions_by_rank, parallelism, entry.name)
    if seq_len % num_slices:
        raise ValueError(
            f"training.seq_len={seq_len} does not split into num_slices={num_slices} equal slices; "
            "choose num_slices dividing seq_len"
        )
    sequence_shards = parallelism.tp if parallelism.sequence_parallel else 1
    if parallelism.slicing != "equal_length":
        _check_equal_cost(parallelism, num_slices)
    num_stages = num_ranks * stages_per_rank
    if parallelism.pipeline_stage_modules:
        names = with_shared_modules(
            structure,
            [
                [name.strip() for name in entry_text.split(",") if name.strip()]
                for entry_text in parallelism.pipeline_stage_modules
            ],
        )
        if len(names) != num_stages:
            raise ValueError(
                f"pipeline_stage_modules has {len(names)} stages but pipeline_parallel_degree="
                f"{num_ranks} x stages_per_rank={stages_per_rank} = {num_stages}; give one entry "
                "per stage"
            )
    else:
        names = stage_module_names(
            structure,
            model.num_layers,
            num_stages,
            parallelism.pipeline_embedding_cost,
            parallelism.pipeline_output_cost,
            vocab_parallel=parallelism.vocab_parallel,
        )
    if parallelism.context_exchange:
        _check_context_exchange(structure, names, actions_by_rank, num_slices)
    if parallelism.cp > 1:
        _check_context_parallel(parallelism, seq_len, num_slices)
    if sequence_shards > 1:
        _check_sequence_parallel(parallelism, seq_len // num_slices // parallelism.cp)
    granularity = _slice_granularity(seq_len // num_slices, sequence_shards)
    if parallelism.vocab_parallel:  # the output passes must fit the schedule without deadlock
        with_output_passes(actions_by_rank, num_slices, lockstep=parallelism.context_exchange)
    offload = resolve_offload_ratios(parallelism.activation_offload, actions_by_rank)
    return PipelinePlan(
        schedule=entry.name,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        num_slices=num_slices,
        num_microbatches=num_microbatches,
        stage_style=entry.stage_style,
        module_names_per_stage=names,
        actions_by_rank=actions_by_rank,
        structure=structure,
        model=model,
        unit_rows=local_batch_size // num_microbatches,
        slice_bounds=slice_bounds(
            seq_len, num_slices, parallelism.slicing, attention_to_linear, granularity
        ),
        vocab_parallel=parallelism.vocab_parallel,
        context_exchange=parallelism.context_exchange,
        context_parallel=parallelism.cp,
        context_parallel_variant=parallelism.cp_variant,
        sequence_shards=sequence_shards,
        attention_to_linear=attention_to_linear,
        activation_offload=offload,
    )


def _slice_granularity(equal_slice: int, sequence_shards: int) -> int:
    """Tokens equal-cost bounds round to: a power of two up to `_SLICE_GRANULARITY` (a block
    attention kernels like) dividing the equal slice into at least 16 granules, so rounding
    moves a slice's cost by a few percent at most, times what the tp ranks' shares need."""
    granularity = math.gcd(equal_slice, _SLICE_GRANULARITY)
    while granularity > 1 and equal_slice < 16 * granularity:
        granularity //= 2
    return math.lcm(granularity, sequence_shards)


def _check_equal_cost(parallelism: ParallelismConfig, num_slices: int) -> None:
    """Equal-cost slices differ in length; the features that pair slices across ranks or cut
    them into equal pieces need equal lengths."""
    if parallelism.slicing not in SLICINGS:
        raise ValueError(f"slicing={parallelism.slicing!r} is not one of {', '.join(SLICINGS)}")
    if num_slices < 2:
        raise ValueError(
            f"slicing={parallelism.slicing!r} needs sliced passes: num_slices >= 2, not "
            f"{num_slices}"
        )
    clashes = {
        "context_exchange = true": parallelism.context_exchange,
        "vocab_parallel = true": parallelism.vocab_parallel,
        f"cp = {parallelism.cp}": parallelism.cp > 1,
    }
    for setting, on in clashes.items():
        if on:
            raise ValueError(
                f"slicing='equal_cost' with {setting}: that feature needs slices of equal "
                "length; use slicing = 'equal_length' with it"
            )


def _features(
    vocab_parallel: bool, context_exchange: bool, cp: int, offload: bool = False
) -> frozenset[str]:
    """The registry names of the features these settings turn on."""
    on = {
        "vocab_parallel": vocab_parallel,
        "context_exchange": context_exchange,
        "context_parallel": cp > 1,
        "activation_offload": offload,
    }
    return frozenset(name for name, enabled in on.items() if enabled)


def _check_context_parallel(parallelism: ParallelismConfig, seq_len: int, num_slices: int) -> None:
    """Every slice is cut into 2 x cp equal pieces; context exchange lends KV-cache chunks a
    context-parallel rank does not hold whole."""
    check_context_parallel_variant(parallelism.cp_variant)
    if parallelism.cp_variant == "ring":
        raise ValueError(
            "cp_variant='ring' passes a whole sequence's K/V around the ranks; inside a "
            "pipeline use commutated, kv_passing or auto"
        )
    pieces = 2 * parallelism.cp * num_slices
    if seq_len % pieces:
        raise ValueError(
            f"training.seq_len={seq_len} must be a multiple of 2 x cp x num_slices = {pieces} "
            f"(each of the {num_slices} slices is cut into 2 x cp = {2 * parallelism.cp} equal "
            "pieces for the cp ranks); choose seq_len, cp or num_slices to fit"
        )
    if parallelism.context_exchange and parallelism.cp_variant == "kv_passing":
        raise ValueError(
            "context_exchange = true with cp_variant='kv_passing': a lending slice hands its "
            "peer this rank's share of earlier slices, which only the commutated variant keeps "
            "at home; use cp_variant = 'commutated' or 'auto' (lending slices run commutated)"
        )


def _check_sequence_parallel(parallelism: ParallelismConfig, slice_length: int) -> None:
    """Each tp rank holds an equal run of every slice's tokens between the stages."""
    if slice_length % parallelism.tp:
        raise ValueError(
            f"sequence_parallel = true with tp={parallelism.tp}: a slice's {slice_length} tokens "
            "per cp rank must split evenly over the tp ranks; choose seq_len, num_slices or cp "
            "so that seq_len / (num_slices x cp) is a multiple of tp, or sequence_parallel = false"
        )


def _check_context_exchange(
    structure: ModelStructure,
    names: list[list[str]],
    actions_by_rank: dict[int, list[Action]],
    num_slices: int,
) -> None:
    """Context exchange moves attention between slices' passes: it needs several slices, and
    every stage must hold an attention layer to serve with."""
    if num_slices < 2:
        raise ValueError(
            f"context_exchange = true needs sliced passes: num_slices >= 2, not {num_slices}"
        )
    blocks = blocks_per_stage(structure, names)
    empty = [stage for stage, count in blocks.items() if not count]
    if empty:
        raise ValueError(
            f"context_exchange = true: stages {empty} hold no transformer layer to serve "
            "attention with; change the stage split or set context_exchange = false"
        )
    plan_context_exchange(actions_by_rank, num_slices)


def _check_user_lists(
    actions_by_rank: dict[int, list[Action]],
    where: str,
    num_ranks: int,
    stages_per_rank: int,
    num_microbatches: int,
    num_slices: int,
) -> dict[int, list[Action]]:
    """A user schedule's action lists, checked against the plan's p, v, m and n."""
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


def _check_split_backward_without_data_parallel(
    actions_by_rank: Mapping[int, Sequence[Action]], parallelism: ParallelismConfig, name: str
) -> None:
    """Refuse input/weight-split backwards (I/W actions) on data-parallel stages.

    torch's runtime computes a W action's gradients for the stage module's registered
    parameters; under FSDP2 those are the sharded parameters, which the graph never saw (it ran
    on the gathered ones), so the weight gradients of every stage but the first come out wrong
    or missing (measured: ZBVZeroBubble on 2 pipeline x 2 FSDP ranks). A degree of -1 (not
    resolved against a world size) counts as data-parallel."""
    data_parallel = parallelism.dp_shard != 1 or parallelism.dp_replicate != 1
    split = any(
        action.computation_type in (INPUT_BACKWARD, WEIGHT_BACKWARD)
        for actions in actions_by_rank.values()
        for action in actions
        if action is not None
    )
    if split and data_parallel:
        raise ValueError(
            f"pipeline_schedule={name!r} splits backwards into input and weight parts (I/W), "
            "which torch's pipeline runtime gets wrong on FSDP-sharded stages; with "
            "dp_shard or dp_replicate > 1 use a schedule with full backwards (1F1B, "
            "Interleaved1F1B, sliced)"
        )
