"""`[training] loss_chunk_tokens`: a job's step with the chunked head equals the step with the
whole head (loss and every gradient), for models unlike each other (logits soft-capping, a
biased output, tied embeddings, a GPT-2 style MoE) and under FSDP, tensor parallelism with
sequence and loss parallelism, and context parallelism; what cannot be chunked is refused in
one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipekit.config import ConfigError, load_job_config
from pipekit.models.spec import ModelStructure
from pipekit.testing import run_on_ranks
from pipekit.train.chunked_output import check_chunked_output
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

ARGS = [
    "--training.global_batch_size", "4", "--training.seq_len", "32",
    "--checkpoint.enable", "false", "--checkpoint.resume", "false",
    "--metrics.peak_flops", "1e9", "--training.loss_chunk_tokens", "7",
]  # fmt: skip


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _step_both_ways(
    rank: int, world_size: int, output_dir: Path, overrides: list[str], ablate: bool
) -> tuple[float, float, float]:
    """The first batch's loss and gradients with the chunked head (first: it is the model's
    first forward), then with the whole head; returns both losses and the largest gradient
    difference relative to the largest gradient."""
    config = load_job_config([*ARGS, "--job.output_dir", str(output_dir), *overrides])
    trainer = Trainer(validate_job(config, world_size))
    assert trainer._chunked_loss is not None
    if ablate:  # the head without the model's logits transforms
        trainer._chunked_loss.head._transforms = []
    batches = [next(trainer.data)]
    grads, losses = [], []
    for chunked in (trainer._chunked_loss, None):
        trainer._chunked_loss = chunked
        losses.append(trainer._loss(batches, backward=True)[0])
        grads.append({n: _full(p.grad).clone() for n, p in trainer.model.named_parameters()})
        trainer.optimizer.zero_grad(set_to_none=True)
    scale = max(float(g.abs().max()) for g in grads[1].values())
    worst = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[1])
    return losses[0], losses[1], worst / scale


@pytest.mark.parametrize(
    ("world_size", "overrides"),
    [(1, ["--config", "configs/debug_model.toml"]),
     (1, ["--config", "configs/debug_model.toml", "--model.flavor", "debug_tied"]),
     (1, ["--config", "examples/local_global/debug.toml"]),
     (1, ["--config", "examples/parallel_blocks/debug.toml"]),
     (1, ["--config", "examples/custom_model/debug.toml"]),
     (2, ["--config", "configs/debug_model.toml", "--parallelism.dp_shard", "2"]),
     (2, ["--config", "configs/debug_tp.toml"]),
     (2, ["--config", "configs/debug_model.toml", "--parallelism.dp_shard", "1",
          "--parallelism.cp", "2"])],
    ids=["llama", "tied", "softcapped", "biased_output", "gpt2_moe", "fsdp", "tp_sp_loss_parallel",
         "cp"],
)  # fmt: skip
def test_the_chunked_head_trains_the_whole_heads_step(tmp_path, world_size, overrides):
    for chunked, whole, gradient_error in run_on_ranks(
        _step_both_ways, world_size, tmp_path, overrides, False, timeout=180
    ):
        assert chunked == pytest.approx(whole, rel=1e-6)
        assert gradient_error < 1e-5


def test_a_head_without_the_models_transforms_differs(tmp_path):
    """Ablation: the soft-capped model's step differs when the head leaves the cap out."""
    overrides = ["--config", "examples/local_global/debug.toml"]
    [(chunked, whole, gradient_error)] = run_on_ranks(
        _step_both_ways, 1, tmp_path, overrides, True, timeout=180
    )
    assert chunked != pytest.approx(whole, rel=1e-3) and gradient_error > 1e-3


class _ScaledOutput(nn.Linear):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(hidden)


def test_what_cannot_be_chunked_is_refused_in_one_line():
    structure = ModelStructure(blocks="layers", embedding="embed", output="output")
    model = nn.Module()
    model.output = _ScaledOutput(4, 8)
    with pytest.raises(ConfigError, match="'output' is a _ScaledOutput with a forward of its own"):
        check_chunked_output(16, structure, model, pipeline_degree=1)
    model.output = nn.Linear(4, 8)
    check_chunked_output(16, structure, model, pipeline_degree=1)
    check_chunked_output(0, structure, model, pipeline_degree=2)  # off: nothing to check
    config = load_job_config(["--config", "configs/debug_sliced_pp.toml", *ARGS])
    with pytest.raises(ConfigError, match="loss_chunk_tokens=7 chunks the head of a job without"):
        validate_job(config, world_size=2)
    config = load_job_config(["--config", "configs/debug_model.toml", *ARGS[:-1], "-3"])
    with pytest.raises(ConfigError, match="loss_chunk_tokens=-3 must be >= 0"):
        validate_job(config, world_size=1)
