"""Hugging Face DeepseekV3ForCausalLM checkpoints <-> pipekit's DeepSeek-V3: config, names,
load, save.

The checked load and save, embeddings, block norms, dense FFNs and the per-expert layout of the
experts are the shared decoder format's (`pipekit.families.decoder.hf_layout`); the attention
is multi-head latent attention, and an MoE block adds shared experts and the router's bias:

    pipekit: layers.L.                        Hugging Face: model.layers.L.
    attention.wq_a.weight        [Q, D]       self_attn.q_a_proj.weight
    attention.q_norm.weight      [Q]          self_attn.q_a_layernorm.weight
    attention.wq_b.weight        [H*K, Q]     self_attn.q_b_proj.weight
    attention.wq.weight          [H*K, D]     self_attn.q_proj.weight        (q_lora_rank null)
    attention.wkv_a.weight       [C+R, D]     self_attn.kv_a_proj_with_mqa.weight
    attention.kv_norm.weight     [C]          self_attn.kv_a_layernorm.weight
    attention.wkv_b.weight       [H*(N+V), C] self_attn.kv_b_proj.weight
    attention.wo.weight          [D, H*V]     self_attn.o_proj.weight
    feed_forward.w1, w3, w2                   mlp.gate_proj, up_proj, down_proj (dense layers)
    feed_forward.router.gate.weight   [E, D]  mlp.gate.weight
    feed_forward.router.expert_bias   [E]     mlp.gate.e_score_correction_bias (float32 buffer)
    feed_forward.experts.w1_EFD[j]    [F, D]  mlp.experts.j.gate_proj.weight
    feed_forward.experts.w2_EDF[j]    [D, F]  mlp.experts.j.down_proj.weight
    feed_forward.experts.w3_EFD[j]    [F, D]  mlp.experts.j.up_proj.weight
    feed_forward.shared_experts.w1, w3, w2    mlp.shared_experts.gate_proj, up_proj, down_proj

Multi-token prediction depth k is stored as layer n_layers + k (`num_nextn_predict_layers`
depths): its block's tensors named as any layer's, and beside them

    pipekit: mtp.k.                           Hugging Face: model.layers.{n_layers + k}.
    block.*                                   (as a layer's)
    enorm.weight, hnorm.weight   [D]          enorm.weight, hnorm.weight
    eh_proj.weight               [D, 2D]      eh_proj.weight
    norm.weight                  [D]          shared_head.norm.weight
    (tok_embeddings.weight, output.weight)    embed_tokens.weight, shared_head.head.weight

The last two are copies of the main model's embedding and output layer: written on save,
checked equal to them on load (one weight is trained). transformers writes
`num_nextn_predict_layers` but drops those layers: a checkpoint without them loads as the main
model alone.

No row is reordered. DeepSeek keeps each head's RoPE part in interleaved pairs, as pipekit's RoPE
does; transformers (`rope_interleave=true`) splits q and k into even and odd channels alike
before rotating, which leaves every q.k product as it was. A checkpoint with
`rope_interleave=false` would need its RoPE rows de-interleaved, and is refused instead.

config.json: `first_k_dense_replace` is `first_dense_layers`, `intermediate_size` the dense
FFNs' width and `moe_intermediate_size` the experts'; the router is `sigmoid_topk` with
`n_group`/`topk_group` groups, `routed_scaling_factor`, `n_shared_experts`, DeepSeek's
sequence-wise balance loss weighted by `aux_loss_alpha`. YaRN (`rope_type="yarn"`) becomes
`YarnScaling`. `attention_cache` is how pipekit runs the attention, not what the weights
compute: a load gives "expanded", and a model of either kind loads the checkpoint.

Legend: D model dim, H heads, Q query rank, C KV latent rank, R RoPE dim, N no-RoPE dim,
V value dim, K = N + R, E experts, F expert hidden dim.
"""

from __future__ import annotations

import json
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
from pipekit.families.deepseek_v3.args import DeepSeekV3Args
from pipekit.families.deepseek_v3.model import DeepSeekV3
from pipekit.moe import MoEArgs

__all__ = [
    "DEEPSEEK_V3_HF",
    "DEEPSEEK_V3_MODEL_TYPE",
    "args_to_deepseek_v3_config",
    "check_deepseek_v3_compatible",
    "deepseek_v3_config_to_args",
]

DEEPSEEK_V3_MODEL_TYPE = HFModelType(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    pipekit_model="DeepSeek-V3",
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    num_key_value_heads=128,
    rope_types=("llama3", "yarn"),
)
"""transformers' DeepseekV3Config."""

