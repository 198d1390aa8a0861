"""What a layer's queries attend to, as data: `AttentionPattern`.

A model says per layer what its attention sees — causal (the default), a sliding window, local
chunks, a bidirectional prefix, or any further rule on token positions — and hands it to its
attention context with the layer's q, k, v (`pipekit.attention.context.attend`). The pattern
speaks of *token indices in the sequence*, never of blocks, so every context turns it into the
kernel masks of its own blocks: a whole sequence, a slice against its KV-cache chunks, a
context-parallel rank's load-balanced shard against another's, a lent chunk on an exchange peer.
`visible_keys` bounds the keys a block of queries can see, so a context skips (and need not
keep, gather or send) the chunks outside it.

Every pattern is causal at heart: a query never sees a later key, except inside a bidirectional
prefix. Under slicing the prefix must fit in the first slice (a slice cannot see keys that are
not computed yet): `check_sliced` refuses it otherwise.

Legend: S queries, K keys, B batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pipekit.attention.backends import AttentionBackend
from pipekit.attention.masks import (
    MaskMod,
    and_masks,
    causal_within_documents,
    document_mask,
    documents_or_all,
)
from pipekit.attention.softcap import SoftcapBackend

__all__ = [
    "CAUSAL",
    "AttentionPattern",
    "PositionRule",
    "block_mask",
    "block_visible",
    "is_causal",
    "pattern_backend",
]

PositionRule = Callable[[Tensor, Tensor], Tensor]
"""`(q_token, kv_token) -> bool`: a further rule on the tokens' sequence indices (broadcast
tensors), True where attention is allowed; it is ANDed with the pattern's other terms."""


