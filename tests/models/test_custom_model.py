"""A model defined outside pipekit (examples/custom_model: GPT-2 style, learned positions,
LayerNorm, GELU, MoE every other block) trains through the model contract alone: under FSDP
(2 ranks) and under the 2-rank sliced pipeline with context exchange and vocabulary
parallelism, its loss and every gradient equal the single-process step on the same microbatches
(float64, 1e-10), MoE auxiliary losses on. With ALiBi on its even layers it does so under
tensor parallelism, context parallelism (the automatic variant and Ulysses) and the sliced
pipeline with context exchange. Ablations: the runner without its auxiliary-loss scaling, a
structure that puts the final norm on the wrong stage, every tp rank biasing its heads by the
first heads' slopes, and the KV cache's earlier slices attended without the bias. The registry
keeps the built-in families when a user registers first, and the job runs from its config
file."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import examples.custom_model.model as custom
import pipekit.attention.kv_cache as kv_cache_module
from pipekit.layers import HeadValues
from pipekit.moe import MoEArgs
from pipekit.testing import (
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    run_on_ranks,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-10
ARGS = custom.TinyGPTArgs(dim=32, n_layers=4, n_heads=2, vocab_size=61, max_seq_len=32)
NO_AUX = dataclasses.replace(ARGS, moe=MoEArgs(num_experts=4, top_k=2, load_balance_weight=0))
ROWS, SEQ_LEN, MICROBATCHES, SLICES = 4, 16, 2, 4
SLICED = {
    "pipeline_schedule": "sliced",
    "num_slices": SLICES,
    "microbatches": MICROBATCHES,
    "context_exchange": True,
    "vocab_parallel": True,
}


def _batch():
    return parity_batch(ARGS.vocab_size, ROWS, SEQ_LEN)


def _cases(rank: int, world: int, ablation: str = "") -> list:
    """FSDP, then the sliced pipeline (aux losses on, then off), on one process group."""
    import pipekit.pipelining.runtime.unit_step as unit_step_module

    spec = custom.TINY_GPT
    if ablation == "no_aux_scaling":
        unit_step_module.aux_loss_scale = lambda scale: nullcontext()
    if ablation == "norm_on_the_first_stage":
        wrong = dataclasses.replace(spec.structure, before_blocks=("wpe", "ln_f"), after_blocks=())
        spec = dataclasses.replace(spec, structure=wrong)
    return [
        data_parallel_step(rank, world, custom.TINY_GPT, ARGS, _batch()),
        pipeline_step(rank, world, spec, ARGS, _batch(), **SLICED),
        pipeline_step(rank, world, spec, NO_AUX, _batch(), **SLICED),
    ]


@pytest.fixture(scope="module")
def references() -> list:
    spec = custom.TINY_GPT
    return [
        reference_step(spec, ARGS, _batch(), microbatches=2),  # each data-parallel rank's rows
        reference_step(spec, ARGS, _batch(), microbatches=MICROBATCHES),
        reference_step(spec, NO_AUX, _batch()),  # the whole batch at once
    ]


def _differences(references: list, ablation: str = "") -> list[float]:
    per_rank = run_on_ranks(_cases, 2, ablation, timeout=180)
    return [
        max_relative_difference([results[index] for results in per_rank], reference)
        for index, reference in enumerate(references)
    ]


def test_custom_model_matches_one_process_under_fsdp_and_the_sliced_pipeline_fp64(references):
    fsdp, sliced, sliced_without_aux = _differences(references)
    assert fsdp <= TOLERANCE, fsdp
    assert sliced <= TOLERANCE, sliced
    assert sliced_without_aux <= TOLERANCE, sliced_without_aux


@pytest.mark.parametrize("ablation", ["no_aux_scaling", "norm_on_the_first_stage"])
def test_breaking_the_aux_scaling_or_the_structure_breaks_parity(references, ablation: str):
    _, sliced, sliced_without_aux = _differences(references, ablation)
    assert sliced > 1e-6
    if ablation == "norm_on_the_first_stage":
        assert sliced_without_aux > 1e-6


ALIBI_ARGS = dataclasses.replace(ARGS, n_heads=4, alibi=True)
"""ALiBi on layers 0 and 2; 4 heads, so each tp rank holds two with slopes of their own."""
ALIBI_LAYOUTS = {
    "tp 2": {"tp": 2},
    "tp 2, first heads' slopes on every rank": {"tp": 2},
    "cp 2": {"cp": 2},
    "cp 2 ulysses": {"cp": 2, "cp_variant": "ulysses"},
    "sliced pipeline, exchange": SLICED,
    "sliced pipeline, cached slices unbiased": {**SLICED, "context_exchange": False},
}


_SLOPES, _BLOCK_MASK = HeadValues.forward, kv_cache_module.block_mask


def _first_heads_slopes(self: HeadValues) -> torch.Tensor:
    """Ablation: a wrong head offset, every tp rank reading the first heads' slopes."""
    local_H = _SLOPES(self)
    return torch.tensor(self.values[: local_H.shape[0]], dtype=local_H.dtype)


