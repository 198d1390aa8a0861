"""pipekit's own pipeline features, as entries of the feature table (`features.registry`).

Each entry says which `[parallelism]` setting turns the feature on, its rules, what it fixes at
planning and how a rank builds it; the feature's runtime lives in its own module. Order: context
parallelism first (context exchange wraps its attention), context exchange before vocabulary
parallelism (it plans on the compute lists), activation offload last.
"""

from __future__ import annotations

import os

from pipekit.attention.across import (
    VariantRules,
    check_context_parallel,
    check_context_parallel_split,
)
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.process_group import hierarchical_groups, new_group_along
from pipekit.memory.offload_store import store_for
from pipekit.models.spec import ModelShape
from pipekit.pipelining.actions import Action
from pipekit.pipelining.features.activation_offload import PipelineActivationOffload
from pipekit.pipelining.features.context_exchange import PipelineContextExchange
from pipekit.pipelining.features.context_parallel import PipelineContextParallel
from pipekit.pipelining.features.exchange_plan import plan_context_exchange
from pipekit.pipelining.features.offload_plan import resolve_offload_ratios
from pipekit.pipelining.features.output_passes import with_output_passes
from pipekit.pipelining.features.registry import (
    FEATURE_OFF,
    FeatureBuilding,
    FeatureLayout,
    FeaturePlanning,
    PipelineFeature,
    register_pipeline_feature,
)
from pipekit.pipelining.features.vocab_parallel import (
    PipelineVocabParallel,
    build_vocab_parallel,
)
from pipekit.pipelining.features.vocab_rules import check_vocab_parallel_layout
from pipekit.pipelining.model_split.partition import blocks_per_stage
from pipekit.pipelining.pipeline_plan import PipelinePlan
from pipekit.pipelining.runtime.measured_choice import AUTO

__all__: list[str] = []


