"""The attention work of every token of a packed batch, known when the batch is loaded.

A packed row holds documents back to back, each attending only within itself, so a token's
attention work is not its position: it is the number of keys its query sees under its layer's
`AttentionPattern` inside its own document. `keys_seen` counts them for one pattern in closed
form (O(B·S), no S×S mask), `attention_work` sums them over a model's layers, and
`token_costs` adds each token's linear work: the one measure of a batch that cutting slices,
sharding context-parallel ranks and balancing microbatches all divide. `equal_work_bins` deals
items (rows, pieces of a row) into equal-sized bins of about equal work, the rule the loader's
row balancing and document-balanced context parallelism share.

Kernels compute in tiles, though: `tile_keys_seen` counts the keys of the tiles a causal query
block computes, the work a tiled kernel does (and so its time) where documents are short.
`SlicedTileKeys` counts them for a sliced sequence, whose every slice attends to each earlier
slice's cached chunk and its own, each chunk tiled from its own first token.

Counts are exact for causal attention, sliding windows, local chunks and bidirectional prefixes,
with or without documents. A pattern's free-form `rule` is not counted (it can only remove
keys): the count is then an upper bound, as `AttentionPattern.visible_keys` is.

Document ids follow packing's convention: per row, each document's tokens form one run and ids
never decrease along the row (0, 1, 2, ... in `pipekit.train.data.packing`).

Legend: B rows, S tokens per row.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

from pipekit.attention.patterns import CAUSAL, AttentionPattern

__all__ = [
    "SlicedTileKeys",
    "attention_work",
    "document_spans",
    "equal_work_bins",
    "keys_seen",
    "rows_or_one_sequence",
    "tile_keys_seen",
    "token_costs",
]


def document_spans(document_ids_BS: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, the row index of its document's first token and one past its last
    (`first_BS`, `end_BS`). Refuses ids that decrease along a row: a document split into
    several runs is not what packing makes, and its work would be miscounted."""
    if document_ids_BS.dim() != 2:
        raise ValueError(
            f"document ids must be [rows, tokens], got shape {tuple(document_ids_BS.shape)}"
        )
    rows, length = document_ids_BS.shape
    changes_BS1 = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    if (document_ids_BS[:, 1:] < document_ids_BS[:, :-1]).any():
        raise ValueError(
            "document ids decrease along a row; give each document one run of tokens with ids "
            "that never decrease (0, 1, 2, ... as pipekit's packing writes them)"
        )
    index_BS = torch.arange(length, device=document_ids_BS.device).expand(rows, length)
    edge_B1 = torch.ones(rows, 1, dtype=torch.bool, device=document_ids_BS.device)
    starts_BS = torch.cat([edge_B1, changes_BS1], dim=1)
    first_BS = torch.where(starts_BS, index_BS, 0).cummax(dim=1).values
    lasts_BS = torch.cat([changes_BS1, edge_B1], dim=1)
    end_BS = torch.where(lasts_BS, index_BS + 1, length).flip(1).cummin(dim=1).values.flip(1)
    return first_BS, end_BS


def rows_or_one_sequence(document_ids_BS: Tensor | None, seq_len: int | None) -> Tensor:
    """The rows' document ids, or one row of one `seq_len`-token document."""
    if document_ids_BS is not None:
        return document_ids_BS
    if seq_len is None:
        raise ValueError("attention work needs document ids or seq_len")
    return torch.zeros(1, seq_len, dtype=torch.int64)


def keys_seen(
    document_ids_BS: Tensor | None,
    pattern: AttentionPattern | None = None,
    seq_len: int | None = None,
) -> Tensor:
    """How many keys each query attends to under `pattern` (None: causal), within its own
    document (ids None: the row is one sequence of `seq_len` tokens, one row). int64 [B, S]."""
    pattern = pattern or CAUSAL
    document_ids_BS = rows_or_one_sequence(document_ids_BS, seq_len)
    first_BS, end_BS = document_spans(document_ids_BS)
    length = document_ids_BS.shape[1]
    t_BS = torch.arange(length, device=document_ids_BS.device).expand_as(first_BS)
    low_BS, high_BS = first_BS, t_BS
    if pattern.prefix:
        high_BS = torch.where(
            t_BS < pattern.prefix, torch.clamp(t_BS, min=pattern.prefix - 1), t_BS
        )
    high_BS = torch.minimum(high_BS, end_BS - 1)
    if pattern.window is not None:
        low_BS = torch.maximum(low_BS, t_BS - pattern.window + 1)
    if pattern.chunk is not None:
        chunk_first_BS = t_BS // pattern.chunk * pattern.chunk
        low_BS = torch.maximum(low_BS, chunk_first_BS)
        high_BS = torch.minimum(high_BS, chunk_first_BS + pattern.chunk - 1)
    return high_BS - low_BS + 1


def tile_keys_seen(document_ids_BS: Tensor, block: int) -> Tensor:
    """How many keys each query's kernel tile row computes under causal attention within its
    document, for a kernel that computes `block x block` tiles whole and skips the tiles no
    query sees (pipekit's CPU kernel: 512; FlexAttention's block mask: 128), tiles aligned at
    the row's start. A query block's visible keys run from its first query's document start to
    its last query (one contiguous run: documents are), so its tiles are the key blocks that
    run touches, each `block` keys per query. Short documents cost their whole diagonal tile,
    not the few keys they see: on the CPU kernel a 4096-token row of 100-token documents takes
    0.29 s forward and backward against 0.48 s for one causal document, 40 times the keys.
    int64 [B, S]; `block` 1 is `keys_seen`."""
    if block < 1:
        raise ValueError(f"tile block={block} must be >= 1 token")
    first_BS, _ = document_spans(document_ids_BS)
    length = document_ids_BS.shape[1]
    starts = torch.arange(0, length, block, device=document_ids_BS.device)
    tiles_BN = starts // block - first_BS[:, starts] // block + 1  # block n's last query: n
    return (tiles_BN * block).repeat_interleave(block, dim=1)[:, :length]


