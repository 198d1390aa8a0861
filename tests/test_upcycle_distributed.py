"""Online upcycling on 2 gloo ranks: each rank reads exactly its own blocks, and the first forward
equals the dense model's under expert parallelism + FSDP2; tensor-parallel-style placements read
only their columns and rows too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed_helpers import run_on_ranks
from test_upcycle import DENSE, dense_logits, logits, write_dense
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from models.llama.state_dict_adapter import to_hf_name
from models.llama_moe.upcycle import upcycle_llama
from pipekit._torch_private import local_shape_and_offset
from pipekit.checkpoint import SafetensorsCheckpoint, TensorRead, local_shards
from pipekit.checkpoint.upcycle import UpcycleSpec
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.moe.expert_parallel import apply_expert_parallel, expert_mesh


def _bounds(read: TensorRead) -> tuple[str, tuple[tuple[int, int], ...]]:
    return read.name, read.bounds


def _expected_fsdp_reads(directory: Path, rank: int, granularity: int) -> set:
    """FSDP2 gives rank r rows [r·ceil(R/2), ...) of every dense weight; expert parallelism gives
    every rank whole experts, so it reads each dense FFN weight whole: in G pieces, once each."""
    expected = set()
    with SafetensorsCheckpoint(directory) as checkpoint:
        for name in checkpoint.names:
            shape = checkpoint.info(name).shape
            whole = tuple((0, size) for size in shape)
            if ".mlp." in name:
                dim = 1 if "down_proj" in name else 0
                piece = shape[dim] // granularity
                for g in range(granularity):
                    bounds = list(whole)
                    bounds[dim] = (g * piece, (g + 1) * piece)
                    expected.add((name, tuple(bounds)))
            else:
                rows = math.ceil(shape[0] / 2)
                expected.add((name, ((rank * rows, min(shape[0], (rank + 1) * rows)), *whole[1:])))
    return expected


def _ep_fsdp_run(
    rank: int, world_size: int, directory: Path, dtype, granularity: int, break_offsets: bool
) -> dict:
    if break_offsets:  # ablation: every rank fills its shards with the first block
        real = local_shards.local_block
        local_shards.local_block = lambda param: tuple(
            slice(0, part.stop - part.start) for part in real(param)
        )
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    ep_mesh = expert_mesh("cpu", 2, 2)["ep"]

    def parallelize(model: nn.Module) -> None:
        apply_expert_parallel(model, ep_mesh)
        experts = {p for name, p in model.named_parameters() if ".experts." in name}
        apply_data_parallel(
            model, mesh, dims, param_dtype=dtype, reduce_dtype=dtype, ignored_params=experts
        )

    reads: list[TensorRead] = []
    spec = UpcycleSpec(num_experts=2, top_k=2, granularity=granularity)
    model, _ = upcycle_llama(
        directory, spec, seed=5, dtype=dtype, parallelize=parallelize, read_log=reads
    )
    owned = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * dtype.itemsize
        for p in model.parameters()
    )
    return {
        "logits": logits(model),
        "reads": [_bounds(read) for read in reads],
        "owned": owned,
        "read_bytes": sum(read.nbytes for read in reads),
    }


@pytest.mark.parametrize(
    ("dtype", "granularity", "tolerance"),
    [(torch.float64, 1, 1e-10), (torch.float32, 1, 1e-5), (torch.float64, 2, 1e-10)],
)
def test_expert_parallel_fsdp_upcycling_reads_own_blocks_and_keeps_dense_logits(
    tmp_path: Path, dtype: torch.dtype, granularity: int, tolerance: float
) -> None:
    directory = write_dense(tmp_path / "dense", dtype)
    results = run_on_ranks(_ep_fsdp_run, 2, directory, dtype, granularity, False, timeout=120)
    reference = dense_logits(directory, dtype)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], reference, rtol=0, atol=tolerance)
        assert len(result["reads"]) == len(set(result["reads"])), "a block was read twice"
        assert set(result["reads"]) == _expected_fsdp_reads(directory, rank, granularity)
        assert result["read_bytes"] < result["owned"]


def test_ignoring_the_shard_offsets_breaks_the_logits(tmp_path: Path) -> None:
    """Ablation: ranks that fill their shards from the tensors' first blocks give other logits."""
    directory = write_dense(tmp_path / "dense", torch.float64)
    results = run_on_ranks(_ep_fsdp_run, 2, directory, torch.float64, 1, True, timeout=120)
    gap = (results[1]["logits"] - dense_logits(directory, torch.float64)).abs().max()
    assert gap > 1e-3


def _tp_placements(name: str) -> list:
    """Megatron-style tensor parallelism: column-parallel in-projections (rows), row-parallel
    out-projections (columns), experts cut along their hidden dim, the rest replicated."""
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
        return [Shard(0)]
    if name.endswith(("wo.weight", "w2.weight", "experts.w1_EFD", "experts.w3_EFD")):
        return [Shard(1)]
    if name.endswith("experts.w2_EDF"):
        return [Shard(2)]
    if name.endswith(("tok_embeddings.weight", "output.weight")):
        return [Shard(0)]  # vocabulary-parallel rows
    return [Replicate()]


def _tp_run(rank: int, world_size: int, directory: Path) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    def parallelize(model: nn.Module) -> None:
        for module_name, module in list(model.named_modules()):
            for name, param in list(module.named_parameters(recurse=False)):
                placements = _tp_placements(f"{module_name}.{name}")
                shape, _ = local_shape_and_offset(param.shape, mesh, placements)
                local = torch.empty(shape, dtype=param.dtype, device="meta")
                sharded = DTensor.from_local(
                    local,
                    mesh,
                    placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                setattr(module, name, nn.Parameter(sharded))

    reads: list[TensorRead] = []
    spec = UpcycleSpec(num_experts=4, top_k=2)
    model, _ = upcycle_llama(directory, spec, seed=5, parallelize=parallelize, read_log=reads)
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    return {"full": full, "reads": [_bounds(read) for read in reads]}


def test_tensor_parallel_placements_read_only_their_rows_and_columns(tmp_path: Path) -> None:
    directory = write_dense(tmp_path / "dense", torch.float32)
    results = run_on_ranks(_tp_run, 2, directory, timeout=120)
    single, _ = upcycle_llama(directory, UpcycleSpec(num_experts=4, top_k=2), seed=5)
    for name, param in single.named_parameters():
        assert torch.equal(results[0]["full"][name], param), name
    half_rows, half_columns = DENSE.ffn_dim // 2, DENSE.dim // 2
    for rank, result in enumerate(results):
        reads = dict.fromkeys(result["reads"])
        assert len(reads) == len(result["reads"]), "a block was read twice"
        hf = to_hf_name
        up = (
            hf("layers.0.feed_forward.w1.weight"),
            ((rank * half_rows, (rank + 1) * half_rows), (0, DENSE.dim)),
        )
        down = (
            hf("layers.0.feed_forward.w2.weight"),
            ((0, DENSE.dim), (rank * half_rows, (rank + 1) * half_rows)),
        )
        out = (
            hf("layers.0.attention.wo.weight"),
            ((0, DENSE.dim), (rank * half_columns, (rank + 1) * half_columns)),
        )
        norm = (hf("layers.0.attention_norm.weight"), ((0, DENSE.dim),))
        assert {up, down, out, norm} <= reads.keys()
        # the 4 experts of a layer share one read of each dense FFN block
        assert sum(name == up[0] for name, _ in reads) == 1
