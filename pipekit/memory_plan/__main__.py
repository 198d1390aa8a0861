"""`python -m pipekit.memory_plan --config x.toml --world-size N [--device-memory 80GiB] [...]`.

Checks the config for N ranks (everything but the files it names, which live where the job
runs), builds every pipeline rank's share of the model on the meta device, measures the
blocks' activations, and prints each rank's parameters, gradients, optimizer states,
activations, communication buffers and peak beside the device memory. A plan that does not fit
exits with status 2 and one line naming the rank, its largest term and what shrinks it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from pipekit.config.loader import ConfigError, load_job_config
from pipekit.memory_plan.memory import MemoryPlan, RankMemory, plan_memory
from pipekit.text_table import format_table
from pipekit.train.job import Job, validate_job

__all__ = ["main", "parse_bytes"]

_GIB = 2**30
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_FIX = {
    "parameters": "shard them over more ranks (dp_shard), or split the model into more "
    "pipeline stages (pipeline_parallel_degree)",
    "gradients": "shard them over more ranks (dp_shard) or more pipeline stages",
    "optimizer states": "shard them over more ranks (dp_shard), or use optimizer.name = "
    '"AdamW8bit"',
    "activations": "set training.activation_checkpoint, lower global_batch_size per rank, "
    'slice sequences (pipeline_schedule = "sliced", more num_slices), or, in a pipeline, '
    "offload them (parallelism.activation_offload)",
    "communication buffers": "wrap smaller units (FSDP2 gathers one block at a time), or shard "
    "the largest layer over more pipeline ranks (vocab_parallel)",
}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1.5e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if match is None or (match[2] is not None and match[2].upper() not in _UNITS):
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB or 141GB")
    return int(float(match[1]) * _UNITS[(match[2] or "").upper()])


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.memory_plan",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks the job runs on")
    parser.add_argument(
        "--device-memory", default="80GiB", help="memory of one device (default 80GiB: H100)"
    )
    return parser.parse_known_args(argv)


def describe(plan: MemoryPlan, device_memory: int) -> str:
    """The per-rank table, in GiB (MiB for a plan under 1 GiB)."""
    unit, name = (_GIB, "GiB") if plan.peak >= _GIB else (2**20, "MiB")
    terms = [f"{term} {name}" for term in plan.ranks[0].terms()]
    headers = ["rank", "stages", *terms, f"peak {name}", f"device {name}", "fits"]
    rows = []
    for rank in plan.ranks:
        stages = ",".join(map(str, rank.layout.stages)) or "-"
        values = [f"{value / unit:.2f}" for value in rank.terms().values()]
        fits = "yes" if rank.peak <= device_memory else "NO"
        rows.append([str(rank.layout.rank), stages, *values, f"{rank.peak / unit:.2f}",
                     f"{device_memory / unit:.2f}", fits])  # fmt: skip
    return format_table(headers, rows)


def _without_offload(job: Job, plan: MemoryPlan, device_memory: int) -> str:
    """The offload ratios, and what the same job would need without them."""
    assert job.pipeline is not None
    pipeline = job.pipeline
    ratios = ", ".join(f"{ratio:g}" for ratio in pipeline.feature_plans["activation_offload"])
    plain_pipeline = pipeline.without_feature("activation_offload")
    plain = plan_memory(dataclasses.replace(job, pipeline=plain_pipeline), profile=plan.profile)
    lines = [f"\nactivation offload per pipeline rank: {ratios}"]
    over = [rank for rank in plain.ranks if rank.peak > device_memory]
    if not over:
        lines.append(f"without it the plan fits too (peak {plain.peak / _GIB:.2f} GiB)")
        return "\n".join(lines)
    worst = max(over, key=lambda rank: rank.peak)
    lines.append(
        f"without it {len(over)} of {len(plain.ranks)} pipeline ranks would not fit: rank "
        f"{worst.layout.rank} would need {worst.peak / _GIB:.2f} GiB (activations "
        f"{worst.activations / _GIB:.2f} GiB)"
    )
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= _GIB else f"{nbytes / 2**20:.1f} MiB"


def refusal(rank: RankMemory, device_memory: int) -> str:
    """One line: which rank does not fit, its largest term and what shrinks it (the model
    state first, when it alone is too large)."""
    terms = rank.terms()
    state = rank.parameters + rank.gradients + rank.optimizer
    needs = f"rank {rank.layout.rank} needs {_size(rank.peak)} of {_size(device_memory)}"
    if state > device_memory:
        return (
            f"{needs}; parameters, gradients and optimizer states alone take {_size(state)}: "
            f"{_FIX['parameters']}"
        )
    largest = max(terms, key=terms.__getitem__)
    return f"{needs}; its largest term is {largest} ({_size(terms[largest])}): {_FIX[largest]}"


def main(argv: list[str]) -> None:
    options, config_argv = _parse(argv)
    try:
        device_memory = parse_bytes(options.device_memory)
        job = validate_job(load_job_config(config_argv), options.world_size, check_files=False)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    dims = job.dims
    extras = []
    if dims.tp > 1 and job.config.parallelism.sequence_parallel:
        extras.append("sequence parallel")
    if job.pipeline is not None:
        extras.append(f"{job.pipeline.schedule} schedule, {job.pipeline.num_slices} slices")
    print(
        f"{job.config.job.name}: {job.spec.name} {job.config.model.flavor} on {dims.world_size} "
        f"ranks (pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x "
        f"cp {dims.cp} x tp {dims.tp}, ep {dims.ep}{''.join(', ' + e for e in extras)}); "
        f"{job.local_batch_size} x {job.config.training.seq_len} tokens per data rank and "
        f"micro-step; compute {job.config.training.mixed_precision_param}; one row per "
        "pipeline rank (its data-parallel peers hold the same)\n",
        flush=True,
    )
    plan = plan_memory(job)
    print(describe(plan, device_memory))
    if job.pipeline is not None and "activation_offload" in job.pipeline.features:
        print(_without_offload(job, plan, device_memory))
    over = [rank for rank in plan.ranks if rank.peak > device_memory]
    if over:
        print(f"error: {refusal(max(over, key=lambda r: r.peak), device_memory)}", file=sys.stderr)
        raise SystemExit(2)
    print(f"\nfits: peak {plan.peak / _GIB:.2f} GiB of {device_memory / _GIB:.2f} GiB per device")


if __name__ == "__main__":
    main(sys.argv[1:])
