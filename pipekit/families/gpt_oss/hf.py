"""Hugging Face GptOssForCausalLM checkpoints <-> pipekit's gpt-oss: config, names, load, save.

Embeddings, norms, the checked load and save and the RoPE row order of the Q/K projections
(their biases reordered like their rows) are the shared decoder format's
(`pipekit.families.decoder.hf_layout`); the rest maps as

    pipekit: layers.L.                       Hugging Face: model.layers.L.
    attention.w{q,k,v,o}.bias   [R]          self_attn.{q,k,v,o}_proj.bias
    attention.sinks             [H]          self_attn.sinks
    feed_forward.router.gate.weight [E, D]   mlp.router.weight
    feed_forward.router.gate.bias   [E]      mlp.router.bias
    feed_forward.experts.w1_EFD, w3_EFD      mlp.experts.gate_up_proj [E, D, 2F]
        (transposed, interleaved: column 2f gate w1, 2f+1 up w3)
    feed_forward.experts.b1_EF, b3_EF        mlp.experts.gate_up_proj_bias [E, 2F] (interleaved)
    feed_forward.experts.w2_EDF [E, D, F]    mlp.experts.down_proj [E, F, D] (transposed)
    feed_forward.experts.b2_ED  [E, D]       mlp.experts.down_proj_bias

The fused expert tensors are the layout's custom tensors (`hf_fused_experts`): a rank of an
expert-parallel, FSDP or pipeline job reads only its experts' rows of them, and a sharded model
saves them by sending its blocks to each tensor's writer.

config.json: every layer is MoE with `intermediate_size` hidden units per expert;
`num_local_experts`, `num_experts_per_tok` and `router_aux_loss_coef` (the weight of pipekit's
switch balance loss) give the `topk_softmax` router with biases and the experts with biases and
the clamped SwiGLU, which only `swiglu_alpha=1.702` and `swiglu_limit=7.0` describe. Layers
alternate a `sliding_window` (even) and the whole context (odd) as `layer_types` must say;
`attention_bias` must be true. Absent keys take transformers' GptOssConfig defaults: `head_dim`
64, and with neither `rope_scaling` nor `rope_parameters`, YaRN x32 over 4096 positions without
truncation (so an unscaled model is written with `rope_type="default"`).

Legend: D model dim, H query heads, R projection rows, E experts, F expert hidden dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.families.decoder.hf_config import (
    CONFIG_FILE,
    HFModelType,
    build_args,
    decoder_config_fields,
    decoder_config_keys,
    is_int,
)
from pipekit.families.decoder.hf_fused_experts import InterleavedTensor
from pipekit.families.decoder.hf_layout import DENSE_LAYER_NAMES, DecoderHF, DecoderLayout
from pipekit.families.gpt_oss.args import GptOssArgs, gpt_oss_moe
from pipekit.families.gpt_oss.model import GptOss
from pipekit.moe.activations import SWIGLU_ALPHA, SWIGLU_LIMIT

__all__ = [
    "GPT_OSS_HF",
    "GPT_OSS_MODEL_TYPE",
    "args_to_gpt_oss_config",
    "check_gpt_oss_compatible",
    "gpt_oss_config_to_args",
]

GPT_OSS_MODEL_TYPE = HFModelType(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    pipekit_model="gpt-oss",
    rope_theta=150000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    num_key_value_heads=8,
    rope_types=("llama3", "yarn"),
    attention_bias=True,
)
"""transformers' GptOssConfig."""

# transformers' GptOssConfig defaults of the keys it has beyond Llama's (and of head_dim, which
# it does not derive from hidden_size when absent).
_DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.001,
    "swiglu_alpha": SWIGLU_ALPHA,
    "swiglu_limit": SWIGLU_LIMIT,
}
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""What transformers computes when config.json has neither `rope_scaling` nor
`rope_parameters`."""
_LAYER_TYPES = ("sliding_attention", "full_attention")
_ROUTER = "topk_softmax"
_ACTIVATION = "swiglu_clamped"

_EXPERTS = "feed_forward.experts."
_ATTENTION_WEIGHTS = {k: v for k, v in DENSE_LAYER_NAMES.items() if k.startswith("attention.w")}
_LAYER_NAMES = {
    **{k: v for k, v in DENSE_LAYER_NAMES.items() if not k.startswith("feed_forward.")},
    **{
        k.replace(".weight", ".bias"): v.replace(".weight", ".bias")
        for k, v in _ATTENTION_WEIGHTS.items()
    },
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    _EXPERTS + "b2_ED": "mlp.experts.down_proj_bias",
}
_FUSED_EXPERTS = (
    InterleavedTensor(
        "mlp.experts.gate_up_proj", (_EXPERTS + "w1_EFD", _EXPERTS + "w3_EFD"), transposed=True
    ),
    InterleavedTensor("mlp.experts.gate_up_proj_bias", (_EXPERTS + "b1_EF", _EXPERTS + "b3_EF")),
    InterleavedTensor("mlp.experts.down_proj", (_EXPERTS + "w2_EDF",), transposed=True),
)


def _gpt_oss_problems(config: Mapping[str, Any]) -> list[str]:
    """What pipekit's gpt-oss cannot compute (as transformers does) of the gpt-oss keys."""
    problems = [
        f"{key}={config[key]!r} must be a positive integer"
        for key in ("sliding_window", "num_local_experts", "num_experts_per_tok")
        if not (is_int(config[key]) and config[key] > 0)
    ]
    coef = config["router_aux_loss_coef"]
    if isinstance(coef, bool) or not isinstance(coef, int | float):
        problems.append(f"router_aux_loss_coef={coef!r} must be a number")
    problems += [
        f"{key}={config[key]!r} (pipekit's clamped SwiGLU has {key}={fixed}; only {fixed} loads)"
        for key, fixed in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT))
        if config[key] != fixed
    ]
    layer_types, layers = config.get("layer_types"), config.get("num_hidden_layers")
    if layer_types is not None and is_int(layers) and layer_types != _layer_types(layers):
        problems.append(
            f"layer_types={_abbreviated(layer_types)} (pipekit's gpt-oss alternates "
            f"{_LAYER_TYPES[0]!r} on even and {_LAYER_TYPES[1]!r} on odd layers); give that "
            "pattern or drop layer_types"
        )
    return problems


