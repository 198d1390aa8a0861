"""Qwen3 and Qwen3-MoE: logits of checkpoints written by transformers equal transformers'
forward (tied and untied, dense and MoE, renormalised and plain top-k, dense layers between MoE
ones), our checkpoints load in transformers with the same logits, save -> load is bit-exact,
config.json edge cases are refused by name, and every family reads through the inspect command.
A dense Qwen3 upcycles into a Qwen3-MoE with the dense logits, online and offline (transformers
loads the offline one). Ablations: the QK-norm weights left in Hugging Face order, the QK-norm
left out, and the softmax-then-top-k router in upcycling."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from hf_reference import TINY_HF_CONFIG, save_transformers_model, spread_weights
from safetensors.torch import load_file

from pipekit.checkpoint import CheckpointError, SafetensorsCheckpoint
from pipekit.checkpoint.inspect import main as inspect_main
from pipekit.checkpoint.upcycle import upcycle_model
from pipekit.families.decoder.hf_layout import DecoderLayout
from pipekit.families.qwen3 import Qwen3, Qwen3Args, Qwen3Attention, Qwen3MoE, Qwen3MoEArgs
from pipekit.families.qwen3.hf import (
    QWEN3_HF,
    QWEN3_MOE_HF,
    args_to_qwen3_config,
    args_to_qwen3_moe_config,
    qwen3_config_to_args,
    qwen3_moe_config_to_args,
)
from pipekit.models import get_model_spec, spec_for_checkpoint
from pipekit.models.upcycling import UpcycleSpec
from pipekit.moe import MoEArgs
from pipekit.upcycle import upcycle_offline

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 5, 17, 99, 42, 0, 63, 8, 3, 3, 77, 12, 50, 2, 9, 31]])
PARITY_TOLERANCE = 1e-4
QWEN3_CONFIG = TINY_HF_CONFIG | {"head_dim": 32, "rope_theta": 10000.0}  # head_dim != 64 / 4
QWEN3_MOE_CONFIG = QWEN3_CONFIG | {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "norm_topk_prob": True,
}


def _transformers_qwen3(directory: Path, **overrides: object):
    config = transformers.Qwen3Config(**(QWEN3_CONFIG | overrides))
    return save_transformers_model(transformers.Qwen3ForCausalLM, config, directory)


def _transformers_qwen3_moe(directory: Path, **overrides: object):
    config = transformers.Qwen3MoeConfig(**(QWEN3_MOE_CONFIG | overrides))
    return save_transformers_model(transformers.Qwen3MoeForCausalLM, config, directory)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS)


def _hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.eval()(TOKENS).logits


# (a) transformers' checkpoints load with transformers' logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_checkpoint_gives_transformers_logits(tmp_path: Path, tied: bool) -> None:
    hf_model = _transformers_qwen3(tmp_path / "hf", tie_word_embeddings=tied)
    model, args = QWEN3_HF.build_from_checkpoint(tmp_path / "hf")
    assert isinstance(model, Qwen3) and args.tie_embeddings == tied
    assert args.per_head_dim == 32 != args.dim // args.n_heads
    assert (_logits(model) - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_topk_prob": False}, {"decoder_sparse_step": 2}, {"tie_word_embeddings": True}],
    ids=["renormalised", "plain_topk", "dense_layers_between", "tied"],
)
def test_qwen3_moe_checkpoint_gives_transformers_logits(tmp_path: Path, overrides: dict) -> None:
    hf_model = _transformers_qwen3_moe(tmp_path / "hf", **overrides)
    model, args = QWEN3_MOE_HF.build_from_checkpoint(tmp_path / "hf")
    assert isinstance(model, Qwen3MoE)
    expected_router = "softmax_topk" if overrides.get("norm_topk_prob") is False else "topk_softmax"
    assert args.moe.router == expected_router and args.moe_ffn_dim == 24
    assert args.moe_every == overrides.get("decoder_sparse_step", 1)
    assert (_logits(model) - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE


# (b) our checkpoints load in transformers, and back in pipekit bit for bit

TINY_QWEN3 = Qwen3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=100, ffn_dim=96,
    rope_theta=10000.0, max_seq_len=256,
)  # fmt: skip
TINY_QWEN3_MOE = Qwen3MoEArgs(
    **vars(TINY_QWEN3), moe=MoEArgs(num_experts=4, top_k=2), expert_ffn_dim=24, moe_every=2
)


def _model(args, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    family = Qwen3MoE if isinstance(args, Qwen3MoEArgs) else Qwen3
    with torch.device("meta"):
        model = family(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.to(dtype)


@pytest.mark.parametrize(
    ("args", "hf_class"),
    [
        (TINY_QWEN3, "Qwen3ForCausalLM"),
        (TINY_QWEN3.with_updates(tie_embeddings=True), "Qwen3ForCausalLM"),
        (TINY_QWEN3_MOE, "Qwen3MoeForCausalLM"),
    ],
    ids=["dense", "dense_tied", "moe"],
)
def test_saved_model_loads_in_transformers_with_our_logits(tmp_path: Path, args, hf_class) -> None:
    model = _model(args)
    spread_weights(model)
    model.tie_weights()
    hf = QWEN3_MOE_HF if isinstance(args, Qwen3MoEArgs) else QWEN3_HF
    hf.save(model, args, tmp_path / "hf")
    hf_model = getattr(transformers, hf_class).from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    )
    assert (_logits(model) - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("args", [TINY_QWEN3, TINY_QWEN3_MOE], ids=["dense", "moe"])
def test_export_round_trips_bit_exactly(tmp_path: Path, args, dtype: torch.dtype) -> None:
    hf = QWEN3_MOE_HF if isinstance(args, Qwen3MoEArgs) else QWEN3_HF
    model = _model(args, dtype=dtype)
    spread_weights(model)
    hf.save(model, args, tmp_path / "hf", max_shard_bytes=50_000)
    assert hf.read_args(tmp_path / "hf") == args
    reloaded = _model(args, seed=1, dtype=dtype)
    hf.load(tmp_path / "hf", reloaded, args)
    for (name, before), after in zip(
        model.state_dict().items(), reloaded.state_dict().values(), strict=True
    ):
        assert after.dtype == dtype and torch.equal(before, after), name


def test_moe_tensors_are_the_published_per_expert_layout(tmp_path: Path) -> None:
    _transformers_qwen3_moe(tmp_path / "theirs", decoder_sparse_step=2)
    with SafetensorsCheckpoint(tmp_path / "theirs") as theirs:
        listed = QWEN3_MOE_HF.tensors(TINY_QWEN3_MOE)
        assert sorted(entry.hf_name for entry in listed) == theirs.names
        for entry in listed:
            assert theirs.info(entry.hf_name).shape == entry.hf_shape, entry.hf_name
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in theirs.names
        assert "model.layers.0.mlp.gate_proj.weight" in theirs.names  # a dense layer


# (c) ablations: the QK-norm's order and presence matter


def test_qk_norm_weights_in_hugging_face_order_break_parity(tmp_path: Path) -> None:
    hf_model = _transformers_qwen3(tmp_path / "hf")
    unpermuted = DecoderLayout(
        QWEN3_HF.layout.model_type,
        layer_names=QWEN3_HF.layout.layer_names,
        rope_permuted=("attention.wq.weight", "attention.wk.weight"),
    )
    ablated = dataclasses.replace(QWEN3_HF, layout=unpermuted)
    model, _ = ablated.build_from_checkpoint(tmp_path / "hf")
    assert (_logits(model) - _hf_logits(hf_model)).abs().max() > 0.05


def test_skipping_the_qk_norm_breaks_parity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    hf_model = _transformers_qwen3(tmp_path / "hf")
    model, _ = QWEN3_HF.build_from_checkpoint(tmp_path / "hf")
    monkeypatch.setattr(Qwen3Attention, "transform_qk", lambda self, q, k: (q, k))
    assert (_logits(model) - _hf_logits(hf_model)).abs().max() > 0.05


# (d) config.json


def test_written_configs_are_canonical() -> None:
    dense = args_to_qwen3_config(TINY_QWEN3.with_updates(tie_embeddings=True), torch.bfloat16)
    assert dense["model_type"] == "qwen3" and dense["architectures"] == ["Qwen3ForCausalLM"]
    assert dense["head_dim"] == 32 and dense["tie_word_embeddings"] is True
    assert dense["use_sliding_window"] is False and dense["dtype"] == "bfloat16"
    moe = args_to_qwen3_moe_config(TINY_QWEN3_MOE)
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (
        4,
        2,
        24,
    )
    assert moe["decoder_sparse_step"] == 2 and moe["norm_topk_prob"] is True
    hf_config = transformers.Qwen3MoeConfig.from_dict(moe)
    assert (hf_config.num_local_experts, hf_config.decoder_sparse_step) == (4, 2)
    assert qwen3_moe_config_to_args(moe) == TINY_QWEN3_MOE.with_updates(
        moe=MoEArgs(num_experts=4, top_k=2, load_balance_weight=0.01)
    )


def test_expert_count_reads_under_either_name() -> None:
    moe = args_to_qwen3_moe_config(TINY_QWEN3_MOE)
    renamed = {key: value for key, value in moe.items() if key != "num_experts"}
    assert qwen3_moe_config_to_args(renamed | {"num_local_experts": 4}).moe.num_experts == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_sliding_window": True}, "use_sliding_window=true"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types other than"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"model_type": "llama"}, "model_type='llama' \\(need 'qwen3'\\)"),
    ],
)
def test_unrepresentable_dense_config_is_refused(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        qwen3_config_to_args(args_to_qwen3_config(TINY_QWEN3) | change)


def test_explicit_dense_layers_are_refused() -> None:
    config = args_to_qwen3_moe_config(TINY_QWEN3_MOE) | {"mlp_only_layers": [0]}
    with pytest.raises(CheckpointError, match=r"mlp_only_layers=\[0\]"):
        qwen3_moe_config_to_args(config)


def test_experts_other_than_swiglu_have_no_qwen3_moe_layout() -> None:
    """Refused by the adapter's check_layout (what job validation runs) and the config writer."""
    args = TINY_QWEN3_MOE.with_updates(moe=MoEArgs(num_experts=4, top_k=2, activation="gelu"))
    message = r"no Qwen3-MoE layout: moe.activation='gelu' experts, .* use activation='swiglu'"
    with pytest.raises(ValueError, match=message):
        get_model_spec("qwen3_moe").hf.check_layout(args)
    with pytest.raises(ValueError, match=message):
        args_to_qwen3_moe_config(args)


