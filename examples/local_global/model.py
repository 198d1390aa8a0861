"""A Gemma/Mistral-flavoured MoE decoder written outside pipekit, with every trait pipekit must
honour in every layout: sliding-window attention on even layers and full causal attention on
odd ones, every layer's attention scores soft-capped (`AttentionPattern`), RMSNorm applied as
`(1 + w)`, GeGLU MLPs, embeddings scaled by
sqrt(dim) (a stateless module on the first stage only), logits soft-capped as
`tanh(logits / 30) * 30` (a logits transform), tied input and output embeddings, and pipekit's
MoE with GeGLU experts on every third block. `python -m pipekit.check --config
examples/local_global/debug.toml` checks it under every layout against one process."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from pipekit.attention import AttentionPattern
from pipekit.attention.context import AttentionContext
from pipekit.distributed.tensor_parallel_styles import gathered_input, routes_own_tokens, row_split
from pipekit.layers import GroupedQueryAttention, RotaryEmbedding
from pipekit.layers.init import seeded, trunc_normal_
from pipekit.models import ModelShape, ModelSpec, ModelStructure, register_model
from pipekit.moe import MoE, MoEArgs


@dataclass(frozen=True)
class LocalGlobalArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    vocab_size: int = 258  # pipekit's byte tokenizer
    max_seq_len: int = 1024
    window: int = 16
    """Sliding window of the even (local) layers; the odd ones attend to everything before."""
    moe_every: int = 3
    """Every `moe_every`-th block (1-based) is a mixture of experts."""
    moe: MoEArgs = field(
        default_factory=lambda: MoEArgs(num_experts=4, top_k=2, activation="geglu")
    )
    softcap: float = 2.0
    """Soft cap of the logits (Gemma 2 uses 30; this small model's logits are small)."""
    attention_softcap: float | None = 1.0
    """Soft cap of every layer's attention scores (Gemma 2 uses 50; small here too)."""
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.moe_every == 0


class OnePlusRMSNorm(nn.Module):
    """Gemma's RMSNorm: `x / rms(x) * (1 + w)`, w starting near zero."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.1)  # not zero, so (1 + w) and w differ in a test

    def forward(self, x_BSD: Tensor) -> Tensor:
        rstd_BS1 = torch.rsqrt(x_BSD.pow(2).mean(-1, keepdim=True) + self.eps)
        return x_BSD * rstd_BS1 * (1 + self.weight)


class GeGLU(nn.Module):
    """`w2(gelu_tanh(w1 x) * w3 x)`."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_BSD: Tensor) -> Tensor:
        gate_BSF = nn.functional.gelu(self.w1(x_BSD), approximate="tanh")
        return self.w2(gate_BSF * self.w3(x_BSD))


class Scale(nn.Module):
    """Multiplies by a constant (the embedding's sqrt(dim)): no parameters."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


class SoftCap(nn.Module):
    """`tanh(x / cap) * cap`, on every logit alone."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, logits: Tensor) -> Tensor:
        return torch.tanh(logits / self.cap) * self.cap


class Block(nn.Module):
    def __init__(self, layer_id: int, args: LocalGlobalArgs) -> None:
        super().__init__()
        self.layer_id = str(layer_id)
        window = args.window if layer_id % 2 == 0 else None
        pattern = AttentionPattern(window=window, softcap=args.attention_softcap)
        self.attention_norm, self.ffn_norm = OnePlusRMSNorm(args.dim), OnePlusRMSNorm(args.dim)
        self.attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, pattern=pattern
        )
        self.feed_forward: nn.Module = (
            MoE(args.dim, args.ffn_dim, args.moe)
            if args.is_moe(layer_id)
            else GeGLU(args.dim, args.ffn_dim)
        )

    def reset_parameters(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters()
        if isinstance(self.feed_forward, MoE):
            self.feed_forward.reset_parameters()
        else:
            for linear in (self.feed_forward.w1, self.feed_forward.w2, self.feed_forward.w3):
                trunc_normal_(linear.weight, 0.02)

    def forward(
        self, h_BSD: Tensor, rope_cos_sin: tuple[Tensor, Tensor], context: AttentionContext | None
    ) -> Tensor:
        h_BSD = h_BSD + self.attention(
            self.attention_norm(h_BSD), rope_cos_sin, self.layer_id, context
        )
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD))


