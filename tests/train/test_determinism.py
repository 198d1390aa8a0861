"""`[debug] deterministic`: torch's deterministic algorithms on, and memory that is allocated
but never written filled with NaN. A 2-stage sliced pipeline (whose KV-cache chunks, receive
buffers and gradient accumulators start as allocations) trains the same losses, bit for bit,
as without: no path of it reads memory before writing it."""

import torch

from pipekit.config import load_job_config
from pipekit.testing import run_on_ranks
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

ARGS = [
    "--config", "configs/debug_model.toml", "--training.steps", "3",
    "--training.global_batch_size", "4", "--training.seq_len", "32",
    "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "false",
    "--checkpoint.resume", "false", "--metrics.peak_flops", "1e9",
    "--parallelism.dp_shard", "1", "--parallelism.pipeline_parallel_degree", "2",
]  # fmt: skip


def _both_modes(rank: int, world_size: int, output_dir: str) -> dict[str, object]:
    """The losses without and then with the mode, and what the mode turned on."""
    runs: dict[str, object] = {}
    for deterministic in ("false", "true"):
        config = load_job_config(
            [*ARGS, "--job.output_dir", output_dir, "--debug.deterministic", deterministic]
        )
        runs[deterministic] = Trainer(validate_job(config, world_size)).train()
    runs["enabled"] = torch.are_deterministic_algorithms_enabled()
    runs["empty_is_nan"] = bool(torch.empty(4).isnan().all())
    return runs


def test_deterministic_mode_trains_the_same_losses_bit_for_bit(tmp_path):
    per_rank = run_on_ranks(_both_modes, 2, str(tmp_path), timeout=180)
    last = per_rank[1]  # the last stage logs the losses
    assert last["enabled"] and last["empty_is_nan"]
    assert len(last["true"]) == 3 and last["true"] == last["false"]
