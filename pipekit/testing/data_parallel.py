"""One parity step under data parallelism: FSDP2 (HSDP), with expert, context and tensor
parallelism composed, on every rank of the default process group.

`data_parallel_step` runs inside `pipekit.testing.run_on_ranks`: every rank builds its shard of
the model on the meta device, materialises it from the seed the reference draws from, runs its
share of the batch and returns the full gradients, gathered, to be compared with
`pipekit.testing.reference_step` by `pipekit.testing.compare`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

from pipekit._torch_private import flatten_mesh
from pipekit.attention.context import CausalAttention
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.context_parallel import context_parallel_ranks
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.distributed.tensor_parallel import apply_tensor_parallel
from pipekit.layers.loss import count_label_tokens, token_sum_cross_entropy
from pipekit.layers.sequence_statistics import statistics_group
from pipekit.models.materialize import seeded_materializer
from pipekit.models.spec import ModelSpec
from pipekit.moe.aux_loss import aux_loss_scale
from pipekit.moe.expert_parallel import (
    apply_expert_parallel,
    expert_mesh,
    expert_parallel_mesh,
)
from pipekit.testing.parity import Result, full_gradient, training_targets
from pipekit.train.parallel_rules import check_parallel_layout

__all__ = ["data_parallel_model", "data_parallel_step"]


def data_parallel_model(
    world: int,
    spec: ModelSpec,
    args: Any,
    *,
    ep: int = 1,
    etp: int = 1,
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
    (an ablation) leaves an MoE's routers out of the units over the tp ranks. A layout the
    trainer refuses (`pipekit.train.parallel_rules`) raises its ConfigError first."""
    parallelism = ParallelismConfig(  # FSDP2 over the ranks the others leave
        dp_shard=-1, dp_replicate=dp_replicate, cp=cp, tp=tp, ep=ep, etp=etp,
        sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
    )  # fmt: skip
    return _parallelized(parallelism, world, spec, args, None, tp_plan, routers, seed, dtype)


def _parallelized(
    parallelism: ParallelismConfig,
    world: int,
    spec: ModelSpec,
    args: Any,
    seq_len: int | None,
    tp_plan: ModelSpec | None,
    routers: bool,
    seed: int,
    dtype: torch.dtype,
) -> tuple[nn.Module, ParallelDims, Any]:
    """`data_parallel_model` of a layout, checked by the trainer's rules for sequences of
    `seq_len` tokens (None: no batch yet) before its mesh is built."""
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    dims = check_parallel_layout(parallelism, world, spec, args, seq_len=seq_len,
                                 model=spec.name, meta_model=model)  # fmt: skip
    mesh = dims.build_mesh("cpu")
    tp, ep = dims.tp, dims.ep
    if tp > 1:
        apply_tensor_parallel(
            model, mesh["tp"], tp_plan or spec, sequence_parallel=parallelism.sequence_parallel,
            loss_parallel=parallelism.loss_parallel,
            tied_embeddings=spec.shape(args).tied_embeddings,
        )  # fmt: skip
    experts_mesh = routers_mesh = None
    tp_moe = tp > 1 and getattr(args, "moe", None) is not None
    if dims.ep_enabled or tp_moe:  # every rank holds tokens of its own (tp: sequence parallel)
        experts = expert_mesh("cpu", world, ep, etp=dims.etp)
        if dims.ep_enabled:
            apply_expert_parallel(model, expert_parallel_mesh(experts))
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
    cp_variant: str = "auto",
    cp_ulysses: int = 0,
    cp_across: str = "auto",
    cp_balance: str = "documents",
    cp_balance_pieces: int = 2,
    etp: int = 1,
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
    `cp` context-parallel ranks its share of their tokens (dealt by `cp_balance` in
    `cp_balance_pieces` pieces, attending by `cp_variant`, with `cp_ulysses` and `cp_across`
    its groups where it takes them);
    the full gradients, gathered. `adjust` sees the parallelized model before the step
    (ablations)."""
    parallelism = ParallelismConfig(
        dp_shard=-1, dp_replicate=dp_replicate, cp=cp, tp=tp, ep=ep, etp=etp,
        cp_variant=cp_variant, cp_ulysses=cp_ulysses, cp_across=cp_across,
        cp_balance=cp_balance, cp_balance_pieces=cp_balance_pieces,
        sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
    )  # fmt: skip
    seq_len = batch.batch_size[1]
    model, dims, mesh = _parallelized(
        parallelism, world, spec, args, seq_len, tp_plan, routers, seed, dtype
    )
    if adjust is not None:
        adjust(model)
    rows = batch.batch_size[0] // dims.dp_degree
    data_rank = dims.dp_rank(mesh)
    part = batch[data_rank * rows : (data_rank + 1) * rows]
    context: Any = CausalAttention(part["document_ids"])
    cp_group = mesh["cp"].get_group() if cp > 1 else None
    sequence_group = dims.mesh("cp_tp").get_group() if tp > 1 and sequence_parallel else cp_group
    if cp > 1:
        ranks = context_parallel_ranks(mesh, parallelism, seq_len)
        part = ranks.shard(part)
        context = ranks.attention(part)
    normaliser = count_label_tokens(batch["labels"])
    with loss_parallel_context() if loss_parallel else nullcontext():
        with (
            aux_loss_scale(1.0 / dims.dp_degree),
            statistics_group(sequence_group),
            training_targets(part, normaliser, model, spec.structure),
        ):
            logits = model(part["tokens"], part["positions"], context)
        loss = token_sum_cross_entropy(logits, part["labels"], normaliser)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    total /= tp  # every tensor-parallel rank computed the whole loss of its rows
    grads = {
        name: full_gradient(p.grad) for name, p in model.named_parameters() if p.grad is not None
    }
    return (total.item() if rank == 0 else None), grads
