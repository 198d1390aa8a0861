"""The sliced pipeline equals one process running the whole batch unsliced (float64): loss and
every parameter gradient, for p = 2 and 4 ranks, n in {p, 2p, 4p} slices, m in {1, 2, 3}
microbatches and v in {1, 2} stages per rank, on packed documents with ignored labels, with
equal-length and equal-cost slices. torch's own schedules on the same split match too. The
ablations drop the KV-cache gradients, or the per-slice receive buffers, and must fail."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from tiny_models import (
    PARITY_ROWS,
    PARITY_SEQ_LEN,
    PARITY_TOLERANCE,
    pp_mesh,
    tiny_batch,
    tiny_pipeline,
    tiny_reference,
)
from torch import nn

from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.layers.loss import count_label_tokens
from pipekit.pipelining.runtime.stage import SlicedPipelineStage
from pipekit.testing import (
    RankFailedError,
    Result,
    max_relative_difference,
    run_on_ranks,
    runner_step,
)


def _run_pipeline(
    rank: int,
    world: int,
    schedule: str,
    v: int,
    m: int,
    n: int,
    drop_kv_grads: bool = False,
    checkpoint_activations: bool = False,
    slicing: str = "equal_length",
) -> Result:
    runner = tiny_pipeline(
        pp_mesh(world),
        schedule=schedule,
        stages_per_rank=v,
        microbatches=m,
        num_slices=n,
        rows=PARITY_ROWS,
        seq_len=PARITY_SEQ_LEN,
        checkpoint_activations=checkpoint_activations,
        slicing=slicing,
        attention_to_linear=_ATTENTION_TO_LINEAR,
    )
    for stage in runner.stages:
        stage.kv_cache.drop_cached_gradients = drop_kv_grads
    return runner_step(runner, tiny_batch())


_ATTENTION_TO_LINEAR = 4.0
"""Heavy attention, so equal-cost slices of the 32-token parity batch differ in length."""


def _run_many(rank: int, world: int, configs: list[tuple]) -> list[tuple]:
    return [_run_pipeline(rank, world, *config) for config in configs]


def _differences(world: int, configs: list[tuple], timeout: float) -> dict[tuple, float]:
    """Run every config on `world` ranks in one group; max relative difference to the reference."""
    results = run_on_ranks(_run_many, world, configs, timeout=timeout)
    references = {v: tiny_reference(world * v) for v in {config[1] for config in configs}}
    return {
        config: max_relative_difference(
            [results[rank][index] for rank in range(world)], references[config[1]]
        )
        for index, config in enumerate(configs)
    }


@pytest.mark.parametrize("world", [2, 4])
def test_sliced_pipeline_equals_unsliced_single_process_fp64(world: int) -> None:
    configs = [
        ("sliced", v, m, n)
        for v, m, n in itertools.product((1, 2), (1, 2, 3), (world, 2 * world, 4 * world))
    ]
    for config, difference in _differences(world, configs, timeout=300).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_torch_schedules_match_on_the_same_split() -> None:
    configs = [("1F1B", 1, 6, 1), ("GPipe", 1, 3, 1), ("Interleaved1F1B", 2, 6, 1)]
    configs += [("ZBVZeroBubble", 2, 6, 1), ("sliced", 2, 3, 4)]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_activation_checkpointing_recomputes_slices_against_the_cache() -> None:
    """A checkpointed block recomputes its slice inside the slice's backward, against the
    cached earlier slices; the gradients stay exact (sliced, v = 1 and 2; and 1F1B)."""
    configs = [("sliced", 1, 2, 4, False, True), ("sliced", 2, 3, 4, False, True)]
    configs.append(("1F1B", 1, 6, 1, False, True))
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_dropping_kv_cache_gradients_breaks_parity() -> None:
    configs = [("sliced", 1, 2, 4, True), ("sliced", 2, 1, 2, True)]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference > 1e-3, config


def test_equal_cost_slices_equal_the_unsliced_single_process_fp64() -> None:
    """Slices of different lengths (equal cost: (0, 14, 22, 27, 32) for n = 4) through p = 2
    ranks, v = 1 and 2, m = 1 and 3, recomputed under activation checkpointing too: every unit
    is received into a buffer of its own length, and the result stays exact."""
    configs = [
        ("sliced", 1, 1, 4, False, False, "equal_cost"),
        ("sliced", 1, 3, 8, False, False, "equal_cost"),
        ("sliced", 2, 3, 4, False, False, "equal_cost"),
        ("sliced", 1, 2, 4, False, True, "equal_cost"),
    ]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def _run_without_fitted_buffers(rank: int, world: int) -> Result:
    """The ablation: every unit receives into torch's one size (the longest slice's)."""
    SlicedPipelineStage.after_receive_buffers = lambda self: None
    return _run_pipeline(rank, world, "sliced", 1, 1, 4, slicing="equal_cost")


def test_equal_cost_slices_need_per_slice_receive_buffers() -> None:
    with pytest.raises(RankFailedError, match=r"Stage 1\] failed to run forward"):
        run_on_ranks(_run_without_fitted_buffers, 2, timeout=60)


def _run_two_batches(rank: int, world: int, v: int, m: int, n: int) -> Result:
    """Slices cut per microbatch by its documents: a step on the batch's rows reversed (other
    cuts), its gradients dropped, then the parity step: the buffers and the cache follow the
    new cuts."""
    runner = tiny_pipeline(
        pp_mesh(world), stages_per_rank=v, microbatches=m, num_slices=n, rows=PARITY_ROWS,
        seq_len=PARITY_SEQ_LEN, slicing="documents", attention_to_linear=_ATTENTION_TO_LINEAR,
    )  # fmt: skip
    reversed_rows = tiny_batch()[torch.arange(PARITY_ROWS - 1, -1, -1)]
    runner.step(reversed_rows, count_label_tokens(reversed_rows["labels"]))
    first = [stage.microbatch_bounds for stage in runner.stages]
    for stage in runner.stages:
        stage.submod.zero_grad(set_to_none=True)
    result = runner_step(runner, tiny_batch())
    assert all(
        stage.microbatch_bounds != bounds
        for stage, bounds in zip(runner.stages, first, strict=True)
    )
    return result


def test_slices_cut_per_microbatch_by_documents_equal_the_unsliced_single_process_fp64() -> None:
    """Each microbatch cut by its own documents' attention work (the parity batch's three
    microbatches of two rows: (0, 15, 22, 28, 32), (0, 11, 21, 27, 32), (0, 10, 16, 25, 32)),
    v = 1 and 2, recomputed under activation checkpointing too; and a second step on other
    cuts."""
    configs = [
        ("sliced", 1, 3, 4, False, False, "documents"),
        ("sliced", 2, 2, 4, False, False, "documents"),
        ("sliced", 1, 3, 4, False, True, "documents"),
    ]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"
    results = run_on_ranks(_run_two_batches, 2, 1, 3, 4, timeout=120)
    assert max_relative_difference(results, tiny_reference(2)) <= PARITY_TOLERANCE


def _run_without_telling_the_stages(rank: int, world: int) -> Result:
    """The ablation: the batch is cut per microbatch but the stages keep the planned cuts."""
    SlicedPipelineStage.use_microbatch_bounds = lambda self, bounds: None
    return _run_pipeline(rank, world, "sliced", 1, 3, 4, slicing="documents")


def test_slices_cut_per_microbatch_need_the_stages_to_follow_them() -> None:
    with pytest.raises(RankFailedError, match="data size doesn't match expected size"):
        run_on_ranks(_run_without_telling_the_stages, 2, timeout=60)


def _run_pipeline_with_fsdp(rank: int, world: int, m: int, n: int) -> Result:
    """pp=2 x dp_shard=2: each data-parallel rank runs half the batch through a 2-stage sliced
    pipeline whose stages are FSDP2-sharded; gradients are summed over data-parallel ranks."""
    dims = ParallelDims.from_config(
        ParallelismConfig(dp_shard=2, pipeline_parallel_degree=2), world
    )
    mesh = dims.build_mesh("cpu")
    rows = PARITY_ROWS // 2

    def parallelize(stage_module: nn.Module) -> None:
        apply_data_parallel(
            stage_module,
            mesh,
            dims,
            blocks=list(stage_module.layers.values()),
            param_dtype=torch.float64,
            reduce_dtype=torch.float64,
        )

    runner = tiny_pipeline(
        mesh,
        microbatches=m,
        num_slices=n,
        rows=rows,
        seq_len=PARITY_SEQ_LEN,
        parallelize=parallelize,
    )
    stages = runner.stages
    batch = tiny_batch()
    dp_rank = dims.dp_rank(mesh)
    loss = runner.step(
        batch[dp_rank * rows : (dp_rank + 1) * rows], count_label_tokens(batch["labels"])
    )
    if loss is not None:
        dist.all_reduce(loss, group=dims.mesh("dp_shard").get_group())
    grads = {
        name: p.grad.full_tensor()
        for stage in stages
        for name, p in stage.submod.named_parameters()
    }
    dist.barrier()
    return (None if loss is None or dp_rank else loss.item()), grads


def test_sliced_pipeline_composes_with_fsdp_on_the_data_parallel_dim() -> None:
    results = run_on_ranks(_run_pipeline_with_fsdp, 4, 3, 4, timeout=120)
    difference = max_relative_difference(results, tiny_reference(2))
    assert difference <= PARITY_TOLERANCE, f"max relative difference {difference:.2e}"
