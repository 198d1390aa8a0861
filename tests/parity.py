"""Parity for any registered model: one process against FSDP, expert parallelism and pipelines.

Every function takes a `ModelSpec` and its args, so a new family or a user's model is checked
by the same code as Llama. The reference runs the batch as row blocks (`microbatches`): MoE
auxiliary losses take their load-balancing statistics per forward, so the reference's blocks
must be the parallel run's microbatches (for data parallelism, each rank's rows); slices do
not matter, since the pipeline computes those losses over the whole microbatch. Results are
(loss or None, {name: gradient}); a vocabulary-parallel rank reports its rows as
(start, end, gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

from pipekit._torch_private import flatten_mesh
from pipekit.attention.context import CausalAttention, ContextParallelAttention
from pipekit.attention.context_parallel import (
    context_parallel_tokens,
    load_balanced_indices,
)
from pipekit.config.job_config import ParallelismConfig, TrainingConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.distributed.process_group import single_rank_mesh
from pipekit.distributed.tensor_parallel import apply_tensor_parallel
from pipekit.layers.loss import IGNORE_INDEX, count_label_tokens, token_sum_cross_entropy
from pipekit.layers.sequence_statistics import statistics_group
from pipekit.models.materialize import seeded_materializer
from pipekit.models.spec import ModelSpec
from pipekit.moe.aux_loss import aux_loss_scale
from pipekit.moe.expert_parallel import (
    apply_expert_parallel,
    expert_mesh,
)
from pipekit.pipelining import (
    PipelineVocabParallel,
    StageSetup,
    build_pipeline,
    plan_pipeline,
)
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.train.activation_checkpoint import apply_activation_checkpointing

Result = tuple[float | None, dict[str, Any]]


def build_model(spec: ModelSpec, args: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    """The whole model in `dtype`, drawn from `seed` in that dtype (as every layout draws it)."""
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def parity_batch(vocab_size: int, rows: int, seq_len: int, seed: int = 7) -> TensorDict:
    """Two packed documents per row (split at a row-dependent point), some labels ignored."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    labels = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    labels[:, ::5] = IGNORE_INDEX
    split_BS = (5 + 3 * torch.arange(rows)).unsqueeze(1) % seq_len
    index_S = torch.arange(seq_len)
    document_ids = (index_S >= split_BS).long()
    positions = torch.where(index_S >= split_BS, index_S - split_BS, index_S)
    return TensorDict(
        tokens=tokens,
        labels=labels,
        positions=positions,
        document_ids=document_ids,
        batch_size=[rows, seq_len],
    )


