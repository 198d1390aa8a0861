"""What the pipeline benchmarks share: fresh-interpreter gloo ranks, the model, the batch.

`run_ranks` starts each rank as a new Python interpreter (`python -m
pipekit.bench._pipeline_launch`), not a fork: glibc reads `GLIBC_TUNABLES` only when a process
starts, so an allocator setting must be in a rank's environment from its first instruction
(otherwise full-sequence schedules pay page faults that sliced ones avoid). Ranks meet through a
FileStore in a fresh temporary folder, run one intra-op thread each, call the worker
`"module:function"(rank, num_ranks, spec)` with the JSON-able `spec`, meet at a barrier before
the group is destroyed, and write the worker's dict as JSON; the parent returns those dicts in
rank order. A rank that fails ends the others and raises with its stderr.

Timing benches pin each rank to cores of its own (`rank_core_sets`) when there are at least as
many cores as ranks: a rank then stands for one device, and the threads it starts (context
exchange's serving threads, gloo's) share its cores instead of taking another rank's.

Legend: B batch rows, S sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipekit.attention.document_lengths import positions_in_documents
from pipekit.attention.kernels.backends import attention_work_block
from pipekit.config.job_config import JobConfig, ModelConfig, ParallelismConfig, TrainingConfig
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.distributed.process_group import exit_process
from pipekit.models.materialize import seeded_materializer
from pipekit.models.registry import get_model_spec
from pipekit.models.spec import ModelSpec
from pipekit.pipelining.build import StageSetup, build_pipeline
from pipekit.pipelining.plan import PipelinePlan, plan_pipeline
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.pipelining.schedules.sliced import check_sliced_shape
from pipekit.train.activation_checkpoint import (
    apply_activation_checkpointing,
    check_checkpoint_with_schedule,
)
from pipekit.train.job import Job
from pipekit.train.metrics import attention_to_linear_flops

__all__ = [
    "RankFailedError",
    "add_model_arguments",
    "add_pinning_argument",
    "add_pipeline_arguments",
    "bench_job",
    "bench_plan",
    "build_runner",
    "check_pipeline_shape",
    "describe_model",
    "describe_pinning",
    "describe_slices",
    "model_spec",
    "rank_core_sets",
    "run_ranks",
    "synthetic_batch",
]

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_SEED = 0


class RankFailedError(RuntimeError):
    """A rank exited non-zero or did not finish in time; the message holds its stderr tail."""


def run_ranks(
    worker: str,
    num_ranks: int,
    spec: Mapping[str, Any],
    *,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 1800.0,
    cores: Sequence[Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Run `worker` ("module:function") on `num_ranks` fresh gloo ranks; their dicts by rank.

    `env` changes the ranks' environment: a value sets a variable, None removes it. `cores`
    (one list per rank, `rank_core_sets`) pins each rank's threads to its cores.
    """
    if cores is not None and len(cores) != num_ranks:
        raise ValueError(f"cores has {len(cores)} sets for {num_ranks} ranks")
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [_REPO_ROOT, *filter(None, [child_env.get("PYTHONPATH")])]
    )
    for name, value in (env or {}).items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    with tempfile.TemporaryDirectory(prefix="pipekit-bench-") as folder:
        spec_path = os.path.join(folder, "spec.json")
        with open(spec_path, "w") as handle:
            pinned = None if cores is None else [list(rank_cores) for rank_cores in cores]
            json.dump({"worker": worker, "spec": spec, "cores": pinned}, handle)
        processes, logs = [], []
        for rank in range(num_ranks):
            log = open(os.path.join(folder, f"rank{rank}.log"), "w+b")  # noqa: SIM115
            logs.append(log)
            command = [sys.executable, "-m", __name__, folder, str(rank), str(num_ranks)]
            processes.append(
                subprocess.Popen(command, env=child_env, stdout=log, stderr=subprocess.STDOUT)
            )
        try:
            _wait_all(processes, logs, timeout)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for log in logs:
                log.close()
        results = []
        for rank in range(num_ranks):
            with open(os.path.join(folder, f"rank{rank}.json")) as handle:
                results.append(json.load(handle))
        return results