class LocalGlobalLM(nn.Module):
    """A pipeline stage is this model with other stages' modules set to None: forward applies
    what is present, so stages compose to the whole model."""

    def __init__(self, args: LocalGlobalArgs) -> None:
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.embed_scale = Scale(math.sqrt(args.dim))
        self.rope = RotaryEmbedding(args.head_dim, theta=10000.0)
        self.blocks = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm = OnePlusRMSNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.softcap = SoftCap(args.softcap)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_embeddings and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Each module drawn from (seed, its name) alone; a tied head by the embedding's name."""
        seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        device = next(self.parameters()).device
        self.tie_weights()
        embedding = self.wte
        if embedding is None and self.args.tie_embeddings:
            embedding = self.lm_head
        if embedding is not None:
            with seeded(seed, "wte", device):
                nn.init.normal_(embedding.weight, std=0.02)
        for key, block in (self.blocks or {}).items():
            with seeded(seed, f"blocks.{key}", device):
                block.reset_parameters()
        if self.norm is not None:
            with seeded(seed, "norm", device):
                self.norm.reset_parameters()
        if self.lm_head is not None and not self.args.tie_embeddings:
            with seeded(seed, "lm_head", device):
                trunc_normal_(self.lm_head.weight, self.args.dim**-0.5)

    def forward(
        self,
        tokens_or_hidden: Tensor,
        positions: Tensor | None = None,
        attention_context: AttentionContext | None = None,
    ) -> Tensor:
        h_BSD = tokens_or_hidden
        if self.wte is not None and not h_BSD.is_floating_point():
            h_BSD = self.wte(h_BSD)
        if self.embed_scale is not None:
            h_BSD = self.embed_scale(h_BSD)
        if positions is None:
            positions = torch.arange(h_BSD.shape[1], device=h_BSD.device)
        rope_cos_sin = self.rope(positions)
        for block in (self.blocks or {}).values():
            h_BSD = block(h_BSD, rope_cos_sin, attention_context)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.lm_head is None:
            return h_BSD
        logits_BSV = self.lm_head(h_BSD)
        return logits_BSV if self.softcap is None else self.softcap(logits_BSV)


def _shape(args: LocalGlobalArgs) -> ModelShape:
    return ModelShape(
        dim=args.dim,
        num_layers=args.n_layers,
        vocab_size=args.vocab_size,
        num_heads=args.n_heads,
        num_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        tied_embeddings=args.tie_embeddings,
        max_seq_len=args.max_seq_len,
    )


def tensor_parallel_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron's split from pipekit's pieces: q, k, v and the GeGLU's w1, w3 by output rows,
    wo and w2 by input columns; the norms on a rank's tokens under sequence parallelism, the
    MoE routing them."""
    back_to_residual = row_split(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        "attention": gathered_input(sequence_parallel, other_args=3),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": back_to_residual,
    }
    if sequence_parallel:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    if isinstance(block.get_submodule("feed_forward"), GeGLU):
        plan |= {
            "feed_forward": gathered_input(sequence_parallel),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": back_to_residual,
        }
    elif sequence_parallel:
        plan["feed_forward"] = routes_own_tokens()
    return plan


STRUCTURE = ModelStructure(
    blocks="blocks",
    embedding="wte",
    output="lm_head",
    before_blocks=("embed_scale",),
    after_blocks=("norm",),
    logits_transforms=("softcap",),
    shared=("rope",),
)
"""Every module placed once: the embedding scale on the first stage only, the soft-cap after
the output (on each vocabulary shard under vocabulary parallelism), RoPE on every stage."""
LOCAL_GLOBAL = ModelSpec(
    "local_global",
    {"debug": LocalGlobalArgs()},
    LocalGlobalLM,
    _shape,
    STRUCTURE,
    tensor_parallel_plan=tensor_parallel_plan,
)
register_model(LOCAL_GLOBAL)
