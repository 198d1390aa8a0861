"""Several corpora mixed by weight into one packed stream of rows.

Each source is packed on its own (documents never span sources). An epoch of the mixture has as
many rows as the sources hold together, N; source s contributes round(w_s x N) of them (largest
remainders, so they sum to N): a source with more weight than rows is repeated (upsampled, in a
seeded order, every row before any repeats), one with less gives a seeded subset (the same
subset every epoch). The loader then shuffles the mixture's rows per epoch as it shuffles one
corpus's, so the mixture is deterministic for a seed and resumes from the loader's position
like any stream: the table of which source row is mixture row n (interleaved once, so a range
of it, such as the held-out validation rows, mixes the sources too) is a function of the
sources, the weights and the seed alone.

Legend: B rows, S seq_len, N the mixture's rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from pipekit.train.data.packing import TokenStream

__all__ = ["MixedTokenStream", "mixture_counts"]


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """Rows per source out of `total`, proportional to `weights` (largest remainders)."""
    if not weights or any(weight <= 0 for weight in weights):
        raise ValueError(f"mixture weights {list(weights)} must be positive numbers")
    shares = [weight / sum(weights) * total for weight in weights]
    counts = [int(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda s: counts[s] - shares[s])
    for source in by_remainder[: total - sum(counts)]:
        counts[source] += 1
    return counts


class MixedTokenStream:
    """Rows of several `TokenStream`s by weight, as a loader's stream (`num_rows`, `rows`)."""

    def __init__(
        self, streams: Sequence[TokenStream], weights: Sequence[float], seed: int, seq_len: int
    ) -> None:
        if len(streams) != len(weights):
            raise ValueError(f"{len(streams)} mixture sources but {len(weights)} weights")
        self.streams, self.weights, self.seq_len = list(streams), list(weights), seq_len
        sizes = [stream.num_rows(seq_len) for stream in streams]
        empty = [index for index, size in enumerate(sizes) if not size]
        if empty:
            raise ValueError(
                f"mixture sources {empty} pack into no row of seq_len={seq_len}; give them more "
                "text or drop them"
            )
        counts = mixture_counts(weights, sum(sizes))
        generator = torch.Generator().manual_seed(seed)
        sources, rows = [], []
        for source, (size, count) in enumerate(zip(sizes, counts, strict=True)):
            order_R = torch.randperm(size, generator=generator)
            rows.append(order_R.repeat(-(-count // size))[:count])
            sources.append(torch.full((count,), source, dtype=torch.int64))
        # interleaved once, so any range of the table (the held-out validation rows) mixes
        interleave_N = torch.randperm(sum(counts), generator=generator)
        self.source_N, self.row_N = torch.cat(sources)[interleave_N], torch.cat(rows)[interleave_N]
        self.vocab_size = streams[0].vocab_size
        self.num_tokens = sum(stream.num_tokens for stream in streams)
        text = f"{self.weights}/{self.source_N.tolist()}/{self.row_N.tolist()}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        self.key = int.from_bytes(digest, "little") >> 1
        """A 63-bit identity of the mixture's table (its sources' sizes, weights, order), for
        checkpoints: a resume with other weights would name other rows."""

    def num_rows(self, seq_len: int) -> int:
        if seq_len != self.seq_len:
            raise ValueError(f"this mixture is cut in rows of {self.seq_len}, not {seq_len}")
        return self.source_N.numel()

    def rows(self, row_ids_B: Tensor, seq_len: int) -> TensorDict:
        """Mixture rows `row_ids_B`: each from its source, in the given order."""
        row_ids_B = torch.as_tensor(row_ids_B, dtype=torch.int64).reshape(-1)
        sources_B, source_rows_B = self.source_N[row_ids_B], self.row_N[row_ids_B]
        parts, where = [], []
        for source, stream in enumerate(self.streams):
            picked_B = (sources_B == source).nonzero().flatten()
            if picked_B.numel():
                parts.append(stream.rows(source_rows_B[picked_B], seq_len))
                where.append(picked_B)
        batch = torch.cat(parts, dim=0)
        return batch[torch.argsort(torch.cat(where))]