def rank_core_sets(num_ranks: int, pin: bool = True) -> list[list[int]] | None:
    """This process's usable cores split into `num_ranks` disjoint, equal, contiguous sets (the
    rest unused); None when not `pin`, when there are fewer cores than ranks, or when there is
    no way to pin (not Linux)."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    available = sorted(os.sched_getaffinity(0))
    per_rank = len(available) // num_ranks
    if per_rank == 0:
        return None
    return [available[rank * per_rank : (rank + 1) * per_rank] for rank in range(num_ranks)]


def describe_pinning(cores: Sequence[Sequence[int]] | None) -> str:
    """How the ranks were placed, for a bench's header."""
    if cores is None:
        return "ranks not pinned"
    return "ranks pinned to cores " + ", ".join(
        "{" + ",".join(map(str, rank_cores)) + "}" for rank_cores in cores
    )


def _wait_all(processes: list[subprocess.Popen], logs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(process.poll() is None for process in processes):
        failed = [r for r, process in enumerate(processes) if process.poll() not in (None, 0)]
        if failed:
            time.sleep(1.0)  # let the failed rank's peers report their side too
            raise RankFailedError("\n".join(_log_tail(rank, logs[rank]) for rank in failed))
        if time.monotonic() > deadline:
            raise RankFailedError(
                f"ranks did not finish within {timeout:.0f} s (raise --timeout for big runs)\n"
                + "\n".join(_log_tail(rank, log) for rank, log in enumerate(logs))
            )
        time.sleep(0.05)
    failed = [r for r, process in enumerate(processes) if process.returncode != 0]
    if failed:
        raise RankFailedError("\n".join(_log_tail(rank, logs[rank]) for rank in failed))


def _log_tail(rank: int, log: Any, chars: int = 4000) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace")[-chars:]
    return f"rank {rank} failed; its output ends with:\n{text}"


def _rank_main(folder: str, rank: int, num_ranks: int) -> None:
    """Body of one rank process (see the module docstring)."""
    torch.set_num_threads(1)
    with open(os.path.join(folder, "spec.json")) as handle:
        job = json.load(handle)
    if job["cores"] is not None:  # before gloo starts its threads, so they inherit it
        os.sched_setaffinity(0, job["cores"][rank])
    module_name, function_name = job["worker"].split(":")
    worker = getattr(importlib.import_module(module_name), function_name)
    store = dist.FileStore(os.path.join(folder, "store"), num_ranks)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=num_ranks, timeout=timedelta(minutes=30)
    )
    try:
        result = worker(rank, num_ranks, job["spec"])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    path = os.path.join(folder, f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".tmp", path)


def add_pipeline_arguments(
    parser: argparse.ArgumentParser, *, pp: int, slices: int, microbatches: int, seq: int
) -> None:
    """--pp, --slices, --microbatches, --seq and --timeout, shared by the pipeline benches."""
    parser.add_argument("--pp", type=int, default=pp, help="pipeline ranks p")
    parser.add_argument("--slices", type=int, default=slices, help="slices per sequence n (sliced)")
    parser.add_argument(
        "--microbatches", type=int, default=microbatches, help="microbatches m per step"
    )
    parser.add_argument("--seq", type=int, default=seq, help="sequence length S")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for all ranks")


def add_pinning_argument(parser: argparse.ArgumentParser) -> None:
    """--no-pin, for the timing benches that pin each rank to cores of its own."""
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="let the OS place the ranks' threads on any core (default: each rank on its own)",
    )


def add_model_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """--dim, --layers, --heads, --kv-heads, --ffn-dim, --vocab (a small Llama; float32)."""
    group = parser.add_argument_group("model (Llama, float32, random weights)")
    group.add_argument("--dim", type=int, default=defaults["dim"], help="model dimension")
    group.add_argument(
        "--layers", type=int, default=defaults.get("layers"), help="transformer blocks"
    )
    group.add_argument("--heads", type=int, default=defaults["heads"], help="query heads")
    group.add_argument("--kv-heads", type=int, default=defaults["kv_heads"], help="K/V heads")
    group.add_argument("--ffn-dim", type=int, default=defaults["ffn_dim"], help="SwiGLU width")
    group.add_argument("--vocab", type=int, default=defaults["vocab"], help="vocabulary size")


