"""`python -m pipekit.bench step --config CONFIG.toml [--compile] [--section.key value ...]`.

Times training steps of the config's model in this process (one rank, checkpoints off), and
reports tokens/s and MFU against the measured matmul throughput of the device it trains on, in
the compute dtype (the FLOP formula is in pipekit.train.metrics). The figure is one process's:
a job of N ranks logs tokens/s per device, each rank running its share of the batch beside the
others on the machine's cores.

`--compile` trains the same model twice from the same seed, eager and with `[compile] enable`,
one step of each in turn, so both see the same machine load: it prints both rows, the largest
difference between their losses, and `RESULT compile_speedup=<compiled / eager tokens/s>`. The
compiled run's warm-up steps include compiling.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from pipekit.bench.report import machine_description, print_result, print_table
from pipekit.config import load_job_config
from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES
from pipekit.train.job import validate_job
from pipekit.train.metrics import measure_matmul_flops

__all__ = ["main"]


class _TimedTrainer:
    """One trainer of the bench, with the losses and the time of the steps it ran."""

    def __init__(self, config_argv: list[str], output_dir: str, steps: int, compiled: bool) -> None:
        from pipekit.train.trainer import Trainer

        overrides = {
            "parallelism.dp_shard": 1,
            "parallelism.dp_replicate": 1,
            "checkpoint.enable": "false",
            "checkpoint.resume": "false",
            "job.output_dir": output_dir,
            "training.steps": steps,
            "lr_scheduler.warmup_steps": 0,
            "compile.enable": "true" if compiled else "false",
        }
        argv = [*config_argv]
        for key, value in overrides.items():
            argv += [f"--{key}", str(value)]
        self.config = load_job_config(argv)
        self.trainer = Trainer(validate_job(self.config, world_size=1))
        self.losses: list[float] = []
        self.seconds, self.tokens = 0.0, 0

    def step(self, timed: bool) -> None:
        start = time.perf_counter()
        loss, _, tokens = self.trainer.train_step()
        if timed:
            self.seconds += time.perf_counter() - start
            self.tokens += tokens
        self.losses.append(loss)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipekit.bench step", description=__doc__)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--timed", type=int, default=10, help="timed steps")
    parser.add_argument(
        "--compile", action="store_true", help="compiled against eager, one step of each in turn"
    )
    options, config_argv = parser.parse_known_args(argv)
    steps = options.warmup + options.timed
    with tempfile.TemporaryDirectory() as output_dir:
        variants = [False, True] if options.compile else [False]
        runs = [_TimedTrainer(config_argv, output_dir, steps, compiled) for compiled in variants]
        for step in range(steps):
            for run in runs:
                run.step(timed=step >= options.warmup)
    config, trainer = runs[0].config, runs[0].trainer
    compute_dtype = MIXED_PRECISION_DTYPES[config.training.mixed_precision_param]
    peak, flops_per_token = (
        measure_matmul_flops(trainer.device, compute_dtype),
        trainer.flops_per_token,
    )
    print(
        f"{config.model.name}/{config.model.flavor}, batch {config.training.global_batch_size} x "
        f"{config.training.seq_len}, {options.warmup} warm-up and {options.timed} timed steps; "
        f"{machine_description()}"
    )
    rows = []
    for run, compiled in zip(runs, variants, strict=True):
        achieved = run.tokens_per_s * flops_per_token
        rows.append(
            [
                "compiled" if compiled else "eager",
                run.tokens_per_s,
                run.seconds / options.timed,
                flops_per_token,
                achieved / 1e9,
                peak / 1e9,
                achieved / peak,
            ]
        )
    headers = ["model", "tokens/s", "step s", "FLOPs/token", "achieved GFLOP/s"]
    print_table([*headers, "matmul peak GFLOP/s", "MFU"], rows)
    eager = runs[0]
    figures: dict[str, object] = {
        "tokens_per_s": eager.tokens_per_s,
        "mfu_vs_matmul_peak": rows[0][-1],
    }
    if options.compile:
        compiled_run = runs[1]
        differences = [
            abs(a - b) / abs(a) for a, b in zip(eager.losses, compiled_run.losses, strict=True)
        ]
        print(f"losses, eager:    {' '.join(f'{loss:.6f}' for loss in eager.losses)}")
        print(f"losses, compiled: {' '.join(f'{loss:.6f}' for loss in compiled_run.losses)}")
        figures.update(
            compiled_tokens_per_s=compiled_run.tokens_per_s,
            compile_speedup=compiled_run.tokens_per_s / eager.tokens_per_s,
            max_loss_rel_difference=max(differences),
        )
    print_result(**figures)
