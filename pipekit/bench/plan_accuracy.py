"""`python -m pipekit.bench plan-accuracy`: the memory planner against measured peaks.

For each debug config (FSDP2, context parallelism, tensor parallelism with and without sequence
parallelism, the sliced pipeline with and without activation offload, expert parallelism, an
upcycled MoE), the planner's per-rank peak (`python -m pipekit.memory_plan`) is compared with
what the ranks of a real run hold: each rank (a gloo process forked from the command; the
measure counts the tensors a step creates, so what a fork inherits does not enter it) builds
the trainer, runs one step (so optimizer states exist), then measures the second step with
`PeakTensorMemory` (every tensor the step creates: activations, gradients, FSDP2's gathered
parameters, messages, the optimizer's temporaries). Measured peak = local parameter shards +
optimizer states + that step's peak. The runs use a short sequence (`--seq-len`) and the
configs' own layouts and batch sizes.

RESULT: plan_max_rel_err, the largest |plan - measured| / measured over configs and ranks.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipekit.bench.report import machine_description, print_result, print_table
from pipekit.config.loader import load_job_config
from pipekit.memory.live_tensors import PeakTensorMemory
from pipekit.memory_plan.memory import plan_memory
from pipekit.models.registry import get_model_spec
from pipekit.testing.ranks import run_on_ranks
from pipekit.train.job import validate_job
from pipekit.train.metrics import tensor_bytes

__all__ = ["main"]

_REPO = Path(__file__).resolve().parents[2]
_CONFIGS = {
    "fsdp": ("configs/debug_model.toml", 2, ()),
    "context parallel": (
        "configs/debug_model.toml",
        2,
        ("--parallelism.dp_shard", "1", "--parallelism.cp", "2"),
    ),
    "tensor parallel": (
        "configs/debug_model.toml",
        2,
        (
            "--parallelism.dp_shard",
            "1",
            "--parallelism.tp",
            "2",
            "--parallelism.sequence_parallel",
            "false",
        ),
    ),
    "tensor + sequence parallel": (
        "configs/debug_model.toml",
        2,
        ("--parallelism.dp_shard", "1", "--parallelism.tp", "2"),
    ),
    "sliced pipeline": ("configs/debug_sliced_pp.toml", 2, ()),
    "sliced pipeline + offload": (
        "configs/debug_sliced_pp.toml",
        2,
        ("--parallelism.activation_offload", "0.9"),
    ),
    "expert parallel": ("configs/debug_moe.toml", 2, ()),
    "upcycled": ("configs/debug_upcycle.toml", 2, ()),
}
"""Name -> (config, ranks, overrides)."""
_MIB = 2**20


def _overrides(folder: str, seq_len: int, dense: str) -> list[str]:
    return [
        "--job.output_dir", folder,
        "--training.seq_len", str(seq_len),
        "--checkpoint.enable", "false",
        "--checkpoint.export_hf_at_end", "false",
        "--checkpoint.initial_load_path", dense,
        "--metrics.peak_flops", "1e12",
    ]  # fmt: skip


def _argv(name: str, options: argparse.Namespace, folder: str, dense: str) -> list[str]:
    path, _, extra = _CONFIGS[name]
    upcycled = name == "upcycled"
    return [
        "--config",
        str(_REPO / path),
        *_overrides(folder, options.seq_len, dense if upcycled else ""),
        *extra,
    ]


def _rank_worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    from pipekit.train.trainer import Trainer

    job = validate_job(load_job_config(spec["argv"]), num_ranks)
    trainer = Trainer(job)
    trainer.train_step()
    static = tensor_bytes(trainer.model, trainer.optimizer)  # no gradients between steps
    with PeakTensorMemory() as memory:
        trainer.train_step()
    pipeline_rank = trainer.pipeline.stages[0].group_rank if trainer.pipeline else 0
    return {"pipeline_rank": pipeline_rank, "measured": static + memory.peak_bytes}


def _dense_checkpoint(directory: Path) -> None:
    """The debug Llama, seeded, in Hugging Face layout (what the upcycled config starts from)."""
    llama = get_model_spec("llama")
    args = llama.flavor("debug")
    with torch.device("meta"):
        model = llama.build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert llama.hf is not None
    llama.hf.save(model, args, str(directory))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench plan-accuracy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per config")
    parser.add_argument(
        "--configs",
        default=",".join(_CONFIGS),
        help=f"comma-separated subset of: {', '.join(_CONFIGS)} (default: all)",
    )
    options = parser.parse_args(argv)
    chosen = [name.strip() for name in options.configs.split(",")]
    unknown = [name for name in chosen if name not in _CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose among {', '.join(_CONFIGS)}")
    print(machine_description(), flush=True)
    folder = tempfile.mkdtemp(prefix="pipekit-plan-accuracy-")
    rows, errors = [], []
    try:
        dense = str(Path(folder, "dense"))
        _dense_checkpoint(Path(dense))
        for name in chosen:
            ranks = _CONFIGS[name][1]
            argv_ = _argv(name, options, str(Path(folder, name.replace(" ", "_"))), dense)
            plan = plan_memory(validate_job(load_job_config(argv_), ranks, check_files=False))
            planned = {memory.layout.pipeline_rank: memory for memory in plan.ranks}
            results = run_on_ranks(_rank_worker, ranks, {"argv": argv_}, timeout=options.timeout)
            for rank, result in enumerate(results):
                memory = planned[result["pipeline_rank"]]
                error = (memory.peak - result["measured"]) / result["measured"]
                errors.append(abs(error))
                terms = [value / _MIB for value in memory.terms().values()]
                rows.append([name, rank, *terms, memory.peak / _MIB,
                             result["measured"] / _MIB, error])  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_table(
        ["config", "rank", "params MiB", "grads MiB", "optim MiB", "activ MiB", "buffers MiB",
         "plan peak MiB", "measured MiB", "rel err"],
        rows,
    )  # fmt: skip
    print_result(plan_max_rel_err=max(errors))
