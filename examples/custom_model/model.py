"""A model of your own, trained by pipekit: GPT-2 style (LayerNorm, learned positions, GELU
MLP, biases) with a pipekit mixture of experts in every other block, and optionally ALiBi on
the even layers. docs/custom_models.md walks through it; `[model] module =
"examples.custom_model.model"` makes a job import it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from pipekit.attention import ALIBI, AttentionPattern, alibi_slopes
from pipekit.attention.context import AttentionContext, attend
from pipekit.distributed.tensor_parallel_styles import gathered_input, routes_own_tokens, row_split
from pipekit.layers import HeadValues
from pipekit.layers.init import seeded, trunc_normal_
from pipekit.models import ModelShape, ModelSpec, ModelStructure, register_model
from pipekit.moe import MoE, MoEArgs


@dataclass(frozen=True)
class TinyGPTArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 2
    vocab_size: int = 258  # pipekit's byte tokenizer
    max_seq_len: int = 1024
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=4, top_k=2))
    tie_embeddings: bool = False  # GPT-2 ties lm_head to wte
    alibi: bool = False  # ALiBi on the even layers (a bias on the scores by head and distance)


ALIBI_LAYER = AttentionPattern(score_bias=ALIBI)
"""Causal, each score biased by -slope_h x the distance between the tokens."""


class Attention(nn.Module):
    """Causal self-attention without RoPE; the attention context decides what it attends to
    (a KV cache of earlier slices, another rank's chunks), so pipekit can slice and exchange.
    With `alibi`, each head's scores are biased by its slope times the tokens' distance."""

    def __init__(self, args: TinyGPTArgs, alibi: bool = False) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.qkv, self.proj = nn.Linear(args.dim, 3 * args.dim), nn.Linear(args.dim, args.dim)
        # one slope per head; under tensor parallelism pipekit splits them with the heads
        self.slopes = HeadValues(alibi_slopes(args.n_heads)) if alibi else None
        self.pattern = ALIBI_LAYER if alibi else None

    def forward(self, x_BSD: Tensor, layer_id: str, context: AttentionContext | None) -> Tensor:
        # The fused projection's rows hold each head's q, k and v together (Megatron's layout),
        # so a tensor-parallel split by rows gives each rank whole heads; the head count comes
        # from what the projection returns (all heads, or a rank's).
        qkv_BSH3K = self.qkv(x_BSD).unflatten(-1, (-1, 3, self.head_dim))
        q, k, v = (qkv_BSH3K[..., part, :].transpose(1, 2) for part in range(3))  # [B, H, S, K]
        slopes_H = None if self.slopes is None else self.slopes()  # this rank's heads'
        out_BHSK = attend(
            context, layer_id, q, k, v, self.head_dim**-0.5, self.pattern, bias_H=slopes_H
        )
        return self.proj(out_BHSK.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, layer_id: int, args: TinyGPTArgs) -> None:
        super().__init__()
        self.layer_id = str(layer_id)
        self.ln_1, self.ln_2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attn = Attention(args, alibi=args.alibi and layer_id % 2 == 0)
        if layer_id % 2:  # pipekit's MoE: routing, experts, expert parallelism, aux losses
            self.mlp: nn.Module = MoE(args.dim, 2 * args.dim, args.moe)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim)
            )

    def reset_parameters(self) -> None:
        dense = [] if isinstance(self.mlp, MoE) else [self.mlp[0], self.mlp[2]]
        for linear in (self.attn.qkv, self.attn.proj, *dense):
            trunc_normal_(linear.weight, 0.02)
            nn.init.zeros_(linear.bias)
        moe = self.mlp if isinstance(self.mlp, MoE) else None
        for module in (self.ln_1, self.ln_2, moe, self.attn.slopes):
            if module is not None:
                module.reset_parameters()

    def forward(self, h_BSD: Tensor, context: AttentionContext | None) -> Tensor:
        h_BSD = h_BSD + self.attn(self.ln_1(h_BSD), self.layer_id, context)
        return h_BSD + self.mlp(self.ln_2(h_BSD))


class TinyGPT(nn.Module):
    """A pipeline stage is this model with other stages' modules set to None (blocks deleted):
    forward applies what is present, so stages compose to the whole model."""

    def __init__(self, args: TinyGPTArgs) -> None:
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.blocks = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_embeddings and self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Each module drawn from (seed, its name) alone: any stage initialised by itself holds
        the whole model's values."""
        seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        device = next(self.parameters()).device
        self.tie_weights()
        for name, module in self.named_children():
            children = module.items() if isinstance(module, nn.ModuleDict) else [("", module)]
            for key, child in children:
                if name == "lm_head" and self.args.tie_embeddings:  # wte's weight, by wte's name
                    with seeded(seed, "wte", device):
                        nn.init.normal_(child.weight, std=0.02)
                    continue
                with seeded(seed, f"{name}.{key}" if key else name, device):
                    if isinstance(child, nn.Embedding):
                        nn.init.normal_(child.weight, std=0.02)
                    elif isinstance(child, nn.Linear):
                        trunc_normal_(child.weight, child.in_features**-0.5)
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
        if self.wpe is not None:  # the first stage adds positions (also to vocab-parallel input)
            positions = torch.arange(h_BSD.shape[1]) if positions is None else positions
            # packed positions restart at each document and row: below seq_len <= max_seq_len
            h_BSD = h_BSD + self.wpe(positions.to(h_BSD.device))
        for block in (self.blocks or {}).values():
            h_BSD = block(h_BSD, attention_context)
        if self.ln_f is not None:
            h_BSD = self.ln_f(h_BSD)
        return h_BSD if self.lm_head is None else self.lm_head(h_BSD)


def _shape(args: TinyGPTArgs) -> ModelShape:
    head_dim = args.dim // args.n_heads
    sizes = (args.dim, args.n_layers, args.vocab_size, args.n_heads, args.n_heads, head_dim)
    return ModelShape(*sizes, tied_embeddings=args.tie_embeddings, max_seq_len=args.max_seq_len)


def tensor_parallel_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron's split of one block, from pipekit's pieces: the fused qkv and the first MLP
    layer by output rows, the projections back to the residual stream by input columns; with
    sequence parallelism the LayerNorms run on a rank's tokens and the MoE routes them. pipekit
    shards the residual stream before the first block (after `wpe` is added) and gathers it
    before `lm_head`."""
    plan: dict[str, ParallelStyle] = {
        "attn": gathered_input(sequence_parallel, other_args=2),  # (x, layer_id, context)
        "attn.qkv": ColwiseParallel(),
        "attn.proj": row_split(sequence_parallel),
    }
    if sequence_parallel:
        plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    if not isinstance(block.get_submodule("mlp"), MoE):
        plan |= {
            "mlp": gathered_input(sequence_parallel),
            "mlp.0": ColwiseParallel(),
            "mlp.2": row_split(sequence_parallel),
        }
    elif sequence_parallel:  # pipekit refuses tp with an MoE but without sequence parallelism
        plan["mlp"] = routes_own_tokens()
    return plan


STRUCTURE = ModelStructure("blocks", "wte", "lm_head", ("wpe",), ("ln_f",))
"""Blocks, token embedding, vocabulary head, then what else stage 0 and the last stage hold."""
TINY_GPT = ModelSpec(
    "tiny_gpt",
    {"debug": TinyGPTArgs()},
    TinyGPT,
    _shape,
    STRUCTURE,
    tensor_parallel_plan=tensor_parallel_plan,
)
register_model(TINY_GPT)