def _variant_rules(
    parallelism: ParallelismConfig, model: ModelShape, pipeline: bool, context_exchange: bool
) -> VariantRules:
    """What the variant's entry checks: a tensor-parallel rank's heads, the groups, where."""
    tp = max(parallelism.tp, 1)
    return VariantRules(
        cp=parallelism.cp, query_heads=model.num_heads // tp,
        kv_heads=max(model.num_kv_heads // tp, 1), ulysses_size=parallelism.cp_ulysses,
        across=parallelism.cp_across, pipeline=pipeline, context_exchange=context_exchange,
    )  # fmt: skip


def _check_context_parallel_layout(layout: FeatureLayout) -> None:
    """The variant's rules (pipeline or not) and, outside pipelines, a sequence that cuts into
    the cp ranks' equal pieces (a pipeline's slices are checked at planning)."""
    pipeline = layout.dims.pp > 1
    rules = _variant_rules(layout.parallelism, layout.shape, pipeline, context_exchange=False)
    check_context_parallel(layout.parallelism.cp_variant, rules)
    if not pipeline and layout.seq_len is not None:
        pieces = layout.parallelism.cp_pieces_per_rank
        check_context_parallel_split(layout.seq_len, layout.dims.cp, pieces_per_rank=pieces)


def _check_context_parallel(planning: FeaturePlanning) -> None:
    """Every slice cuts into the cp ranks' equal pieces; under context exchange the variant
    must lend."""
    parallelism = planning.parallelism
    check_context_parallel_split(
        planning.seq_len, parallelism.cp, planning.num_slices, parallelism.cp_pieces_per_rank
    )
    context_exchange = "context_exchange" in planning.features
    rules = _variant_rules(planning.parallelism, planning.model, True, context_exchange)
    check_context_parallel(planning.parallelism.cp_variant, rules)


def _plan_context_parallel(planning: FeaturePlanning) -> tuple[str, int, str]:
    """The variant, and hierarchical context parallelism's group size and variant across."""
    parallelism = planning.parallelism
    return parallelism.cp_variant, parallelism.cp_ulysses, parallelism.cp_across


def _build_context_parallel(building: FeatureBuilding) -> PipelineContextParallel:
    plan = building.plan
    variant, ulysses_size, across = building.feature_plan
    hierarchy = None
    if ulysses_size:  # the variant takes groups (its rules refuse cp_ulysses otherwise)
        hierarchy = hierarchical_groups(building.mesh, ulysses_size, across)
    return PipelineContextParallel(
        building.mesh["cp"].get_group(),
        plan.slices,
        variant,
        hierarchy=hierarchy,
    )


def _check_context_exchange(planning: FeaturePlanning) -> None:
    """Context exchange moves attention between slices' passes: it needs several slices, and
    every stage must hold an attention layer to serve with."""
    if planning.num_slices < 2:
        raise ValueError(
            f"context_exchange = true needs sliced passes: num_slices >= 2, not "
            f"{planning.num_slices}"
        )
    blocks = blocks_per_stage(planning.structure, planning.module_names_per_stage)
    empty = [stage for stage, count in blocks.items() if not count]
    if empty:
        raise ValueError(
            f"context_exchange = true: stages {empty} hold no transformer layer to serve "
            "attention with; change the stage split or set context_exchange = false"
        )
    plan_context_exchange(planning.actions_by_rank, planning.num_slices)


def _build_context_exchange(building: FeatureBuilding) -> PipelineContextExchange:
    plan, setup = building.plan, building.setup
    return PipelineContextExchange(
        new_group_along(building.mesh, "pp"),
        blocks_per_stage(plan.structure, plan.module_names_per_stage),
        downward_group=new_group_along(building.mesh, "pp"),
        chunks_ahead=plan.context_parallel == 1,  # cp lends chunks it builds itself
        backend=setup.attention_backend,
        timeout=setup.collective_timeout,
        measured=building.feature_plan == AUTO,
    )


def _check_vocab_parallel(planning: FeaturePlanning) -> None:
    """The output passes must fit between the schedule's actions without deadlock."""
    with_output_passes(
        planning.actions_by_rank,
        planning.num_slices,
        lockstep="context_exchange" in planning.features,
    )


def _check_activation_offload_layout(layout: FeatureLayout) -> None:
    """Offload follows a pipeline's schedule."""
    if layout.dims.pp < 2:
        raise ValueError(
            f"activation_offload={layout.parallelism.activation_offload!r} follows a pipeline's "
            "schedule; set pipeline_parallel_degree >= 2 or activation_offload = 0"
        )


def _plan_activation_offload(planning: FeaturePlanning) -> tuple[float, ...] | object:
    """One offload ratio per pipeline rank; off when every ratio is 0 (a list of zeros, or
    "auto" on a schedule whose ranks are already even). When on: offload moves what autograd
    saves through its hooks, which activation checkpointing keeps in its own, and writes to a
    folder that must be writable."""
    setting = planning.parallelism.activation_offload
    ratios = resolve_offload_ratios(setting, planning.actions_by_rank)
    if not ratios:
        return FEATURE_OFF
    checkpoint = planning.activation_checkpoint
    if checkpoint != "none":
        raise ValueError(
            f"activation_offload={setting!r} with [training] activation_checkpoint="
            f"{checkpoint!r}: checkpointed blocks keep their tensors inside torch's checkpoint, "
            "out of the offload's reach; use one of the two"
        )
    directory = planning.parallelism.activation_offload_dir
    if directory and not os.access(directory, os.W_OK):
        raise ValueError(
            f"activation_offload_dir={directory!r} is not a writable folder; create it or "
            "leave it empty for the system's temporary folder"
        )
    return ratios


def _exchanged_attention(plan: PipelinePlan, backward_ratio: float) -> dict[Action, float]:
    """The attention each action's rank computes once context exchange has balanced it."""
    exchange = plan_context_exchange(plan.actions_by_rank, plan.num_slices, backward_ratio)
    return exchange.attended_slices()


def _build_activation_offload(building: FeatureBuilding) -> PipelineActivationOffload:
    setup = building.setup
    store = store_for(setup.device, setup.offload_dir or None)
    return PipelineActivationOffload(building.pipeline_rank, building.feature_plan, store)


for _feature in (
    PipelineFeature(
        "context_parallel",
        PipelineContextParallel,
        _build_context_parallel,
        setting=lambda parallelism: parallelism.cp > 1,
        setting_name="cp > 1",
        order=10,
        check_layout=_check_context_parallel_layout,
        check=_check_context_parallel,
        plan=_plan_context_parallel,
    ),
    PipelineFeature(
        "context_exchange",
        PipelineContextExchange,
        _build_context_exchange,
        setting=lambda parallelism: parallelism.context_exchange in (True, AUTO),
        setting_name="context_exchange = true",
        measured_setting="context_exchange",
        off_setting={"context_exchange": False},
        simulated_attention=_exchanged_attention,
        order=20,
        check=_check_context_exchange,
    ),
    PipelineFeature(
        "vocab_parallel",
        PipelineVocabParallel,
        build_vocab_parallel,
        setting=lambda parallelism: parallelism.vocab_parallel,
        setting_name="vocab_parallel = true",
        off_setting={"vocab_parallel": False},
        order=30,
        check_layout=check_vocab_parallel_layout,
        check=_check_vocab_parallel,
    ),
    PipelineFeature(
        "activation_offload",
        PipelineActivationOffload,
        _build_activation_offload,
        setting=lambda parallelism: bool(parallelism.activation_offload),
        setting_name="activation_offload = <ratio>",
        order=40,
        check_layout=_check_activation_offload_layout,
        plan=_plan_activation_offload,
    ),
):
    register_pipeline_feature(_feature)