@dataclass(frozen=True)
class AttentionPattern:
    """Which keys a query attends to, by the tokens' indices in the sequence: causal, narrowed
    by a sliding `window`, local `chunk`s and a `rule`, widened by a bidirectional `prefix`;
    and `softcap`, which caps the scores. Within packed documents the document mask applies on
    top."""

    window: int | None = None
    """Sliding window: a query sees the `window` tokens ending at itself (Mistral, Gemma's
    local layers)."""
    chunk: int | None = None
    """Local chunks: a query sees only keys of its own `chunk`-token block (Llama 4's local
    layers)."""
    prefix: int = 0
    """Bidirectional prefix: the first `prefix` tokens see each other both ways (prefix LM)."""
    rule: PositionRule | None = None
    """Any further rule on token positions (ANDed); it cannot be sent to an exchange peer."""
    softcap: float | None = None
    """Attention-logit soft-capping: scores become `softcap · tanh(s / softcap)` before the
    softmax (Gemma 2); computed by `pipekit.attention.softcap.SoftcapBackend`."""

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"AttentionPattern: {name}={value!r} must be a positive int")
        if not isinstance(self.prefix, int) or self.prefix < 0:
            raise ValueError(f"AttentionPattern: prefix={self.prefix!r} must be an int >= 0")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"AttentionPattern: softcap={self.softcap!r} must be positive")

    @property
    def causal(self) -> bool:
        """Whether this is plain causal attention."""
        return self == CAUSAL

    def allows(self, q_tokens: Tensor, kv_tokens: Tensor) -> Tensor:
        """Elementwise over broadcast token-index tensors: may the query see the key?"""
        allowed = kv_tokens <= q_tokens
        if self.prefix:
            allowed = allowed | ((kv_tokens < self.prefix) & (q_tokens < self.prefix))
        if self.window is not None:
            allowed = allowed & (q_tokens - kv_tokens < self.window)
        if self.chunk is not None:
            allowed = allowed & (
                torch.div(q_tokens, self.chunk, rounding_mode="floor")
                == torch.div(kv_tokens, self.chunk, rounding_mode="floor")
            )
        if self.rule is not None:
            allowed = allowed & self.rule(q_tokens, kv_tokens)
        return allowed

    def visible_keys(self, q_first: int, q_last: int) -> tuple[int, int]:
        """`[low, high)`: no query of the tokens `q_first..q_last` sees a key outside it (a
        bound, exact for contiguous queries without a `rule`)."""
        low, high = 0, q_last + 1
        if self.prefix and q_first < self.prefix:
            high = max(high, self.prefix)
        if self.window is not None:
            low = max(low, q_first - self.window + 1)
        if self.chunk is not None:
            low = max(low, q_first // self.chunk * self.chunk)
            high = min(high, (q_last // self.chunk + 1) * self.chunk)
        return low, max(low, high)

    def sees_any(self, q_first: int, q_last: int, kv_first: int, kv_last: int) -> bool:
        """Whether some query of `q_first..q_last` may see some key of `kv_first..kv_last` (by
        `visible_keys`; a chunk for which this is False is skipped)."""
        low, high = self.visible_keys(q_first, q_last)
        return kv_first < high and kv_last >= low

    def mask(
        self,
        q_tokens_S: Tensor,
        kv_tokens_K: Tensor,
        q_document_ids_BS: Tensor | None = None,
        kv_document_ids_BK: Tensor | None = None,
    ) -> MaskMod:
        """The kernel mask of a query block against a KV chunk, given each row's token index
        in the sequence (1-D), within documents if ids are given."""

        def pattern_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self.allows(q_tokens_S[q_idx], kv_tokens_K[kv_idx])

        if q_document_ids_BS is None or kv_document_ids_BK is None:
            return pattern_mask
        return and_masks(pattern_mask, document_mask(q_document_ids_BS, kv_document_ids_BK))

    def check_sliced(self, first_slice_length: int) -> None:
        """ValueError when slices computed in order cannot honour the pattern: a prefix longer
        than the first slice would make its queries see keys of later slices."""
        if self.prefix > first_slice_length:
            raise ValueError(
                f"a bidirectional prefix of {self.prefix} tokens reaches past the first slice "
                f"({first_slice_length} tokens), whose queries would need keys not computed "
                "yet; use fewer slices (num_slices) so that the first holds the prefix, or a "
                f"prefix of at most {first_slice_length} tokens"
            )


CAUSAL = AttentionPattern()
"""Plain causal attention: every earlier key and the query's own."""


def is_causal(pattern: AttentionPattern | None) -> bool:
    """Whether `pattern` (None: the default) is plain causal attention."""
    return pattern is None or pattern.causal


def block_mask(
    pattern: AttentionPattern | None,
    q_start: int,
    q_length: int,
    kv_start: int,
    kv_length: int,
    q_document_ids_BS: Tensor | None,
    kv_document_ids_BK: Tensor | None,
    device: torch.device,
) -> MaskMod | None:
    """The mask of the contiguous queries `[q_start, q_start + q_length)` against the keys
    `[kv_start, kv_start + kv_length)`, the key block being the queries' own or an earlier one
    (None: all keys, within documents if ids are given). Plain causal attention keeps pipekit's
    cheapest masks; any other pattern compares token indices."""
    if is_causal(pattern):
        if kv_start == q_start:
            return causal_within_documents(q_document_ids_BS)
        return documents_or_all(q_document_ids_BS, kv_document_ids_BK)
    q_tokens_S = torch.arange(q_start, q_start + q_length, device=device)
    kv_tokens_K = torch.arange(kv_start, kv_start + kv_length, device=device)
    return pattern.mask(q_tokens_S, kv_tokens_K, q_document_ids_BS, kv_document_ids_BK)


def block_visible(
    pattern: AttentionPattern | None, q_start: int, q_length: int, kv_start: int, kv_length: int
) -> bool:
    """Whether some query of `[q_start, q_start + q_length)` may see some key of
    `[kv_start, kv_start + kv_length)`: a context skips a chunk for which this is False (it
    need not attend to it, gather it or send it)."""
    if pattern is None:
        return True
    return pattern.sees_any(q_start, q_start + q_length - 1, kv_start, kv_start + kv_length - 1)


def pattern_backend(
    backend: str | AttentionBackend, pattern: AttentionPattern | None
) -> str | AttentionBackend:
    """The kernel a layer with `pattern` runs on: `backend`, or the soft-capped kernel when the
    pattern caps its scores (no other kernel has a score hook)."""
    if pattern is None or pattern.softcap is None:
        return backend
    return SoftcapBackend(pattern.softcap)