# DeepSeek-V3's sequence-wise balance weight and bias step (not in a transformers config).
_BALANCE_WEIGHT = 1e-4
_BIAS_UPDATE_RATE = 1e-3
# transformers' DeepseekV3Config defaults of the DeepSeek-V3 keys (and DeepSeek's balance weight).
_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 3,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "aux_loss_alpha": _BALANCE_WEIGHT,
    "num_nextn_predict_layers": 0,
}
_MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_POSITIVE_INTS = (
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "n_shared_experts",
)
# Keys pipekit computes one value of: (that value, why), checked where present.
_FIXED: dict[str, tuple[object, str]] = {
    "norm_topk_prob": (True, "pipekit's sigmoid_topk router renormalises the chosen weights"),
    "rope_interleave": (True, "pipekit's RoPE rotates interleaved pairs, as DeepSeek stores them"),
    "scoring_func": ("sigmoid", "pipekit's DeepSeek-V3 router scores with a sigmoid"),
    "topk_method": ("noaux_tc", "pipekit picks experts by score plus bias within groups"),
    "moe_layer_freq": (1, "every layer after the first_k_dense_replace dense ones is MoE"),
}
# transformers normalises the query and KV latents with this eps whatever rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6
_ROUTER = "sigmoid_topk"

_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ROUTER_BIAS = "feed_forward.router.expert_bias"
_LAYER_NAMES = {
    **{key: value for key, value in DENSE_LAYER_NAMES.items() if "attention.w" not in key},
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": DENSE_LAYER_NAMES["attention.wo.weight"],
    **{
        f"feed_forward.shared_experts.{weight}.weight": f"mlp.shared_experts.{name}.weight"
        for weight, name in _EXPERT_NAMES.items()
    },
    _ROUTER_BIAS: "mlp.gate.e_score_correction_bias",
}


def _value(config: Mapping[str, Any], key: str) -> Any:
    return config.get(key, _DEFAULTS[key])


def _deepseek_problems(config: Mapping[str, Any]) -> list[str]:
    """What pipekit's DeepSeek-V3 cannot compute (as transformers does) of the DeepSeek keys."""
    problems = [
        f"{key}={_value(config, key)!r} must be a positive integer"
        for key in _POSITIVE_INTS
        if not (is_int(_value(config, key)) and _value(config, key) > 0)
    ]
    q_rank = _value(config, "q_lora_rank")
    if q_rank is not None and not (is_int(q_rank) and q_rank > 0):
        problems.append(f"q_lora_rank={q_rank!r} must be a positive integer or null")
    for key in ("first_k_dense_replace", "num_nextn_predict_layers"):
        if not (is_int(_value(config, key)) and _value(config, key) >= 0):
            problems.append(f"{key}={_value(config, key)!r} must be a non-negative integer")
    problems += [
        f"{key}={_value(config, key)!r} must be a number"
        for key in ("routed_scaling_factor", "aux_loss_alpha")
        if isinstance(_value(config, key), bool) or not isinstance(_value(config, key), int | float)
    ]
    problems += [
        f"{key}={json.dumps(config[key])} ({why}; only {json.dumps(required)} loads)"
        for key, (required, why) in _FIXED.items()
        if key in config and config[key] != required
    ]
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", DEEPSEEK_V3_MODEL_TYPE.num_key_value_heads)
    if kv_heads not in (None, heads):
        problems.append(
            f"num_key_value_heads={kv_heads!r} differs from num_attention_heads={heads!r} "
            "(latent attention expands keys and values for every head); set it to "
            "num_attention_heads"
        )
    rope_dim = _value(config, "qk_rope_head_dim")
    if config.get("head_dim") not in (None, rope_dim):
        problems.append(
            f"head_dim={config['head_dim']!r} differs from qk_rope_head_dim={rope_dim!r} "
            "(transformers sizes DeepSeek-V3's RoPE by head_dim); set head_dim to "
            "qk_rope_head_dim or drop it"
        )
    eps = config.get("rms_norm_eps", DEEPSEEK_V3_MODEL_TYPE.rms_norm_eps)
    if eps != _LATENT_NORM_EPS:
        problems.append(
            f"rms_norm_eps={eps!r} (transformers normalises the query and KV latents with "
            f"{_LATENT_NORM_EPS} whatever it says, pipekit every norm with one eps); need "
            f"{_LATENT_NORM_EPS}"
        )
    return problems


