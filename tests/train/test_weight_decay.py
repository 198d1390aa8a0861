"""`[optimizer] no_decay`: which parameters each kind and pattern names (on models unlike each
other), one line for a pattern that names nothing, the named parameters keeping their values
under weight decay alone on one process and under FSDP and the sliced pipeline, and a resume
from a checkpoint grouped otherwise keeping the job's choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pipekit.checkpoint.dcp import ModelOptimizerState
from pipekit.config import ConfigError, load_job_config
from pipekit.config.job_config import OptimizerConfig
from pipekit.testing import run_on_ranks
from pipekit.train.job import job_model, validate_job
from pipekit.train.optimizer import build_optimizer
from pipekit.train.trainer import Trainer
from pipekit.train.weight_decay import undecayed_names

ARGS = [
    "--training.global_batch_size", "4", "--training.seq_len", "32",
    "--lr_scheduler.warmup_steps", "0", "--optimizer.weight_decay", "0.5",
    "--checkpoint.enable", "false", "--checkpoint.resume", "false",
    "--metrics.peak_flops", "1e9",
]  # fmt: skip


def _meta_model(config_path: str, *overrides: str) -> torch.nn.Module:
    return job_model(load_job_config(["--config", config_path, *ARGS, *overrides]))[3]


def test_each_kind_names_its_parameters_in_models_unlike_each_other():
    llama = _meta_model("configs/debug_model.toml")
    kinds = {kind: undecayed_names(llama, [kind]) for kind in ("norm", "bias", "embedding")}
    assert kinds["norm"] == {"norm.weight"} | {
        f"layers.{i}.{norm}.weight" for i in range(4) for norm in ("attention_norm", "ffn_norm")
    }
    assert kinds["bias"] == set() and kinds["embedding"] == {"tok_embeddings.weight"}

    # GPT-2 style: LayerNorm weights and biases, learned positions, biased linears
    gpt = _meta_model("examples/custom_model/debug.toml")
    norms, biases = undecayed_names(gpt, ["norm"]), undecayed_names(gpt, ["bias"])
    assert norms == {f"blocks.{i}.ln_{j}.{p}" for i in range(len(gpt.blocks)) for j in (1, 2)
                     for p in ("weight", "bias")} | {"ln_f.weight", "ln_f.bias"}  # fmt: skip
    assert "blocks.0.attn.qkv.bias" in biases and "blocks.0.ln_1.bias" in biases
    assert not any(name.endswith("weight") for name in biases)
    assert undecayed_names(gpt, ["embedding"]) == {"wte.weight", "wpe.weight"}

    # tied: the head is the token table, so it is spared under both names
    tied = _meta_model("configs/debug_model.toml", "--model.flavor", "debug_tied")
    assert undecayed_names(tied, ["embedding"]) >= {"tok_embeddings.weight", "output.weight"}

    # gpt-oss: a pattern for its attention sinks; its experts' biases are named by shape
    gpt_oss = _meta_model("configs/debug_gpt_oss.toml")
    sinks = undecayed_names(gpt_oss, ["layers.*.attention.sinks"])
    assert sinks and all(name.endswith("attention.sinks") for name in sinks)
    layer_biases = {n for n in undecayed_names(gpt_oss, ["bias"]) if n.startswith("layers.0.")}
    assert layer_biases == {
        *(f"layers.0.attention.{w}.bias" for w in ("wq", "wk", "wv", "wo")),
        "layers.0.feed_forward.router.gate.bias",
        *(f"layers.0.feed_forward.experts.{b}" for b in ("b1_EF", "b3_EF", "b2_ED")),
    }


def test_a_pattern_that_names_no_parameter_is_one_line_before_launch():
    config = load_job_config(
        [
            "--config",
            "configs/debug_model.toml",
            *ARGS,
            "--optimizer.no_decay",
            "norm;layer.*.bias",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"no_decay entry 'layer\.\*\.bias' is neither a kind"
    ) as error:
        validate_job(config, world_size=1)
    assert "\n" not in str(error.value) and "tok_embeddings.weight" in str(error.value)


def _decay_alone(rank: int, world_size: int, output_dir: Path, overrides: list[str]) -> dict:
    """One optimizer step with every gradient zero: AdamW's update is then the decay alone.
    Returns which of this rank's parameters kept their values and which shrank by exactly
    1 - lr x weight_decay."""
    config = load_job_config([*ARGS, "--job.output_dir", str(output_dir), *overrides])
    trainer = Trainer(validate_job(config, world_size))
    before = {name: _local(p).clone() for name, p in trainer.model.named_parameters()}
    for param in trainer.model.parameters():
        param.grad = torch.zeros_like(param)
    lr = trainer.optimizer.param_groups[0]["lr"]
    trainer.optimizer.step()
    kept, shrunk = set(), set()
    for name, param in trainer.model.named_parameters():
        after = _local(param)
        if torch.equal(after, before[name]):
            kept.add(name)
        elif torch.allclose(after, before[name] * (1 - lr * 0.5), rtol=1e-6, atol=0):
            shrunk.add(name)
    return {"kept": kept, "shrunk": shrunk, "all": set(before)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor.detach()


@pytest.mark.parametrize(
    ("config_path", "world_size", "layout"),
    [("configs/debug_model.toml", 1, []),
     ("configs/debug_model.toml", 2, ["--parallelism.dp_shard", "2"]),
     ("configs/debug_sliced_pp.toml", 2, ["--parallelism.microbatches", "2"])],
    ids=["one_process", "fsdp", "sliced_pipeline"],
)  # fmt: skip
def test_the_named_parameters_keep_their_values_under_weight_decay_alone(
    tmp_path, config_path, world_size, layout
):
    no_decay = ["--optimizer.no_decay", "norm;embedding;output.weight"]
    overrides = ["--config", config_path, *layout, *no_decay]
    ranks = run_on_ranks(_decay_alone, world_size, tmp_path, overrides, timeout=180)
    expected = {"tok_embeddings.weight", "output.weight", "norm.weight"} | {
        f"layers.{i}.{norm}.weight" for i in range(4) for norm in ("attention_norm", "ffn_norm")
    }
    kept = set().union(*(rank["kept"] for rank in ranks))
    every = set().union(*(rank["all"] for rank in ranks))
    assert kept == expected & every and expected <= every
    for rank in ranks:  # the rest decayed, by exactly the factor
        assert rank["shrunk"] == rank["all"] - rank["kept"]


def test_a_resume_keeps_the_jobs_no_decay_whatever_the_checkpoints_groups(tmp_path):
    """A checkpoint of a job that decayed everything, loaded into one with no_decay: torch
    hands each optimizer group its first parameter's saved hyper-parameters, so without care
    the spared group would decay again (the ablation: the saved value is 0.1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    saved = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    model(torch.randn(2, 4)).sum().backward()
    saved.step()
    dcp.save({"state": ModelOptimizerState(model, saved)}, checkpoint_id=tmp_path)

    spared = build_optimizer(model, OptimizerConfig(weight_decay=0.1, no_decay=["norm", "bias"]))
    decays = {
        id(p): group["weight_decay"] for group in spared.param_groups for p in group["params"]
    }
    dcp.load({"state": ModelOptimizerState(model, spared)}, checkpoint_id=tmp_path)
    loaded = {
        id(p): group["weight_decay"] for group in spared.param_groups for p in group["params"]
    }
    assert loaded == decays
    assert sorted(decays.values()) == [0.0, 0.0, 0.0, 0.1]  # linear bias, norm weight and bias
    assert spared.state  # the moments were loaded
