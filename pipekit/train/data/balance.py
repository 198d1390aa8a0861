"""Rows of a global batch spread so every data-parallel rank and microbatch carries about the
same attention work.

Packed rows differ in attention work by their documents: a row of one long document costs up to
its length times the keys of a row of short ones. Rows are cut from the stream in order, so one
microbatch (and one data-parallel rank) can draw the costly rows while another draws cheap ones,
and the pipeline and the gradient all-reduce wait for the slowest. `balanced_row_order` deals a
step's rows into equal-sized bins, costliest first, each to the bin with the least work so far
that still has room (the longest-processing-time rule): deterministic, a function of the batch
alone, so a resumed job deals the same bins. The step's rows, and so its gradient, are
unchanged; only which rank and microbatch runs each row moves.

Legend: G rows of the global batch, S tokens per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipekit.attention.work import keys_seen

__all__ = ["balanced_row_order", "row_attention_work"]


def row_attention_work(document_ids_GS: Tensor) -> Tensor:
    """Each row's causal attention work: the keys its queries see within their documents."""
    return keys_seen(document_ids_GS).sum(dim=1)


def balanced_row_order(work_G: Tensor, bins: int) -> Tensor:
    """A permutation of the rows whose consecutive runs of `G / bins` rows are the bins, each
    with about the same total `work_G` (the longest-processing-time rule, ties by row index)."""
    rows = work_G.shape[0]
    if bins < 1 or rows % bins:
        raise ValueError(f"{rows} rows do not deal into {bins} equal bins; make G a multiple")
    per_bin = rows // bins
    totals = [0.0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    order = sorted(range(rows), key=lambda row: (-float(work_G[row]), row))
    for row in order:
        open_bins = [b for b in range(bins) if len(members[b]) < per_bin]
        chosen = min(open_bins, key=lambda b: (totals[b], b))
        members[chosen].append(row)
        totals[chosen] += float(work_G[row])
    return torch.tensor([row for bin_rows in members for row in sorted(bin_rows)])
