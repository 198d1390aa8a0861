"""Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM checkpoints <-> pipekit's Qwen3.

Names, RoPE row order and the checked load and save are the shared decoder format's
(`pipekit.families.decoder.hf_layout`), plus Qwen3's QK-norm weights
(`self_attn.q_norm`/`k_norm`, whose
`head_dim` entries are reordered like a head's rows of wq and wk). Qwen3-MoE's MoE blocks map as

    pipekit: layers.L.feed_forward.     Hugging Face: model.layers.L.mlp.
    router.gate.weight    [E, D]        gate.weight
    experts.w1_EFD[j]     [F, D]        experts.j.gate_proj.weight
    experts.w2_EDF[j]     [D, F]        experts.j.down_proj.weight
    experts.w3_EFD[j]     [F, D]        experts.j.up_proj.weight

in the published per-expert layout (transformers 5 fuses the experts on load and writes them
back per expert on save), while its dense layers keep Qwen3's `mlp.gate_proj/up_proj/down_proj`.
The experts are SwiGLU ones (`MoEArgs.activation="swiglu"`); a model with other experts is refused.
config.json: `decoder_sparse_step` is `moe_every`, `moe_intermediate_size` the experts' width,
`norm_topk_prob` the router (true: `topk_softmax`, false: `softmax_topk`); `num_experts` is read
under either of its names (`num_local_experts` in transformers 5) and written as published.

Legend: E experts, F expert hidden dim, D model dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipekit.families.decoder.hf_config import (
    CONFIG_FILE,
    HFModelType,
    build_args,
    decoder_config_fields,
    decoder_config_keys,
    is_int,
)
from pipekit.families.decoder.hf_layout import (
    DENSE_LAYER_NAMES,
    DecoderHF,
    DecoderLayout,
    expert_layout_problems,
)
from pipekit.families.qwen3.args import Qwen3Args, Qwen3MoEArgs
from pipekit.families.qwen3.model import Qwen3, Qwen3MoE
from pipekit.moe import MoEArgs

__all__ = [
    "QWEN3_HF",
    "QWEN3_MOE_HF",
    "args_to_qwen3_config",
    "args_to_qwen3_moe_config",
    "qwen3_config_to_args",
    "qwen3_moe_config_to_args",
]

QWEN3_MODEL_TYPE = HFModelType(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    pipekit_model="Qwen3",
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    num_key_value_heads=32,
)
"""transformers' Qwen3Config."""
QWEN3_MOE_MODEL_TYPE = HFModelType(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    pipekit_model="Qwen3-MoE",
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    num_key_value_heads=4,
)
"""transformers' Qwen3MoeConfig."""

_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_ROPE_PERMUTED = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.q_norm.weight",
    "attention.k_norm.weight",
)
# transformers' Qwen3MoeConfig defaults of the MoE keys.
_DEFAULTS = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}
_ROUTERS = {True: "topk_softmax", False: "softmax_topk"}