def test_a_checkpoint_of_another_shape_is_refused_before_loading(tmp_path: Path) -> None:
    _transformers_qwen3(tmp_path / "hf")
    model = _model(TINY_QWEN3.with_updates(head_dim=16))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="head_dim: checkpoint 32, model 16"):
        QWEN3_HF.load(tmp_path / "hf", model, TINY_QWEN3.with_updates(head_dim=16))
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


# (e) the registry and the inspect command read every family


def test_families_are_registered_and_found_by_model_type(tmp_path: Path) -> None:
    assert get_model_spec("qwen3").upcycler.moe_model == "qwen3_moe"
    _transformers_qwen3_moe(tmp_path / "moe")
    assert spec_for_checkpoint(tmp_path / "moe").name == "qwen3_moe"


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3", "qwen3_moe"])
def test_inspect_writes_transformers_logits_for_every_family(
    tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "mixtral": (
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            {"num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3_CONFIG),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {}),
    }
    config_class, model_class, extra = classes[family]
    base = QWEN3_MOE_CONFIG if family == "qwen3_moe" else TINY_HF_CONFIG
    hf_model = save_transformers_model(model_class, config_class(**(base | extra)), tmp_path / "hf")
    tokens = ",".join(str(token) for token in TOKENS[0].tolist())
    monkeypatch.setattr(sys, "argv", ["inspect"])
    status = inspect_main([str(tmp_path / "hf"), "--tokens", tokens, "--out", str(tmp_path / "l")])
    assert status == 0, capsys.readouterr().err
    ours = load_file(tmp_path / "l")["logits"]
    assert (ours - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family


# (f) a dense Qwen3 upcycles into a Qwen3-MoE, online and offline


def _upcycled_online(directory: Path, spec: UpcycleSpec):
    dense = get_model_spec("qwen3")
    return upcycle_model(
        directory, dense.upcycler, QWEN3_HF.read_args(directory), Qwen3MoE, spec, seed=3
    )


@pytest.mark.parametrize("moe_every", [1, 2])
def test_upcycled_qwen3_keeps_the_dense_logits_online_and_offline(
    tmp_path: Path, moe_every: int
) -> None:
    _transformers_qwen3(tmp_path / "dense")
    dense, _ = QWEN3_HF.build_from_checkpoint(tmp_path / "dense")
    spec = UpcycleSpec(num_experts=4, top_k=2, moe_every=moe_every)
    online, args = _upcycled_online(tmp_path / "dense", spec)
    assert isinstance(args, Qwen3MoEArgs) and args.moe.router == "topk_softmax"
    assert (_logits(online) - _logits(dense)).abs().max() < 1e-5
    upcycle_offline(tmp_path / "dense", tmp_path / "moe", spec, seed=3, progress=False)
    assert spec_for_checkpoint(tmp_path / "moe").name == "qwen3_moe"
    offline, _ = QWEN3_MOE_HF.build_from_checkpoint(tmp_path / "moe")
    for (name, a), b in zip(
        online.state_dict().items(), offline.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path / "moe", torch_dtype=torch.float32
    )
    assert (_hf_logits(theirs) - _logits(dense)).abs().max() < PARITY_TOLERANCE


def test_softmax_then_topk_router_moves_the_upcycled_logits(tmp_path: Path) -> None:
    """Ablation: without renormalising the top-k, each MoE layer outputs less than the FFN."""
    _transformers_qwen3(tmp_path / "dense")
    dense, _ = QWEN3_HF.build_from_checkpoint(tmp_path / "dense")
    ablated, _ = _upcycled_online(
        tmp_path / "dense", UpcycleSpec(num_experts=4, top_k=2, router="softmax_topk")
    )
    assert (_logits(ablated) - _logits(dense)).abs().max() > 1e-3
