"""From the `[parallelism]` section to a concrete pipeline: schedule, slices, stages, placement.

Pure and cheap, so config validation runs it before any process group exists and the trainer
runs the same code to build the pipeline: every rule is checked in one place. The pipeline
features' rules and their parts of the plan come from the feature table
(`features.registry`), the schedules' from the schedule table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.tensor_parallel import check_sequence_parallel_split
from pipekit.models.spec import ModelShape, ModelStructure
from pipekit.pipelining.actions import INPUT_BACKWARD, WEIGHT_BACKWARD, Action
from pipekit.pipelining.features.registry import (
    FEATURE_OFF,
    FeaturePlanning,
    PipelineFeature,
    enabled_pipeline_features,
    get_pipeline_feature,
    measured_pipeline_features,
)
from pipekit.pipelining.model_split.partition import (
    stage_module_names,
    with_shared_modules,
)
from pipekit.pipelining.pipeline_plan import PipelinePlan
from pipekit.pipelining.runtime.measured_choice import AUTO
from pipekit.pipelining.schedules.check import check_schedule
from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
from pipekit.pipelining.schedules.slice_bounds import MEASURED_SLICINGS, SLICINGS, slice_bounds
from pipekit.pipelining.schedules.slice_layout import SliceLayout
from pipekit.pipelining.schedules.user import load_schedule_file

__all__ = ["PipelinePlan", "plan_pipeline"]

_SLICE_GRANULARITY = 64
"""Tokens equal-cost slice bounds round to (when seq_len / num_slices allows)."""


def plan_pipeline(
    parallelism: ParallelismConfig,
    structure: ModelStructure,
    model: ModelShape,
    local_batch_size: int,
    seq_len: int,
    *,
    user_actions: Mapping[int, Sequence[Action]] | None = None,
    attention_to_linear: float = 0.0,
    attention_work_block: int = 1,
    activation_checkpoint: str = "none",
) -> PipelinePlan:
    """`_plan_pipeline`, with the measured choices resolved: a feature set to "auto" (its
    entry's `measured_setting`) is on where the job can run it (its plan then says to choose
    by measurement, `MeasuredChoice`), else off; `num_slices` or `slicing = "auto"` plans
    every layout the job can run (`PipelinePlan.layouts`)."""
    planner = functools.partial(
        _plan_pipeline,
        structure=structure,
        model=model,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        user_actions=user_actions,
        attention_to_linear=attention_to_linear,
        attention_work_block=attention_work_block,
        activation_checkpoint=activation_checkpoint,
    )
    if AUTO not in (parallelism.num_slices, parallelism.slicing):
        return _plan_with_measured_features(parallelism, planner)
    plans: list[PipelinePlan] = []
    for candidate in _layout_candidates(parallelism, seq_len):
        try:
            plan = _plan_with_measured_features(candidate, planner)
        except ValueError:
            if not plans:  # the default layout's error is the job's
                raise
            continue
        if all(plan.slice_bounds != other.slice_bounds for other in plans):  # a new layout
            plans.append(plan)
    default = plans[0]
    if default.features and len(plans) > 1:
        raise ValueError(
            f"num_slices or slicing = {AUTO!r} times slice layouts of a pipeline without "
            f"features, but this one runs {', '.join(default.features)}; set num_slices and "
            "slicing to values"
        )
    return replace(default, layouts=tuple(plans) if len(plans) > 1 else ())


_MIN_AUTO_SLICE_TOKENS = 32
"""`num_slices = "auto"` times no layout whose slices hold fewer tokens per rank."""


def _layout_candidates(parallelism: ParallelismConfig, seq_len: int) -> list[ParallelismConfig]:
    """The settings a measured layout choice times, the default first: 2p, 4p and 8p slices
    for `num_slices = "auto"` (those of at least `_MIN_AUTO_SLICE_TOKENS` tokens per cp and
    sequence-parallel rank), each cut both ways for `slicing = "auto"`."""
    p = parallelism.pipeline_parallel_degree
    if parallelism.num_slices == AUTO:
        if parallelism.pipeline_schedule_file or parallelism.pipeline_schedule != "sliced":
            raise ValueError(
                f"num_slices = {AUTO!r} times layouts of the sliced schedule; with "
                f"pipeline_schedule={parallelism.pipeline_schedule!r} or a schedule file set a "
                "count"
            )
        shards = parallelism.cp * (parallelism.tp if parallelism.sequence_parallel else 1)
        counts = [
            n
            for n in (2 * p, 4 * p, 8 * p)
            if n == 2 * p or seq_len // (n * shards) >= _MIN_AUTO_SLICE_TOKENS
        ]
    else:
        counts = [parallelism.num_slices]
    slicings = MEASURED_SLICINGS if parallelism.slicing == AUTO else (parallelism.slicing,)
    return [replace(parallelism, num_slices=n, slicing=cut) for n in counts for cut in slicings]


def _plan_with_measured_features(
    parallelism: ParallelismConfig, plan: Callable[[ParallelismConfig], PipelinePlan]
) -> PipelinePlan:
    """`plan(parallelism)` (`_plan_pipeline` with the job's other arguments) with every
    feature whose `measured_setting` is "auto" resolved: on where the job can run it (its
    feature plan then "auto": chosen by timing), else off."""
    pending = measured_pipeline_features(parallelism)
    if not pending:
        return plan(parallelism)
    feature, field = pending[0], pending[0].measured_setting
    try:
        chosen = _plan_with_measured_features(replace(parallelism, **{field: True}), plan)
    except ValueError:  # the job cannot run the feature: it runs without
        return _plan_with_measured_features(replace(parallelism, **{field: False}), plan)
    return replace(chosen, feature_plans={**chosen.feature_plans, feature.name: AUTO})


def _plan_pipeline(
    parallelism: ParallelismConfig,
    structure: ModelStructure,
    model: ModelShape,
    local_batch_size: int,
    seq_len: int,
    *,
    user_actions: Mapping[int, Sequence[Action]] | None = None,
    attention_to_linear: float = 0.0,
    attention_work_block: int = 1,
    activation_checkpoint: str = "none",
) -> PipelinePlan:
    """Resolve the defaults (0 = auto) and check every pipeline rule; ValueError names the fix.

    A user schedule (`pipeline_schedule_file`, or every rank's compute-only `user_actions`
    given in Python, e.g. from `tasks_to_actions`) overrides `pipeline_schedule`: the plan's
    schedule is "user", and the lists are checked here (`schedules.check.check_schedule`). The
    schedule's own rules come from its registry entry. `attention_to_linear` (the model's
    causal-attention forward FLOPs over its linear ones, whole sequences) places equal-cost
    slices; document-cut ones count attention in the kernel's `attention_work_block`-token
    tiles (`pipekit.attention.kernels.backends.attention_work_block`).
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
    features = enabled_pipeline_features(parallelism)
    entries = [get_pipeline_feature(name) for name in features]
    entry.check(shape, sliced_only=[f.name for f in entries if f.extension.sliced_only])
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
        _check_equal_cost(
            parallelism, num_slices, [f for f in entries if f.extension.equal_length_slices]
        )
    outside = tuple(
        name for feature in entries for name in feature.extension.modules_outside_stages(structure)
    )
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
            outside=outside,
            multi_token_prediction=model.multi_token_depth > 0,
        )
    if sequence_shards > 1:
        check_sequence_parallel_split(seq_len, parallelism.tp, parallelism.cp, num_slices)
    planning = FeaturePlanning(
        parallelism, structure, model, seq_len, num_slices, names, actions_by_rank, features,
        activation_checkpoint,
    )  # fmt: skip
    feature_plans = {}
    for feature in entries:
        feature.check(planning)
        feature_plans[feature.name] = feature.plan(planning)
    features = tuple(name for name in features if feature_plans[name] is not FEATURE_OFF)
    feature_plans = {name: feature_plans[name] for name in features}
    granularity = _slice_granularity(
        seq_len // num_slices, sequence_shards, parallelism.cp, parallelism.cp_pieces_per_rank
    )
    return PipelinePlan(
        schedule=entry.name,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        num_microbatches=num_microbatches,
        stage_style=entry.stage_style,
        module_names_per_stage=names,
        actions_by_rank=actions_by_rank,
        structure=structure,
        model=model,
        unit_rows=local_batch_size // num_microbatches,
        slices=SliceLayout(
            slice_bounds(
                seq_len, num_slices, parallelism.slicing, attention_to_linear, granularity
            ),
            parallelism.cp,
            parallelism.slicing,
            granularity,
            attention_to_linear,
            attention_work_block,
        ),
        features=features,
        feature_plans=feature_plans,
        modules_outside_stages=outside,
        sequence_shards=sequence_shards,
        attention_to_linear=attention_to_linear,
    )