def model_spec(options: argparse.Namespace, seq_len: int) -> dict[str, int]:
    """The JSON-able LlamaArgs fields of the parsed model options (validated here)."""
    spec = {
        "dim": options.dim,
        "n_layers": options.layers,
        "n_heads": options.heads,
        "n_kv_heads": options.kv_heads,
        "ffn_dim": options.ffn_dim,
        "vocab_size": options.vocab,
        "max_seq_len": seq_len,
    }
    bench_model(spec)  # raises ValueError on an impossible shape
    return spec


def describe_model(spec: Mapping[str, Any]) -> str:
    """One line: the model's shape and parameter count."""
    family, args = bench_model(spec)
    with torch.device("meta"):
        params = sum(p.numel() for p in family.build(args).parameters())
    return (
        f"{family.name} dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads "
        f"({args.num_kv_heads} kv, head dim {args.per_head_dim}), ffn {args.ffn_dim}, "
        f"vocab {args.vocab_size}, {params / 1e6:.2f} M parameters, float32"
    )


def describe_slices(plan: PipelinePlan) -> str:
    """One line: the plan's slice lengths and the FLOPs ratio they were placed by."""
    lengths = ", ".join(str(length) for length in plan.slice_lengths)
    return (
        f"{plan.num_slices} slices of {plan.slice_bounds[-1]} tokens: {lengths} (causal "
        f"attention / matmul FLOPs = {plan.attention_to_linear:.3g})"
    )


def bench_model(spec: Mapping[str, Any]) -> tuple[ModelSpec, Any]:
    """The family and args of a bench's model: `spec["family"]`'s debug flavor (default:
    Llama) with `spec`'s other fields, plain RoPE of theta 10000."""
    fields = dict(spec)
    family = get_model_spec(fields.pop("family", "llama"))
    debug = family.flavor("debug")
    return family, dataclasses.replace(debug, **fields, rope_scaling=None, rope_theta=10000.0)


def check_pipeline_shape(
    *,
    num_ranks: int,
    microbatches: int,
    num_slices: int,
    seq_len: int,
    num_layers: int,
    stages_per_rank: int,
) -> None:
    """The constraints every compared schedule needs, as ValueErrors that say how to fix them."""
    if seq_len < 1:
        raise ValueError(f"--seq={seq_len} must be at least 1")
    check_sliced_shape(num_ranks, microbatches, num_slices, stages_per_rank)
    if num_ranks < 2:
        raise ValueError(f"--pp={num_ranks} must be at least 2: a pipeline needs two ranks")
    if seq_len % num_slices:
        raise ValueError(
            f"--seq={seq_len} must split into --slices={num_slices} equal slices; use a multiple "
            f"of {num_slices}"
        )
    if microbatches < num_ranks:
        raise ValueError(
            f"--microbatches={microbatches} must be at least --pp={num_ranks}: torch's 1F1B "
            "baseline needs one microbatch per stage"
        )
    needed = num_ranks * stages_per_rank
    if num_layers < needed:
        raise ValueError(
            f"--layers={num_layers} is too few for {needed} stages (--pp={num_ranks} x "
            f"{stages_per_rank} stages per rank); use --layers {needed} or more"
        )


def _plan_and_model(
    spec: Mapping[str, Any],
    *,
    schedule: str,
    stages_per_rank: int,
    num_ranks: int,
    microbatches: int,
    num_slices: int,
    rows: int,
    **settings: Any,
) -> tuple[PipelinePlan, nn.Module, ParallelismConfig]:
    """The plan, the whole model on the meta device it was planned from (its FLOPs place
    equal-cost slices; the builder splits it into stages), and the `[parallelism]` section a
    job config would write for it (`settings`: any other of its fields, as a config sets them)."""
    parallelism = ParallelismConfig(
        dp_shard=1,
        pipeline_parallel_degree=num_ranks,
        pipeline_schedule=schedule,
        num_slices=num_slices,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        pipeline_embedding_cost=0.0,
        pipeline_output_cost=0.0,
        **settings,
    )
    family, args = bench_model(spec)
    with torch.device("meta"):
        model = family.build(args)
    shape, seq_len = family.shape(args), args.max_seq_len
    ratio = attention_to_linear_flops(model, shape, family.structure, seq_len)
    plan = plan_pipeline(
        parallelism, family.structure, shape, rows, seq_len, attention_to_linear=ratio,
        attention_work_block=attention_work_block("cpu"),
    )  # fmt: skip
    return plan, model, parallelism


