"""DeepSeek-V3 hyper-parameters and the public flavors.

DeepSeek-V3 is a pre-norm decoder whose attention is multi-head latent attention (MLA: low-rank
queries, one compressed KV latent per token, a decoupled RoPE part, YaRN for long context), whose
first `first_dense_layers` FFNs are dense SwiGLU and the rest mixtures of experts: shared experts
beside routed ones, a sigmoid router with group-limited top-k, routed scaling and
auxiliary-loss-free balancing by a per-expert bias (`MoEArgs` with `router="sigmoid_topk"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipekit.families.decoder.args import DecoderArgs, MoEFields
from pipekit.layers.latent_attention import LATENT_ATTENTION_CACHES
from pipekit.layers.rope import RopeScaling, YarnScaling
from pipekit.moe import MoEArgs

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "deepseek_v3_flavor", "deepseek_v3_moe"]


def deepseek_v3_moe(
    num_experts: int,
    top_k: int,
    *,
    shared: int,
    groups: int,
    topk_groups: int,
    routed_scaling: float = 2.5,
) -> MoEArgs:
    """DeepSeek-V3's MoE at a size: shared experts, the grouped sigmoid router with routed
    scaling, bias balancing (step 1e-3) and a small sequence-wise balance loss."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        router="sigmoid_topk",
        num_shared_experts=shared,
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling=routed_scaling,
        bias_update_rate=1e-3,
        load_balance="sequence",
        load_balance_weight=1e-4,
    )


@dataclass(kw_only=True, frozen=True)
class DeepSeekV3Args(MoEFields, DecoderArgs):
    """Shape of a DeepSeek-V3 decoder (defaults: DeepSeek-V3's 671B)."""

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    ffn_dim: int = 18432
    """Hidden units of the dense FFNs of the first layers."""
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = field(
        default_factory=lambda: YarnScaling(
            factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
        )
    )
    max_seq_len: int = 163840
    q_lora_rank: int | None = 1536
    """Rank of the low-rank query projection; None: one full projection (`wq`)."""
    kv_lora_rank: int = 512
    """Width of the compressed KV latent each token keeps."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without RoPE (expanded from the latent)."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with RoPE; the RoPE key of this width is shared by every head."""
    v_head_dim: int = 128
    """Per-head value dims."""
    first_dense_layers: int = 3
    """The first layers keep a dense FFN; every later one is MoE."""
    attention_cache: str = "expanded"
    """What attention hands its context (a KV cache, exchange, context parallelism): "expanded"
    per-head keys and values, or "latent" (the absorbed form: one latent key that is its own
    value, `kv_lora_rank + qk_rope_head_dim` per token)."""
    moe: MoEArgs = field(
        default_factory=lambda: deepseek_v3_moe(256, 8, shared=1, groups=8, topk_groups=4)
    )
    expert_ffn_dim: int | None = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        kind = type(self).__name__
        if self.attention_cache not in LATENT_ATTENTION_CACHES:
            raise ValueError(
                f"{kind}.attention_cache={self.attention_cache!r} must be one of "
                f"{LATENT_ATTENTION_CACHES}"
            )
        if self.head_dim is not None:
            raise ValueError(
                f"{kind}.head_dim={self.head_dim} is set by qk_nope_head_dim + qk_rope_head_dim; "
                "leave it unset"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
            raise ValueError(f"{kind}.qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if not 0 <= self.first_dense_layers < self.n_layers:
            raise ValueError(
                f"{kind}.first_dense_layers={self.first_dense_layers} must be in "
                f"[0, n_layers={self.n_layers}) (at least one MoE layer)"
            )

    @property
    def per_head_dim(self) -> int:
        """A query's (and an expanded key's) dims: the no-RoPE part and the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense_layers

    @property
    def softmax_scale_factor(self) -> float:
        """YaRN's correction of the attention's softmax scale (1 without YaRN)."""
        scaling = self.rope_scaling
        return scaling.softmax_scale_factor if isinstance(scaling, YarnScaling) else 1.0


DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # CPU-sized, byte vocabulary (256 + BOS + EOS): one dense layer, then MoE layers of 8
    # experts top-2 in 4 groups (2 per token), one shared expert, bias balancing.
    "debug": DeepSeekV3Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        vocab_size=258,
        ffn_dim=384,
        rope_scaling=None,
        max_seq_len=8192,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_dense_layers=1,
        moe=deepseek_v3_moe(8, 2, shared=1, groups=4, topk_groups=2),
        expert_ffn_dim=96,
    ),
    # DeepSeek-V2-Lite's shape with V3's routing and YaRN (V2-Lite's own mscale is 0.707):
    # 27 layers, 64 experts top-6, no query LoRA.
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        ffn_dim=10944,
        q_lora_rank=None,
        first_dense_layers=1,
        moe=deepseek_v3_moe(64, 6, shared=2, groups=1, topk_groups=1, routed_scaling=1.0),
        expert_ffn_dim=1408,
    ),
    "671B": DeepSeekV3Args(),
}
# The shapes whose attention hands the latent to its context (what a sliced pipeline caches).
for _name in ("debug", "16B", "671B"):
    DEEPSEEK_V3_FLAVORS[f"{_name}_latent"] = DEEPSEEK_V3_FLAVORS[_name].with_updates(
        attention_cache="latent"
    )


def deepseek_v3_flavor(name: str) -> DeepSeekV3Args:
    """The DeepSeekV3Args of a named flavor, with an error that lists the known names."""
    if name not in DEEPSEEK_V3_FLAVORS:
        raise ValueError(
            f"unknown DeepSeek-V3 flavor {name!r}; known flavors: {sorted(DEEPSEEK_V3_FLAVORS)}"
        )
    return DEEPSEEK_V3_FLAVORS[name]