def _slice_granularity(
    equal_slice: int, sequence_shards: int, context_parallel: int = 1, cp_pieces: int = 2
) -> int:
    """Tokens unequal bounds round to: a power of two up to `_SLICE_GRANULARITY` (a block
    attention kernels like) dividing the equal slice into at least 16 granules, so rounding
    moves a slice's cost by a few percent at most, times what the cp ranks' pieces and the tp
    ranks' shares of them need."""
    granularity = math.gcd(equal_slice, _SLICE_GRANULARITY)
    while granularity > 1 and equal_slice < 16 * granularity:
        granularity //= 2
    if context_parallel > 1:
        granularity = math.lcm(granularity, context_parallel * cp_pieces)
    return math.lcm(granularity, context_parallel * sequence_shards)


def _check_equal_cost(
    parallelism: ParallelismConfig, num_slices: int, needing_equal: Sequence[PipelineFeature]
) -> None:
    """Equal-cost and document-cut slices differ in length; the features that pair slices
    across ranks or cut them into equal pieces (`equal_length_slices`) need equal lengths."""
    if parallelism.slicing not in SLICINGS:
        raise ValueError(f"slicing={parallelism.slicing!r} is not one of {', '.join(SLICINGS)}")
    if num_slices < 2:
        raise ValueError(
            f"slicing={parallelism.slicing!r} needs sliced passes: num_slices >= 2, not "
            f"{num_slices}"
        )
    if needing_equal:
        feature = needing_equal[0]
        raise ValueError(
            f"slicing={parallelism.slicing!r} with {feature.how_to_enable}: that feature needs "
            "slices of equal length; use slicing = 'equal_length' with it"
        )


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