def _layer_types(n_layers: int) -> list[str]:
    """`layer_types` of gpt-oss: a sliding window on even layers (`GptOssArgs.is_sliding_layer`),
    the whole context on odd ones."""
    return [_LAYER_TYPES[layer % 2] for layer in range(n_layers)]


def _abbreviated(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def gpt_oss_config_to_args(config: Mapping[str, Any], *, source: str = CONFIG_FILE) -> GptOssArgs:
    """Parse a gpt-oss config.json; reject what pipekit's gpt-oss cannot compute.

    Routing is dropless (`capacity_factor=None`), as transformers runs it; every layer is MoE.
    """
    config = _DEFAULTS | dict(config)
    if not config.get("rope_scaling") and not config.get("rope_parameters"):
        config["rope_parameters"] = _DEFAULT_ROPE
    fields = decoder_config_fields(
        config, source=source, model_type=GPT_OSS_MODEL_TYPE, problems=_gpt_oss_problems(config)
    )
    try:
        moe = gpt_oss_moe(
            config["num_local_experts"],
            config["num_experts_per_tok"],
            float(config["router_aux_loss_coef"]),
        )
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from error
    extra = {"moe": moe, "sliding_window": config["sliding_window"]}
    return build_args(GptOssArgs, fields | extra, source)


def check_gpt_oss_compatible(args: GptOssArgs) -> None:
    """Raise ValueError, naming the fix, if a model with `args` has no gpt-oss layout."""
    moe, problems = args.moe, []
    if moe.activation != _ACTIVATION or not (moe.expert_biases and moe.router_bias):
        problems.append(
            f"moe.activation={moe.activation!r}, expert_biases={moe.expert_biases}, "
            f"router_bias={moe.router_bias}, but gpt-oss experts are biased {_ACTIVATION!r} ones "
            f"with a biased router; use activation={_ACTIVATION!r} with both biases"
        )
    if moe.router != _ROUTER:
        problems.append(
            f"router={moe.router!r} routes differently from gpt-oss (softmax over the top-k "
            f"logits); use router={_ROUTER!r}"
        )
    if moe.num_shared_experts or args.moe_every != 1:
        problems.append(
            f"moe.num_shared_experts={moe.num_shared_experts}, moe_every={args.moe_every}, but "
            "every gpt-oss layer is MoE with routed experts only; set 0 and 1"
        )
    if problems:
        raise ValueError(
            f"the GptOssArgs have no gpt-oss layout: {'; '.join(problems)}; or keep the model "
            "in pipekit's DCP checkpoints"
        )


def args_to_gpt_oss_config(args: GptOssArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of a gpt-oss with `args` whose weights are `dtype` (published dialect)."""
    check_gpt_oss_compatible(args)
    config = decoder_config_keys(args, dtype, GPT_OSS_MODEL_TYPE)
    return config | {
        # null would mean gpt-oss's YaRN to transformers
        "rope_scaling": config["rope_scaling"] or {"rope_type": "default"},
        "intermediate_size": args.moe_ffn_dim,
        "num_local_experts": args.moe.num_experts,
        "num_experts_per_tok": args.moe.top_k,
        "router_aux_loss_coef": args.moe.load_balance_weight,
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": SWIGLU_LIMIT,
        "sliding_window": args.sliding_window,
        "layer_types": _layer_types(args.n_layers),
        "attention_bias": True,
        "output_router_logits": False,
    }


GPT_OSS_HF = DecoderHF(
    layout=DecoderLayout(
        GPT_OSS_MODEL_TYPE,
        layer_names=_LAYER_NAMES,
        rope_permuted=tuple(
            f"attention.{weight}.{kind}" for weight in ("wq", "wk") for kind in ("weight", "bias")
        ),
        custom=_FUSED_EXPERTS,
    ),
    build=GptOss,
    config_to_args=lambda config, source: gpt_oss_config_to_args(config, source=source),
    args_to_config=args_to_gpt_oss_config,
    check_layout=check_gpt_oss_compatible,
)
"""The gpt-oss family's Hugging Face format."""
