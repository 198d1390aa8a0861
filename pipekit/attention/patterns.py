"""What a layer's queries attend to, as data: `AttentionPattern`.

A model says per layer what its attention sees — causal (the default), a sliding window, local
chunks, a bidirectional prefix, or any further rule on token positions — and hands it to its
attention context with the layer's q, k, v (`pipekit.attention.context.attend`). The pattern
speaks of *token indices in the sequence*, never of blocks, so every context turns it into the
kernel masks of its own blocks: a whole sequence, a slice against its KV-cache chunks, a
context-parallel rank's load-balanced shard against another's, a lent chunk on an exchange peer.
`visible_keys` bounds the keys a block of queries can see, so a context skips (and need not
keep, gather or send) the chunks outside it.

A pattern may also modify the scores it allows: an additive `score_bias` by head and token
indices (ALiBi), then a `softcap`. The bias reads one value per query head (`bias_H`, ALiBi's
slopes), which the layer hands to `attend` with its q, k, v: a rank holding some of the heads
passes its own heads' values. Its mask then carries the chunk's score_mod
(`pipekit.attention.kernels.score_mod`), which every kernel applies.

Every pattern is causal at heart: a query never sees a later key, except inside a bidirectional
prefix. Under slicing the prefix must fit in the first slice (a slice cannot see keys that are
not computed yet): `check_sliced` refuses it otherwise.

Legend: S queries, K keys, B batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from pipekit.attention.kernels.score_mod import ALIBI, ScoreBiasRule, ScoredMask, token_score_mod
from pipekit.attention.masks import (
    MaskMod,
    and_masks,
    causal_within_documents,
    document_mask,
    documents_or_all,
)

__all__ = [
    "CAUSAL",
    "AttentionPattern",
    "PositionRule",
    "block_mask",
    "block_visible",
    "is_causal",
]

PositionRule = Callable[[Tensor, Tensor], Tensor]
"""`(q_token, kv_token) -> bool`: a further rule on the tokens' sequence indices (broadcast
tensors), True where attention is allowed; it is ANDed with the pattern's other terms."""


@dataclass(frozen=True)
class AttentionPattern:
    """Which keys a query attends to, by the tokens' indices in the sequence: causal, narrowed
    by a sliding `window`, local `chunk`s and a `rule`, widened by a bidirectional `prefix`;
    and what it does to the scores it allows: `score_bias` adds a bias (ALiBi), then `softcap`
    caps them. Within packed documents the document mask applies on top."""

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
    softmax (Gemma 2), after any `score_bias`."""
    score_bias: str | ScoreBiasRule | None = None
    """An additive bias on each score from its query head's value in `bias_H` and the tokens'
    indices i, j: `"alibi"` (`-m_h · |i - j|`, the values being ALiBi's slopes m_h) or any rule
    `(value_h, i, j) -> bias` (code: it cannot be sent to an exchange peer)."""
    bias_H: Tensor | None = field(default=None, compare=False, repr=False)
    """`score_bias`'s value for each query head of this call (under tensor parallelism, a rank's
    heads): bound per call by `attend(..., bias_H=...)` or `with_bias_values`."""

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"AttentionPattern: {name}={value!r} must be a positive int")
        if not isinstance(self.prefix, int) or self.prefix < 0:
            raise ValueError(f"AttentionPattern: prefix={self.prefix!r} must be an int >= 0")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"AttentionPattern: softcap={self.softcap!r} must be positive")
        if (
            self.score_bias is not None
            and self.score_bias != ALIBI
            and not callable(self.score_bias)
        ):
            raise ValueError(
                f"AttentionPattern: score_bias={self.score_bias!r} must be {ALIBI!r} or a rule "
                "(head_value, q_token, kv_token) -> bias"
            )
        if self.bias_H is not None and (self.score_bias is None or self.bias_H.dim() != 1):
            raise ValueError(
                f"AttentionPattern: bias_H of shape {tuple(self.bias_H.shape)} needs a "
                "score_bias and one value per query head; give score_bias or drop bias_H"
            )

    @property
    def causal(self) -> bool:
        """Whether this is plain causal attention."""
        return self == CAUSAL

    @property
    def modifies_scores(self) -> bool:
        """Whether the pattern changes the scores it allows (a bias or a cap)."""
        return self.score_bias is not None or self.softcap is not None

    def with_bias_values(self, bias_H: Tensor | None) -> AttentionPattern:
        """This pattern with `score_bias`'s per-head values for one call's query heads."""
        return replace(self, bias_H=bias_H)

    def on_head_shard(self, index: int, shards: int) -> AttentionPattern:
        """The pattern of the `index`-th of `shards` equal runs of the call's heads (Ulysses
        gives a rank such a run): its heads' values of `bias_H`."""
        if self.bias_H is None:
            return self
        return self.with_bias_values(self.bias_H.chunk(shards)[index])

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
        in the sequence (1-D), within documents if ids are given; with the chunk's score_mod
        (a `ScoredMask`) if the pattern modifies scores."""

        def pattern_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self.allows(q_tokens_S[q_idx], kv_tokens_K[kv_idx])

        mask: MaskMod = pattern_mask
        if q_document_ids_BS is not None and kv_document_ids_BK is not None:
            mask = and_masks(pattern_mask, document_mask(q_document_ids_BS, kv_document_ids_BK))
        if not self.modifies_scores:
            return mask
        if self.score_bias is not None and self.bias_H is None:
            raise ValueError(
                f"{self}: score_bias needs one value per query head; pass bias_H to attend "
                "(ALiBi: the slopes, pipekit.layers.HeadValues(alibi_slopes(n_heads)))"
            )
        bias_H = None if self.bias_H is None else self.bias_H.to(q_tokens_S.device)
        score_mod = token_score_mod(q_tokens_S, kv_tokens_K, self.score_bias, bias_H, self.softcap)
        return ScoredMask(mask, score_mod, None if bias_H is None else bias_H.shape[0])

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