def _qwen3_problems(config: Mapping[str, Any]) -> list[str]:
    """What pipekit's Qwen3 cannot compute of the Qwen3 keys of `config`."""
    problems = []
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window=true (pipekit's Qwen3 attends to the whole context)")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        problems.append(f"layer_types other than full_attention: {sorted(set(layer_types))}")
    return problems


def qwen3_config_to_args(config: Mapping[str, Any], *, source: str = CONFIG_FILE) -> Qwen3Args:
    """Parse a Qwen3 config.json; reject what pipekit's Qwen3 cannot compute."""
    fields = decoder_config_fields(
        config, source=source, model_type=QWEN3_MODEL_TYPE, problems=_qwen3_problems(config)
    )
    return build_args(Qwen3Args, fields, source)


def _qwen3_keys(args: Qwen3Args, dtype: torch.dtype, model_type: HFModelType) -> dict[str, Any]:
    return decoder_config_keys(args, dtype, model_type) | {
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def args_to_qwen3_config(args: Qwen3Args, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of a Qwen3 with `args` whose weights are `dtype`."""
    return _qwen3_keys(args, dtype, QWEN3_MODEL_TYPE)


def _moe_value(config: Mapping[str, Any], key: str) -> Any:
    if key == "num_experts" and "num_experts" not in config:
        return config.get("num_local_experts", _DEFAULTS[key])
    return config.get(key, _DEFAULTS[key])


def qwen3_moe_config_to_args(
    config: Mapping[str, Any], *, source: str = CONFIG_FILE
) -> Qwen3MoEArgs:
    """Parse a Qwen3-MoE config.json; reject what pipekit's Qwen3-MoE cannot compute.

    `router_aux_loss_coef` becomes the weight of pipekit's switch balance loss; dense layers
    must be every layer but each `decoder_sparse_step`-th (an explicit `mlp_only_layers` list
    is refused unless empty)."""
    problems = _qwen3_problems(config)
    experts, top_k = _moe_value(config, "num_experts"), _moe_value(config, "num_experts_per_tok")
    if not (is_int(experts) and is_int(top_k) and 1 <= top_k <= experts):
        problems.append(
            f"num_experts={experts!r}, num_experts_per_tok={top_k!r} must be integers with "
            "1 <= num_experts_per_tok <= num_experts"
        )
    if config.get("mlp_only_layers"):
        problems.append(
            f"mlp_only_layers={config['mlp_only_layers']} (pipekit's Qwen3-MoE makes every "
            "decoder_sparse_step-th layer MoE and keeps no other dense layers)"
        )
    fields = decoder_config_fields(
        config, source=source, model_type=QWEN3_MOE_MODEL_TYPE, problems=problems
    )
    moe = MoEArgs(
        num_experts=experts,
        top_k=top_k,
        router=_ROUTERS[bool(_moe_value(config, "norm_topk_prob"))],
        capacity_factor=None,
        load_balance="switch",
        load_balance_weight=float(_moe_value(config, "router_aux_loss_coef")),
    )
    extra = {
        "moe": moe,
        "moe_every": _moe_value(config, "decoder_sparse_step"),
        "expert_ffn_dim": _moe_value(config, "moe_intermediate_size"),
    }
    return build_args(Qwen3MoEArgs, fields | extra, source)


def check_qwen3_moe_compatible(args: Qwen3MoEArgs) -> None:
    """Raise ValueError, naming the fix, if a model with `args` has no Qwen3-MoE layout."""
    problems = expert_layout_problems(args)
    if args.moe.router not in _ROUTERS.values():
        problems.append(
            f"router={args.moe.router!r} routes differently from Qwen3-MoE (a softmax over all "
            "experts, then top-k, renormalised or not); use topk_softmax or softmax_topk"
        )
    if problems:
        raise ValueError(f"the Qwen3MoEArgs have no Qwen3-MoE layout: {'; '.join(problems)}")


def args_to_qwen3_moe_config(
    args: Qwen3MoEArgs, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The config.json of a Qwen3-MoE with `args` whose weights are `dtype`."""
    check_qwen3_moe_compatible(args)
    return _qwen3_keys(args, dtype, QWEN3_MOE_MODEL_TYPE) | {
        "num_experts": args.moe.num_experts,
        "num_experts_per_tok": args.moe.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "decoder_sparse_step": args.moe_every,
        "mlp_only_layers": [],
        "norm_topk_prob": args.moe.router == "topk_softmax",
        "router_aux_loss_coef": args.moe.load_balance_weight,
        "output_router_logits": False,
    }


_QWEN3_LAYER_NAMES = {**DENSE_LAYER_NAMES, **_QK_NORMS}

QWEN3_HF = DecoderHF(
    layout=DecoderLayout(
        QWEN3_MODEL_TYPE, layer_names=_QWEN3_LAYER_NAMES, rope_permuted=_ROPE_PERMUTED
    ),
    build=Qwen3,
    config_to_args=lambda config, source: qwen3_config_to_args(config, source=source),
    args_to_config=args_to_qwen3_config,
)
"""The Qwen3 family's Hugging Face format."""

QWEN3_MOE_HF = DecoderHF(
    layout=DecoderLayout(
        QWEN3_MOE_MODEL_TYPE,
        layer_names=_QWEN3_LAYER_NAMES,
        rope_permuted=_ROPE_PERMUTED,
        moe_block="mlp",
        expert_names={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    ),
    build=Qwen3MoE,
    config_to_args=lambda config, source: qwen3_moe_config_to_args(config, source=source),
    args_to_config=args_to_qwen3_moe_config,
    check_layout=check_qwen3_moe_compatible,
)
"""The Qwen3-MoE family's Hugging Face format."""
