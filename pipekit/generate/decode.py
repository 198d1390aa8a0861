"""Autoregressive decoding on the chunked KV cache: a prompt's forward fills the cache, then one
token at a time attends to it.

The model runs as in training, its attention handed `SlicedKVCache`: each forward is the next
slice of the sequence, attending causally to itself and fully to every cached slice (the
layer's pattern honoured: sliding windows, sinks, a latent cache), with explicit positions. So
any registered model decodes without code of its own, and the cached decode's logits equal a
full forward's (tested). Sampling: greedy, or temperature with top-k and top-p (nucleus)
filtering, from a seeded generator.

Legend: B batch (1), S tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipekit.attention.context import SlicedKVCache

__all__ = ["Sampling", "decode_tokens"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (`temperature` 0), or drawn at `temperature` from
    the `top_k` most likely (0: all) within top-p probability mass `top_p` (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}"
            )

    def pick(self, logits_V: Tensor, generator: torch.Generator) -> int:
        """The next token from the last position's logits."""
        if self.temperature == 0:
            return int(logits_V.argmax())
        logits_V = logits_V.float() / self.temperature
        if self.top_k:
            kth = torch.topk(logits_V, min(self.top_k, logits_V.numel())).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
        if self.top_p < 1:
            sorted_V, order_V = torch.sort(logits_V, descending=True)
            before_V = torch.softmax(sorted_V, dim=-1).cumsum(-1) - torch.softmax(sorted_V, -1)
            sorted_V = sorted_V.masked_fill(before_V >= self.top_p, float("-inf"))
            logits_V = torch.full_like(logits_V, float("-inf")).scatter(0, order_V, sorted_V)
        probabilities_V = torch.softmax(logits_V, dim=-1)
        return int(torch.multinomial(probabilities_V, 1, generator=generator))


def decode_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop: Sequence[int] = (),
    max_seq_len: int | None = None,
) -> Iterator[int]:
    """The tokens `model` writes after `prompt` (ids), one at a time as they are picked, until
    `max_new_tokens` or a token of `stop` (which is yielded, then decoding ends). With
    `max_seq_len` (the model's longest sequence), a prompt and count whose positions would pass
    it are refused here, before any forward: a learned position table has no rows there."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    # the last token picked is yielded, never fed: the largest position fed is one less
    longest = len(prompt) + max_new_tokens - 1
    if max_seq_len is not None and longest > max_seq_len:
        raise ValueError(
            f"a prompt of {len(prompt)} tokens and {max_new_tokens} new tokens need positions up "
            f"to {longest - 1}, past the model's max_seq_len={max_seq_len}; ask for at most "
            f"{max(0, max_seq_len - len(prompt) + 1)} new tokens or shorten the prompt"
        )
    return _decoded(model, prompt, max_new_tokens, sampling, stop)


@torch.no_grad()
def _decoded(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    stop: Sequence[int],
) -> Iterator[int]:
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    cache = SlicedKVCache(backend="auto")
    tokens_BS = torch.tensor([list(prompt)], device=device)
    positions_BS = torch.arange(len(prompt), device=device).unsqueeze(0)
    for _ in range(max_new_tokens):
        logits_BSV = model(tokens_BS, positions_BS, cache)
        token = sampling.pick(logits_BSV[0, -1].cpu(), generator)
        yield token
        if token in stop:
            return
        next_position = int(positions_BS[0, -1]) + 1
        tokens_BS = torch.tensor([[token]], device=device)
        positions_BS = torch.tensor([[next_position]], device=device)
