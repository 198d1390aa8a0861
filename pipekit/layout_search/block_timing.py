"""What one block's pass costs on a CPU, measured on the job's own block as the job places it.

On a CPU neither FLOPs nor a datasheet predict a pass: a small pass is dominated by the
operators' dispatch and Python (the fixed cost, paid by every pass whatever its tokens, which
layouts that cut work into many small passes pay over and over), and a long one by attention
and element-wise kernels that reach a fraction of a large matmul's FLOP/s. Tensor and context
parallelism change more than a block's FLOPs: a rank's half-width matmuls and attention heads
run at a lower rate, the mask work of attention is not split with the heads, DTensor adds
dispatch, and gloo's collectives cost what they cost (an all-gather several times a send of
the same bytes); with more ranks than cores, the ranks of a ring also wait for the scheduler.

So the search times the job's first block forward and backward at 2 tokens (the fixed cost),
and once per pass shape it prices (rows of whole sequences, tp, cp) the block split over tp
and cp as the job splits it, with every rank of the world running at once as the job will,
in the attention context the trainer gives it (every row's document ids); it prices each
layout's passes at the rate their own shape reached.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from pipekit.attention.context import (
    AttentionContext,
    CausalAttention,
)
from pipekit.distributed.context_parallel import context_parallel_ranks
from pipekit.distributed.process_group import free_local_port, join_local_gloo
from pipekit.distributed.tensor_parallel import apply_tensor_parallel
from pipekit.memory_plan.activations import give_probe_weights
from pipekit.memory_plan.forked import in_forked_child, map_in_forked_children
from pipekit.models.spec import ModelSpec
from pipekit.models.stage_module import build_stage_module
from pipekit.train.job import Job

__all__ = ["measure_block_overhead", "measure_placed_block_pass_s"]


def measure_block_overhead(spec: ModelSpec, meta_model: nn.Module, dim: int) -> float:
    """Seconds of one forward and backward of the model's first block at 2 tokens (one rank,
    one thread, in a forked child): the fixed cost of a pass."""
    return in_forked_child(_time_block, spec, meta_model, dim)


def measure_placed_block_pass_s(
    job: Job, meta_model: nn.Module, rows: int, repeats: int = 2
) -> float:
    """Median seconds of one forward and backward of the model's first block over `rows`
    whole sequences, split over `job`'s tp and cp ranks as the job splits them, in forked
    gloo ranks of the job's world size all running at once (one thread each), after one
    untimed pass: the slowest rank's."""
    world_size, port = job.dims.world_size, free_local_port()
    calls = [(job, meta_model, rows, repeats, rank, port) for rank in range(world_size)]
    return max(map_in_forked_children(_time_placed_block, calls, world_size))


def _time_block(spec: ModelSpec, meta_model: nn.Module, dim: int, repeats: int = 7) -> float:
    block = _first_block(spec, meta_model)
    give_probe_weights(block)
    context = CausalAttention(torch.zeros(1, 2, dtype=torch.long))
    return _median_pass_s(block, (1, 2, dim), None, context, repeats)


def _time_placed_block(
    job: Job, meta_model: nn.Module, rows: int, repeats: int, rank: int, port: int
) -> float:
    dims, seq_len = job.dims, job.config.training.seq_len
    join_local_gloo(rank, dims.world_size, port)
    try:
        mesh = dims.build_mesh("cpu")
        block = _first_block(job.spec, meta_model)
        if dims.tp > 1:
            apply_tensor_parallel(
                block, dims.mesh("tp"), job.spec, sequence_parallel=job.sequence_parallel
            )
        give_probe_weights(block)
        backend = job.config.model.attention_backend
        positions_S = torch.arange(seq_len)
        context: AttentionContext = CausalAttention(
            torch.zeros(rows, seq_len, dtype=torch.long), backend
        )
        if dims.cp > 1:
            ranks = context_parallel_ranks(mesh, job.config.parallelism, seq_len)
            one_document = TensorDict(
                document_ids=torch.zeros(rows, seq_len, dtype=torch.long),
                batch_size=(rows, seq_len),
            )
            shard = ranks.shard(one_document)
            positions_S = shard["cp_tokens"][0, :, ranks.rank]
            context = ranks.attention(shard, backend)
        split = dims.tp if job.sequence_parallel else 1  # a rank's run of the residual stream
        hidden_shape = (rows, positions_S.numel() // split, job.shape.dim)
        positions_BS = positions_S.expand(rows, -1)
        return _median_pass_s(block, hidden_shape, positions_BS, context, repeats)
    finally:
        dist.destroy_process_group()


def _first_block(spec: ModelSpec, meta_model: nn.Module) -> nn.Module:
    structure = spec.structure
    return build_stage_module(meta_model, [*structure.shared, structure.block_name(0)])


def _median_pass_s(
    block: nn.Module,
    hidden_shape: tuple[int, int, int],
    positions_BS: torch.Tensor | None,
    context: AttentionContext,
    repeats: int,
) -> float:
    """Median seconds of the block's forward and backward over fresh hidden states, after one
    untimed pass (ranks of a group start each pass together)."""
    samples = []
    for _ in range(repeats + 1):
        hidden_BSD = torch.randn(*hidden_shape, requires_grad=True)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        block(hidden_BSD, positions_BS, context).float().sum().backward()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])
