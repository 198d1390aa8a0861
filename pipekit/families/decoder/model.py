"""The decoder the built-in families share: embedding, pre-norm blocks, final norm, output.

A family subclasses `DecoderLM` and overrides what differs (`build_attention`, e.g. Qwen3's
QK-norm); its FFNs are SwiGLU, or `pipekit.moe.MoE` in the layers its args make MoE
(`MoEFields`). The model is parallelism-agnostic and follows pipekit's model contract
(`pipekit.models.spec`): built on the meta device, moved with `to_empty`, then
`init_weights(seed)` seeds each module from its name alone; `forward` takes token ids (or hidden
states, for a pipeline stage without the embedding), positions that may start anywhere, and an
optional attention context (packed documents, a sliced KV cache, ...). Blocks sit in a
ModuleDict keyed by layer index, so state-dict names survive splitting into stages.

A pipeline stage is this model with some modules removed (set to None, block keys deleted):
`forward` applies the modules that are present, and returns hidden states when it has no output
layer, so the stages compose to the whole model.

Legend: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipekit.attention.context import AttentionContext
from pipekit.families.decoder.args import DecoderArgs, MoEFields
from pipekit.layers import FeedForward, GroupedQueryAttention, RMSNorm, RotaryEmbedding
from pipekit.layers.init import seeded, trunc_normal_
from pipekit.layers.multi_token_prediction import MTPModule, MultiTokenPrediction
from pipekit.models.spec import ModelShape, ModelStructure
from pipekit.moe import MoE

__all__ = ["DECODER_STRUCTURE", "DecoderLM", "TransformerBlock", "decoder_shape"]

DECODER_STRUCTURE = ModelStructure(
    blocks="layers",
    embedding="tok_embeddings",
    output="output",
    after_blocks=("norm",),
    shared=("rope",),
    multi_token_prediction=("mtp",),
)
"""Where pipekit finds the parts of a `DecoderLM` it splits and wraps."""


def decoder_shape(args: DecoderArgs) -> ModelShape:
    """The sizes pipekit needs of a decoder with `args`."""
    return ModelShape(
        dim=args.dim,
        num_layers=args.n_layers,
        vocab_size=args.vocab_size,
        num_heads=args.n_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.per_head_dim,
        tied_embeddings=args.tie_embeddings,
        max_seq_len=args.max_seq_len,
        multi_token_depth=args.mtp_depth,
    )


class TransformerBlock(nn.Module):
    """Pre-norm attention and FFN, each with a residual connection."""

    def __init__(
        self, layer_id: int, attention: nn.Module, feed_forward: nn.Module, args: DecoderArgs
    ) -> None:
        super().__init__()
        self.layer_id = str(layer_id)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward
        # Depth-scaled init of the residual projections keeps the residual stream's variance flat.
        self._output_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Every submodule by pipekit's convention; the residual writes depth-scaled."""
        output_std = self._output_std if output_std is None else output_std
        for module in (self.attention_norm, self.ffn_norm, self.attention, self.feed_forward):
            module.reset_parameters(init_std, output_std)

    def forward(
        self,
        h_BSD: Tensor,
        rope_cos_sin: tuple[Tensor, Tensor],
        context: AttentionContext | None = None,
    ) -> Tensor:
        h_BSD = h_BSD + self.attention(
            self.attention_norm(h_BSD), rope_cos_sin, self.layer_id, context
        )
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD))


