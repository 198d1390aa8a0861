"""`python -m pipekit.bench pipeline-memory --model deepseek_v3 --pp 2 --slices 4 --seq 2048`.

The KV cache of the sliced pipeline for multi-head latent attention that caches the latent
against the same model caching expanded per-head K/V. One training step of the sliced schedule
(v = 1) on `--pp` gloo ranks for each of DeepSeek-V3's two attention forms
(`attention_cache = "latent"` / `"expanded"`), same weights and batch: the peak bytes of the
chunked KV cache and of everything autograd saves, per rank, and the loss of each (equal:
the two forms are one function). The ratio of the cache peaks is compared with the formula
`(kv_lora_rank + qk_rope_head_dim) / (2 x heads x head_dim)`, head_dim being the key's
(values are padded to it; against unpadded values the denominator is heads x (qk + v)).
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch.distributed as dist

from pipekit.bench._pipeline_launch import (
    bench_model,
    build_runner,
    describe_model,
    run_ranks,
    synthetic_batch,
)
from pipekit.bench.report import print_result, print_table
from pipekit.memory.tracker import ActivationMemoryTracker

__all__ = ["add_latent_cache_arguments", "run_latent_cache_comparison"]

_MIB = 2**20
_FORMS = ("expanded", "latent")


def add_latent_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """--model: compare a latent-attention family's two KV cache forms instead."""
    parser.add_argument(
        "--model",
        choices=["llama", "deepseek_v3"],
        default="llama",
        help="deepseek_v3: compare its latent KV cache with expanded K/V under the sliced "
        "schedule (the model's MLA dims are its debug flavor's; --dim, --heads, --layers, "
        "--vocab apply)",
    )


def latent_cache_spec(options: argparse.Namespace, seq_len: int) -> dict[str, Any]:
    """The bench's DeepSeek-V3 (its debug flavor with the shape options), validated."""
    spec = {
        "family": "deepseek_v3",
        "dim": options.dim,
        "n_layers": options.layers,
        "n_heads": options.heads,
        "vocab_size": options.vocab,
        "max_seq_len": seq_len,
    }
    bench_model(spec)  # raises ValueError on an impossible shape
    return spec


def _measure(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: one tracked sliced step per attention form on this rank."""
    measurements = {}
    microbatches, num_slices = spec["microbatches"], spec["slices"]
    for form in _FORMS:
        model = spec["model"] | {"attention_cache": form}
        batch = synthetic_batch(microbatches, model["max_seq_len"], model["vocab_size"])
        runner = build_runner(
            model,
            schedule="sliced",
            stages_per_rank=1,
            rank=rank,
            num_ranks=num_ranks,
            microbatches=microbatches,
            num_slices=num_slices,
            rows=microbatches,
        )
        params = [p for stage in runner.stages for p in stage.submod.parameters()]
        dist.barrier()
        with ActivationMemoryTracker(exclude=params) as tracker:
            losses = runner.step(batch, float(batch["labels"].numel()))
        report = tracker.report()
        loss = None if losses is None else float(losses)
        measurements[form] = {
            "kv_cache": report.peak_kv_cache_bytes,
            "saved": report.peak_saved_bytes,
            "loss": loss,
        }
        del runner, params, batch
        gc.collect()
    return {"rank": rank, "measurements": measurements}


def run_latent_cache_comparison(options: argparse.Namespace) -> None:
    """Measure both forms on `options.pp` ranks; print the table and the RESULT line."""
    spec = {
        "model": latent_cache_spec(options, options.seq),
        "microbatches": options.microbatches,
        "slices": options.slices,
    }
    _, args = bench_model(spec["model"])
    print(describe_model(spec["model"]))
    latent_dims = args.kv_lora_rank + args.qk_rope_head_dim
    key_dim = max(args.per_head_dim, args.v_head_dim)
    print(
        f"MLA: latent {args.kv_lora_rank} + RoPE key {args.qk_rope_head_dim} per token; "
        f"expanded: {args.n_heads} heads x (key {args.per_head_dim} + value {args.v_head_dim}, "
        f"padded to {key_dim}); sliced v=1, p={options.pp}, m={options.microbatches}, "
        f"n={options.slices}, 1 x {options.seq} tokens per microbatch"
    )
    ranks = run_ranks(f"{__name__}:_measure", options.pp, spec, timeout=options.timeout)
    rows = []
    for rank_result in ranks:
        for form in _FORMS:
            row = rank_result["measurements"][form]
            loss = "" if row["loss"] is None else f"{row['loss']:.6f}"
            rows.append(
                [rank_result["rank"], form, row["kv_cache"] / _MIB, row["saved"] / _MIB, loss]
            )
    print_table(["rank", "KV cache form", "KV cache MiB", "saved MiB", "loss"], rows)
    first = ranks[0]["measurements"]
    last = ranks[-1]["measurements"]
    print_result(
        mla_cache_vs_expanded=first["latent"]["kv_cache"] / first["expanded"]["kv_cache"],
        formula=latent_dims / (2 * args.n_heads * key_dim),
        unpadded_formula=latent_dims / (args.n_heads * (args.per_head_dim + args.v_head_dim)),
        saved_latent_vs_expanded=first["latent"]["saved"] / first["expanded"]["saved"],
        loss_difference=abs(last["latent"]["loss"] - last["expanded"]["loss"]),
    )
