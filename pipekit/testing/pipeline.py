"""One parity step of a pipeline: any schedule pipekit builds, with FSDP2, expert, context,
tensor and vocabulary parallelism and the pipeline features composed, on every rank of the
default process group.

`pipeline_step` runs inside `pipekit.testing.run_on_ranks`: it plans the pipeline from
`[parallelism]` keys (`pipeline_layout`), builds it with pipekit's one builder, and runs one
step (`runner_step`) whose loss and full gradients `pipekit.testing.compare` holds against
`pipekit.testing.reference_step`. `runner_step` also steps a runner you built yourself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

from pipekit._torch_private import flatten_mesh
from pipekit.attention.kernels.backends import attention_work_block
from pipekit.config.job_config import ParallelismConfig, TrainingConfig
from pipekit.distributed.context_parallel import ContextParallelRanks, context_parallel_ranks
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.distributed.process_group import single_rank_mesh
from pipekit.distributed.tensor_parallel import apply_tensor_parallel
from pipekit.layers.loss import count_label_tokens
from pipekit.layers.multi_token_prediction import sequence_targets
from pipekit.layers.sequence_statistics import statistics_group
from pipekit.models.materialize import seeded_materializer
from pipekit.models.spec import ModelSpec
from pipekit.moe.aux_loss import aux_loss_scale
from pipekit.moe.expert_parallel import (
    apply_expert_parallel,
    expert_mesh,
    expert_parallel_mesh,
)
from pipekit.pipelining import (
    StageSetup,
    build_pipeline,
    plan_pipeline,
)
from pipekit.pipelining.features.context_exchange import PipelineContextExchange
from pipekit.pipelining.features.multi_token_units import MultiTokenUnits
from pipekit.pipelining.runtime.runner import PipelineRunner, make_schedule
from pipekit.testing.parity import Result, full_gradient
from pipekit.train.activation_checkpoint import apply_activation_checkpointing
from pipekit.train.metrics import attention_to_linear_flops
from pipekit.train.parallel_rules import check_parallel_layout

__all__ = ["pipeline_layout", "pipeline_step", "replace_context_exchange", "runner_step"]


def pipeline_step(
    rank: int,
    world: int,
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    *,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
    compute_dtype: torch.dtype | None = None,
    dp_shard: int = 1,
    ep: int = 1,
    cp: int = 1,
    tp: int = 1,
    routers: bool = True,
    materialize: Callable[[nn.Module], None] | None = None,
    adjust: Callable[[PipelineRunner], None] | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    work_block: int | None = None,
    **parallelism: Any,
) -> Result:
    """One step of this rank's pipeline (`pipeline_layout`); `adjust` sees the runner before
    the step (ablations). Under tp, `sequence_parallel` and `loss_parallel` are the trainer's
    settings (on by default, as there)."""
    runner, dims, mesh = pipeline_layout(
        world, spec, args, batch.batch_size, seed=seed, dtype=dtype,
        compute_dtype=compute_dtype, dp_shard=dp_shard, ep=ep, cp=cp, tp=tp, routers=routers,
        materialize=materialize, sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel, work_block=work_block, **parallelism,
    )  # fmt: skip
    if adjust is not None:
        adjust(runner)
    data_group = dims.mesh("dp_shard").get_group() if dp_shard > 1 else None
    context = None
    if cp > 1:
        config = ParallelismConfig(cp=cp, **parallelism)
        seq_len = batch.batch_size[1]
        context = context_parallel_ranks(
            mesh, config, seq_len, runner.num_slices, True, runner.layout.slices.microbatch_bounds
        )
    return runner_step(
        runner, batch, data_rank=dims.dp_rank(mesh), data_group=data_group, context=context,
        sequence_group=dims.mesh("cp_tp").get_group() if tp > 1 and sequence_parallel else None,
        loss_parallel=tp > 1 and loss_parallel,
    )  # fmt: skip


def pipeline_layout(
    world: int,
    spec: ModelSpec,
    args: Any,
    batch_shape: tuple[int, int],
    *,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
    compute_dtype: torch.dtype | None = None,
    dp_shard: int = 1,
    ep: int = 1,
    cp: int = 1,
    tp: int = 1,
    routers: bool = True,
    materialize: Callable[[nn.Module], None] | None = None,
    activation_checkpoint: str = "none",
    work_block: int | None = None,
    **parallelism: Any,
) -> tuple[PipelineRunner, ParallelDims, Any]:
    """This rank's pipeline (runner, dims, mesh), planned from `parallelism` (ParallelismConfig
    keys) over `world // dp_shard` pipeline ranks and built by the one builder. With `dp_shard` > 1
    each stage is FSDP2-sharded over its data ranks, which read their share of the rows; with
    `ep` > 1 its experts are sharded over `ep` of them (FSDP leaving them alone). Weights are
    kept in `dtype`; with a `compute_dtype` (bf16) FSDP2 computes in it, the stages send it and
    gradients are reduced in `dtype` (over one rank's mesh without data parallelism). Each
    stage's storage and values come from `materialize` if given (e.g. upcycling a checkpoint),
    else from `seed`. With `tp` > 1 the stages are split over tp ranks with sequence and loss
    parallelism (the trainer's defaults; the keys `sequence_parallel`, `loss_parallel` turn them
    off), an MoE's experts and routers data parallel over the tp ranks too (`routers=False`, an
    ablation, leaves the routers out). The blocks are checkpointed by `activation_checkpoint`
    (`[training] activation_checkpoint`). A layout the trainer refuses (`pipekit.train.
    parallel_rules`, the pipeline plan) raises its error before any process group work.
    `work_block`: the tile, in tokens, document cuts count attention in (default: the CPU
    kernel's)."""
    config = ParallelismConfig(
        dp_shard=dp_shard, pipeline_parallel_degree=-1, ep=ep, cp=cp, tp=tp, **parallelism
    )
    rows, length = batch_shape
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    dims = check_parallel_layout(config, world, spec, args, seq_len=length, model=spec.name,
                                 meta_model=model)  # fmt: skip
    config = dataclasses.replace(config, pipeline_parallel_degree=dims.pp)
    shape = spec.shape(args)
    attention_to_linear = attention_to_linear_flops(model, shape, spec.structure, length)
    plan = plan_pipeline(
        config, spec.structure, shape, rows // dp_shard, length,
        attention_to_linear=attention_to_linear,
        attention_work_block=work_block or attention_work_block("cpu"),
    )  # fmt: skip
    mesh = dims.build_mesh("cpu")
    tp_moe = tp > 1 and getattr(args, "moe", None) is not None
    token_ranks = dp_shard * cp * tp
    experts = None
    if dims.ep_enabled or tp_moe:
        experts = expert_mesh("cpu", token_ranks, ep, pipeline_ranks=dims.pp, etp=dims.etp)
    routers_mesh = flatten_mesh(experts, "ep_tokens") if tp_moe and routers else None

    precision = {"param_dtype": compute_dtype or dtype, "reduce_dtype": dtype}
    if compute_dtype is not None and dp_shard == 1:
        precision["precision_mesh"] = single_rank_mesh("cpu")

    def parallelize(module: nn.Module) -> None:
        if tp > 1:
            apply_tensor_parallel(
                module, mesh["tp"], spec, sequence_parallel=config.sequence_parallel,
                loss_parallel=config.loss_parallel,
                tied_embeddings=spec.shape(args).tied_embeddings,
            )  # fmt: skip
        if dims.ep_enabled:
            assert experts is not None
            apply_expert_parallel(module, expert_parallel_mesh(experts))
        checkpointing = TrainingConfig(activation_checkpoint=activation_checkpoint)
        apply_activation_checkpointing(spec.structure.named_blocks_of(module), checkpointing)
        apply_data_parallel(
            module,
            mesh,
            dims,
            blocks=spec.structure.blocks_of(module),
            experts_mesh=None if experts is None else experts["ep_replicate"],
            routers_mesh=routers_mesh,
            **precision,
        )

    def parallelize_vocab(embedding: nn.Module, output: nn.Module) -> None:
        apply_data_parallel(embedding, mesh, dims, **precision)
        apply_data_parallel(output, mesh, dims, reshard_after_forward=False, **precision)

    setup = StageSetup(
        device=torch.device("cpu"), materialize=materialize or seeded_materializer("cpu", seed),
        parallelize=parallelize,
        parallelize_vocab=parallelize_vocab,
        attention_backend="cpu", message_dtype=compute_dtype or dtype,
    )  # fmt: skip
    return build_pipeline(plan, model, mesh, setup), dims, mesh


def runner_step(
    runner: PipelineRunner,
    batch: TensorDict,
    *,
    data_rank: int = 0,
    data_group: dist.ProcessGroup | None = None,
    context: ContextParallelRanks | None = None,
    sequence_group: dist.ProcessGroup | None = None,
    loss_parallel: bool = False,
) -> Result:
    """One step of `runner` on this data rank's share of `batch` (the rows split evenly over
    `data_group`; the whole batch without one; under context parallelism, this cp rank's
    tokens as `context` deals each microbatch): the step's loss on one rank (None elsewhere)
    and this rank's gradients, in full (a tied weight once, under the embedding's name).
    `sequence_group`: the ranks that split a sequence's tokens, if not the cp group (cp x tp
    under sequence parallelism); `loss_parallel`: the step runs in torch's `loss_parallel()`."""
    data_ranks = dist.get_world_size(data_group) if data_group is not None else 1
    rows = batch.batch_size[0] // data_ranks
    part = batch[data_rank * rows : (data_rank + 1) * rows]
    cp_group = None
    if context is not None:  # this cp rank's tokens of every slice
        part, cp_group = context.shard(part, runner.num_microbatches), context.group
    normaliser = count_label_tokens(batch["labels"])
    units = runner.extension(MultiTokenUnits.name)  # the model's multi-token prediction
    with (
        loss_parallel_context() if loss_parallel else nullcontext(),
        aux_loss_scale(1.0 / data_ranks),
        statistics_group(sequence_group or cp_group),
        nullcontext()
        if not isinstance(units, MultiTokenUnits)
        else sequence_targets(
            part["tokens"], part["labels"], part["document_ids"], units.depth, 1 / float(normaliser)
        ),
    ):
        loss = runner.step(part, normaliser)
    for group in (data_group, cp_group):
        if loss is not None and group is not None:
            dist.all_reduce(loss, group=group)
    assert runner.model is not None
    rows = runner.row_sharded_parameters()
    grads: dict[str, Any] = {}
    duplicates = {id(param) for param in runner.duplicate_parameters()}
    for name, param in runner.model.named_parameters():
        if param.grad is None or id(param) in duplicates:  # the comparison names the missing
            continue
        grad = full_gradient(param.grad)
        if name in rows:  # this rank's vocabulary rows of the parameter
            start = rows[name].start
            grads[name] = (start, start + grad.shape[0], grad)
        else:
            grads[name] = grad
    dist.barrier()
    return (None if loss is None or data_rank else loss.item()), grads


def replace_context_exchange(runner: PipelineRunner, **options: Any) -> PipelineContextExchange:
    """The runner's context exchange rebuilt with `options` (its other settings and the other
    features kept) in a sliced schedule, for ablations: e.g. `drop_remote_kv_grads=True`,
    `chunks_ahead=False`."""
    exchange = runner.extension("context_exchange")
    if not isinstance(exchange, PipelineContextExchange):
        raise ValueError("the runner has no context exchange to replace")
    kept = ("downward_group", "chunks_ahead", "backend", "timeout")
    options = {**{name: getattr(exchange, name) for name in kept}, **options}
    rebuilt = PipelineContextExchange(exchange.group, exchange.layers_per_stage, **options)
    extensions = [rebuilt if ext is exchange else ext for ext in runner.extensions]
    runner.schedule = make_schedule(
        "sliced", runner.stages, runner.num_microbatches, runner.num_slices,
        extensions=extensions,
    )  # fmt: skip
    runner.extensions = extensions
    return rebuilt
