"""The one pipeline builder: a plan and a meta model in, this rank's `PipelineRunner` out.

    runner = build_pipeline(plan, model, mesh, StageSetup(device=..., materialize=...))

The trainer, every bench and the tests build pipelines through here. The model arrives on the
meta device; this rank keeps a pruned copy holding only its stages' modules (full-model names),
so it never allocates another rank's weights. `StageSetup` says how each stage is parallelized
(activation checkpointing, expert and data parallelism), which happens on the meta device, and
how it then gets storage and values (`materialize`: a seeded init or a checkpoint, shard by
shard). Each stage is a view sharing the rank
copy's modules, so the optimizer, checkpoints and gradient clipping see one model. The features
the plan turns on become the pipeline's extensions: vocabulary parallelism (its shards are
built here, filled with the unsplit model's rows, and set on the rank model under the model's
own names) and context exchange, each on a process group of its own, and activation offload
(`RELOAD` actions in the schedule). A tied model's embedding and output get a copy each, kept
equal by `TiedWeights` (a step-level extension the schedule does not carry).
"""

from __future__ import annotations

import copy

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipekit.distributed.process_group import new_group_between
from pipekit.layers.multi_token_prediction import prediction_depth
from pipekit.models.stage_module import (
    build_stage_module,
    check_structure,
    validate_stage_module_names,
)
from pipekit.pipelining.features.multi_token_units import (
    MultiTokenUnits,
    check_multi_token_stage,
)
from pipekit.pipelining.features.registry import FeatureBuilding, get_pipeline_feature
from pipekit.pipelining.features.tied_weights import TiedWeights, untie_vocabulary
from pipekit.pipelining.plan import PipelinePlan
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.runtime.measured_choice import MeasuredChoice
from pipekit.pipelining.runtime.runner import PipelineRunner, RunnerLayout, make_schedule
from pipekit.pipelining.runtime.stage import SlicedPipelineStage, StageShapes
from pipekit.pipelining.stage_setup import StageSetup

__all__ = ["StageSetup", "build_pipeline"]


def build_pipeline(
    plan: PipelinePlan, model: nn.Module, mesh: DeviceMesh, setup: StageSetup
) -> PipelineRunner:
    """This rank's runner of `plan` over `model` (the whole model, on the meta device).

    `mesh` is the world's mesh; its "pp" dim is the pipeline. Every rank of the mesh must call
    this together (features create process groups). Returns the runner; the rank's model (all
    its stages' modules, vocabulary shards included) is `runner.model`.
    """
    check_structure(model, plan.structure)
    validate_stage_module_names(
        model, plan.module_names_per_stage, plan.modules_outside_stages, plan.structure.shared
    )
    check_multi_token_stage(model, plan.structure, plan.module_names_per_stage)
    tied = plan.model.tied_embeddings
    if tied:  # the embedding's and the output's stages each get a copy
        untie_vocabulary(model, plan.structure)
    pp_mesh = mesh["pp"]
    rank = pp_mesh.get_local_rank()
    indices = plan.stage_indices(rank)
    names = [name for index in indices for name in plan.module_names_per_stage[index]]
    rank_model = build_stage_module(model, names)
    depth = prediction_depth(model, plan.structure.multi_token_prediction)
    last = plan.num_stages - 1
    embedding_name = plan.structure.embedding
    if depth and last in indices and getattr(rank_model, embedding_name) is None:
        # multi-token prediction embeds on the last stage: a copy of the first stage's
        setattr(rank_model, embedding_name, copy.deepcopy(getattr(model, embedding_name)))
    shapes = _stage_shapes(plan, setup)
    extensions: list[PipelineExtension] = []
    for name in plan.features:  # in the table's order
        building = FeatureBuilding(
            plan,
            model,
            rank_model,
            mesh,
            setup,
            shapes,
            tuple(extensions),
            plan.feature_plans[name],
        )
        extensions.append(get_pipeline_feature(name).build(building))
    if depth:
        extensions.append(MultiTokenUnits(last, plan.num_microbatches, depth))
    stage_modules = []
    for stage_index in indices:
        if len(indices) == 1 and not plan.modules_outside_stages:  # the rank model is the stage
            stage_module = rank_model
        else:
            stage_names = list(plan.module_names_per_stage[stage_index])
            if depth and stage_index == last:
                stage_names.append(embedding_name)
            stage_module = build_stage_module(rank_model, stage_names, share_modules=True)
        setup.parallelize(stage_module)  # on the meta device
        setup.materialize(stage_module)
        stage_modules.append(stage_module)
    layouts = [
        _layout(layout, stage_modules, indices, pp_mesh, setup, tuple(extensions))
        for layout in plan.layouts or (plan,)
    ]
    if tied or depth:  # a step-level feature: the schedule does not carry it
        extensions.append(_tied_weights(plan, rank_model, mesh, extensions, bool(depth)))
    choice = None
    if len(layouts) > 1:  # one decision for the world: dp replicas must run alike
        choice = MeasuredChoice(
            "pipeline layout",
            dist.group.WORLD,
            range(len(layouts)),
            labels=[layout.slices.label for layout in plan.layouts],
        )
    return PipelineRunner(
        layouts[0],
        plan.num_microbatches,
        extensions,
        model=rank_model,
        layouts=layouts,
        layout_choice=choice,
    )


