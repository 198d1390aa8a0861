"""`context_exchange = "auto"`: the exchange where the job can run it, kept on only if the first
steps were faster with it (`MeasuredChoice`); the losses are the single process's throughout,
whichever way each step ran, and every rank decides the same."""

import pytest
import torch

from pipekit.config import ConfigError, load_job_config
from pipekit.pipelining.runtime.measured_choice import trial_order
from pipekit.testing import run_on_ranks
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

ARGS = [
    "--config", "configs/debug_sliced_pp.toml", "--training.steps", "9",
    "--training.global_batch_size", "4", "--training.seq_len", "64",
    "--parallelism.microbatches", "2", "--lr_scheduler.warmup_steps", "1",
    "--checkpoint.enable", "false", "--checkpoint.resume", "false",
    "--metrics.peak_flops", "1e9", "--metrics.log_interval", "1",
]  # fmt: skip


def test_auto_is_the_exchange_where_the_job_can_run_it_and_none_elsewhere():
    def plan(*overrides):
        config = load_job_config([*ARGS, *overrides])
        return validate_job(config, world_size=2).pipeline

    auto = plan("--parallelism.context_exchange", "auto")
    assert "context_exchange" in auto.features
    assert auto.feature_plans["context_exchange"] == "auto"
    whole = ("--parallelism.pipeline_schedule", "1F1B", "--parallelism.num_slices", "0")
    assert "context_exchange" not in plan("--parallelism.context_exchange", "auto", *whole).features
    with pytest.raises(ConfigError, match="1F1B' cannot carry context_exchange"):
        plan("--parallelism.context_exchange", "true", *whole)
    equal_cost = ("--parallelism.slicing", "equal_cost")  # unequal slices lend too
    assert (
        "context_exchange" in plan("--parallelism.context_exchange", "auto", *equal_cost).features
    )
    with pytest.raises(ConfigError, match="context_exchange='sometimes' is not one of false, true"):
        plan("--parallelism.context_exchange", "sometimes")


def _train(rank, world_size, output_dir, overrides):
    config = load_job_config([*ARGS, "--job.output_dir", str(output_dir), *overrides])
    trainer = Trainer(validate_job(config, world_size))
    losses = trainer.train()
    exchange = trainer.pipeline.extension("context_exchange") if trainer.pipeline else None
    choice = exchange.choice if exchange is not None else None
    return {
        "losses": losses,
        "chosen": None if choice is None else choice.chosen,
        "trial_steps": None if choice is None else len(choice.step_seconds),
    }


def test_an_auto_job_trains_the_single_process_losses_and_its_ranks_agree(tmp_path):
    single = _train(0, 1, tmp_path / "single", ["--parallelism.pipeline_parallel_degree", "1",
                                                 "--parallelism.num_slices", "0"])  # fmt: skip
    ranks = run_on_ranks(
        _train, 2, tmp_path / "auto", ["--parallelism.context_exchange", "auto"], timeout=180
    )
    assert ranks[0]["chosen"] is not None and ranks[0]["chosen"] == ranks[1]["chosen"]
    assert ranks[0]["trial_steps"] == len(trial_order(2))
    losses = next(rank["losses"] for rank in ranks if rank["losses"])
    torch.testing.assert_close(losses, single["losses"], rtol=1e-5, atol=0)
