"""`[optimizer] name = "Muon"`: on every layout the update of each parameter equals one process
running `torch.optim.Muon` on the matrices (each expert's matrix as its own) and
`torch.optim.AdamW` on the rest, in float64, over two steps with the same gradients; the split
between the two; a Muon job that resumes exactly."""

from __future__ import annotations

import pytest
import torch
from job_runs import LAYOUT_RUN, train_job
from tiny_models import TINY_LLAMA
from torch.distributed.tensor import DTensor, distribute_tensor

from pipekit.config.job_config import OptimizerConfig
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.models import get_model_spec
from pipekit.moe import MoEArgs
from pipekit.testing import build_model, data_parallel_model, run_on_ranks
from pipekit.testing.pipeline import pipeline_layout
from pipekit.train import muon
from pipekit.train.muon import muon_parameter_names
from pipekit.train.optimizer import build_optimizer

LR, WEIGHT_DECAY = 0.02, 0.1
TINY_MOE = LlamaMoEArgs(
    **{**vars(TINY_LLAMA), "n_layers": 2}, moe=MoEArgs(num_experts=4, top_k=2), moe_every=1
)
CONFIG = OptimizerConfig(name="Muon", lr=LR, weight_decay=WEIGHT_DECAY)
_WHOLE_MATRICES = muon._orthogonalised


def _gradients(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """The same made-up gradients on every rank: one generator per step, names in order."""
    generator = torch.Generator().manual_seed(100 + step)
    return {
        name: torch.randn(param.shape, generator=generator, dtype=torch.float64)
        for name, param in sorted(model.named_parameters())
    }


def _reference(model: torch.nn.Module, names: set[str]):
    """One process: torch's Muon over every matrix in `names` (an expert stack as one leaf per
    expert), torch's AdamW over the rest. Returns (step(grads), current weights)."""
    params = dict(model.named_parameters())
    leaves = {name: list(p.detach().clone().unbind()) if p.ndim == 3 else [p.detach().clone()]
              for name, p in params.items()}  # fmt: skip
    for parts in leaves.values():
        for leaf in parts:
            leaf.requires_grad_()
    muon_leaves = [leaf for name in sorted(names) for leaf in leaves[name]]
    adamw_leaves = [leaf for name in sorted(set(params) - names) for leaf in leaves[name]]
    muon = torch.optim.Muon(
        muon_leaves, lr=LR, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(
        adamw_leaves, lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95), eps=1e-8,
        foreach=False,
    )  # fmt: skip

    def step(grads: dict[str, torch.Tensor]) -> None:
        for name, parts in leaves.items():
            for leaf, grad in zip(parts, grads[name].unbind() if len(parts) > 1 else [grads[name]],
                                  strict=True):  # fmt: skip
                leaf.grad = grad.clone()
        muon.step()
        adamw.step()

    def weights() -> dict[str, torch.Tensor]:
        return {name: torch.stack(parts) if params[name].ndim == 3 else parts[0]
                for name, parts in leaves.items()}  # fmt: skip

    return step, weights


def _shard_by_shard(update: torch.Tensor, group: dict) -> torch.Tensor:
    """The ablation: Newton-Schulz of each rank's shard, as a Muon unaware of FSDP/TP would."""
    if not isinstance(update, DTensor):
        return _WHOLE_MATRICES(update, group)
    local = _WHOLE_MATRICES(update.to_local(), group)
    return DTensor.from_local(
        local, update.device_mesh, update.placements, shape=update.shape, stride=update.stride()
    )


def _muon_against_torch(rank: int, world_size: int, layout: str, ablate: bool = False) -> float:
    if ablate:  # this rank is a forked child: the patch dies with it
        muon._orthogonalised = _shard_by_shard
    moe = layout in ("ep", "etp")
    spec = get_model_spec("llama_moe" if moe else "llama")
    args = TINY_MOE if moe else TINY_LLAMA
    if layout == "pp":
        runner, _, _ = pipeline_layout(world_size, spec, args, (4, 16), num_slices=2)
        model = runner.model
    else:
        degrees = {"fsdp": {}, "tp": {"tp": 2}, "ep": {"ep": 2}, "etp": {"etp": 2}}[layout]
        model, _, _ = data_parallel_model(world_size, spec, args, **degrees)
    whole = build_model(spec, args, seed=3, dtype=torch.float64)
    names = muon_parameter_names(whole, spec.structure.embedding, spec.structure.output)
    reference_step, reference_weights = _reference(whole, names)
    optimizer = build_optimizer(model, CONFIG, spec.structure)
    for step in range(2):
        grads = _gradients(whole, step)
        for name, param in model.named_parameters():
            grad = grads[name]
            if isinstance(param, DTensor):
                grad = distribute_tensor(grad, param.device_mesh, param.placements,
                                         src_data_rank=None)  # fmt: skip
            param.grad = grad
        optimizer.step()
        reference_step(grads)
    expected = reference_weights()
    worst = 0.0
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        worst = max(worst, float((value - expected[name]).abs().max()))
    return worst


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep", "etp", "pp"])
def test_muon_updates_every_layout_as_torch_does_on_one_process_fp64(layout):
    for worst in run_on_ranks(_muon_against_torch, 2, layout, timeout=180):
        assert worst <= 1e-10


@pytest.mark.parametrize("layout", ["fsdp", "tp", "etp"])
def test_muon_of_each_shard_alone_is_not_torchs_update(layout):
    """The ablation: orthogonalising the shards FSDP2 or tensor parallelism leave on a rank,
    instead of the whole matrix, gives another update."""
    for worst in run_on_ranks(_muon_against_torch, 2, layout, True, timeout=180):
        assert worst > 1e-4


def test_muon_takes_the_matrices_and_adamw_the_rest():
    spec = get_model_spec("llama_moe")
    whole = build_model(spec, TINY_MOE, seed=3, dtype=torch.float64)
    names = muon_parameter_names(whole, spec.structure.embedding, spec.structure.output)
    assert "layers.0.attention.wq.weight" in names
    assert "layers.0.feed_forward.experts.w1_EFD" in names  # each expert's matrix
    assert "layers.0.feed_forward.router.gate.weight" in names
    assert not names & {"tok_embeddings.weight", "output.weight", "norm.weight"}
    assert not any(name.endswith("_norm.weight") for name in names)
    optimizer = build_optimizer(whole, CONFIG, spec.structure)
    split = {group["muon"]: sum(p.numel() for p in group["params"])
             for group in optimizer.param_groups}  # fmt: skip
    assert split[True] > split[False] > 0


def test_a_muon_job_resumes_exactly(tmp_path):
    """FSDP over 2 ranks: a Muon job stopped after step 2 and resumed logs the uninterrupted
    run's losses (momentum buffers and AdamW moments are in the checkpoint, keyed by name)."""
    muon = ("--optimizer.name", "Muon", "--optimizer.lr", "0.01")
    whole = train_job(tmp_path / "whole", *LAYOUT_RUN, *muon, "--checkpoint.enable", "false")
    train_job(
        tmp_path / "stopped", *LAYOUT_RUN[:-4], "--training.steps", "2", *LAYOUT_RUN[-2:], *muon
    )
    assert train_job(tmp_path / "stopped", *LAYOUT_RUN, *muon) == whole
    assert whole[4] < whole[1]
