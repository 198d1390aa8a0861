"""Llama 3 decoder, parallelism-agnostic.

Build on the meta device, move with `to_empty`, then `init_weights()`. `forward` takes token ids
(or hidden states, for a pipeline stage without the embedding), integer positions that may start
anywhere, and an optional attention context (packed documents, a sliced KV cache, ...). Layers
sit in a ModuleDict keyed by layer index, so state-dict names survive splitting into stages.

A pipeline stage is this model with some modules removed (set to None, layer keys deleted; see
`pipekit.pipelining.stage_split`): `forward` applies the modules that are present, and
`init_weights` seeds each module from its name alone, so a stage initialised on its own holds the
full model's weights.

Legend: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from models.llama.args import LlamaArgs
from pipekit.attention.context import AttentionContext
from pipekit.layers import FeedForward, GroupedQueryAttention, RMSNorm, RotaryEmbedding

__all__ = ["Llama", "TransformerBlock"]


class TransformerBlock(nn.Module):
    """Pre-norm attention and SwiGLU, each with a residual connection."""

    def __init__(self, layer_id: int, args: LlamaArgs) -> None:
        super().__init__()
        self.layer_id = str(layer_id)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.num_kv_heads, args.per_head_dim
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        # Depth-scaled init of the residual projections keeps the residual stream's variance flat.
        self._output_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def reset_parameters(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters(0.02, self._output_std)
        self.feed_forward.reset_parameters(0.02, self._output_std)

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


class Llama(nn.Module):
    """Token embedding, `n_layers` blocks, final norm and output projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.per_head_dim, args.rope_theta, args.rope_scaling)
        self.layers = nn.ModuleDict(
            {str(layer_id): TransformerBlock(layer_id, args) for layer_id in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

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
            with _seeded(seed, "tok_embeddings", device):
                nn.init.normal_(embedding.weight, std=0.02 if tied else 1.0)
        for key, block in (self.layers or {}).items():
            with _seeded(seed, f"layers.{key}", device):
                block.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not tied:
            std = self.args.dim**-0.5
            with _seeded(seed, "output", device):
                nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

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
                f"Llama.forward got token ids of dtype {tokens_or_hidden.dtype}, but this stage "
                "has no tok_embeddings; feed it hidden states [B, S, D] from the previous stage"
            )
        else:
            h_BSD = self.tok_embeddings(tokens_or_hidden)
        if positions is None:
            positions = torch.arange(h_BSD.shape[1], device=h_BSD.device)
        if positions.shape[-1] != h_BSD.shape[1]:
            raise ValueError(
                f"Llama.forward: positions {tuple(positions.shape)} do not match the sequence "
                f"length {h_BSD.shape[1]} of the input {tuple(tokens_or_hidden.shape)}"
            )
        rope_cos_sin = self.rope(positions)
        for block in (self.layers or {}).values():
            h_BSD = block(h_BSD, rope_cos_sin, attention_context)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        return h_BSD if self.output is None else self.output(h_BSD)


@contextmanager
def _seeded(seed: int, module_name: str, device: torch.device) -> Iterator[None]:
    """Seed the generators for one module's init from (seed, name); restore them afterwards."""
    digest = hashlib.sha256(f"{seed}/{module_name}".encode()).digest()
    accelerators = [device] if device.type not in ("cpu", "meta") else []
    device_type = device.type if accelerators else "cuda"
    with torch.random.fork_rng(devices=accelerators, device_type=device_type):
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        yield
