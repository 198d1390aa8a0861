"""Packing as the documents stream in: for corpora too large to tokenize before training.

`StreamingPackedLoader` reads an epoch's documents in order (`documents_of_epoch(epoch)`, e.g.
a Hugging Face streaming dataset, shuffled by its shard order and a buffer, deterministically
for a given seed and epoch), frames and tokenizes them a few at a time, and cuts rows exactly as
`TokenStream.rows` cuts them from a whole corpus: row r of an epoch is the window
`[r*S, r*S + S + 1)` of the epoch's framed stream. Step k takes the global batch of rows
`[k*G, (k+1)*G)` and rank r its block of B rows, so the global batch is the same whatever the
data-parallel degree. Every rank reads (and tokenizes) the whole stream and keeps its block.

The resumable state is `(epoch, position)` in global rows; loading it re-reads the epoch from its
start up to the position (exact, since the order is a function of seed and epoch; it costs the
time to tokenize what was already trained on). An epoch's tail of fewer than G rows is dropped.

Legend: B local batch, S seq_len, G global batch (B * dp_world_size).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from tensordict import TensorDict

from pipekit.train.data.packing import TokenStream, check_batch_args, pack_documents
from pipekit.train.data.tokenizer import Tokenizer

__all__ = ["StreamingPackedLoader"]

_DOCUMENTS_PER_CHUNK = 256
"""Documents tokenized together (one `encode_many` call)."""


class _RollingStream:
    """The framed tokens read but not yet cut into rows, with their documents' starts (the
    first document's start may lie before the first token: its head was cut already)."""

    def __init__(self, vocab_size: int) -> None:
        self.tokens_T = torch.empty(0, dtype=torch.int32)
        self.document_starts_D = torch.empty(0, dtype=torch.int64)
        self.vocab_size = vocab_size

    def extend(self, chunk: TokenStream) -> None:
        offset = self.tokens_T.numel()
        self.tokens_T = torch.cat([self.tokens_T, chunk.tokens_T])
        self.document_starts_D = torch.cat(
            [self.document_starts_D, chunk.document_starts_D + offset]
        )

    def num_rows(self, seq_len: int) -> int:
        return max(self.tokens_T.numel() - 1, 0) // seq_len

    def cut_rows(self, count: int, seq_len: int) -> TensorDict:
        """The first `count` rows; their tokens are dropped but the last (the next row's
        first input is their last label)."""
        stream = TokenStream(self.tokens_T, self.document_starts_D, self.vocab_size)
        rows = stream.rows(torch.arange(count), seq_len)
        cut = count * seq_len
        self.tokens_T = self.tokens_T[cut:]
        first_kept = int(torch.searchsorted(self.document_starts_D, cut, right=True)) - 1
        self.document_starts_D = self.document_starts_D[first_kept:] - cut
        return rows


class StreamingPackedLoader:
    """Infinite iterator of this rank's `[B, S]` batches, packed from streamed documents."""

    def __init__(
        self,
        documents_of_epoch: Callable[[int], Iterable[str]],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
    ) -> None:
        check_batch_args(seq_len, local_batch_size, dp_rank, dp_world_size)
        self.documents_of_epoch = documents_of_epoch
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.global_batch_size = local_batch_size * dp_world_size
        self.epoch = 0
        self.position = 0
        self._batches: Iterator[TensorDict] | None = None

    def __iter__(self) -> StreamingPackedLoader:
        return self

    def __next__(self) -> TensorDict:
        if self._batches is None:
            self._batches = self._global_batches(self.epoch)
            for _ in range(self.position // self.global_batch_size):  # resume: re-read
                next(self._batches)
        batch = next(self._batches, None)
        if batch is None:  # the epoch ended
            if self.position == 0:
                raise ValueError(
                    f"the stream packs into fewer than one global batch of "
                    f"{self.global_batch_size} rows of seq_len={self.seq_len}; use a larger "
                    "source, a shorter seq_len or a smaller batch"
                )
            self.epoch, self.position = self.epoch + 1, 0
            self._batches = self._global_batches(self.epoch)
            return next(self)
        self.position += self.global_batch_size
        start = self.dp_rank * self.local_batch_size
        return batch[start : start + self.local_batch_size]

    def _global_batches(self, epoch: int) -> Iterator[TensorDict]:
        """The epoch's global batches, in order, each cut as soon as its rows are read."""
        rolling = _RollingStream(self.tokenizer.vocab_size)
        documents = iter(self.documents_of_epoch(epoch))
        while chunk := list(itertools.islice(documents, _DOCUMENTS_PER_CHUNK)):
            rolling.extend(pack_documents(chunk, self.tokenizer))
            while rolling.num_rows(self.seq_len) >= self.global_batch_size:
                yield rolling.cut_rows(self.global_batch_size, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, in global rows of the current epoch (the same on every rank)."""
        return {"epoch": self.epoch, "position": self.position, "streaming": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved `state_dict()` (of a streaming loader over the same source)."""
        if int(state.get("streaming", 0)) != 1:
            raise ValueError(
                "data loader state was saved by the in-memory loader, this one streams "
                "(data.streaming differs): resume with the setting the run started with"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._batches = None

    def close(self) -> None:
        """Nothing to release (the trainer closes every loader)."""
