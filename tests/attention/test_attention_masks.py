"""mask_mod semantics, composition, and agreement between broadcast and vmap evaluation."""

import pytest
import torch
from attention_reference import dense_allowed
from torch.nn.attention.flex_attention import create_mask

from pipekit.attention import (
    and_masks,
    causal_mask,
    document_mask,
    offset_causal_mask,
    or_masks,
    sliding_window_mask,
)
from pipekit.attention.kernels._tiles import evaluate_mask, iter_tiles, whole_problem_tile

DOCS_BS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])


def _grid(mask, batch=2, heads=3, q_len=8, kv_len=8):
    return evaluate_mask(mask, batch, heads, slice(0, q_len), slice(0, kv_len), torch.device("cpu"))


def test_causal_and_offset_causal_follow_positions():
    assert torch.equal(_grid(causal_mask)[0, 0], torch.ones(8, 8, dtype=torch.bool).tril())
    # queries at positions 8..15 against keys 4..11: key p is visible from query q iff q >= p.
    allowed = _grid(offset_causal_mask(8, 4))[0, 0]
    expected = torch.tensor([[8 + q >= 4 + k for k in range(8)] for q in range(8)])
    assert torch.equal(allowed, expected)


def test_document_mask_separates_documents_per_batch_row():
    allowed = _grid(document_mask(DOCS_BS, DOCS_BS))
    for b in range(2):
        expected = DOCS_BS[b][:, None] == DOCS_BS[b][None, :]
        assert torch.equal(allowed[b, 0], expected)
    assert not torch.equal(allowed[0], allowed[1])


def test_sliding_window_and_composition():
    window = and_masks(causal_mask, sliding_window_mask(3))
    expected = torch.tensor([[0 <= q - k < 3 for k in range(8)] for q in range(8)])
    assert torch.equal(_grid(window)[0, 0], expected)
    either = or_masks(sliding_window_mask(2), offset_causal_mask(0, 4))
    expected_or = torch.tensor([[abs(q - k) < 2 or q >= k + 4 for k in range(8)] for q in range(8)])
    assert torch.equal(_grid(either)[0, 0], expected_or)


@pytest.mark.parametrize(
    "mask",
    [
        causal_mask,
        offset_causal_mask(5, 2),
        and_masks(causal_mask, document_mask(DOCS_BS, DOCS_BS)),
        and_masks(causal_mask, sliding_window_mask(3, q_offset=2)),
    ],
)
def test_broadcast_evaluation_equals_flex_vmap_and_loops(mask):
    broadcast = _grid(mask, heads=2).expand(2, 2, 8, 8)
    assert torch.equal(broadcast, create_mask(mask, 2, 2, 8, 8, device="cpu"))
    assert torch.equal(broadcast, dense_allowed(mask, 2, 2, 8, 8))


def test_tiles_skip_masked_blocks_and_recognise_causal():
    tiles = list(iter_tiles(causal_mask, 1, 1, 8, 8, 4, 4, torch.device("cpu")))
    kinds = [(t.q_rows.start, t.kv_cols.start, t.is_causal, t.allowed is None) for t in tiles]
    # The upper-right tile is skipped, diagonal tiles run causal, the lower-left one unmasked.
    assert kinds == [(0, 0, True, True), (4, 0, False, True), (4, 4, True, True)]


def test_tiles_causal_in_every_batch_row_run_causal_without_a_dense_mask():
    """A document mask varies with the batch index; where every row's tile lies inside one
    document, the tile is causal and runs on the kernel's causal path (one row's boundary
    keeps its dense mask). Before, any batch-dependent mask sent every diagonal tile, and a
    batch of one-document rows its whole problem, through a dense additive mask."""
    one_document_rows = torch.tensor([[0] * 8, [1] * 8])
    mask = and_masks(causal_mask, document_mask(one_document_rows, one_document_rows))
    tiles = list(iter_tiles(mask, 2, 1, 8, 8, 4, 4, torch.device("cpu")))
    kinds = [(t.is_causal, t.allowed is None) for t in tiles]
    assert kinds == [(True, True), (False, True), (True, True)]
    assert whole_problem_tile(tiles, 8, 8, 4, 4).is_causal
    boundary = and_masks(causal_mask, document_mask(DOCS_BS, DOCS_BS))
    diagonal = next(iter_tiles(boundary, 2, 1, 8, 8, 4, 4, torch.device("cpu")))
    assert not diagonal.is_causal and diagonal.allowed is not None


@pytest.mark.parametrize(
    ("mask", "q_len", "kv_len", "q_block", "kv_block", "expected"),
    [
        (causal_mask, 24, 24, 8, 8, "causal"),
        (causal_mask, 20, 20, 8, 8, "causal"),  # ragged last block
        (causal_mask, 8, 24, 8, 8, "causal"),  # more keys than queries, top-left aligned
        (None, 24, 13, 8, 8, "full"),
        (offset_causal_mask(8, 0), 8, 16, 8, 8, None),  # shifted: not q >= kv from the corner
        (offset_causal_mask(24, 0), 8, 16, 8, 8, "full"),  # every key is earlier
        (causal_mask, 24, 24, 8, 5, None),  # the diagonal crosses cells off their corners
        (sliding_window_mask(3), 24, 24, 8, 8, None),  # dense tiles
        (None, 8, 0, 8, 8, None),  # no keys: nothing for the kernel to run
        (offset_causal_mask(0, 8), 8, 8, 8, 8, None),  # every key is later: all tiles skipped
    ],
)
def test_whole_problem_tile_only_where_the_tiles_add_up_to_one_kernel_mask(
    mask, q_len, kv_len, q_block, kv_block, expected
):
    tiles = list(iter_tiles(mask, 1, 1, q_len, kv_len, q_block, kv_block, torch.device("cpu")))
    whole = whole_problem_tile(tiles, q_len, kv_len, q_block, kv_block)
    if expected is None:
        assert whole is None
        return
    assert (whole.q_rows, whole.kv_cols) == (slice(0, q_len), slice(0, kv_len))
    assert whole.is_causal == (expected == "causal") and whole.allowed is None
    # the one call's mask is the problem's mask
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if whole.is_causal:
        allowed = allowed.tril()
    evaluated = torch.ones(q_len, kv_len, dtype=torch.bool)
    if mask is not None:
        evaluated = _grid(mask, q_len=q_len, kv_len=kv_len)[0, 0]
    assert torch.equal(allowed, evaluated)


def test_bad_masks_are_rejected():
    with pytest.raises(ValueError, match="window_size"):
        sliding_window_mask(0)
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        document_mask(DOCS_BS[0], DOCS_BS)
    with pytest.raises(TypeError, match="bool"):
        _grid(lambda b, h, q, k: (q - k).float())
