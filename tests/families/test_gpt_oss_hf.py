"""gpt-oss in Hugging Face's layout (GptOssForCausalLM): checkpoints transformers writes (every
weight random, biases and sinks included; YaRN without truncation; sequences longer than the
sliding window) give transformers' logits in pipekit; pipekit's checkpoints load into
transformers with no missing or unexpected key, give pipekit's logits there and load back bit for
bit; a block of experts reads only those experts' rows of the fused tensors; an expert-parallel
FSDP model (4 gloo ranks) saves the same files as the whole model and loads its own blocks, as a
pipeline stage loads its own; the inspect command reads the checkpoint; config.json keys pipekit
cannot compute, and models without gpt-oss's experts, are refused by name, in one line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from pipekit.checkpoint import CheckpointError, SafetensorsCheckpoint, TensorRead
from pipekit.checkpoint.inspect import main as inspect_main
from pipekit.families.gpt_oss import GptOss, GptOssArgs, gpt_oss_flavor
from pipekit.families.gpt_oss.hf import GPT_OSS_HF, gpt_oss_config_to_args
from pipekit.families.gpt_oss.spec import GPT_OSS
from pipekit.layers.rope import YarnScaling
from pipekit.models import register_model
from pipekit.models.materialize import local_block
from pipekit.testing import build_model, data_parallel_model, run_on_ranks

transformers = pytest.importorskip("transformers")

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, FFN, WINDOW = (
    96, 32, 3, 4, 2, 8, 4, 2, 24, 5,
)  # fmt: skip
TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
PARITY_TOLERANCE = 1e-4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
HF_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=DIM,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    num_local_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    rope_parameters=YARN,
)
_DEBUG = gpt_oss_flavor("debug")
TINY = dataclasses.replace(
    _DEBUG,
    dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
    vocab_size=VOCAB, ffn_dim=FFN, rope_theta=150000.0,
    rope_scaling=YarnScaling(
        factor=4.0, original_max_position_embeddings=16, mscale=0.0, truncate=False
    ),
    max_seq_len=256, sliding_window=WINDOW,
    moe=dataclasses.replace(_DEBUG.moe, num_experts=EXPERTS, top_k=TOP_K),
)  # fmt: skip


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random and large enough that any mapping mistake shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def _transformers_model(directory: Path) -> torch.nn.Module:
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF_CONFIG)).float().eval()
    _randomise(model, seed=0)
    model.save_pretrained(directory)
    return model


def _pipekit_model(args: GptOssArgs) -> GptOss:
    with torch.device("meta"):
        model = GptOss(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    _randomise(model, seed=2)
    return model


def _logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        output = model.eval()(tokens)
    return getattr(output, "logits", output)


def test_transformers_checkpoint_gives_transformers_logits(tmp_path: Path) -> None:
    hf_model = _transformers_model(tmp_path / "hf")
    model, args = GPT_OSS.hf.build_from_checkpoint(str(tmp_path / "hf"))
    assert isinstance(model, GptOss) and TOKENS.shape[1] > args.sliding_window == WINDOW
    assert args.rope_scaling == TINY.rope_scaling and args.moe.capacity_factor is None
    assert GPT_OSS_HF.comparable(args) == GPT_OSS_HF.comparable(TINY)
    expected = _logits(hf_model)
    difference = (_logits(model) - expected).abs().max()
    assert expected.abs().max() > 1.0 and difference < PARITY_TOLERANCE, difference


def test_pipekit_checkpoint_gives_pipekit_logits_in_transformers(tmp_path: Path) -> None:
    model = _pipekit_model(TINY)
    GPT_OSS.hf.save(model, TINY, str(tmp_path / "hf"))
    hf_model, info = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf_model.config.rope_parameters["truncate"] is False
    expected = _logits(model)
    difference = (_logits(hf_model.float()) - expected).abs().max()
    assert difference < PARITY_TOLERANCE, difference
    reloaded, _ = GPT_OSS.hf.build_from_checkpoint(str(tmp_path / "hf"))
    ours, theirs = model.state_dict(), reloaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_block_of_experts_reads_only_those_experts(tmp_path: Path) -> None:
    """An expert-parallel rank's block (experts 2 and 3) of each fused parameter reads those
    experts' rows of the checkpoint tensor, once for all the parameters fused in it, and
    equals them."""
    model = _pipekit_model(TINY)
    GPT_OSS.hf.save(model, TINY, str(tmp_path / "hf"))
    reads: list[TensorRead] = []
    with SafetensorsCheckpoint(tmp_path / "hf", read_log=reads) as checkpoint:
        for short in ("w1_EFD", "w3_EFD", "w2_EDF", "b1_EF", "b3_EF"):
            name = f"layers.1.feed_forward.experts.{short}"
            whole = model.get_parameter(name).detach()
            block = (slice(2, 4), *(slice(0, size) for size in whole.shape[1:]))
            source = GPT_OSS_HF.source(checkpoint, name, TINY)
            out = torch.empty_like(whole[block])
            source.read_into(block, out)
            assert torch.equal(out, whole[block]), name
        assert sorted(read.name.rpartition(".")[2] for read in reads) == [
            "down_proj",
            "gate_up_proj",
            "gate_up_proj_bias",
        ]
        for read in reads:  # half the experts: half of each fused tensor, no more
            assert read.bounds[0] == (2, 4), read
            assert read.nbytes == checkpoint.info(read.name).nbytes // 2, read


def _sharded_save_and_load(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Expert parallel (2) x FSDP2 over 4 ranks: save, then load into a differently seeded
    layout."""
    model, _, _ = data_parallel_model(world, GPT_OSS, TINY, ep=2, seed=3, dtype=torch.float32)
    GPT_OSS.hf.save(model, TINY, folder)
    loaded, _, _ = data_parallel_model(world, GPT_OSS, TINY, ep=2, seed=11, dtype=torch.float32)
    reads: list[TensorRead] = []
    GPT_OSS.hf.load(folder, loaded, TINY, read_log=reads)
    blocks = {}
    for name, param in loaded.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        blocks[name] = (local_block(param), local.detach().clone())
    return {"blocks": blocks, "read": sum(read.nbytes for read in reads)}


