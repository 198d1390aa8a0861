"""gpt-oss hyper-parameters and the public flavors.

gpt-oss ("gpt-oss-120b & gpt-oss-20b Model Card") is a pre-norm decoder whose every FFN is a
mixture of experts, and whose attention alternates between a sliding window (even layers) and
the whole context (odd layers), with biased projections and a learned attention sink per head.
Its experts have biases and a clamped SwiGLU (`swiglu_clamped`), its router a bias and a softmax
over the top-k logits (`topk_softmax`); RoPE is YaRN-scaled (x32 over 4K) with the ramp's ends
kept fractional.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipekit.families.decoder.args import DecoderArgs, MoEFields
from pipekit.layers.rope import RopeScaling, YarnScaling
from pipekit.moe import MoEArgs

__all__ = ["GPT_OSS_FLAVORS", "GptOssArgs", "gpt_oss_flavor", "gpt_oss_moe"]


def gpt_oss_moe(num_experts: int, top_k: int = 4, load_balance_weight: float = 0.001) -> MoEArgs:
    """gpt-oss's experts and router: biases on both, the clamped SwiGLU, top-k then softmax
    (the flavors' and a Hugging Face config's)."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        router="topk_softmax",
        router_bias=True,
        expert_biases=True,
        activation="swiglu_clamped",
        load_balance_weight=load_balance_weight,
    )


@dataclass(kw_only=True, frozen=True)
class GptOssArgs(MoEFields, DecoderArgs):
    """Shape of a gpt-oss decoder (defaults: gpt-oss-120b's)."""

    dim: int = 2880
    n_layers: int = 36
    n_heads: int = 64
    n_kv_heads: int | None = 8
    head_dim: int | None = 64
    vocab_size: int = 201088
    ffn_dim: int = 2880
    """Hidden units of each expert (every FFN is a mixture of experts)."""
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: RopeScaling | YarnScaling | None = field(
        default_factory=lambda: YarnScaling(
            factor=32.0, original_max_position_embeddings=4096, mscale=0.0, truncate=False
        )
    )
    max_seq_len: int = 131072
    sliding_window: int = 128
    """Keys a query of a sliding-window layer (the even ones) sees, itself included."""
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(128))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"GptOssArgs.sliding_window={self.sliding_window} must be positive")

    def is_sliding_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` attends to a sliding window (else to the whole context)."""
        return layer_id % 2 == 0


GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    # CPU-sized, byte vocabulary (256 + BOS + EOS): 8 experts top-2, a 32-token window.
    "debug": GptOssArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=258,
        ffn_dim=96,
        rope_theta=10000.0,
        rope_scaling=None,
        max_seq_len=8192,
        sliding_window=32,
        moe=gpt_oss_moe(8, top_k=2),
    ),
    "20B": GptOssArgs(n_layers=24, moe=gpt_oss_moe(32)),
    "120B": GptOssArgs(),
}


def gpt_oss_flavor(name: str) -> GptOssArgs:
    """The GptOssArgs of a named flavor, with an error that lists the known names."""
    if name not in GPT_OSS_FLAVORS:
        raise ValueError(
            f"unknown gpt-oss flavor {name!r}; known flavors: {sorted(GPT_OSS_FLAVORS)}"
        )
    return GPT_OSS_FLAVORS[name]
