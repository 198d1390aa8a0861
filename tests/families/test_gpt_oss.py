"""gpt-oss: pipekit's model computes transformers' `GptOssForCausalLM` (attention sinks, biased
projections, alternating sliding-window layers, YaRN without truncation, biased experts with
the clamped SwiGLU and a biased router), weights copied by hand here so the model is checked
apart from any checkpoint code; and its flavors build."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from pipekit.families.gpt_oss import GptOss, GptOssArgs, gpt_oss_flavor
from pipekit.layers.rope import YarnScaling

transformers = pytest.importorskip("transformers")

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, FFN, WINDOW = (
    96, 32, 3, 4, 2, 8, 4, 2, 24, 5,
)  # fmt: skip


def _hf_model() -> torch.nn.Module:
    config = transformers.GptOssConfig(
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
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # every parameter random, biases and sinks included
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model


def _args() -> GptOssArgs:
    base = gpt_oss_flavor("debug")
    return dataclasses.replace(
        base,
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        ffn_dim=FFN,
        rope_theta=150000.0,
        rope_scaling=YarnScaling(
            factor=4.0, original_max_position_embeddings=16, truncate=False, mscale=0.0
        ),
        max_seq_len=256,
        sliding_window=WINDOW,
        moe=dataclasses.replace(base.moe, num_experts=EXPERTS, top_k=TOP_K),
        expert_ffn_dim=FFN,
    )


def _interleaved_rows(weight: Tensor, head_dim: int) -> Tensor:
    """Rows of a Q/K projection from Hugging Face's rotate-half order to interleaved pairs."""
    half = torch.arange(head_dim // 2)
    per_head = torch.stack([half, half + head_dim // 2], dim=-1).flatten()
    heads = weight.shape[0] // head_dim
    order = (torch.arange(heads)[:, None] * head_dim + per_head).flatten()
    return weight[order]


def _copy_weights(hf: torch.nn.Module, model: GptOss) -> None:
    hf_state = hf.state_dict()
    state = {"tok_embeddings.weight": hf_state["model.embed_tokens.weight"]}
    state["norm.weight"] = hf_state["model.norm.weight"]
    state["output.weight"] = hf_state["lm_head.weight"]
    for layer in range(LAYERS):
        hf_prefix, prefix = f"model.layers.{layer}.", f"layers.{layer}."
        state[prefix + "attention_norm.weight"] = hf_state[hf_prefix + "input_layernorm.weight"]
        state[prefix + "ffn_norm.weight"] = hf_state[hf_prefix + "post_attention_layernorm.weight"]
        state[prefix + "attention.sinks"] = hf_state[hf_prefix + "self_attn.sinks"]
        projections = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
        for ours, theirs in projections:
            for kind in ("weight", "bias"):
                tensor = hf_state[f"{hf_prefix}self_attn.{theirs}.{kind}"]
                if ours in ("wq", "wk"):
                    tensor = _interleaved_rows(tensor, HEAD_DIM)
                state[f"{prefix}attention.{ours}.{kind}"] = tensor
        moe, hf_moe = prefix + "feed_forward.", hf_prefix + "mlp."
        state[moe + "router.gate.weight"] = hf_state[hf_moe + "router.weight"]
        state[moe + "router.gate.bias"] = hf_state[hf_moe + "router.bias"]
        gate_up_EDX = hf_state[hf_moe + "experts.gate_up_proj"]
        gate_up_EX = hf_state[hf_moe + "experts.gate_up_proj_bias"]
        state[moe + "experts.w1_EFD"] = gate_up_EDX[:, :, 0::2].transpose(1, 2)
        state[moe + "experts.w3_EFD"] = gate_up_EDX[:, :, 1::2].transpose(1, 2)
        state[moe + "experts.b1_EF"] = gate_up_EX[:, 0::2]
        state[moe + "experts.b3_EF"] = gate_up_EX[:, 1::2]
        state[moe + "experts.w2_EDF"] = hf_state[hf_moe + "experts.down_proj"].transpose(1, 2)
        state[moe + "experts.b2_ED"] = hf_state[hf_moe + "experts.down_proj_bias"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.endswith("expert_load") for name in missing), missing


def test_logits_equal_transformers_gpt_oss() -> None:
    """Sequences longer than the window (so the sliding layers mask), every weight random:
    float32 logits within 1e-4 of transformers'."""
    hf = _hf_model()
    model = GptOss(_args()).float()
    _copy_weights(hf, model)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        logits = model(tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    with torch.no_grad():  # the sinks take part: zeroing them moves the logits
        for block in model.layers.values():
            block.attention.sinks.zero_()
        assert (model(tokens) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("flavor", ["debug", "20B", "120B"])
def test_flavors_build(flavor: str) -> None:
    args = gpt_oss_flavor(flavor)
    with torch.device("meta"):
        model = GptOss(args)
    params = sum(p.numel() for p in model.parameters())
    expected = {"20B": (20e9, 22.5e9), "120B": (115e9, 121e9), "debug": (0, 1e7)}[flavor]
    assert expected[0] < params < expected[1], params


SINKS_H = torch.linspace(-1.5, 1.5, 4, dtype=torch.float64)
"""Sinks far from their zero init, one per head, so a rank holding other heads' shows."""


def _set_sinks(model: torch.nn.Module, first_heads: bool = False) -> None:
    """Give every layer SINKS_H (a sharded one its share); `first_heads` (the ablation): every
    tp rank the first tp rank's heads' sinks."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    values_H = SINKS_H[:2].repeat(2) if first_heads else SINKS_H
    for module in model.modules():
        sinks = getattr(module, "sinks", None)
        if sinks is None:
            continue
        with torch.no_grad():
            if isinstance(sinks, DTensor):
                split = distribute_tensor(values_H, sinks.device_mesh, sinks.placements)
                sinks.to_local().copy_(split.to_local())
            else:
                sinks.copy_(values_H)


def _tensor_parallel_runs(rank: int, world: int) -> dict:
    from pipekit.models import get_model_spec
    from pipekit.testing import data_parallel_step, parity_batch

    spec, args = get_model_spec("gpt_oss"), _tp_args()
    batch = parity_batch(args.vocab_size, 8, 16)
    return {
        "tp": data_parallel_step(rank, world, spec, args, batch, tp=2, adjust=_set_sinks),
        "ablated": data_parallel_step(
            rank, world, spec, args, batch, tp=2,
            adjust=lambda model: _set_sinks(model, first_heads=True),
        ),
    }  # fmt: skip


def _tp_args() -> GptOssArgs:
    base = gpt_oss_flavor("debug")
    return dataclasses.replace(
        base, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, ffn_dim=32,
        max_seq_len=64, sliding_window=5, moe=dataclasses.replace(base.moe, num_experts=4),
    )  # fmt: skip


def test_tensor_parallel_splits_the_sinks_with_their_heads_fp64() -> None:
    """tp 2 x FSDP 2 (sequence parallel, the MoE routing each rank's tokens): the biases split
    with their projections and each rank's sinks are its heads', so loss and every gradient
    equal one process's; giving every rank the first heads' sinks does not."""
    from pipekit.models import get_model_spec
    from pipekit.testing import (
        build_model,
        max_relative_difference,
        parity_batch,
        reference_step,
        run_on_ranks,
    )

    per_rank = run_on_ranks(_tensor_parallel_runs, 4, timeout=300)
    spec, args = get_model_spec("gpt_oss"), _tp_args()
    model = build_model(spec, args, seed=3, dtype=torch.float64)
    _set_sinks(model)
    batch = parity_batch(args.vocab_size, 8, 16)
    reference = reference_step(spec, args, batch, microbatches=2, model=model)
    assert max_relative_difference([r["tp"] for r in per_rank], reference) <= 1e-10
    assert max_relative_difference([r["ablated"] for r in per_rank], reference) > 1e-3