def deepseek_v3_config_to_args(
    config: Mapping[str, Any], *, source: str = CONFIG_FILE
) -> DeepSeekV3Args:
    """Parse a DeepSeek-V3 config.json; reject what pipekit's DeepSeek-V3 cannot compute.

    Routing is dropless (`capacity_factor=None`), as transformers runs it; the balance loss is
    DeepSeek's sequence-wise one, weighted by `aux_loss_alpha` (default 1e-4, DeepSeek-V3's),
    and the bias moves by DeepSeek-V3's 1e-3 per step."""
    fields = decoder_config_fields(
        config,
        source=source,
        model_type=DEEPSEEK_V3_MODEL_TYPE,
        problems=_deepseek_problems(config),
    )
    moe_fields = {
        "num_experts": _value(config, "n_routed_experts"),
        "top_k": _value(config, "num_experts_per_tok"),
        "router": _ROUTER,
        "capacity_factor": None,
        "num_shared_experts": _value(config, "n_shared_experts"),
        "num_groups": _value(config, "n_group"),
        "topk_groups": _value(config, "topk_group"),
        "routed_scaling": float(_value(config, "routed_scaling_factor")),
        "bias_update_rate": _BIAS_UPDATE_RATE,
        "load_balance": "sequence",
        "load_balance_weight": float(_value(config, "aux_loss_alpha")),
    }
    extra = {
        "head_dim": None,  # qk_nope_head_dim + qk_rope_head_dim
        "n_kv_heads": None,
        "q_lora_rank": _value(config, "q_lora_rank"),
        "kv_lora_rank": _value(config, "kv_lora_rank"),
        "qk_nope_head_dim": _value(config, "qk_nope_head_dim"),
        "qk_rope_head_dim": _value(config, "qk_rope_head_dim"),
        "v_head_dim": _value(config, "v_head_dim"),
        "first_dense_layers": _value(config, "first_k_dense_replace"),
        "expert_ffn_dim": _value(config, "moe_intermediate_size"),
        "moe": build_args(MoEArgs, moe_fields, source),
        "attention_cache": "expanded",
        "mtp_depth": _value(config, "num_nextn_predict_layers"),
    }
    return build_args(DeepSeekV3Args, fields | extra, source)


def check_deepseek_v3_compatible(args: DeepSeekV3Args) -> None:
    """Raise ValueError, naming the fix, if a model with `args` has no DeepSeek-V3 layout."""
    problems = expert_layout_problems(args, shared_experts=True)
    if args.moe.router != _ROUTER:
        problems.append(
            f"router={args.moe.router!r} routes differently from DeepSeek-V3 (sigmoid scores, "
            f"top-k of score + bias within groups); use router={_ROUTER!r}"
        )
    if args.moe.num_shared_experts < 1:
        problems.append(
            "moe.num_shared_experts=0, but DeepSeek-V3 layers always have shared experts; "
            "set num_shared_experts >= 1, or keep the model in pipekit's DCP checkpoints"
        )
    if args.norm_eps != _LATENT_NORM_EPS:
        problems.append(
            f"norm_eps={args.norm_eps} (transformers normalises the query and KV latents with "
            f"{_LATENT_NORM_EPS} whatever rms_norm_eps says); use norm_eps={_LATENT_NORM_EPS}"
        )
    if problems:
        raise ValueError(f"the DeepSeekV3Args have no DeepSeek-V3 layout: {'; '.join(problems)}")


def args_to_deepseek_v3_config(
    args: DeepSeekV3Args, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The config.json of a DeepSeek-V3 with `args` whose weights are `dtype` (with the keys
    DeepSeek's own code reads as well as transformers')."""
    check_deepseek_v3_compatible(args)
    moe = args.moe
    return decoder_config_keys(args, dtype, DEEPSEEK_V3_MODEL_TYPE) | {
        "head_dim": args.qk_rope_head_dim,  # what transformers sizes the RoPE by
        "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "first_k_dense_replace": args.first_dense_layers,
        "moe_layer_freq": 1,
        "moe_intermediate_size": args.moe_ffn_dim,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.num_shared_experts,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.routed_scaling,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "aux_loss_alpha": moe.load_balance_weight,
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": args.mtp_depth,
        "output_router_logits": False,
    }


DEEPSEEK_V3_HF = DecoderHF(
    layout=DecoderLayout(
        DEEPSEEK_V3_MODEL_TYPE,
        layer_names=_LAYER_NAMES,
        rope_permuted=(),
        moe_block="mlp",
        expert_names=_EXPERT_NAMES,
        buffers=(_ROUTER_BIAS,),
        mtp_names=_MTP_NAMES,
    ),
    build=DeepSeekV3,
    config_to_args=lambda config, source: deepseek_v3_config_to_args(config, source=source),
    args_to_config=args_to_deepseek_v3_config,
    check_layout=check_deepseek_v3_compatible,
    training_fields=("max_seq_len", "attention_cache", "mtp_loss_weight"),
)
"""The DeepSeek-V3 family's Hugging Face format."""
