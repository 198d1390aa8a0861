"""Sequence packing: documents framed as `[BOS] + tokens + [EOS]`, back to back in one stream.

Row r of a stream packed for `seq_len` S is the window `stream[r*S : r*S + S + 1]`: windows
overlap by one token, so every token but the stream's last is a label exactly once and no
next-token pair is lost at a row edge (the incomplete tail after the last full window is
dropped). A row gives
- `tokens`   = window[:-1], `labels` = window[1:], except `IGNORE_INDEX` (-100) where the label
  token belongs to another document than the input token (EOS -> next BOS): no predicting
  across documents;
- `positions` = each token's index within its document's part in the row: 0 at a BOS, and 0
  at the row's first token when the row continues a document from the previous row, since the
  row cannot attend to that document's earlier part (document ids restart per row). So every
  position lies in [0, S), below the model's `max_seq_len` (a job's S never exceeds it), and a
  learned position table or RoPE sees the distances the row's attention sees;
- `document_ids` = 0, 1, 2, ... in order of the documents met in the row (0 is the document the
  row starts in), which is what `pipekit.attention.document_mask` compares.

The whole corpus is tokenized once into an int32 tensor held in memory; rows are cut from it by
index arithmetic, so building a batch costs O(B*S) and no Python loop per token ever runs.

Legend: T tokens in the stream, D documents, B rows, S seq_len, W = S + 1 (window).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor

from pipekit.layers.loss import IGNORE_INDEX
from pipekit.train.data.tokenizer import Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "TokenStream",
    "check_batch_args",
    "pack_documents",
]  # IGNORE_INDEX re-exported

_CHUNK_CHARS = 1 << 23
"""Texts encoded per `encode_many` call: large enough to amortise the call, small enough to
bound the memory held as Python strings."""


@dataclass(frozen=True)
class TokenStream:
    """A packed corpus: the framed token stream and where each document starts."""

    tokens_T: Tensor
    """int32 ids of every document framed as [BOS] + tokens + [EOS], back to back."""
    document_starts_D: Tensor
    """int64 offset of each document's BOS in `tokens_T` (increasing, first is 0)."""
    vocab_size: int
    """Vocabulary size of the tokenizer that made the stream."""
    loss_mask_T: Tensor | None = None
    """Per token, whether it counts as a label (chat data: the assistant's tokens); None:
    every token does."""

    @property
    def num_tokens(self) -> int:
        return self.tokens_T.numel()

    @property
    def num_documents(self) -> int:
        return self.document_starts_D.numel()

    def num_rows(self, seq_len: int) -> int:
        """Rows of `seq_len` inputs (windows of `seq_len + 1` tokens) the stream holds."""
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} must be positive")
        return max(self.num_tokens - 1, 0) // seq_len

    def rows(self, row_ids_B: Tensor, seq_len: int) -> TensorDict:
        """Rows `row_ids_B` as a `[B, S]` TensorDict of int64 tokens, labels, positions and
        document_ids (see the module docstring)."""
        num_rows = self.num_rows(seq_len)
        row_ids_B = torch.as_tensor(row_ids_B, dtype=torch.int64).reshape(-1)
        if row_ids_B.numel() and not (0 <= int(row_ids_B.min()) <= int(row_ids_B.max()) < num_rows):
            raise IndexError(f"row ids must lie in [0, {num_rows}) for seq_len={seq_len}")
        offsets_BW = row_ids_B[:, None] * seq_len + torch.arange(seq_len + 1)
        window_BW = self.tokens_T[offsets_BW].long()
        document_BW = torch.searchsorted(self.document_starts_D, offsets_BW, right=True) - 1
        crosses_document_BS = document_BW[:, 1:] != document_BW[:, :-1]
        ignored_BS = crosses_document_BS
        if self.loss_mask_T is not None:  # the targets that do not count
            ignored_BS = ignored_BS | ~self.loss_mask_T[offsets_BW[:, 1:]]
        labels_BS = window_BW[:, 1:].masked_fill(ignored_BS, IGNORE_INDEX)
        document_BS = document_BW[:, :-1]
        # a document continued from the previous row starts again at the row's first token
        starts_BS = torch.maximum(self.document_starts_D[document_BS], offsets_BW[:, :1])
        positions_BS = offsets_BW[:, :-1] - starts_BS
        return TensorDict(
            {
                "tokens": window_BW[:, :-1].contiguous(),
                "labels": labels_BS,
                "positions": positions_BS,
                "document_ids": document_BS - document_BS[:, :1],
            },
            batch_size=[row_ids_B.numel(), seq_len],
        )