def _earlier_slices_unbiased(pattern, q_start, q_length, kv_start, *rest):
    """Ablation: a slice's queries meet the earlier slices' keys without the score bias."""
    if pattern is not None and kv_start != q_start:
        pattern = dataclasses.replace(pattern, score_bias=None, bias_H=None)
    return _BLOCK_MASK(pattern, q_start, q_length, kv_start, *rest)


def _alibi_cases(rank: int, world: int) -> dict:
    """Every ALiBi layout on one process group; the ablations break one mechanism each."""
    results = {}
    for name, layout in ALIBI_LAYOUTS.items():
        if "first heads" in name:
            HeadValues.forward = _first_heads_slopes
        if "unbiased" in name:
            kv_cache_module.block_mask = _earlier_slices_unbiased
        try:
            step = pipeline_step if "pipeline" in name else data_parallel_step
            results[name] = step(rank, world, custom.TINY_GPT, ALIBI_ARGS, _batch(), **layout)
        finally:
            HeadValues.forward, kv_cache_module.block_mask = _SLOPES, _BLOCK_MASK
    return results


def test_alibi_model_matches_one_process_under_tp_cp_and_the_sliced_pipeline_fp64() -> None:
    """The example with ALiBi on its even layers: tp 2 (each rank its heads' slopes), cp 2 and
    the sliced pipeline with context exchange and vocabulary parallelism equal one process
    (loss and every gradient, float64); a wrong head offset under tp, or the earlier slices'
    keys attended without the bias, do not. The bias is in effect: without it the model
    computes something else."""
    per_rank = run_on_ranks(_alibi_cases, 2, timeout=300)
    spec = custom.TINY_GPT
    whole = reference_step(spec, ALIBI_ARGS, _batch())  # tp and cp: one data rank
    sliced = reference_step(spec, ALIBI_ARGS, _batch(), microbatches=MICROBATCHES)
    for name in ALIBI_LAYOUTS:
        reference = sliced if "pipeline" in name else whole
        difference = max_relative_difference([results[name] for results in per_rank], reference)
        broken = "first heads" in name or "unbiased" in name
        assert (difference > 1e-3) if broken else (difference <= TOLERANCE), (name, difference)
    without = reference_step(spec, dataclasses.replace(ALIBI_ARGS, alibi=False), _batch())
    assert max_relative_difference([whole], without) > 1e-3


def test_registering_a_model_keeps_the_built_in_families() -> None:
    program = (
        "import examples.custom_model.model as custom\n"  # registers tiny_gpt first
        "from pipekit.models import get_model_spec, known_models\n"
        "print(get_model_spec('llama').name, get_model_spec('tiny_gpt').name, known_models())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["llama", "tiny_gpt"]
    assert all(name in result.stdout for name in ("llama_moe", "qwen3", "qwen3_moe"))


def test_the_example_job_trains_from_its_config(tmp_path: Path) -> None:
    command = [
        sys.executable, "train.py", "--config", "examples/custom_model/debug.toml",
        "--job.output_dir", str(tmp_path), "--training.steps", "6",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_interval", "1",
        "--training.seq_len", "64", "--metrics.peak_flops", "1e9",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "  loss " in line]
    losses = [float(line.split("  loss ")[1].split()[0]) for line in lines]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses


def test_pipekit_installs_no_top_level_models_package(tmp_path) -> None:
    """A user's own `models` package cannot collide with pipekit's families: outside the
    checkout `import models` finds nothing, and the families load as `pipekit.families`."""
    program = (
        "import importlib.util as u\n"
        "from pipekit.models import get_model_spec\n"
        "print(u.find_spec('models') is None, get_model_spec('llama').build.__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "pipekit.families.llama.model"]
