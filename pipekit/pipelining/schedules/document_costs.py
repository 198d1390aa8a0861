"""What the schedule simulator needs to price packed documents: every microbatch's slices, as
the layout cuts them (each microbatch by its own documents under `slicing = "documents"`, the
planned bounds otherwise), and each slice's share of the sequence's tokens and of one causal
sequence's attention, counted as the layout counts it (`SliceLayout.slice_attention`: in the
kernel's tiles, as the sliced kernel computes them). A packed batch drawn from a corpus's
document lengths, or from a named distribution, gives the simulator that corpus's step instead
of one causal sequence per row.

Legend: B rows, S tokens per row.
"""

from __future__ import annotations

import itertools

from torch import Tensor

from pipekit.attention.work import attention_work
from pipekit.pipelining.schedules.slice_layout import SliceLayout

__all__ = ["UnitShares", "document_unit_shares"]

UnitShares = tuple[tuple[tuple[float, float], ...], ...]
"""Per microbatch, per slice: (share of tokens, share of one causal sequence's attention)."""


def document_unit_shares(
    layout: SliceLayout, document_ids_BS: Tensor, microbatches: int
) -> UnitShares:
    """`CostModel.unit_shares` of a batch whose rows carry `document_ids_BS`, split into
    `microbatches` equal row blocks (each row's work averaged over its microbatch's rows)."""
    rows, seq_len = document_ids_BS.shape
    if rows % microbatches:
        raise ValueError(f"{rows} rows do not split into {microbatches} microbatches")
    if seq_len != layout.bounds[-1]:
        raise ValueError(
            f"rows of {seq_len} tokens for slices of a {layout.bounds[-1]}-token sequence; "
            "give the batch the layout was planned for"
        )
    causal = float(attention_work(None, [None], seq_len, layout.work_block).sum())
    shares = []
    for ids_BS in document_ids_BS.tensor_split(microbatches):
        bounds = layout.microbatch_bounds(ids_BS)
        keys = layout.slice_attention(ids_BS, bounds)
        shares.append(
            tuple(
                ((end - start) / seq_len, slice_keys / ids_BS.shape[0] / causal)
                for (start, end), slice_keys in zip(itertools.pairwise(bounds), keys, strict=True)
            )
        )
    return tuple(shares)