def _stage_shapes(plan: PipelinePlan, setup: StageSetup) -> StageShapes:
    return StageShapes(
        rows=plan.unit_rows,
        slice_lengths=plan.slice_lengths,
        model_dim=plan.model.dim,
        vocab_size=plan.model.vocab_size,
        dtype=setup.message_dtype,
        embedding_outside=plan.embedding_outside,
        output_outside=plan.output_outside,
        sequence_shards=plan.sequence_shards,
        context_parallel=plan.context_parallel,
    )


def _layout(
    plan: PipelinePlan,
    stage_modules: list[nn.Module],
    indices: list[int],
    pp_mesh: DeviceMesh,
    setup: StageSetup,
    extensions: tuple[PipelineExtension, ...],
) -> RunnerLayout:
    """This rank's stages and schedule for one slice layout of `plan`, over `stage_modules`
    (built once: every layout trains the same parameters)."""
    shapes = _stage_shapes(plan, setup)
    stages = [
        SlicedPipelineStage(
            stage_module,
            stage_index,
            plan.num_stages,
            setup.device,
            shapes,
            num_slices=plan.num_slices,
            group=pp_mesh.get_group(),
            backend=setup.attention_backend,
        )
        for stage_module, stage_index in zip(stage_modules, indices, strict=True)
    ]
    schedule = make_schedule(
        plan.schedule,
        stages,
        plan.num_microbatches,
        plan.num_slices,
        setup.loss_fn,
        actions_by_rank=plan.actions_by_rank if plan.stage_style == "user" else None,
        extensions=extensions,
    )
    return RunnerLayout(schedule, stages, plan.slices)


def _tied_weights(
    plan: PipelinePlan,
    rank_model: nn.Module,
    mesh: DeviceMesh,
    extensions: list[PipelineExtension],
    embedding_on_last: bool,
) -> TiedWeights:
    """The copies on this rank of the embedding's weight (after parallelization, which
    replaces the parameters): the first stage's embedding, the last stage's output layer when
    the model ties them, and its copy of the embedding for multi-token prediction; with the
    group of the first and last stages' ranks. Every rank calls this."""
    held = next((copies for ext in extensions if (copies := ext.tied_copies())), None)
    if held is not None:  # a feature holds both ends of the tie on every rank
        return TiedWeights(held, None, counted_here=True)
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_stages - 1)
    group = None if first == last else new_group_between(mesh, "pp", (first, last))
    rank = mesh["pp"].get_local_rank()
    embedding_name, output_name = plan.structure.vocabulary_modules
    holders = [(embedding_name, first)]
    if plan.model.tied_embeddings:
        holders.append((output_name, last))
    if embedding_on_last:
        holders.append((embedding_name, last))
    copies: dict[int, nn.Parameter] = {}  # one module may stand for two holders
    for name, holder in holders:
        if holder == rank:
            weight = getattr(rank_model, name).weight
            copies.setdefault(id(weight), weight)
    return TiedWeights(list(copies.values()), group, counted_here=rank == first)
