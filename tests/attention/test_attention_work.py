"""The attention work of packed batches (`pipekit.attention.work`) against brute force over the
patterns' own masks, and slices cut by it (`cost_slice_bounds`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipekit.attention.kernels._tiles import iter_tiles
from pipekit.attention.patterns import CAUSAL, AttentionPattern
from pipekit.attention.work import (
    SlicedTileKeys,
    attention_work,
    document_spans,
    keys_seen,
    tile_keys_seen,
    token_costs,
)
from pipekit.pipelining.schedules.slice_bounds import cost_slice_bounds, slice_bounds

PATTERNS = [
    CAUSAL,
    AttentionPattern(window=5),
    AttentionPattern(chunk=8),
    AttentionPattern(prefix=6),
    AttentionPattern(prefix=6, window=3),
    AttentionPattern(prefix=12, chunk=8),
    AttentionPattern(window=4, chunk=8),
]


def _packed_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """Document ids of rows packed from documents of the given lengths."""
    return torch.stack(
        [
            torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
            for lengths in lengths_per_row
        ]
    )


def _brute_force(document_ids_BS: torch.Tensor, pattern: AttentionPattern) -> torch.Tensor:
    """Keys each query sees, by evaluating the pattern and the document mask on every pair."""
    length = document_ids_BS.shape[1]
    q_S1 = torch.arange(length)[:, None]
    allowed_SK = pattern.allows(q_S1, torch.arange(length)[None, :])
    same_BSK = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
    return (allowed_SK & same_BSK).sum(-1)


@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
def test_keys_seen_equal_the_patterns_masks_on_packed_rows(pattern):
    ids_BS = _packed_ids([[40], [3, 1, 17, 19], [9, 9, 9, 9, 4], [1] * 40])
    assert torch.equal(keys_seen(ids_BS, pattern), _brute_force(ids_BS, pattern))
    # ablation: documents ignored, the counts are those of one sequence per row
    whole_BS = torch.zeros_like(ids_BS)
    if not torch.equal(ids_BS, whole_BS):
        assert not torch.equal(keys_seen(whole_BS, pattern), _brute_force(ids_BS, pattern))


def test_without_documents_a_row_is_one_causal_sequence():
    assert keys_seen(None, seq_len=5).tolist() == [[1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="needs document ids or seq_len"):
        keys_seen(None)


def test_attention_work_sums_each_layers_pattern():
    ids_BS = _packed_ids([[10, 22], [32]])
    layers = [None, AttentionPattern(window=5), None, AttentionPattern(window=5)]
    expected = 2 * _brute_force(ids_BS, CAUSAL) + 2 * _brute_force(ids_BS, layers[1])
    assert torch.equal(attention_work(ids_BS, layers), expected)
    costs = token_costs(ids_BS, layers, linear_per_token=3.0, attention_per_key=0.5)
    assert costs.dtype == torch.float64 and torch.equal(costs, 3.0 + 0.5 * expected.double())


def _brute_force_tiles(document_ids_BS: torch.Tensor, block: int) -> torch.Tensor:
    """Per query, `block` keys for every `block x block` tile of its row's grid in which some
    query of its block sees some key (causal, within documents)."""
    allowed_BSK = _brute_force_pairs(document_ids_BS)
    rows, length = document_ids_BS.shape
    counts_BS = torch.zeros(rows, length, dtype=torch.int64)
    for q in range(0, length, block):
        tiles_B = sum(
            allowed_BSK[:, q : q + block, k : k + block].flatten(1).any(1).long()
            for k in range(0, length, block)
        )
        counts_BS[:, q : q + block] = (tiles_B * block)[:, None]
    return counts_BS


def _brute_force_pairs(document_ids_BS: torch.Tensor) -> torch.Tensor:
    length = document_ids_BS.shape[1]
    causal_SK = torch.arange(length)[:, None] >= torch.arange(length)[None, :]
    return causal_SK & (document_ids_BS[:, :, None] == document_ids_BS[:, None, :])


@pytest.mark.parametrize("block", [1, 4, 8, 16])
def test_tile_keys_count_the_tiles_a_tiled_kernel_computes(block):
    """Every key of each tile some query of the block sees, on rows of long, short and
    edge-crossing documents; one-token tiles are the keys themselves; in attention work, only
    causal layers are counted in tiles."""
    ids_BS = _packed_ids([[40], [3, 1, 17, 19], [9, 9, 9, 9, 4], [1] * 40, [5, 30, 5]])
    assert torch.equal(tile_keys_seen(ids_BS, block), _brute_force_tiles(ids_BS, block))
    if block == 1:
        assert torch.equal(tile_keys_seen(ids_BS, 1), keys_seen(ids_BS))
    else:  # short documents cost their whole tile, far above the keys they see
        short_BS = ids_BS[3:4]
        assert tile_keys_seen(short_BS, block).sum() >= block * keys_seen(short_BS).sum() / 2
        assert torch.equal(
            attention_work(ids_BS, [None, None], block=block), 2 * tile_keys_seen(ids_BS, block)
        )
        with pytest.raises(ValueError, match="counted for causal layers only"):
            attention_work(ids_BS, [AttentionPattern(window=5)], block=block)


def _kernel_tile_keys(document_ids_BS: torch.Tensor, bounds: list[int], block: int) -> list[int]:
    """Per slice, the area of the tiles the tiled kernel plans (`iter_tiles`) for the slice's
    queries against each earlier slice's chunk and its own, times the rows."""
    rows, per_slice = document_ids_BS.shape[0], []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        total = 0
        for chunk_start, chunk_end in list(itertools.pairwise(bounds))[: index + 1]:

            def mask(b, h, q, k, chunk_start=chunk_start, start=start):
                query, key = q + start, k + chunk_start
                same = document_ids_BS[b, query] == document_ids_BS[b, key]
                return same & (query >= key)

            tiles = iter_tiles(mask, rows, 1, end - start, chunk_end - chunk_start, block, block,
                               torch.device("cpu"))  # fmt: skip
            total += sum(
                rows * (t.q_rows.stop - t.q_rows.start) * (t.kv_cols.stop - t.kv_cols.start)
                for t in tiles
            )
        per_slice.append(total)
    return per_slice


