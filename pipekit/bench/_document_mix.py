"""A long-tailed mix of document lengths packed into rows, as pretraining data is.

Document lengths in web and book corpora are close to log-normal: most documents are short (a
few hundred to a few thousand tokens) and a thin tail runs to hundreds of thousands. The mix
draws lengths from a log-normal with median `median` tokens and log-spread `sigma` (1024 and
1.6: a quarter of the documents under 350 tokens, one in twenty over 14K), clipped to
`[minimum, row length x rows]`, and packs them back to back into rows as pipekit's packing does:
a document that crosses a row edge continues in the next row, whose ids and positions restart.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipekit.attention.work import document_spans

__all__ = ["MIX_DESCRIPTION", "packed_document_ids", "positions_in_documents"]

MIX_DESCRIPTION = "log-normal document lengths, median {median} tokens, sigma {sigma}"


def packed_document_ids(
    rows: int,
    seq_len: int,
    *,
    median: int = 1024,
    sigma: float = 1.6,
    minimum: int = 16,
    seed: int = 0,
) -> Tensor:
    """Document ids `[rows, seq_len]` of documents drawn from the mix and packed in order: per
    row 0, 1, 2, ... (0 is the document the row starts in)."""
    generator = torch.Generator().manual_seed(seed)
    total = rows * seq_len
    lengths: list[int] = []
    while sum(lengths) < total:
        drawn = math.exp(math.log(median) + sigma * float(torch.randn(1, generator=generator)))
        lengths.append(int(min(max(drawn, minimum), total)))
    stream_T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:total]
    document_ids_BS = stream_T.view(rows, seq_len)
    return document_ids_BS - document_ids_BS[:, :1]


def positions_in_documents(document_ids_BS: Tensor) -> Tensor:
    """Each token's index within its document's part of the row (what packing gives RoPE)."""
    first_BS, _ = document_spans(document_ids_BS)
    return torch.arange(document_ids_BS.shape[1]).expand_as(first_BS) - first_BS
