"""A model unlike pipekit's built-in families, trained by pipekit: a Falcon / GPT-J style
decoder with parallel blocks (attention and MLP read one biased LayerNorm and add to the stream
together), learned absolute positions and no RoPE, ALiBi on the even layers, multi-query
attention with biased projections, an untied output projection with a bias, and a
switch-routed mixture of experts with a capacity factor in every other block.
`python -m pipekit.check --config examples/parallel_blocks/debug.toml --model.flavor
debug_dropless` holds it against one process under every layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipekit.attention import ALIBI, AttentionPattern, alibi_slopes
from pipekit.attention.context import AttentionContext, attend
from pipekit.layers import HeadValues
from pipekit.layers.init import seeded, trunc_normal_
from pipekit.models import ModelShape, ModelSpec, ModelStructure, register_model
from pipekit.moe import MoE, MoEArgs


@dataclass(frozen=True)
class ParallelBlocksArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 258  # pipekit's byte tokenizer
    max_seq_len: int = 512
    moe: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=4, top_k=1, router="switch", capacity_factor=1.25, activation="gelu"
        )
    )


ALIBI_LAYER = AttentionPattern(score_bias=ALIBI)
"""Causal attention with each head's scores lowered by its slope times the tokens' distance."""


class MultiQueryAttention(nn.Module):
    """Every query head reads one shared key/value head (multi-query attention); q, k and v
    carry biases (the key's gets no gradient: softmax ignores a per-query constant). With
    `alibi`, the scores are biased by head and distance instead of positions entering q, k."""

    def __init__(self, args: ParallelBlocksArgs, alibi: bool) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim)
        self.wkv = nn.Linear(args.dim, 2 * self.head_dim)
        self.proj = nn.Linear(args.dim, args.dim)
        self.slopes = HeadValues(alibi_slopes(args.n_heads)) if alibi else None
        self.pattern = ALIBI_LAYER if alibi else None

    def forward(self, x_BSD: Tensor, layer_id: str, context: AttentionContext | None) -> Tensor:
        q_BHSK = self.wq(x_BSD).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k_BSK, v_BSK = self.wkv(x_BSD).chunk(2, dim=-1)
        k_B1SK, v_B1SK = k_BSK.unsqueeze(1), v_BSK.unsqueeze(1)
        slopes_H = None if self.slopes is None else self.slopes()
        out_BHSK = attend(
            context, layer_id, q_BHSK, k_B1SK, v_B1SK, self.head_dim**-0.5, self.pattern,
            bias_H=slopes_H,
        )  # fmt: skip
        return self.proj(out_BHSK.transpose(1, 2).flatten(2))


class ParallelBlock(nn.Module):
    """`h + attention(ln(h)) + mlp(ln(h))`: one LayerNorm feeds both branches (GPT-J)."""

    def __init__(self, layer_id: int, args: ParallelBlocksArgs) -> None:
        super().__init__()
        self.layer_id = str(layer_id)
        self.ln = nn.LayerNorm(args.dim)
        self.attn = MultiQueryAttention(args, alibi=layer_id % 2 == 0)
        if layer_id % 2:
            self.mlp: nn.Module = MoE(args.dim, 2 * args.dim, args.moe)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim)
            )

    def reset_parameters(self) -> None:
        dense = [] if isinstance(self.mlp, MoE) else [self.mlp[0], self.mlp[2]]
        for linear in (self.attn.wq, self.attn.wkv, self.attn.proj, *dense):
            trunc_normal_(linear.weight, 0.02)
            nn.init.normal_(linear.bias, std=0.02)  # non-zero: every bias is exercised
        self.ln.reset_parameters()
        nn.init.normal_(self.ln.bias, std=0.02)
        for module in (self.mlp if isinstance(self.mlp, MoE) else None, self.attn.slopes):
            if module is not None:
                module.reset_parameters()

    def forward(self, h_BSD: Tensor, context: AttentionContext | None) -> Tensor:
        x_BSD = self.ln(h_BSD)
        return h_BSD + self.attn(x_BSD, self.layer_id, context) + self.mlp(x_BSD)


class ParallelBlocksLM(nn.Module):
    """A pipeline stage is this model with other stages' modules set to None (blocks deleted):
    forward applies what is present."""

    def __init__(self, args: ParallelBlocksArgs) -> None:
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.blocks = nn.ModuleDict({str(i): ParallelBlock(i, args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=True)

    def tie_weights(self) -> None:
        """Nothing is tied."""

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Each top-level module and block drawn from (seed, its name) alone."""
        seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        device = next(self.parameters()).device
        for name, module in self.named_children():
            children = module.items() if isinstance(module, nn.ModuleDict) else [("", module)]
            for key, child in children:
                with seeded(seed, f"{name}.{key}" if key else name, device):
                    if isinstance(child, nn.Embedding):
                        nn.init.normal_(child.weight, std=0.02)
                    elif isinstance(child, nn.Linear):
                        trunc_normal_(child.weight, child.in_features**-0.5)
                        nn.init.normal_(child.bias, std=0.02)
                    else:
                        child.reset_parameters()

    def forward(
        self,
        tokens_or_hidden: Tensor,
        positions: Tensor | None = None,
        attention_context: AttentionContext | None = None,
    ) -> Tensor:
        h_BSD = tokens_or_hidden
        if self.wte is not None and not h_BSD.is_floating_point():
            h_BSD = self.wte(h_BSD)
        if self.wpe is not None:
            positions = torch.arange(h_BSD.shape[1]) if positions is None else positions
            h_BSD = h_BSD + self.wpe(positions.to(h_BSD.device))
        for block in (self.blocks or {}).values():
            h_BSD = block(h_BSD, attention_context)
        if self.ln_f is not None:
            h_BSD = self.ln_f(h_BSD)
        return h_BSD if self.lm_head is None else self.lm_head(h_BSD)


def _shape(args: ParallelBlocksArgs) -> ModelShape:
    head_dim = args.dim // args.n_heads
    sizes = (args.dim, args.n_layers, args.vocab_size, args.n_heads, 1, head_dim)
    return ModelShape(*sizes, tied_embeddings=False, max_seq_len=args.max_seq_len)


STRUCTURE = ModelStructure("blocks", "wte", "lm_head", ("wpe",), ("ln_f",))
FLAVORS = {
    "debug": ParallelBlocksArgs(),
    # which tokens a capacity drops depends on how the batch is split, so a layout matches one
    # process exactly only without drops
    "debug_dropless": ParallelBlocksArgs(
        moe=MoEArgs(num_experts=4, top_k=1, router="switch", activation="gelu")
    ),
}
PARALLEL_BLOCKS = ModelSpec("parallel_blocks", FLAVORS, ParallelBlocksLM, _shape, STRUCTURE)
register_model(PARALLEL_BLOCKS)