def bench_plan(spec: Mapping[str, Any], **keywords: Any) -> PipelinePlan:
    """The plan of `schedule` over an evenly split Llama (equal layers per stage).

    `keywords`: `schedule`, `stages_per_rank`, `num_ranks`, `microbatches`, `num_slices`,
    `rows` (the local batch), and optionally any other `[parallelism]` setting (a pipeline
    feature's, `activation_offload`, `slicing`: equal-cost slices balance the model's FLOPs).
    Embedding and output get no extra weight in the split: SlimPipe's Table 2 compares equal
    stages, and so do the throughput figures (a feature that holds them itself, as vocabulary
    parallelism does, splits their rows over the ranks instead).
    """
    return _plan_and_model(spec, **keywords)[0]


def bench_job(
    spec: Mapping[str, Any], *, activation_checkpoint: str = "none", **keywords: Any
) -> Job:
    """The job a config would make of `bench_plan(spec, **keywords)` with `activation_checkpoint`
    (the memory plan predicts its peaks): the bench model, float32, the local batch as the
    global one, one pipeline rank per process."""
    plan, _, parallelism = _plan_and_model(spec, **keywords)
    check_checkpoint_with_schedule(activation_checkpoint, plan.schedule, plan.splits_backward)
    family, args = bench_model(spec)
    training = TrainingConfig(
        seq_len=args.max_seq_len,
        global_batch_size=keywords["rows"],
        activation_checkpoint=activation_checkpoint,
    )
    config = JobConfig(
        model=ModelConfig(name=family.name, vocab_size=args.vocab_size),
        training=training,
        parallelism=parallelism,
    )
    p = plan.num_ranks
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=p, ep=1, world_size=p)
    return Job(config, family, args, family.shape(args), None, dims, plan, keywords["rows"])


def build_runner(
    spec: Mapping[str, Any], *, rank: int, activation_checkpoint: str = "none", **keywords: Any
) -> PipelineRunner:
    """This rank's runner of `bench_plan(spec, **keywords)`, by the one pipeline builder, its
    blocks checkpointed as `activation_checkpoint` says (the `[training]` setting); every rank
    of the world calls it together. Every stage gets the same seeded weights whatever the
    schedule."""
    del rank  # the mesh knows it
    plan, model, _ = _plan_and_model(spec, **keywords)
    mesh = init_device_mesh("cpu", (plan.num_ranks,), mesh_dim_names=("pp",))
    materialize = seeded_materializer("cpu", _SEED)
    family = bench_model(spec)[0]
    checkpointing = TrainingConfig(activation_checkpoint=activation_checkpoint)

    def parallelize(stage: nn.Module) -> None:
        apply_activation_checkpointing(family.structure.named_blocks_of(stage), checkpointing)

    setup = StageSetup(
        device=torch.device("cpu"),
        materialize=materialize,
        attention_backend="cpu",
        parallelize=parallelize,
    )
    return build_pipeline(plan, model, mesh, setup)


def synthetic_batch(
    rows: int, seq_len: int, vocab_size: int, document_ids_BS: torch.Tensor | None = None
) -> TensorDict:
    """Random tokens and labels `[B, S]`: one document per row (positions 0..S-1), or the
    packed documents `document_ids_BS` says (positions restart at each)."""
    generator = torch.Generator().manual_seed(_SEED)
    tokens_BS = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    labels_BS = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    if document_ids_BS is None:
        positions_BS = torch.arange(seq_len).expand(rows, seq_len).contiguous()
        fields = {}
    else:
        positions_BS = positions_in_documents(document_ids_BS).contiguous()
        fields = {"document_ids": document_ids_BS}
    return TensorDict(
        tokens=tokens_BS,
        labels=labels_BS,
        positions=positions_BS,
        **fields,
        batch_size=[rows, seq_len],
    )


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    exit_process(0)  # the result is written; see exit_process for why not a plain return