def reference_step(
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    *,
    microbatches: int = 1,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
    model: nn.Module | None = None,
) -> Result:
    """One process: the batch as `microbatches` row blocks in order, every block's loss over
    the batch's label count, its aux losses (statistics over the block) weighted
    1/microbatches. The model is `model` if given (its weights made elsewhere, e.g. upcycled),
    else drawn from `seed`."""
    if model is None:
        model = build_model(spec, args, seed, dtype)
    normaliser = count_label_tokens(batch["labels"])
    total = torch.zeros((), dtype=torch.float64)
    for part in batch.split(batch.batch_size[0] // microbatches):
        with aux_loss_scale(1.0 / microbatches):
            logits = model(part["tokens"], part["positions"], CausalAttention(part["document_ids"]))
        loss = token_sum_cross_entropy(logits, part["labels"], normaliser)
        loss.backward()
        total += loss.detach()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return total.item(), grads


def data_parallel_model(
    world: int,
    spec: ModelSpec,
    args: Any,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    cp: int = 1,
    tp: int = 1,
    tp_plan: ModelSpec | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    routers: bool = True,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
) -> tuple[nn.Module, ParallelDims, Any]:
    """This rank's FSDP2 (HSDP, + expert-, context- and tensor-parallel) model, parallelized on
    the meta device and then materialised shard by shard from `seed`; its dims and mesh.
    `tp_plan`: the spec whose tensor-parallel plan applies (default: `spec`'s); `routers=False`
    (an ablation) leaves an MoE's routers out of the units over the tp ranks."""
    config = ParallelismConfig(
        dp_replicate=dp_replicate, dp_shard=world // (dp_replicate * cp * tp), cp=cp, tp=tp,
        ep=ep,
    )  # fmt: skip
    dims = ParallelDims.from_config(config, world)
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    if tp > 1:
        apply_tensor_parallel(
            model, mesh["tp"], tp_plan or spec, sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel, tied_embeddings=spec.shape(args).tied_embeddings,
        )  # fmt: skip
    experts_mesh = routers_mesh = None
    tp_moe = tp > 1 and getattr(args, "moe", None) is not None
    if ep > 1 or tp_moe:  # every rank holds tokens of its own (tp: sequence parallelism)
        experts = expert_mesh("cpu", world, ep)
        if ep > 1:
            apply_expert_parallel(model, experts["ep"])
        experts_mesh = experts["ep_replicate"]
        if tp_moe and routers:
            routers_mesh = flatten_mesh(experts, "ep_tokens")
    apply_data_parallel(
        model,
        mesh,
        dims,
        blocks=spec.structure.blocks_of(model),
        param_dtype=dtype,
        reduce_dtype=dtype,
        experts_mesh=experts_mesh,
        routers_mesh=routers_mesh,
    )
    seeded_materializer("cpu", seed)(model)
    return model, dims, mesh


def data_parallel_step(
    rank: int,
    world: int,
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    cp: int = 1,
    tp: int = 1,
    tp_plan: ModelSpec | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    routers: bool = True,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
    adjust: Callable[[nn.Module], None] | None = None,
) -> Result:
    """FSDP2 over all ranks (HSDP with `dp_replicate` replicas; experts sharded over `ep` of
    them and by FSDP2 over the ep groups), each data rank its share of the rows, each of its
    `cp` context-parallel ranks its load-balanced share of their tokens; the full gradients,
    gathered. `adjust` sees the parallelized model before the step (ablations)."""
    model, dims, mesh = data_parallel_model(
        world, spec, args, ep=ep, dp_replicate=dp_replicate, cp=cp, tp=tp, tp_plan=tp_plan,
        sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, routers=routers,
        seed=seed, dtype=dtype,
    )  # fmt: skip
    if adjust is not None:
        adjust(model)
    rows = batch.batch_size[0] // dims.dp_degree
    data_rank = dims.dp_rank(mesh)
    part = batch[data_rank * rows : (data_rank + 1) * rows]
    context: Any = CausalAttention(part["document_ids"])
    cp_group = mesh["cp"].get_group() if cp > 1 else None
    sequence_group = dims.mesh("cp_tp").get_group() if tp > 1 and sequence_parallel else cp_group
    if cp > 1:
        tokens_S = load_balanced_indices(batch.batch_size[1], cp)[mesh["cp"].get_local_rank()]
        part = part[:, tokens_S]
        context = ContextParallelAttention(tokens_S, part["document_ids"], cp_group)
    with loss_parallel_context() if loss_parallel else nullcontext():
        with aux_loss_scale(1.0 / dims.dp_degree), statistics_group(sequence_group):
            logits = model(part["tokens"], part["positions"], context)
        normaliser = count_label_tokens(batch["labels"])
        loss = token_sum_cross_entropy(logits, part["labels"], normaliser)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    total /= tp  # every tensor-parallel rank computed the whole loss of its rows
    grads = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return (total.item() if rank == 0 else None), grads


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
    **parallelism: Any,
) -> Result:
    """One step of this rank's pipeline (`pipeline_layout`); `adjust` sees the runner before
    the step (ablations)."""
    runner, dims, mesh = pipeline_layout(
        world, spec, args, batch.batch_size, seed=seed, dtype=dtype,
        compute_dtype=compute_dtype, dp_shard=dp_shard, ep=ep, cp=cp, tp=tp, routers=routers,
        materialize=materialize, **parallelism,
    )  # fmt: skip
    if adjust is not None:
        adjust(runner)
    data_group = dims.mesh("dp_shard").get_group() if dp_shard > 1 else None
    context = None
    if cp > 1:
        tokens_S = context_parallel_tokens(
            batch.batch_size[1], cp, mesh["cp"].get_local_rank(), runner.num_slices
        )
        context = (tokens_S, mesh["cp"].get_group())
    return runner_step(
        runner, batch, data_rank=dims.dp_rank(mesh), data_group=data_group, context=context,
        sequence_group=dims.mesh("cp_tp").get_group() if tp > 1 else None,
        loss_parallel=tp > 1,
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
    parallelism (the trainer's defaults), an MoE's experts and routers data parallel over the
    tp ranks too (`routers=False`, an ablation, leaves the routers out). The blocks are
    checkpointed by `activation_checkpoint` (`[training] activation_checkpoint`)."""
    config = ParallelismConfig(
        dp_shard=dp_shard, pipeline_parallel_degree=world // (dp_shard * cp * tp), ep=ep, cp=cp,
        tp=tp, **parallelism,
    )  # fmt: skip
    dims = ParallelDims.from_config(config, world)
    mesh = dims.build_mesh("cpu")
    rows, length = batch_shape
    plan = plan_pipeline(config, spec.structure, spec.shape(args), rows // dp_shard, length)
    tp_moe = tp > 1 and getattr(args, "moe", None) is not None
    token_ranks = dp_shard * cp * tp
    experts = None
    if ep > 1 or tp_moe:
        experts = expert_mesh("cpu", token_ranks, ep, pipeline_ranks=dims.pp)
    routers_mesh = flatten_mesh(experts, "ep_tokens") if tp_moe and routers else None
    loss_parallel = tp > 1

    precision = {"param_dtype": compute_dtype or dtype, "reduce_dtype": dtype}
    if compute_dtype is not None and dp_shard == 1:
        precision["precision_mesh"] = single_rank_mesh("cpu")

    def parallelize(module: nn.Module) -> None:
        if tp > 1:
            apply_tensor_parallel(
                module, mesh["tp"], spec, loss_parallel=loss_parallel,
                tied_embeddings=spec.shape(args).tied_embeddings,
            )  # fmt: skip
        if ep > 1:
            assert experts is not None
            apply_expert_parallel(module, experts["ep"])
        checkpointing = TrainingConfig(activation_checkpoint=activation_checkpoint)
        apply_activation_checkpointing(spec.structure.blocks_of(module), checkpointing)
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
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    return build_pipeline(plan, model, mesh, setup), dims, mesh


def runner_step(
    runner: PipelineRunner,
    batch: TensorDict,
    *,
    data_rank: int = 0,
    data_group: dist.ProcessGroup | None = None,
    context: tuple[Tensor, dist.ProcessGroup] | None = None,
    sequence_group: dist.ProcessGroup | None = None,
    loss_parallel: bool = False,
) -> Result:
    """One step of `runner` on this data rank's share of `batch` (the rows split evenly over
    `data_group`; the whole batch without one; under context parallelism, `context` = (this cp
    rank's token indices, the cp group)): the step's loss on one rank (None elsewhere)
    and this rank's gradients, in full (a tied weight once, under the embedding's name).
    `sequence_group`: the ranks that split a sequence's tokens, if not the cp group (cp x tp
    under sequence parallelism); `loss_parallel`: the step runs in torch's `loss_parallel()`."""
    data_ranks = dist.get_world_size(data_group) if data_group is not None else 1
    rows = batch.batch_size[0] // data_ranks
    part = batch[data_rank * rows : (data_rank + 1) * rows]
    cp_group = None
    if context is not None:  # this cp rank's tokens of every slice
        tokens_S, cp_group = context
        part = part[:, tokens_S]
    with (
        loss_parallel_context() if loss_parallel else nullcontext(),
        aux_loss_scale(1.0 / data_ranks),
        statistics_group(sequence_group or cp_group),
    ):
        loss = runner.step(part, count_label_tokens(batch["labels"]))
    for group in (data_group, cp_group):
        if loss is not None and group is not None:
            dist.all_reduce(loss, group=group)
    assert runner.model is not None
    vocab = runner.extension("vocab_parallel")
    shards = {}
    if isinstance(vocab, PipelineVocabParallel):
        embedding_name, output_name = vocab.module_names
        shards = {
            f"{embedding_name}.weight": vocab.embedding,
            f"{output_name}.weight": vocab.output,
        }
    grads: dict[str, Any] = {}
    duplicates = {id(param) for param in runner.duplicate_parameters()}
    for name, param in runner.model.named_parameters():
        if param.grad is None or id(param) in duplicates:  # the comparison names the missing
            continue
        if name in shards:
            shard = shards[name]
            grads[name] = (shard.vocab_start, shard.vocab_end, _full(param.grad))
        else:
            grads[name] = _full(param.grad)
    dist.barrier()
    return (None if loss is None or data_rank else loss.item()), grads


def max_relative_difference(results: list[Result], reference: Result) -> float:
    """Largest difference, relative to the reference's largest entry, of the loss and of every
    gradient any rank reports (each parameter must be reported, by one rank or by row shards;
    one without a gradient is not)."""
    ref_loss, ref_grads = reference
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == 1 or all(loss == losses[0] for loss in losses), losses
    worst = abs(losses[0] - ref_loss) / abs(ref_loss)
    seen: set[str] = set()
    for _, grads in results:
        for name, grad in grads.items():
            seen.add(name)
            want = ref_grads[name]
            if isinstance(grad, tuple):  # vocabulary rows
                start, end, grad = grad
                want = want[start:end]
            scale = ref_grads[name].abs().max().clamp_min(1e-30)
            worst = max(worst, ((grad - want).abs().max() / scale).item())
    assert seen == set(ref_grads), f"parameters not reported: {sorted(set(ref_grads) - seen)}"
    return worst


def _full(grad: Tensor) -> Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
