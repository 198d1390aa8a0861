"""`[compile] enable`: compiled blocks and loss train to the eager losses under FSDP with
selective checkpointing, under expert parallelism with full checkpointing, and in a sliced
pipeline with context exchange; slicing and pipelining add no recompiles, and equal-cost slices
of several lengths one (CPU inductor)."""

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from tiny_models import (
    PARITY_ROWS,
    PARITY_SEQ_LEN,
    pp_mesh,
    tiny_batch,
    tiny_pipeline,
    tiny_reference,
)

from pipekit.config import load_job_config
from pipekit.models import get_model_spec
from pipekit.testing import max_relative_difference, run_on_ranks, runner_step
from pipekit.train.compile import compile_blocks
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

STEPS = 3
BASE = [
    "--training.steps", str(STEPS), "--training.global_batch_size", "4",
    "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "1",
    "--checkpoint.enable", "false", "--checkpoint.resume", "false",
    "--metrics.log_interval", "1", "--metrics.peak_flops", "1e9",
]  # fmt: skip

# Forked ranks compile in their own process: no pool of compile workers to inherit.
torch._inductor.config.compile_threads = 1


def _losses_and_frames(output_dir, overrides, compiled, world_size):
    """The losses of a short run, and how many frames dynamo compiled for it."""
    torch._dynamo.reset()  # a forked rank inherits its parent's compiled code and counters
    torch._dynamo.utils.counters.clear()
    argv = [*BASE, *overrides, "--job.output_dir", str(output_dir)]
    config = load_job_config([*argv, "--compile.enable", str(compiled).lower()])
    losses = Trainer(validate_job(config, world_size=world_size)).train()
    return losses, torch._dynamo.utils.counters["frames"]["ok"]


def _eager_and_compiled(rank, world_size, output_dir, overrides):
    return [
        _losses_and_frames(output_dir / f"{compiled}", overrides, compiled, world_size)
        for compiled in (False, True)
    ]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Eager and compiled runs of the debug model on one process."""
    overrides = ["--config", "configs/debug_model.toml", "--parallelism.dp_shard", "1"]
    return _eager_and_compiled(0, 1, tmp_path_factory.mktemp("single"), overrides)


def test_compiled_blocks_train_to_the_eager_losses_in_one_process(single_process):
    (eager, eager_frames), (compiled, compiled_frames) = single_process
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    # the compiled run really compiled (eager compiles FlexAttention alone, on CUDA)
    assert compiled_frames > eager_frames


@pytest.mark.parametrize(
    "overrides",
    [
        (
            "--config", "configs/debug_model.toml", "--parallelism.dp_shard", "2",
            "--training.activation_checkpoint", "selective",
        ),
        (
            "--config", "configs/debug_moe.toml", "--parallelism.dp_shard", "2",
            "--parallelism.ep", "2", "--training.activation_checkpoint", "full",
        ),
    ],
    ids=["fsdp+selective_checkpointing", "expert_parallel+full_checkpointing"],
)  # fmt: skip
def test_compiled_blocks_train_to_the_eager_losses_on_two_ranks(tmp_path, overrides):
    per_rank = run_on_ranks(_eager_and_compiled, 2, tmp_path, overrides, timeout=600)
    for (eager, _), (compiled, frames) in per_rank:
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
        assert frames > 0


@pytest.mark.parametrize(
    "config", ["configs/debug_sliced_pp.toml", "configs/debug_context_exchange_pp.toml"]
)
def test_sliced_pipeline_compiles_once_for_every_slice(tmp_path, single_process, config):
    """Four slices of four microbatches: the losses are eager's, and the last stage (blocks and
    loss) compiles the frames one unsliced process does: no recompiles per slice, microbatch or
    step. With context exchange, the lending units' second context type compiles the frames that
    take a context once more, and nothing else does."""
    per_rank = run_on_ranks(_eager_and_compiled, 2, tmp_path, ("--config", config), timeout=600)
    (eager, _), (compiled, last_stage_frames) = per_rank[1]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    _, (_, single_process_frames) = single_process
    context_types = 2 if "exchange" in config else 1
    frames_taking_a_context = 2  # the block's forward, and its attention's
    expected = single_process_frames + (context_types - 1) * frames_taking_a_context
    assert last_stage_frames == expected


def _equal_cost_pipeline(rank, world_size, compiled, slicing):
    """One float64 step of the tiny 2-stage pipeline (4 slices of 2 microbatches), its blocks
    compiled or not; its gradients, and the frames dynamo compiled."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    blocks_of = get_model_spec("llama").structure.blocks_of
    runner = tiny_pipeline(
        pp_mesh(world_size),
        microbatches=2,
        num_slices=4,
        rows=PARITY_ROWS,
        seq_len=PARITY_SEQ_LEN,
        slicing=slicing,
        attention_to_linear=4.0,  # (0, 14, 22, 27, 32): four slice lengths
        parallelize=(lambda module: compile_blocks(blocks_of(module))) if compiled else None,
    )
    return runner_step(runner, tiny_batch()), torch._dynamo.utils.counters["frames"]["ok"]


def test_equal_cost_slices_recompile_once_for_a_dynamic_length():
    """Four slice lengths: the compiled blocks reproduce the single-process model, and compile
    the frames of one slice length twice (the second length makes the sequence dynamic), not
    once per length."""
    per_rank = run_on_ranks(_both_slicings, 2, timeout=600)
    equal_cost = [by_slicing["equal_cost"] for by_slicing in per_rank]
    equal_length = [by_slicing["equal_length"] for by_slicing in per_rank]
    difference = max_relative_difference([result for result, _ in equal_cost], tiny_reference(2))
    assert difference < 1e-9, difference
    for rank in range(2):
        assert equal_cost[rank][1] == 2 * equal_length[rank][1] > 0, (equal_cost, equal_length)


def _both_slicings(rank: int, world_size: int) -> dict[str, tuple]:
    """Both slicings on the same ranks (`_equal_cost_pipeline` resets dynamo before each)."""
    return {
        slicing: _equal_cost_pipeline(rank, world_size, True, slicing)
        for slicing in ("equal_cost", "equal_length")
    }
