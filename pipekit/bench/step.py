"""`python -m pipekit.bench step --config CONFIG.toml [--section.key value ...]`.

Times training steps of the config's model in this process (one rank, checkpoints off), and
reports tokens/s and MFU against this machine's measured float32 matmul throughput (the FLOP
formula is in pipekit.train.metrics).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from pipekit.bench._report import print_result, print_table
from pipekit.config import load_job_config
from pipekit.train.job import plan_job
from pipekit.train.metrics import measure_matmul_flops

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipekit.bench step", description=__doc__)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--timed", type=int, default=10, help="timed steps")
    options, config_argv = parser.parse_known_args(argv)
    from pipekit.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as output_dir:
        config = load_job_config(
            [
                *config_argv,
                "--parallelism.dp_shard",
                "1",
                "--parallelism.dp_replicate",
                "1",
                "--checkpoint.enable",
                "false",
                "--checkpoint.resume",
                "false",
                "--job.output_dir",
                output_dir,
                "--training.steps",
                str(options.warmup + options.timed),
                "--lr_scheduler.warmup_steps",
                "0",
            ]
        )
        trainer = Trainer(plan_job(config, world_size=1))
        for _ in range(options.warmup):
            trainer.train_step()
        tokens, start = 0, time.perf_counter()
        for _ in range(options.timed):
            tokens += trainer.train_step()[2]
        seconds = time.perf_counter() - start
    peak = measure_matmul_flops()
    tokens_per_s = tokens / seconds
    achieved = tokens_per_s * trainer.flops_per_token
    print(
        f"{config.model.name}/{config.model.flavor}, batch {config.training.global_batch_size} x "
        f"{config.training.seq_len}, {torch.get_num_threads()} threads, {options.timed} timed steps"
    )
    print_table(
        ["tokens/s", "step s", "FLOPs/token", "achieved GFLOP/s", "matmul peak GFLOP/s", "MFU"],
        [
            [
                tokens_per_s,
                seconds / options.timed,
                trainer.flops_per_token,
                achieved / 1e9,
                peak / 1e9,
                achieved / peak,
            ]
        ],
    )
    print_result(tokens_per_s=tokens_per_s, mfu_vs_matmul_peak=achieved / peak)
