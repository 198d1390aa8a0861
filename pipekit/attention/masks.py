"""Attention masks as FlexAttention `mask_mod` functions.

A mask_mod maps index tensors `(b, h, q_idx, kv_idx)` to a bool tensor: True where the query may
attend to the key. Indices are *local* to the query block and the KV chunk; masks that need global
positions (causal across slices) carry the blocks' offsets. Every mask here is written with
elementwise ops and advanced indexing only, so the same function works under FlexAttention's vmap
and when evaluated on broadcast index grids (how the CPU kernel builds a tile's mask).

Offsets are stored as 0-dim tensors, not Python ints: a compiled FlexAttention kernel guards on
Python constants it closes over, so int offsets would recompile once per slice.

Legend: B batch, S query length, K key length.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

import torch
from torch import Tensor

__all__ = [
    "MaskMod",
    "and_masks",
    "causal_mask",
    "causal_within_documents",
    "document_mask",
    "documents_or_all",
    "offset_causal_mask",
    "or_masks",
    "sliding_window_mask",
    "token_order_mask",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""`(b, h, q_idx, kv_idx) -> bool`: True where attention is allowed."""


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal attention when the query block and the KV chunk start at the same position."""
    return q_idx >= kv_idx


def _position_delta(
    q_offset: int | Tensor, kv_offset: int | Tensor, device: torch.device | str | None
) -> Tensor:
    """q_offset - kv_offset as a 0-dim int64 tensor (see the module docstring for why)."""
    delta = torch.as_tensor(q_offset, dtype=torch.int64) - torch.as_tensor(
        kv_offset, dtype=torch.int64
    )
    return delta.to(device) if device is not None else delta


def offset_causal_mask(
    q_offset: int | Tensor, kv_offset: int | Tensor, device: torch.device | str | None = None
) -> MaskMod:
    """Causal mask for queries at positions `[q_offset, q_offset+S)` and keys at
    `[kv_offset, kv_offset+K)`: query position >= key position."""
    delta = _position_delta(q_offset, kv_offset, device)

    def offset_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx + delta >= kv_idx

    return offset_causal


def sliding_window_mask(
    window_size: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    device: torch.device | str | None = None,
) -> MaskMod:
    """Keys within `window_size` positions of the query (either side); `and` it with a causal
    mask for causal sliding-window attention."""
    if window_size <= 0:
        raise ValueError(f"sliding_window_mask: window_size={window_size} must be positive")
    delta = _position_delta(q_offset, kv_offset, device)

    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx + delta - kv_idx).abs() < window_size

    return sliding_window


def document_mask(q_document_ids_BS: Tensor, kv_document_ids_BK: Tensor) -> MaskMod:
    """Packed sequences: a query attends only to keys of its own document.

    The id tensors cover exactly the query block and the KV chunk (slice them with the blocks).
    """
    if q_document_ids_BS.dim() != 2 or kv_document_ids_BK.dim() != 2:
        raise ValueError(
            "document_mask expects [batch, length] document-id tensors, got shapes "
            f"{tuple(q_document_ids_BS.shape)} and {tuple(kv_document_ids_BK.shape)}"
        )

    def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_document_ids_BS[b, q_idx] == kv_document_ids_BK[b, kv_idx]

    return same_document


def and_masks(*masks: MaskMod) -> MaskMod:
    """Attention allowed where every mask allows it."""
    if not masks:
        raise ValueError("and_masks needs at least one mask")

    def all_of(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return reduce(torch.logical_and, (mask(b, h, q_idx, kv_idx) for mask in masks))

    return all_of


def or_masks(*masks: MaskMod) -> MaskMod:
    """Attention allowed where any mask allows it."""
    if not masks:
        raise ValueError("or_masks needs at least one mask")

    def any_of(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return reduce(torch.logical_or, (mask(b, h, q_idx, kv_idx) for mask in masks))

    return any_of


def causal_within_documents(document_ids_BS: Tensor | None) -> MaskMod:
    """Causal attention of a block against itself, confined to packed documents if ids are given."""
    if document_ids_BS is None:
        return causal_mask
    return and_masks(causal_mask, document_mask(document_ids_BS, document_ids_BS))


def documents_or_all(q_docs_BS: Tensor | None, kv_docs_BK: Tensor | None) -> MaskMod | None:
    """A query block against an earlier KV chunk: within documents if ids are given, else all."""
    return None if q_docs_BS is None else document_mask(q_docs_BS, kv_docs_BK)


def token_order_mask(
    q_tokens_S: Tensor,
    kv_tokens_K: Tensor,
    q_document_ids_BS: Tensor | None = None,
    kv_document_ids_BK: Tensor | None = None,
) -> MaskMod:
    """Causal attention between blocks whose tokens are not contiguous: a query attends to a key
    whose index in the sequence is not later (`q_tokens_S`, `kv_tokens_K`: each row's index),
    within its document if ids are given. Context parallelism's load-balanced shards need it."""
    if q_tokens_S.dim() != 1 or kv_tokens_K.dim() != 1:
        raise ValueError(
            "token_order_mask expects 1-D token-index tensors, got shapes "
            f"{tuple(q_tokens_S.shape)} and {tuple(kv_tokens_K.shape)}"
        )

    def not_later(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_tokens_S[q_idx] >= kv_tokens_K[kv_idx]

    if q_document_ids_BS is None or kv_document_ids_BK is None:
        return not_later
    return and_masks(not_later, document_mask(q_document_ids_BS, kv_document_ids_BK))
