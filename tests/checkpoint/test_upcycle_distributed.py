"""Online upcycling on 2 gloo ranks: each rank reads exactly its own blocks, and the first forward
equals the dense model's under expert parallelism + FSDP2; tensor-parallel-style placements read
only their columns and rows too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_upcycle import DENSE, dense_logits, logits, write_dense
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from pipekit._torch_private import local_shape_and_offset
from pipekit.checkpoint import SafetensorsCheckpoint, TensorRead, local_shards
from pipekit.checkpoint.local_shards import local_nbytes
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.families.llama_moe.upcycle import upcycle_llama
from pipekit.models.upcycling import UpcycleSpec
from pipekit.moe.expert_parallel import apply_expert_parallel, expert_mesh
from pipekit.testing import run_on_ranks


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
    rank: int,
    world_size: int,
    directory: Path,
    dtype: torch.dtype,
    granularity: int,
    router: str = "topk_softmax",
    break_offsets: bool = False,
) -> dict:
    if break_offsets:  # ablation: every rank fills its shards with the first block
        real = local_shards.local_block
        local_shards.local_block = lambda param: tuple(
            slice(0, part.stop - part.start) for part in real(param)
        )
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    experts = expert_mesh("cpu", 2, 2)

    def parallelize(model: nn.Module) -> None:
        apply_expert_parallel(model, experts["ep"])
        apply_data_parallel(
            model, mesh, dims, param_dtype=dtype, reduce_dtype=dtype,
            experts_mesh=experts["ep_replicate"],
        )  # fmt: skip

    return _upcycle_on_rank(
        directory, UpcycleSpec(4, 2, granularity, router=router), dtype, parallelize
    )


def _upcycle_on_rank(directory: Path, spec: UpcycleSpec, dtype: torch.dtype, parallelize) -> dict:
    reads: list[TensorRead] = []
    model, _ = upcycle_llama(
        directory, spec, seed=5, dtype=dtype, parallelize=parallelize, read_log=reads
    )
    return {
        "logits": logits(model),
        "reads": [_bounds(read) for read in reads],
        "owned": local_nbytes(model),
        "read_bytes": sum(read.nbytes for read in reads),
    }


@pytest.mark.parametrize(
    ("dtype", "granularity", "tolerance", "tied"),
    [
        (torch.float64, 1, 1e-10, False),
        (torch.float32, 1, 1e-5, False),
        (torch.float64, 2, 1e-10, False),
        (torch.float64, 1, 1e-10, True),
    ],
)
def test_expert_parallel_fsdp_upcycling_reads_own_blocks_and_keeps_dense_logits(
    tmp_path: Path, dtype: torch.dtype, granularity: int, tolerance: float, tied: bool
) -> None:
    """4 copies, top-2 (x G): each rank holds 2 copies' experts and half of every other weight
    (tied: the embedding rows serve the output layer too)."""
    directory = write_dense(tmp_path / "dense", dtype, DENSE.with_updates(tie_embeddings=tied))
    results = run_on_ranks(_ep_fsdp_run, 2, directory, dtype, granularity, timeout=120)
    reference = dense_logits(directory, dtype)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], reference, rtol=0, atol=tolerance)
        assert len(result["reads"]) == len(set(result["reads"])), "a block was read twice"
        assert set(result["reads"]) == _expected_fsdp_reads(directory, rank, granularity)
        assert result["read_bytes"] < result["owned"]


@pytest.mark.parametrize("ablation", ["shard offsets ignored", "softmax then top-k"])
def test_expert_parallel_ablations_move_the_logits(tmp_path: Path, ablation: str) -> None:
    """Ranks that fill their shards from the tensors' first blocks, or the ST router (weights
    summing to less than 1), give logits far from the dense ones under the same layout."""
    directory = write_dense(tmp_path / "dense", torch.float64)
    router = "softmax_topk" if ablation == "softmax then top-k" else "topk_softmax"
    broken = ablation == "shard offsets ignored"
    results = run_on_ranks(
        _ep_fsdp_run, 2, directory, torch.float64, 1, router, broken, timeout=120
    )
    gap = (results[1]["logits"] - dense_logits(directory, torch.float64)).abs().max()
    assert gap > 1e-3, f"{ablation}: the logits moved by only {gap:.2e}"


def _fsdp3_run(rank: int, world_size: int, directory: Path) -> dict:
    """FSDP2 alone over 3 ranks: uneven row shards everywhere, wq/wk shards off head
    boundaries, and the 4 experts (and router rows) split 2, 2, 0."""
    dims = ParallelDims(dp_replicate=1, dp_shard=3, cp=1, tp=1, pp=1, ep=1, world_size=world_size)
    mesh = dims.build_mesh("cpu")

    def parallelize(model: nn.Module) -> None:
        apply_data_parallel(model, mesh, dims, param_dtype=torch.float64)

    spec = UpcycleSpec(num_experts=4, top_k=2)
    return _upcycle_on_rank(directory, spec, torch.float64, parallelize)


def _expected_fsdp3_reads(directory: Path, rank: int) -> set:
    """Rows [r·c, (r+1)·c) with c = ceil(R/3); wq/wk widened to whole heads; each dense FFN
    whole on the ranks that hold experts (0 and 1), nothing on rank 2."""
    expected, head_dim = set(), DENSE.per_head_dim
    with SafetensorsCheckpoint(directory) as checkpoint:
        for name in checkpoint.names:
            shape = checkpoint.info(name).shape
            rest = tuple((0, size) for size in shape[1:])
            if ".mlp." in name:
                if rank < 2:
                    expected.add((name, ((0, shape[0]), *rest)))
                continue
            rows = math.ceil(shape[0] / 3)
            start, stop = rank * rows, min(shape[0], (rank + 1) * rows)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                start, stop = start // head_dim * head_dim, math.ceil(stop / head_dim) * head_dim
            expected.add((name, ((start, stop), *rest)))
    return expected


def test_uneven_and_empty_shards_read_their_blocks_and_keep_dense_logits(tmp_path: Path) -> None:
    directory = write_dense(tmp_path / "dense", torch.float64)
    results = run_on_ranks(_fsdp3_run, 3, directory, timeout=120)
    reference = dense_logits(directory, torch.float64)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], reference, rtol=0, atol=1e-10)
        assert len(result["reads"]) == len(set(result["reads"])), "a block was read twice"
        assert set(result["reads"]) == _expected_fsdp3_reads(directory, rank)


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
    for rank, result in enumerate(results):
        assert len(result["reads"]) == len(set(result["reads"])), "a block was read twice"
        assert set(result["reads"]) == _expected_tp_reads(directory, rank)


def _expected_tp_reads(directory: Path, rank: int) -> set:
    """Halves by rows (q/k/v, the FFN's gate and up rows the experts are cut along, vocabulary)
    or by columns (o, the FFN's down columns); norms whole. The 4 experts of a layer share one
    read of each FFN half."""
    by_columns = ("o_proj.weight", "down_proj.weight")
    replicated = ("norm.weight", "layernorm.weight")
    expected = set()
    with SafetensorsCheckpoint(directory) as checkpoint:
        for name in checkpoint.names:
            bounds = [(0, size) for size in checkpoint.info(name).shape]
            if not name.endswith(replicated):
                dim = 1 if name.endswith(by_columns) else 0
                half = bounds[dim][1] // 2
                bounds[dim] = (rank * half, (rank + 1) * half)
            expected.add((name, tuple(bounds)))
    return expected