class DecoderLM(nn.Module):
    """Token embedding, `n_layers` blocks, final norm and output projection."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = self.build_rope()
        self.layers = nn.ModuleDict(
            {
                str(layer_id): TransformerBlock(
                    layer_id, self.build_attention(layer_id), self.build_ffn(layer_id), args
                )
                for layer_id in range(args.n_layers)
            }
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = self.build_multi_token_prediction() if args.mtp_depth else None
        self.tie_weights()

    def build_multi_token_prediction(self) -> MultiTokenPrediction:
        """The `mtp_depth` extra modules, each with the block layer `n_layers + k` would have
        (DeepSeek-V3 numbers its MTP layer after the last)."""
        args = self.args
        depths = []
        for layer_id in range(args.n_layers, args.n_layers + args.mtp_depth):
            block = TransformerBlock(
                layer_id, self.build_attention(layer_id), self.build_ffn(layer_id), args
            )
            depths.append(MTPModule(args.dim, args.norm_eps, block))
        return MultiTokenPrediction(depths, args.mtp_loss_weight)

    def build_rope(self) -> RotaryEmbedding:
        """The rotary embedding every layer shares: over the whole head dim."""
        args = self.args
        return RotaryEmbedding(args.per_head_dim, args.rope_theta, args.rope_scaling)

    def build_attention(self, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s attention: grouped-query attention with RoPE."""
        args = self.args
        return GroupedQueryAttention(args.dim, args.n_heads, args.num_kv_heads, args.per_head_dim)

    def build_ffn(self, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s FFN: a mixture of experts where the args say so, else SwiGLU."""
        args = self.args
        if isinstance(args, MoEFields) and args.is_moe_layer(layer_id):
            return MoE(args.dim, args.moe_ffn_dim, args.moe)
        return FeedForward(args.dim, args.ffn_dim)

    def tie_weights(self) -> None:
        """Share the embedding with the output projection if the args say so.

        Moving a module off the meta device gives each module its own tensor, so this runs again
        in `init_weights`. A pipeline stage holding only one of the two has nothing to tie.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every present parameter in place (after `to_empty`); there are no buffers.

        Each module draws from its own generator seeded by (seed, module name), so its weights do
        not depend on which other modules exist: a pipeline stage initialised alone equals the
        same modules of the full model. `seed=None` draws one base seed from the global generator
        (so equal global states still give equal stages); the global state is otherwise untouched.
        """
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        self.tie_weights()
        device, tied = next(self.parameters()).device, self.args.tie_embeddings
        # A tied weight belongs to the embedding: its name seeds it even where only output exists.
        embedding = self.tok_embeddings
        if embedding is None and tied and self.output is not None:
            embedding = self.output
        if embedding is not None:
            with seeded(seed, "tok_embeddings", device):
                nn.init.normal_(embedding.weight, std=0.02 if tied else 1.0)
        for key, block in (self.layers or {}).items():
            with seeded(seed, f"layers.{key}", device):
                block.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not tied:
            with seeded(seed, "output", device):
                trunc_normal_(self.output.weight, self.args.dim**-0.5)
        for key, depth in (self.mtp or {}).items():
            with seeded(seed, f"mtp.{key}", device):
                depth.reset_parameters()

    def forward(
        self,
        tokens_or_hidden: Tensor,
        positions: Tensor | None = None,
        attention_context: AttentionContext | None = None,
    ) -> Tensor:
        """Logits `[B, S, V]` from token ids `[B, S]` (or hidden states `[B, S, D]`).

        A stage applies only the modules it holds: without `output` it returns hidden states
        `[B, S, D]` (after `norm` if it holds `norm`), so the stages compose to the full model.

        `positions` (`[B, S]` or `[S]`, default `0..S-1`) place the tokens for RoPE; a slice of a
        longer sequence passes its own positions and a context holding the earlier slices' KV.
        """
        if tokens_or_hidden.is_floating_point():
            h_BSD = tokens_or_hidden
        elif self.tok_embeddings is None:
            raise ValueError(
                f"{type(self).__name__}.forward got token ids of dtype {tokens_or_hidden.dtype}, "
                "but this stage has no tok_embeddings; feed it hidden states [B, S, D] from the "
                "previous stage"
            )
        else:
            h_BSD = self.tok_embeddings(tokens_or_hidden)
        if positions is None:
            positions = torch.arange(h_BSD.shape[1], device=h_BSD.device)
        if positions.shape[-1] != h_BSD.shape[1]:
            raise ValueError(
                f"{type(self).__name__}.forward: positions {tuple(positions.shape)} do not match "
                f"the sequence length {h_BSD.shape[1]} of the input {tuple(tokens_or_hidden.shape)}"
            )
        rope_cos_sin = self.rope(positions)
        for block in (self.layers or {}).values():
            h_BSD = block(h_BSD, rope_cos_sin, attention_context)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.output is None:
            return h_BSD
        logits_BSV = self.output(h_BSD)
        if self.mtp is not None:  # the extra loss, in training only (`multi_token_targets`)
            logits_BSV = self.mtp.attach_loss(
                logits_BSV, h_BSD, self.tok_embeddings, self.output, rope_cos_sin,
                attention_context,
            )  # fmt: skip
        return logits_BSV