def test_expert_parallel_model_saves_the_whole_models_files(tmp_path: Path) -> None:
    per_rank = run_on_ranks(_sharded_save_and_load, 4, str(tmp_path / "sharded"), timeout=120)
    reference = build_model(GPT_OSS, TINY, 3, torch.float32)
    GPT_OSS.hf.save(reference, TINY, str(tmp_path / "whole"))
    ours, theirs = _tensors(tmp_path / "sharded"), _tensors(tmp_path / "whole")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    params = dict(reference.named_parameters())
    gate = "layers.0.feed_forward.experts.w1_EFD"
    blocks = [report["blocks"][gate][0][:2] for report in per_rank]
    # each rank holds half the hidden units of half the experts
    assert blocks == [(slice(e, e + 2), slice(f, f + 12)) for f in (0, 12) for e in (0, 2)]
    for report in per_rank:
        for name, (index, values) in report["blocks"].items():
            assert torch.equal(values, params[name].detach()[index]), name
        owned = sum(values.nbytes for _, values in report["blocks"].values())
        # the fused tensors' rows of its experts, whole heads of a RoPE-reordered block
        assert report["read"] <= 1.1 * owned, (report["read"], owned)


def test_a_pipeline_stage_loads_its_part(tmp_path: Path) -> None:
    model = _pipekit_model(TINY)
    GPT_OSS.hf.save(model, TINY, str(tmp_path / "hf"))
    stage = _pipekit_model(TINY)  # layers 1 and 2 and the output, other values before loading
    _randomise(stage, seed=5)
    stage.tok_embeddings = None
    del stage.layers["0"]
    GPT_OSS.hf.load(str(tmp_path / "hf"), stage, TINY)
    whole = dict(model.named_parameters())
    loaded = dict(stage.named_parameters())
    assert "layers.2.feed_forward.experts.w3_EFD" in loaded
    assert all(torch.equal(loaded[name], whole[name]) for name in loaded)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with SafetensorsCheckpoint(directory) as checkpoint:
        files = checkpoint.files
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors |= load_file(str(path))
    return tensors


def test_inspect_reads_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    register_model(GPT_OSS)  # found by its entry point once pipekit is reinstalled
    hf_model = _transformers_model(tmp_path / "hf")
    tokens = ",".join(str(token) for token in TOKENS[0].tolist())
    monkeypatch.setattr(sys, "argv", ["inspect"])
    status = inspect_main([str(tmp_path / "hf"), "--tokens", tokens, "--out", str(tmp_path / "l")])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert "model.layers.2.mlp.experts.gate_up_proj" in printed.out
    assert "GptOssArgs(" in printed.out
    expected = _logits(hf_model, TOKENS[:1])
    assert (load_file(tmp_path / "l")["logits"] - expected).abs().max() < PARITY_TOLERANCE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"swiglu_limit": 5.0}, r"swiglu_limit=5.0 \(pipekit's clamped SwiGLU .*only 7.0 loads"),
        (
            {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
            r"layer_types=\['full_attention'.* \(pipekit's gpt-oss alternates",
        ),
        ({"attention_bias": False}, r"attention_bias=false \(pipekit's gpt-oss has biased"),
    ],
    ids=["swiglu_limit", "layer_types", "attention_bias"],
)
def test_configs_pipekit_cannot_compute_are_refused(overrides: dict, message: str) -> None:
    config = transformers.GptOssConfig(**HF_CONFIG).to_dict() | overrides
    with pytest.raises(CheckpointError, match=message) as error:
        gpt_oss_config_to_args(config)
    assert "\n" not in str(error.value)


def test_models_without_the_gpt_oss_layout_are_refused() -> None:
    plain = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, activation="swiglu"))
    with pytest.raises(ValueError, match=r"moe.activation='swiglu'.*use activation=") as error:
        GPT_OSS.hf.check_layout(plain)
    assert "\n" not in str(error.value)
