"""`python scripts/gpu_check.py [--device cuda] [--only name,...]`: every GPU-only path once,
and one short timed training step, in a few minutes and without a network.

The checks (`pipekit.tools.device_checks`) compare compiled FlexAttention (forward, backward and
its lse gradient), compiled blocks, grouped experts, MPipeMoE's partitions with shared buffers
and side-stream offload, activation offload through pinned memory, and bf16 / float8 linear
layers with references computed another way on the same inputs. Then the debug Llama trains a
few steps in bf16 on the device, and its tokens/s and MFU against the device's peak are
reported. One table, then `RESULT ...`; the exit status is 1 when any check fails.

`--device cpu` runs the same checks where a CPU can (FlexAttention forward only, float8
emulated): the test suite's use of it, not a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from pipekit.bench.report import print_result, print_table
from pipekit.config import load_job_config
from pipekit.tools.device_checks import CHECKS, CheckResult, timed
from pipekit.train.job import validate_job
from pipekit.train.metrics import measure_matmul_flops
from pipekit.train.trainer import Trainer

__all__ = ["BF16_PEAK_FLOPS", "main", "training_step"]

BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peaks (FLOP/s) by device name, from the vendors' data sheets (SXM
parts); another device's peak is measured with a bf16 matmul."""

_REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_model.toml"


def device_peak_flops(device: torch.device) -> tuple[float, str]:
    """The peak MFU is reported against, and where it came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, peak in BF16_PEAK_FLOPS.items():
            if part in name:
                return peak, f"{name} bf16 data-sheet peak"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    measured = measure_matmul_flops(device, dtype)
    return measured, "measured matmul peak"


def training_step(device: torch.device, steps: int, seq_len: int) -> dict[str, float]:
    """Train the debug Llama `steps` steps on one process (the trainer's device; bf16 on
    CUDA): the last loss, and the tokens/s and MFU of the steps after the first (which
    compiles)."""
    peak, _ = device_peak_flops(device)
    with tempfile.TemporaryDirectory(prefix="pipekit-gpu-check-") as output:
        argv = [
            "--config", str(_REPO_CONFIG), "--job.output_dir", output,
            "--training.steps", str(steps), "--training.seq_len", str(seq_len),
            "--training.global_batch_size", "8", "--parallelism.dp_shard", "1",
            "--checkpoint.enable", "false", "--checkpoint.resume", "false",
            "--metrics.log_interval", str(steps), "--metrics.peak_flops", str(peak),
            "--lr_scheduler.warmup_steps", "1",
            "--training.mixed_precision_param",
            "bfloat16" if device.type == "cuda" else "float32",
        ]  # fmt: skip
        Trainer(validate_job(load_job_config(argv), world_size=1)).train()
        rows = [json.loads(line) for line in Path(output, "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {"loss": last["loss"], "tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--only", default="", help=f"comma-separated checks (of {', '.join(CHECKS)}, training)"
    )
    parser.add_argument("--steps", type=int, default=6, help="training steps (the first excluded)")
    parser.add_argument("--seq-len", type=int, default=2048, help="training sequence length")
    options = parser.parse_args(argv)
    chosen = [name for name in options.only.split(",") if name] or [*CHECKS, "training"]
    unknown = set(chosen) - {*CHECKS, "training"}
    if unknown:
        parser.exit(2, f"{parser.prog}: error: unknown checks {sorted(unknown)}\n")
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.exit(
            2,
            f"{parser.prog}: error: no CUDA device here; --device cpu runs the checks a CPU can\n",
        )
    if options.steps < 2:
        parser.exit(2, f"{parser.prog}: error: --steps={options.steps} must be at least 2\n")
    device = torch.device(options.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"pipekit GPU check on {name}, torch {torch.__version__}")
    rows, figures, failed = [], {}, []
    for check_name in chosen:
        if check_name == "training":
            continue
        try:
            result, seconds = timed(CHECKS[check_name], device)
        except Exception as error:  # one line in the table, the other checks still run
            result, seconds = CheckResult(float("inf"), 0.0, f"raised {error!r}"[:160]), 0.0
        status = "ok" if result.passed else "FAILED"
        rows.append([check_name, result.error, result.tolerance, seconds, status, result.detail])
        figures[f"{check_name}_error"] = result.error
        if not result.passed:
            failed.append(check_name)
    print_table(["check", "error", "tolerance", "seconds", "status", "what"], rows)
    if "training" in chosen:
        peak, source = device_peak_flops(device)
        trained = training_step(device, options.steps, options.seq_len)
        print(
            f"training: debug Llama, {options.steps} steps of 8 x {options.seq_len} tokens, loss "
            f"{trained['loss']:.4f}, {trained['tokens_per_s']:.0f} tokens/s, MFU "
            f"{100 * trained['mfu']:.2f}% of {peak / 1e12:.1f} TFLOP/s ({source})"
        )
        figures.update(trained)
    print_result(
        device=name.replace(" ", "_"), passed=len(rows) - len(failed), failed=len(failed), **figures
    )
    return 1 if failed else 0