@pytest.mark.parametrize("block", [8, 16, 32])
def test_sliced_tile_keys_are_the_tiles_the_sliced_kernel_plans(block):
    """Slices on unaligned bounds, one and several rows (a tile is computed for every row when
    any row needs it): the closed form equals the kernel's own tile plan; on tile-aligned
    bounds of one row it is the row-aligned count, on unaligned ones it is not (the ablation:
    the row-aligned count prices other tiles)."""
    generator = torch.Generator().manual_seed(block)
    misses = 0
    for _ in range(12):
        rows = int(torch.randint(1, 3, (1,), generator=generator))
        starts_BS = torch.rand(rows, 192, generator=generator) < 0.04
        ids_BS = starts_BS.long().cumsum(1)
        inner = torch.randint(1, 24, (3,), generator=generator).unique().mul(8).tolist()
        bounds = [0, *inner, 192]
        counted = SlicedTileKeys(ids_BS, block).per_slice(bounds)
        assert counted == _kernel_tile_keys(ids_BS, bounds, block), bounds
        row_aligned_S = tile_keys_seen(ids_BS, block).sum(0)
        by_row = [int(row_aligned_S[a:b].sum()) for a, b in itertools.pairwise(bounds)]
        misses += by_row != counted
    assert misses > 0
    aligned = [0, 4 * block, 192]
    ids_BS = (torch.rand(1, 192, generator=generator) < 0.04).long().cumsum(1)
    row_aligned_S = tile_keys_seen(ids_BS, block)[0]
    assert SlicedTileKeys(ids_BS, block).per_slice(aligned) == [
        int(row_aligned_S[a:b].sum()) for a, b in itertools.pairwise(aligned)
    ]


def test_document_spans_and_bad_ids_name_the_fix():
    first, end = document_spans(_packed_ids([[2, 3]]))
    assert first.tolist() == [[0, 0, 2, 2, 2]] and end.tolist() == [[2, 2, 5, 5, 5]]
    with pytest.raises(ValueError, match="ids decrease along a row"):
        document_spans(torch.tensor([[0, 1, 0]]))
    with pytest.raises(ValueError, match=r"\[rows, tokens\]"):
        document_spans(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="one pattern per attention layer"):
        attention_work(None, [], seq_len=4)


@pytest.mark.parametrize(("seq_len", "slices", "granularity", "ratio"),
                         [(4096, 8, 64, 0.7), (1024, 4, 16, 3.0), (512, 2, 1, 0.0)])  # fmt: skip
def test_one_causal_document_cuts_where_the_single_sequence_formula_does(
    seq_len, slices, granularity, ratio
):
    # per-token cost of one causal sequence whose attention is `ratio` of its linear work
    attention_per_key = 2 * ratio / (seq_len + 1)
    cost_S = token_costs(None, [None], 1.0, attention_per_key, seq_len)[0]
    by_cost = cost_slice_bounds(cost_S, slices, granularity)
    by_formula = slice_bounds(seq_len, slices, "equal_cost", ratio, granularity)
    assert all(abs(a - b) <= granularity for a, b in zip(by_cost, by_formula, strict=True))


def _slice_costs(cost_S: torch.Tensor, bounds: tuple[int, ...]) -> list[float]:
    return [float(cost_S[a:b].sum()) for a, b in itertools.pairwise(bounds)]


def test_packed_documents_get_slices_of_equal_work_where_the_formula_does_not():
    """A row of short documents then one long one: the long document's tokens see many keys,
    so equal-cost slices by the batch's work give the end fewer tokens; the single-sequence
    formula (front-loaded) and equal lengths both leave the slices far apart."""
    seq_len, slices, granularity = 2048, 4, 4
    ids_BS = _packed_ids([[64] * 16 + [1024]])
    cost_S = token_costs(ids_BS, [None] * 4, 1.0, 0.05)[0]
    bounds = cost_slice_bounds(cost_S, slices, granularity)
    granule_max = float(cost_S.view(-1, granularity).sum(1).max())
    costs = _slice_costs(cost_S, bounds)
    assert max(costs) - min(costs) <= 2 * granule_max
    total = float(cost_S.sum())
    ratio = float(4 * 0.05 * seq_len * (seq_len + 1) / 2) / seq_len  # as if one sequence
    for static in (slice_bounds(seq_len, slices),
                   slice_bounds(seq_len, slices, "equal_cost", ratio, granularity)):  # fmt: skip
        assert max(_slice_costs(cost_S, static)) / (total / slices) > 1.3
    assert max(costs) / (total / slices) < 1.05


def test_cost_slice_bounds_refuse_bad_input_in_one_line():
    with pytest.raises(ValueError, match="one cost per token"):
        cost_slice_bounds(torch.ones(2, 8), 2)
    with pytest.raises(ValueError, match="granularity dividing the length"):
        cost_slice_bounds(torch.ones(10), 4, granularity=4)
    with pytest.raises(ValueError, match=">= 0"):
        cost_slice_bounds(-torch.ones(8), 2)
    # all the cost in the last token: the cuts crowd before it, each slice keeping a granule
    spike_S = torch.zeros(64)
    spike_S[-1] = 1.0
    assert cost_slice_bounds(spike_S, 4, 8) == (0, 40, 48, 56, 64)
