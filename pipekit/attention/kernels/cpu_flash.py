"""CPU training kernel: the CPU flash-attention op of ATen, run tile by tile.

Why this kernel: `aten._scaled_dot_product_flash_attention_for_cpu` is the op that
`scaled_dot_product_attention` itself uses on CPU; it is blocked (no score matrix), returns the
log-sum-exp, and has a backward op that accepts an arbitrary `(out, lse)`. That last property is
what multi-chunk attention needs (the ring-attention identity: every chunk's backward runs with
the *merged* output and lse). FlexAttention has no CPU backward in torch 2.13, and a blocked
kernel written in Python ops would be several times slower.

Differentiability: the op's lse carries no gradient, so this backend is used through one
autograd function over all KV chunks (see `pipekit.attention.chunked`). Masks: the op only knows
dense additive masks and top-left causal, so masks are evaluated per tile (`_tiles`); fully masked
tiles are skipped. GQA: each KV tile is expanded to the query heads just before its call. The op
has no score hook: a chunk whose scores its pattern modifies (a bias, a soft cap: a
`ScoredMask`) runs on `pipekit.attention.kernels.score_mod.ScoreModKernel` instead.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from pipekit._torch_private import cpu_flash_attention_backward, cpu_flash_attention_forward
from pipekit.attention.kernels._tiles import Tile, iter_tiles, whole_problem_tile
from pipekit.attention.kernels.score_mod import ScoredMask, ScoreModKernel
from pipekit.attention.masks import MaskMod
from pipekit.attention.merge import merge_attention

__all__ = ["CpuFlashBackend"]

_flash_forward = cpu_flash_attention_forward
_flash_backward = cpu_flash_attention_backward


def _expand_kv_heads(kv_BGKD: Tensor, query_heads: int) -> Tensor:
    """Repeat each KV head for the query heads that share it (GQA)."""
    batch, kv_heads, length, head_dim = kv_BGKD.shape
    if kv_heads == query_heads:
        return kv_BGKD
    group = query_heads // kv_heads
    return (
        kv_BGKD.unsqueeze(2)
        .expand(batch, kv_heads, group, length, head_dim)
        .reshape(batch, query_heads, length, head_dim)
    )


def _reduce_kv_heads(grad_BHKD: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradients of the query heads that share one KV head (inverse of the expansion)."""
    query_heads = grad_BHKD.shape[1]
    if kv_heads == query_heads:
        return grad_BHKD
    return grad_BHKD.unflatten(1, (kv_heads, query_heads // kv_heads)).sum(2)


class _PlanCache:
    """The most recently used tile plans of masks, at most `max_plans` of them holding at most
    `max_mask_bytes` of dense tile masks (a partially masked tile keeps its bool mask), least
    recently used dropped first. Each entry holds its mask, so the id in its key stays unique.
    A mask is taken as immutable (pipekit's contexts build a new one whenever documents change)."""

    def __init__(self, max_plans: int = 16, max_mask_bytes: int = 64 * 2**20) -> None:
        self.max_plans, self.max_mask_bytes = max_plans, max_mask_bytes
        self._entries: OrderedDict[tuple[object, ...], tuple[MaskMod, list[list[Tile]], int]] = (
            OrderedDict()
        )
        self._mask_bytes = 0

    def get(self, key: tuple[object, ...]) -> list[list[Tile]] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: tuple[object, ...], mask: MaskMod, plan: list[list[Tile]]) -> None:
        nbytes = sum(
            tile.allowed.numel() * tile.allowed.element_size()
            for row_tiles in plan
            for tile in row_tiles
            if tile.allowed is not None
        )
        if nbytes > self.max_mask_bytes:
            return
        self._entries[key] = (mask, plan, nbytes)
        self._mask_bytes += nbytes
        while len(self._entries) > self.max_plans or self._mask_bytes > self.max_mask_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._mask_bytes -= dropped


class CpuFlashBackend:
    """Tiled ATen CPU flash attention; `q_block` x `kv_block` bounds every tile and mask.

    512-token tiles by default: a tile no query of which sees a key is skipped, so small tiles
    skip the keys of other packed documents (and outside windows) that 2048-token ones compute
    and mask (a row of short documents' last 4480 queries against 16K keys: 0.34 s forward
    against 1.02 s), while unmasked and causal problems run as one call whatever the tile."""

    name = "cpu"
    lse_has_grad = False

    def __init__(self, q_block: int = 512, kv_block: int = 512) -> None:
        self.q_block = q_block
        self.kv_block = kv_block
        self.work_block = max(q_block, kv_block)
        """Tokens per side of the tiles it computes whole (`pipekit.attention.work`)."""
        self._plans = _PlanCache()
        self._scored = ScoreModKernel()  # chunks whose scores a pattern modifies

    def _tiles(self, q_BHSD: Tensor, k_BGKD: Tensor, mask: MaskMod | None) -> list[list[Tile]]:
        """Tiles grouped by query block (each group's partials are merged).

        Plans of masks are cached (`_PlanCache`): every layer, forward and backward, asks for
        the same masks in turn (a sliced sequence: its own block's causal mask between
        unmasked cached chunks), and evaluating a mask is a pass over every tile.
        """
        (batch, heads, q_len, _), kv_len, device = q_BHSD.shape, k_BGKD.shape[2], q_BHSD.device
        key = (id(mask), batch, heads, q_len, kv_len, device)
        plan = self._plans.get(key) if mask is not None else None
        if plan is not None:
            return plan
        tiles = list(
            iter_tiles(mask, batch, heads, q_len, kv_len, self.q_block, self.kv_block, device)
        )
        whole = whole_problem_tile(tiles, q_len, kv_len, self.q_block, self.kv_block)
        groups: dict[int, list[Tile]] = {}
        for tile in [whole] if whole is not None else tiles:
            groups.setdefault(tile.q_rows.start, []).append(tile)
        plan = list(groups.values())
        if mask is not None:
            self._plans.put(key, mask, plan)
        return plan

    def _tile_forward(
        self, tile: Tile, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        heads = q_BHSD.shape[1]
        out_t, lse_t = _flash_forward(
            q_BHSD[:, :, tile.q_rows],
            _expand_kv_heads(k_BGKD[:, :, tile.kv_cols], heads),
            _expand_kv_heads(v_BGKD[:, :, tile.kv_cols], heads),
            is_causal=tile.is_causal,
            attn_mask=tile.additive_mask(q_BHSD.dtype),
            scale=scale,
        )
        empty_rows = tile.empty_rows()
        if empty_rows is not None:  # the op reports lse = 0 for rows with no key
            lse_t = lse_t.masked_fill(empty_rows, float("-inf"))
        return out_t, lse_t

    def _tile_backward(
        self,
        tile: Tile,
        grad_out_BHSD: Tensor,
        q_BHSD: Tensor,
        k_BGKD: Tensor,
        v_BGKD: Tensor,
        out_BHSD: Tensor,
        lse_BHS: Tensor,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        heads, kv_heads, rows = q_BHSD.shape[1], k_BGKD.shape[1], tile.q_rows
        grad_q_t, grad_k_t, grad_v_t = _flash_backward(
            grad_out_BHSD[:, :, rows].contiguous(),
            q_BHSD[:, :, rows],
            _expand_kv_heads(k_BGKD[:, :, tile.kv_cols], heads),
            _expand_kv_heads(v_BGKD[:, :, tile.kv_cols], heads),
            out_BHSD[:, :, rows].contiguous(),
            lse_BHS[:, :, rows].contiguous(),
            0.0,
            tile.is_causal,
            attn_mask=tile.additive_mask(q_BHSD.dtype),
            scale=scale,
        )
        return grad_q_t, _reduce_kv_heads(grad_k_t, kv_heads), _reduce_kv_heads(grad_v_t, kv_heads)

    @staticmethod
    def _single_tile(plan: list[list[Tile]], q_len: int, kv_len: int) -> Tile | None:
        """The plan's only tile if it covers the whole problem (then no buffers are needed)."""
        if len(plan) == 1 and len(plan[0]) == 1:
            tile = plan[0][0]
            if tile.q_rows == slice(0, q_len) and tile.kv_cols == slice(0, kv_len):
                return tile
        return None

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        """Attention of the queries over one KV chunk: `(out_BHSD, lse_BHS)`, no autograd."""
        if isinstance(mask, ScoredMask):
            return self._scored.forward_chunk(q_BHSD, k_BGKD, v_BGKD, mask, scale)
        plan = self._tiles(q_BHSD, k_BGKD, mask)
        single = self._single_tile(plan, q_BHSD.shape[2], k_BGKD.shape[2])
        if single is not None:
            return self._tile_forward(single, q_BHSD, k_BGKD, v_BGKD, scale)
        # in [B, S, H, D] memory, as the one-tile kernel returns it: joining the heads for the
        # output projection is then a view, not a copy the projection would save
        batch, heads, queries, head_dim = q_BHSD.shape
        out_BHSD = q_BHSD.new_zeros(batch, queries, heads, head_dim).transpose(1, 2)
        stat_dtype = torch.promote_types(q_BHSD.dtype, torch.float32)
        lse_BHS = torch.full(
            q_BHSD.shape[:3], float("-inf"), dtype=stat_dtype, device=q_BHSD.device
        )
        for row_tiles in plan:
            out_t, lse_t = merge_attention(
                [self._tile_forward(tile, q_BHSD, k_BGKD, v_BGKD, scale) for tile in row_tiles]
            )
            out_BHSD[:, :, row_tiles[0].q_rows] = out_t
            lse_BHS[:, :, row_tiles[0].q_rows] = lse_t
        return out_BHSD, lse_BHS

    def backward_chunk(
        self,
        grad_out_BHSD: Tensor,
        q_BHSD: Tensor,
        k_BGKD: Tensor,
        v_BGKD: Tensor,
        out_BHSD: Tensor,
        lse_BHS: Tensor,
        mask: MaskMod | None,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one chunk given the *merged* `out` and `lse` (ring-attention identity)."""
        if isinstance(mask, ScoredMask):
            return self._scored.backward_chunk(
                grad_out_BHSD, q_BHSD, k_BGKD, v_BGKD, out_BHSD, lse_BHS, mask, scale
            )
        stat_dtype = torch.promote_types(q_BHSD.dtype, torch.float32)
        # Rows with no key anywhere have lse = -inf; +inf makes their probabilities exp(-inf) = 0.
        lse_BHS = lse_BHS.masked_fill(torch.isneginf(lse_BHS), float("inf")).to(stat_dtype)
        tensors = (grad_out_BHSD, q_BHSD, k_BGKD, v_BGKD, out_BHSD, lse_BHS)
        plan = self._tiles(q_BHSD, k_BGKD, mask)
        single = self._single_tile(plan, q_BHSD.shape[2], k_BGKD.shape[2])
        if single is not None:
            return self._tile_backward(single, *tensors, scale)
        grad_q_BHSD = torch.zeros_like(q_BHSD)
        grad_k_BGKD = torch.zeros_like(k_BGKD)
        grad_v_BGKD = torch.zeros_like(v_BGKD)
        for tile in (tile for row_tiles in plan for tile in row_tiles):
            grad_q_t, grad_k_t, grad_v_t = self._tile_backward(tile, *tensors, scale)
            grad_q_BHSD[:, :, tile.q_rows] += grad_q_t
            grad_k_BGKD[:, :, tile.kv_cols] += grad_k_t
            grad_v_BGKD[:, :, tile.kv_cols] += grad_v_t
        return grad_q_BHSD, grad_k_BGKD, grad_v_BGKD
