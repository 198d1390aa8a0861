"""What the training-job tests share: launching train.py under torchrun or alone, reading
its logged losses, the short runs they use, and a debug Llama in Hugging Face layout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pipekit.memory_plan.forked import in_forked_child
from pipekit.testing import run_on_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(REPO_ROOT / "configs" / "debug_model.toml")
SLICED_PP_CONFIG = str(REPO_ROOT / "configs" / "debug_sliced_pp.toml")
VOCAB_PP_CONFIG = str(REPO_ROOT / "configs" / "debug_vocab_parallel_pp.toml")
EXCHANGE_PP_CONFIG = str(REPO_ROOT / "configs" / "debug_context_exchange_pp.toml")
MOE_CONFIG = str(REPO_ROOT / "configs" / "debug_moe.toml")
TP_CONFIG = str(REPO_ROOT / "configs" / "debug_tp.toml")
CP_SLICED_PP_CONFIG = str(REPO_ROOT / "configs" / "debug_cp_sliced_pp.toml")
FIVE_D_CONFIG = str(REPO_ROOT / "configs" / "debug_5d.toml")
MOE_SLICED_CONFIG = str(REPO_ROOT / "configs" / "debug_moe_sliced_pp.toml")


def job_command(
    output_dir: Path, *overrides: str, nproc: int = 2, config: str = CONFIG
) -> list[str]:
    """The torchrun command of a job on `nproc` local ranks writing to `output_dir`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--standalone",
        str(REPO_ROOT / "train.py"),
        "--config",
        config,
        "--job.output_dir",
        str(output_dir),
        *overrides,
    ]


def job_env() -> dict[str, str]:
    """One thread per rank (two cores run every test) and unbuffered output for the logs."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers and theirs), parents before children."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [grand for child in children for grand in [child, *descendants(child)]]


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and every process below it, leaves first, as a crash would."""
    for victim in [*reversed(descendants(pid)), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def train_job(
    output_dir: Path, *overrides: str, nproc: int = 2, config: str = CONFIG, timeout: float = 600
) -> dict:
    """Run a job to completion (it must succeed) on `nproc` gloo ranks forked from this process,
    doing what train.py does once torchrun has started it (check the config for the world size,
    lock the output folder, train); its logged losses by step. Forked ranks inherit the imported
    torch, so a run costs its steps, not the seconds of `nproc` fresh interpreters; tests of the
    launcher itself (signals, exit codes, console lines, nodes) use `job_command`. The ranks take
    a stated peak FLOP/s (MFU's denominator) instead of each measuring its matmuls for half a
    second: these runs are compared by their losses."""
    argv = ["--config", config, "--job.output_dir", str(output_dir), *_STATED_PEAK, *overrides]
    _pack_corpus_here(argv)
    run_on_ranks(_train_rank, nproc, argv, str(output_dir.parent), timeout=timeout)
    return logged_losses(output_dir)


_STATED_PEAK = ("--metrics.peak_flops", "1e12")


def _pack_corpus_here(argv: list[str]) -> None:
    """Pack the job's corpus once in this process, into the loader's in-memory cache, which the
    forked ranks inherit instead of each packing it again: for the byte tokenizer on the
    standard-library corpus only (pure Python; a Hugging Face tokenizer or dataset would leave
    threads in this process)."""
    from pipekit.config import load_job_config
    from pipekit.train.data import load_token_stream

    data = load_job_config(argv).data
    if data.source == "stdlib" and data.tokenizer == "bytes" and not data.mix_sources:
        load_token_stream(data)
    if data.source == "hf":
        # Hugging Face datasets (and pandas, pyarrow) imported here, before the fork: forked
        # ranks importing them while this process held threads of earlier tests (a progress
        # bar's monitor, a checkpoint server) once hung in the import
        import datasets  # noqa: F401


def _train_rank(rank: int, world_size: int, argv: list[str], folder: str) -> None:
    from pipekit.config import load_job_config
    from pipekit.train.job import validate_job
    from pipekit.train.output_lock import lock_output_dir
    from pipekit.train.trainer import Trainer

    os.chdir(folder)
    if str(REPO_ROOT) not in sys.path:  # train.py's folder, where `[model] module`s are found
        sys.path.insert(0, str(REPO_ROOT))
    config = load_job_config(argv)
    job = validate_job(config, world_size)
    if rank == 0:
        lock_output_dir(config.job.output_dir)
    Trainer(job).train()


def logged_losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


SHORT_RUN_STEPS = 24  # long enough that a kill after step 8 lands mid-run
SHORT_RUN = (
    "--training.steps",
    str(SHORT_RUN_STEPS),
    "--training.global_batch_size",
    "4",
    "--training.seq_len",
    "64",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_interval",
    "1",
    "--checkpoint.interval",
    "4",
    "--checkpoint.keep_last",
    "2",
)


LAYOUT_RUN = (*SHORT_RUN[:10], "--training.steps", "4", "--checkpoint.interval", "2")
NO_CHECKPOINTS = ("--checkpoint.enable", "false")


def single_process_error(
    output_dir: Path, *overrides: str, world_size: int | None = None, fresh: bool = False
) -> str:
    """Run train.py without torchrun (WORLD_SIZE set only to test validation against it);
    require exit status 2 and return its one stderr line. `fresh` starts a new interpreter, as a
    user does (so import-time warnings would count); otherwise train.py's `main` runs in a child
    forked from this process, its stderr sent to a file, which costs no interpreter start."""
    argv = ["--config", CONFIG, "--job.output_dir", str(output_dir), *overrides]
    env = job_env() if world_size is None else {**job_env(), "WORLD_SIZE": str(world_size)}
    if fresh:
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / "train.py"), *argv],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        status, stderr = result.returncode, result.stderr
    else:
        stderr_path = output_dir.parent / f"{output_dir.name}.stderr"
        status = in_forked_child(_train_main, argv, env, str(stderr_path))
        stderr = stderr_path.read_text()
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def _train_main(argv: list[str], env: dict[str, str], stderr_path: str) -> int:
    """train.py's `main(argv)` under `env`, everything it writes to stderr going to the file."""
    import importlib.util

    os.environ.clear()
    os.environ.update(env)
    with open(stderr_path, "w") as stderr:
        os.dup2(stderr.fileno(), 2)
        sys.stderr = stderr
        spec = importlib.util.spec_from_file_location("train_script", REPO_ROOT / "train.py")
        assert spec is not None and spec.loader is not None
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        status = script.main(argv)
        stderr.flush()
    return status


def write_debug_llama(directory: Path, seed: int = 11, flavor: str = "debug") -> None:
    """A debug Llama flavor, initialised from `seed`, in Hugging Face layout."""
    import torch

    from pipekit.families.llama.hf import save_hf_llama
    from pipekit.models import get_model_spec

    spec = get_model_spec("llama")
    args = spec.flavor(flavor)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    save_hf_llama(model, args, directory)
