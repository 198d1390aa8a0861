"""Rows of a global batch spread so every data-parallel rank and microbatch carries about the
same attention work.

Packed rows differ in attention work by their documents: a row of one long document costs up to
its length times the keys of a row of short ones. Rows are cut from the stream in order, so one
microbatch (and one data-parallel rank) can draw the costly rows while another draws cheap ones,
and the pipeline and the gradient all-reduce wait for the slowest. The loader deals a step's
rows by `row_attention_work` into equal-sized bins (`pipekit.attention.work.equal_work_bins`:
costliest first, each to the bin with the least work so far that still has room), a function of
the batch alone, so a resumed job deals the same bins. The step's rows, and so its gradient, are
unchanged; only which rank and microbatch runs each row moves.

Legend: G rows of the global batch, S tokens per row.
"""

from __future__ import annotations

from torch import Tensor

from pipekit.attention.work import keys_seen

__all__ = ["row_attention_work"]


def row_attention_work(document_ids_GS: Tensor) -> Tensor:
    """Each row's causal attention work: the keys its queries see within their documents."""
    return keys_seen(document_ids_GS).sum(dim=1)