class SlicedTileKeys:
    """The keys a tiled causal kernel computes for one slice of a sliced microbatch, in closed
    form: the slice's queries, in `block`-token tiles from its first token, against each
    earlier slice's KV chunk and its own, each in `block`-token tiles from the chunk's first
    token (the KV cache keeps one chunk per slice), a tile computed whole when any query of any
    row sees one of its keys (the kernel runs a tile for every row at once).

    Why not `tile_keys_seen`: its tiles are aligned at the row's start, so it prices a slice
    that starts inside a tile by the wrong tiles (six 16K-token rows of a long-tailed document
    mix cut in 8 slices on 64-token bounds by the row-aligned count: up to 1.26x imbalance in
    the kernel's tiles, 1.09x on average; cut by this count, at most 1.05x)."""

    def __init__(self, document_ids_BS: Tensor, block: int) -> None:
        if block < 1:
            raise ValueError(f"tile block={block} must be >= 1 token")
        first_BS, _ = document_spans(document_ids_BS)
        self.rows, self.block = document_ids_BS.shape[0], block
        self.first_S: list[int] = first_BS.min(dim=0).values.tolist()
        """Per position, the earliest start of its document over the rows."""

    def slice_keys(self, start: int, end: int, earlier: Sequence[int]) -> int:
        """Keys computed for the slice `[start, end)`, summed over its queries and rows, when
        the slices before it are cut at `earlier` (0 up to `start`)."""
        block, total = self.block, 0
        for q_start in range(start, end, block):
            q_size, first = min(block, end - q_start), self.first_S[q_start]
            keys = 0
            if first < start:  # earlier chunks from the one holding `first`: its tiles from there
                chunk_start = earlier[bisect.bisect_right(earlier, first) - 1]
                keys += start - chunk_start - (first - chunk_start) // block * block
            diagonal, lowest = (q_start - start) // block, (max(first, start) - start) // block
            keys += block * (diagonal - lowest) + q_size  # own chunk: tiles up to the diagonal
            total += q_size * keys
        return self.rows * total

    def per_slice(self, bounds: Sequence[int]) -> list[int]:
        """`slice_keys` of every slice of a microbatch cut at `bounds`."""
        return [
            self.slice_keys(start, end, bounds[: index + 1])
            for index, (start, end) in enumerate(itertools.pairwise(bounds))
        ]


def attention_work(
    document_ids_BS: Tensor | None,
    patterns: Sequence[AttentionPattern | None],
    seq_len: int | None = None,
    block: int = 1,
) -> Tensor:
    """Keys seen by each query summed over layers, one pattern per layer (None: causal):
    each distinct pattern is counted once. `block` > 1: the keys of the causal tiles a kernel
    of that tile side computes (`tile_keys_seen`; causal layers only). int64 [B, S]."""
    if not patterns:
        raise ValueError("attention_work needs one pattern per attention layer; got none")
    counts = Counter(pattern or CAUSAL for pattern in patterns)
    if block > 1:
        if set(counts) != {CAUSAL}:
            raise ValueError(
                f"attention work in {block}-token tiles is counted for causal layers only; "
                "count windowed or chunked layers by keys (block=1)"
            )
        ids_BS = rows_or_one_sequence(document_ids_BS, seq_len)
        return counts[CAUSAL] * tile_keys_seen(ids_BS, block)
    return sum(
        layers * keys_seen(document_ids_BS, pattern, seq_len) for pattern, layers in counts.items()
    )


def token_costs(
    document_ids_BS: Tensor | None,
    patterns: Sequence[AttentionPattern | None],
    linear_per_token: float,
    attention_per_key: float,
    seq_len: int | None = None,
    block: int = 1,
) -> Tensor:
    """Each token's work: `linear_per_token` (its matmuls over all layers) plus
    `attention_per_key` for every key a layer's query sees, or its kernel computes in
    `block`-token tiles (`attention_work`), in the caller's unit (FLOPs, multiply-adds,
    seconds). float64 [B, S]."""
    if linear_per_token < 0 or attention_per_key < 0:
        raise ValueError(
            f"linear_per_token={linear_per_token} and attention_per_key={attention_per_key} "
            "must be >= 0"
        )
    work_BS = attention_work(document_ids_BS, patterns, seq_len, block).to(torch.float64)
    return linear_per_token + attention_per_key * work_BS


def equal_work_bins(work_N: Tensor, bins: int) -> Tensor:
    """A permutation of the N items whose consecutive runs of `N / bins` items are the bins,
    each with about the same total `work_N`: costliest first, each to the bin with the least
    work so far that still has room (the longest-processing-time rule), ties by index; each
    bin's items in index order. Deterministic: a function of `work_N` alone."""
    items = work_N.shape[0]
    if bins < 1 or items % bins:
        raise ValueError(f"{items} items do not deal into {bins} equal bins; make N a multiple")
    per_bin = items // bins
    totals = [0.0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    values = work_N.tolist()
    for item in sorted(range(items), key=lambda index: (-values[index], index)):
        chosen = min(
            (b for b in range(bins) if len(members[b]) < per_bin), key=lambda b: (totals[b], b)
        )
        members[chosen].append(item)
        totals[chosen] += values[item]
    return torch.tensor([item for bin_items in members for item in sorted(bin_items)])