def _encode_chunk(tokenizer: Tokenizer, texts: list[str]) -> tuple[Tensor, Tensor]:
    """`(ids_T, lengths_D)` of `texts`, through `encode_many` when the tokenizer has it. The ids
    keep the tokenizer's dtype (uint8 for bytes) until framing, to hold less memory."""
    encode_many = getattr(tokenizer, "encode_many", None)
    if encode_many is not None:
        ids_T, lengths_D = encode_many(texts)
        return ids_T, lengths_D.to(torch.int64)
    encoded = [torch.as_tensor(tokenizer.encode(text), dtype=torch.int32) for text in texts]
    lengths_D = torch.tensor([ids.numel() for ids in encoded], dtype=torch.int64)
    return torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.int32), lengths_D


def _frame_into(
    region_T: Tensor, ids_T: Tensor, lengths_D: Tensor, bos_id: int, eos_id: int
) -> Tensor:
    """Write the documents of the flat `ids_T` into `region_T` as [BOS] + ids + [EOS] each,
    vectorised; returns the documents' start offsets within the region."""
    framed_lengths_D = lengths_D + 2
    ends_D = framed_lengths_D.cumsum(0)
    starts_D = ends_D - framed_lengths_D
    is_content_T = torch.ones(region_T.numel(), dtype=torch.bool)
    is_content_T[starts_D] = False
    is_content_T[ends_D - 1] = False
    region_T[starts_D] = bos_id
    region_T[ends_D - 1] = eos_id
    region_T[is_content_T] = ids_T.to(torch.int32)
    return starts_D


def pack_documents(documents: Iterable[str], tokenizer: Tokenizer) -> TokenStream:
    """Tokenize `documents` in order and pack them into one `TokenStream`.

    Texts are encoded a few MB at a time; the stream is allocated once its length is known and
    framed chunk by chunk, so peak memory stays near the stream's own size."""
    if tokenizer.vocab_size >= 2**31:
        raise ValueError(f"vocab_size={tokenizer.vocab_size} does not fit the int32 token stream")
    chunks: list[tuple[Tensor, Tensor]] = []
    pending: list[str] = []
    pending_chars = 0
    for text in documents:
        pending.append(text)
        pending_chars += len(text)
        if pending_chars >= _CHUNK_CHARS:
            chunks.append(_encode_chunk(tokenizer, pending))
            pending, pending_chars = [], 0
    if pending:
        chunks.append(_encode_chunk(tokenizer, pending))
    if not chunks:
        raise ValueError("no documents to pack: the source is empty (or all its texts are empty)")
    total = sum(ids_T.numel() + 2 * lengths_D.numel() for ids_T, lengths_D in chunks)
    stream_T = torch.empty(total, dtype=torch.int32)
    starts: list[Tensor] = []
    offset = 0
    for ids_T, lengths_D in chunks:
        size = ids_T.numel() + 2 * lengths_D.numel()
        region_T = stream_T[offset : offset + size]
        starts.append(_frame_into(region_T, ids_T, lengths_D, tokenizer.bos_id, tokenizer.eos_id))
        starts[-1] += offset
        offset += size
    return TokenStream(stream_T, torch.cat(starts), tokenizer.vocab_size)


def check_batch_args(seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int) -> None:
    """ValueError naming the bad one, before any data is read."""
    if seq_len <= 0 or local_batch_size <= 0:
        raise ValueError(
            f"seq_len={seq_len} and local_batch_size={local_batch_size} must both be positive"
        )
    if dp_world_size <= 0 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(
            f"dp_rank={dp_rank} must lie in [0, dp_world_size={dp_world_size}) and "
            "dp_world_size must be positive"
        )
