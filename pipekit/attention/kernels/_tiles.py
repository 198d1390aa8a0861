"""Tiles of a (query block x KV chunk) attention problem, with each tile's mask evaluated.

Kernels that cannot take a mask_mod directly (the CPU flash kernel wants a dense additive mask)
work tile by tile, so no mask or score matrix larger than one tile ever exists. A tile whose mask
is all False is skipped, one that is all True runs unmasked, and one that is exactly top-left
causal runs with the kernel's own causal path; only the rest get a dense mask. When no tile needs
a dense mask and together they are all of the problem or exactly its top-left causal half, the
kernel runs once over the whole problem (`whole_problem_tile`): it blocks its own work, and
tile-sized calls only add calls and merges.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from pipekit.attention.masks import MaskMod

__all__ = [
    "Tile",
    "evaluate_mask",
    "index_grids",
    "iter_tiles",
    "mask_dependence",
    "whole_problem_tile",
]


@dataclass(frozen=True)
class Tile:
    """One rectangle of the attention problem and how to run it."""

    q_rows: slice
    kv_cols: slice
    is_causal: bool
    """The tile's mask is exactly `q_idx >= kv_idx` (top-left aligned)."""
    allowed: Tensor | None
    """bool `[b|1, h|1, q, kv]` where partially masked; None when fully allowed or causal."""

    def additive_mask(self, dtype: torch.dtype) -> Tensor | None:
        """0 where allowed, -inf elsewhere, in the kernel's dtype (None if unmasked)."""
        if self.allowed is None:
            return None
        return torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device).masked_fill(
            ~self.allowed, float("-inf")
        )

    def empty_rows(self) -> Tensor | None:
        """bool `[b|1, h|1, q]`: rows with no allowed key in this tile (None if there are none)."""
        if self.allowed is None:
            return None
        empty = ~self.allowed.any(dim=-1)
        return empty if bool(empty.any()) else None


def index_grids(
    batch: int, heads: int, q_rows: slice, kv_cols: slice, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(b, h, q_idx, kv_idx)` of a tile as broadcast index tensors (`[B,1,1,1]`, `[1,H,1,1]`,
    `[1,1,q,1]`, `[1,1,1,kv]`): how a mask_mod or a score_mod is evaluated outside
    FlexAttention."""
    return (
        torch.arange(batch, device=device).view(-1, 1, 1, 1),
        torch.arange(heads, device=device).view(1, -1, 1, 1),
        torch.arange(q_rows.start, q_rows.stop, device=device).view(1, 1, -1, 1),
        torch.arange(kv_cols.start, kv_cols.stop, device=device).view(1, 1, 1, -1),
    )


def evaluate_mask(
    mask: MaskMod,
    batch: int,
    heads: int,
    q_rows: slice,
    kv_cols: slice,
    device: torch.device,
) -> Tensor:
    """The mask on a tile as a bool tensor broadcastable to `[batch, heads, q, kv]`.

    Index grids are broadcast, so the result keeps size 1 on the batch and head dims when the
    mask does not depend on them.
    """
    b, h, q_idx, kv_idx = index_grids(batch, heads, q_rows, kv_cols, device)
    allowed = torch.as_tensor(mask(b, h, q_idx, kv_idx), device=device)
    if allowed.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got {allowed.dtype}")
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    tile_shape = (allowed.shape[0], allowed.shape[1], q_idx.shape[2], kv_idx.shape[3])
    return allowed.expand(tile_shape)


def mask_dependence(
    mask: MaskMod, batch: int, heads: int, device: torch.device
) -> tuple[bool, bool]:
    """Whether the mask varies with the batch index and with the head index."""
    allowed = evaluate_mask(mask, batch, heads, slice(0, 1), slice(0, 1), device)
    return allowed.shape[0] > 1, allowed.shape[1] > 1


def _is_top_left_causal(allowed: Tensor) -> bool:
    """Whether every batch row and head of the tile is top-left causal (a document mask
    varies with the batch index, yet a tile inside one document of every row is causal)."""
    q_len, kv_len = allowed.shape[-2:]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=allowed.device).tril()
    return torch.equal(allowed, causal.expand_as(allowed))


def iter_tiles(
    mask: MaskMod | None,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    q_block: int,
    kv_block: int,
    device: torch.device,
) -> Iterator[Tile]:
    """Tiles with any allowed entry, ordered by query block, then by KV block."""
    for q_start in range(0, q_len, q_block):
        q_rows = slice(q_start, min(q_start + q_block, q_len))
        for kv_start in range(0, kv_len, kv_block):
            kv_cols = slice(kv_start, min(kv_start + kv_block, kv_len))
            if mask is None:
                yield Tile(q_rows, kv_cols, is_causal=False, allowed=None)
                continue
            allowed = evaluate_mask(mask, batch, heads, q_rows, kv_cols, device)
            if not bool(allowed.any()):
                continue
            if bool(allowed.all()):
                yield Tile(q_rows, kv_cols, is_causal=False, allowed=None)
            elif _is_top_left_causal(allowed):
                yield Tile(q_rows, kv_cols, is_causal=True, allowed=None)
            else:
                yield Tile(q_rows, kv_cols, is_causal=False, allowed=allowed)


def whole_problem_tile(
    tiles: list[Tile], q_len: int, kv_len: int, q_block: int, kv_block: int
) -> Tile | None:
    """One tile for the whole `q_len x kv_len` problem when the tiles `iter_tiles` kept on its
    `q_block x kv_block` grid say the mask is all True or exactly top-left causal
    (`q_idx >= kv_idx`); else None.

    Decided from the tiles' classes alone: each grid cell must be what the whole-problem mask
    makes of it (skipped wholly above the diagonal, full wholly on or below it, causal where
    the diagonal crosses it from its top-left corner).
    """
    if not tiles or any(tile.allowed is not None for tile in tiles):
        return None  # nothing to attend to, or a tile that needs its dense mask
    kept = {(tile.q_rows.start, tile.kv_cols.start): tile.is_causal for tile in tiles}
    cells = [(q, kv) for q in range(0, q_len, q_block) for kv in range(0, kv_len, kv_block)]
    whole = (slice(0, q_len), slice(0, kv_len))
    if len(kept) == len(cells) and not any(kept.values()):
        return Tile(*whole, is_causal=False, allowed=None)
    for q_start, kv_start in cells:
        q_stop, kv_stop = min(q_start + q_block, q_len), min(kv_start + kv_block, kv_len)
        if q_stop - 1 < kv_start:  # above the diagonal
            expected = None
        elif q_start >= kv_stop - 1:  # on or below it
            expected = False
        elif q_start == kv_start:  # crossed from the top-left corner
            expected = True
        else:
            return None
        if kept.get((q_start, kv_start)) != expected:
            return None
    return Tile(*whole, is_causal=True, allowed=None)
