"""Parity for any registered model: one process against FSDP, expert parallelism and pipelines.

Every function takes a `ModelSpec` and its args, so a new family or a user's model is checked
by the same code as Llama. The reference runs the same units (microbatches x slices) the
parallel run does, in one process: MoE auxiliary losses take their load-balancing statistics per
unit, so the reference must too; without auxiliary losses the unit split changes nothing and
`units=(1, 1)` is the whole batch at once. Results are (loss or None, {name: gradient}); a
vocabulary-parallel rank reports its rows as (start, end, gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipekit.attention.context import CausalAttention, SlicedKVCache
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.layers.loss import IGNORE_INDEX, count_label_tokens, token_sum_cross_entropy
from pipekit.models.spec import ModelSpec
from pipekit.moe.aux_loss import aux_loss_scale
from pipekit.moe.expert_parallel import apply_expert_parallel, expert_parameters
from pipekit.pipelining import (
    PipelineVocabParallel,
    StageSetup,
    build_pipeline,
    plan_pipeline,
)
from pipekit.pipelining.runtime.runner import PipelineRunner

Result = tuple[float | None, dict[str, Any]]


def build_model(spec: ModelSpec, args: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.to(dtype)


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
    units: tuple[int, int] = (1, 1),
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
) -> Result:
    """One process: the batch as `units` = (microbatches, slices), in order, slices against a
    KV cache; every unit's loss over the batch's label count, aux losses over the units."""
    model = build_model(spec, args, seed, dtype)
    microbatches, slices = units
    rows, length = batch.batch_size
    normaliser = count_label_tokens(batch["labels"])
    total = torch.zeros((), dtype=torch.float64)
    for part in batch.split(rows // microbatches):
        cache = SlicedKVCache(part["document_ids"], "cpu") if slices > 1 else None
        context = cache or CausalAttention(part["document_ids"], "cpu")
        loss = torch.zeros((), dtype=dtype)
        for piece in part.split(length // slices, dim=1):
            with aux_loss_scale(1.0 / (microbatches * slices)):
                logits = model(piece["tokens"], piece["positions"], context)
            loss = loss + token_sum_cross_entropy(logits, piece["labels"], normaliser)
        loss.backward()  # once per microbatch: its slices share the cache's graph
        total += loss.detach()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return total.item(), grads


def data_parallel_step(
    rank: int,
    world: int,
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    *,
    ep: int = 1,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
) -> Result:
    """FSDP2 over all ranks (experts sharded over `ep` of them, FSDP leaving them alone), each
    rank its share of the rows; the full gradients, gathered."""
    dims = ParallelDims.from_config(ParallelismConfig(dp_shard=world, ep=ep), world)
    mesh = dims.build_mesh("cpu")
    model = build_model(spec, args, seed, dtype)
    ignored = None
    if ep > 1:
        ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("rep", "ep"))
        apply_expert_parallel(model, ep_mesh["ep"])
        ignored = expert_parameters(model)
    apply_data_parallel(
        model,
        mesh,
        dims,
        blocks=spec.structure.blocks_of(model),
        param_dtype=dtype,
        reduce_dtype=dtype,
        ignored_params=ignored,
    )
    rows = batch.batch_size[0] // world
    part = batch[rank * rows : (rank + 1) * rows]
    with aux_loss_scale(1.0 / world):
        logits = model(part["tokens"], part["positions"], CausalAttention(part["document_ids"]))
    loss = token_sum_cross_entropy(logits, part["labels"], count_label_tokens(batch["labels"]))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
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
    mesh: DeviceMesh | None = None,
    **parallelism: Any,
) -> Result:
    """One step of this rank's pipeline, planned from `parallelism` (ParallelismConfig keys;
    pipeline_parallel_degree = world unless a `mesh` says otherwise) and built by the one
    builder."""
    mesh = mesh or init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    config = ParallelismConfig(
        dp_shard=1, pipeline_parallel_degree=mesh["pp"].size(), **parallelism
    )
    rows, length = batch.batch_size
    plan = plan_pipeline(config, spec.structure, spec.shape(args), rows, length)

    def materialize(module: nn.Module) -> None:
        module.to_empty(device="cpu")
        module.init_weights(seed=seed)
        module.to(dtype)

    setup = StageSetup(
        device=torch.device("cpu"), materialize=materialize, attention_backend="cpu",
        message_dtype=dtype,
    )  # fmt: skip
    with torch.device("meta"):
        model = spec.build(args)
    runner = build_pipeline(plan, model, mesh, setup)
    return runner_step(runner, batch)


def runner_step(runner: PipelineRunner, batch: TensorDict) -> Result:
    """One step of `runner`: this rank's loss (None without the last stage) and gradients."""
    loss = runner.step(batch, count_label_tokens(batch["labels"]))
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
    for name, param in runner.model.named_parameters():
        if param.grad is None:  # not reported: the comparison names it
            continue
        if name in shards:
            shard = shards[name]
            grads[name] = (shard.vocab_start, shard.vocab_end, param.grad.clone())
        else:
            grads[name] = _full(param.grad)
    dist.barrier()
    return (None if loss is None else loss.item()), grads


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
