"""What crosses the wire for an attention loan (context exchange), and in what order.

`AttentionLoan` is the pair of ranks (and the group and timeout); every message goes as
non-blocking sends in a fixed order per pair, led by a small long-tensor header that carries the
shapes, so the receiver needs no prior knowledge:

- lent chunks (`send_lent_chunks` / `receive_lent_chunks`): keys, values and document ids of
  earlier KV slices, inside a request or ahead of it (early KV exchange);
- a request (`send_request` / `receive_loan`): its kind, the softmax scale, the query and its
  document ids, then the chunks unless they went ahead.

A layer whose `AttentionPattern` is not plain causal (a sliding window, local chunks, a score
bias) sends the pattern's numbers in the request (with its soft cap and its score bias's value
for each of the query's heads beside the softmax scale) and each token's index in the sequence
with the query and the chunks, so the server builds the same masks and score modifications the
lender would; a pattern with a `rule` or a score-bias rule (code) cannot travel and is refused.
A request may carry no chunk at all (every chunk its plan lends lies outside the layer's
window): the server answers it with an empty attention.

The attention computed on either side is `pipekit.attention.across.lending`'s.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.chunked import KVChunk
from pipekit.attention.kernels.score_mod import ALIBI
from pipekit.attention.masks import MaskMod, documents_or_all
from pipekit.attention.patterns import AttentionPattern, is_causal

__all__ = [
    "DEFAULT_LOAN_TIMEOUT",
    "AttentionLoan",
    "LentChunk",
    "QueryPositions",
    "ReceivedLoan",
    "lent_chunk_mask",
    "receive_lent_chunks",
    "receive_loan",
    "send_lent_chunks",
    "send_request",
    "wait_all",
]

DEFAULT_LOAN_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for an exchange peer before it reports the pair."""
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LentChunk:
    """Keys and values of an earlier KV slice, its document ids (None: attend to all) and,
    for a layer with a non-causal pattern, each key's token index in the sequence."""

    k_BGKD: Tensor
    v_BGKD: Tensor
    document_ids_BK: Tensor | None = None
    tokens_K: Tensor | None = None


def lent_chunk_mask(
    chunk: LentChunk,
    q_document_ids_BS: Tensor | None,
    q_tokens_S: Tensor | None,
    pattern: AttentionPattern | None,
) -> MaskMod | None:
    """The query's mask against a lent chunk: every key (within documents) for a causal
    layer, whose lent chunks are earlier slices; by token indices for any other pattern."""
    if is_causal(pattern):
        return documents_or_all(q_document_ids_BS, chunk.document_ids_BK)
    assert pattern is not None and q_tokens_S is not None and chunk.tokens_K is not None
    return pattern.mask(q_tokens_S, chunk.tokens_K, q_document_ids_BS, chunk.document_ids_BK)


def _pattern_fields(pattern: AttentionPattern | None) -> list[int]:
    """[non-causal, window, chunk, prefix, ALiBi] (0 for none) of a pattern that can travel
    (its soft cap and its score bias's head values travel with the softmax scale)."""
    if is_causal(pattern):
        return [0, 0, 0, 0, 0]
    assert pattern is not None
    if pattern.rule is not None or callable(pattern.score_bias):
        raise ValueError(
            f"context exchange: {pattern} has a rule (code), which cannot be sent to the peer "
            "that computes a lent chunk; express it by window, chunk, prefix and "
            f"score_bias={ALIBI!r}, or set [parallelism] context_exchange = false"
        )
    alibi = pattern.score_bias == ALIBI
    return [1, pattern.window or 0, pattern.chunk or 0, pattern.prefix, int(alibi)]


def _pattern_of(fields: Sequence[int], numbers: Tensor) -> AttentionPattern | None:
    """The pattern `_pattern_fields` and `_pattern_numbers` describe."""
    non_causal, window, chunk, prefix, alibi = fields
    if not non_causal:
        return None
    softcap = float(numbers[1]) or None
    return AttentionPattern(
        window=window or None,
        chunk=chunk or None,
        prefix=prefix,
        softcap=softcap,
        score_bias=ALIBI if alibi else None,
        bias_H=numbers[2:] if alibi else None,
    )


def _pattern_numbers(scale: float, pattern: AttentionPattern | None) -> Tensor:
    """[scale, soft cap (0: none), the score bias's value per query head...] in float64."""
    softcap = (pattern.softcap if pattern else None) or 0.0
    numbers = torch.tensor([scale, softcap], dtype=torch.float64)
    if pattern is None or pattern.bias_H is None:
        return numbers
    return torch.cat([numbers, pattern.bias_H.detach().to("cpu", torch.float64)])


@dataclass(frozen=True)
class AttentionLoan:
    """Rank `peer` of `group` computes the lent part of this query's attention; a receive that
    waits longer than `timeout` fails with an error naming the pair (a peer died, or the two
    ranks' plans disagree)."""

    peer: int
    group: dist.ProcessGroup | None = None
    timeout: timedelta = DEFAULT_LOAN_TIMEOUT

    def send(self, *tensors: Tensor) -> list[dist.Work]:
        """Non-blocking sends, in order; wait on the works before touching the tensors (a
        blocking send could wait for a peer that is itself sending to us)."""
        return [
            dist.isend(tensor.contiguous(), group=self.group, group_dst=self.peer)
            for tensor in tensors
        ]

    def receive(self, *tensors: Tensor) -> None:
        """Blocking receives, in order."""
        self.wait(self.post_receives(*tensors))

    def post_receives(self, *tensors: Tensor) -> list[dist.Work]:
        """Non-blocking receives; a lender posts every peer's at once, so no peer's answer
        waits behind another's (a server's send may not complete before its receive is
        posted)."""
        return [dist.irecv(tensor, group=self.group, group_src=self.peer) for tensor in tensors]

    def wait(self, works: Sequence[dist.Work]) -> None:
        """Wait for receives from the peer, naming the pair if it fails or takes too long."""
        start = time.monotonic()
        for work in works:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as error:
                here = dist.get_rank(self.group)
                waited = time.monotonic() - start
                why = (
                    f"waited more than {self.timeout.total_seconds():g} s for rank {self.peer}"
                    if waited >= self.timeout.total_seconds()
                    else f"lost rank {self.peer} after {waited:.1f} s"
                )
                raise RuntimeError(
                    f"context exchange: rank {here} of the exchange group {why}; that rank died "
                    "or its exchange plan differs (build every rank's from the same schedule)"
                ) from error


def _chunks_header(lent: Sequence[LentChunk]) -> Tensor:
    """[dtype, B, G, D, documents, tokens, chunks, K_1..K_c] (zeros but the count: none)."""
    if not lent:
        return torch.zeros(7, dtype=torch.long)
    batch, kv_heads, _, head_dim = lent[0].k_BGKD.shape
    keys = [chunk.k_BGKD.shape[2] for chunk in lent]
    documents = lent[0].document_ids_BK is not None
    tokens = lent[0].tokens_K is not None
    fields = [_DTYPES.index(lent[0].k_BGKD.dtype), batch, kv_heads, head_dim, documents, tokens]
    return torch.tensor([*fields, len(lent), *keys], dtype=torch.long)


def send_lent_chunks(loan: AttentionLoan, lent: Sequence[LentChunk]) -> list[dist.Work]:
    """Send lent chunks (keys, values, document ids, token indices), led by a header with their
    shapes: inside a request, or ahead of it (early KV exchange) as soon as they exist."""
    header = _chunks_header(lent)
    works = loan.send(torch.tensor([header.numel()]), header)
    for chunk in lent:
        works += loan.send(chunk.k_BGKD, chunk.v_BGKD)
        works += loan.send(*(t for t in (chunk.document_ids_BK, chunk.tokens_K) if t is not None))
    return works


def receive_lent_chunks(loan: AttentionLoan) -> list[LentChunk]:
    """Receive what `send_lent_chunks` sent."""
    header = _receive_header(loan)
    dtype_index, batch, kv_heads, head_dim, documents, tokens, count = (int(x) for x in header[:7])
    chunks = []
    for keys in header[7 : 7 + count].tolist():
        shape = (batch, kv_heads, keys, head_dim)
        k_BGKD, v_BGKD = (torch.empty(shape, dtype=_DTYPES[dtype_index]) for _ in "kv")
        loan.receive(k_BGKD, v_BGKD)
        document_ids_BK = torch.empty(batch, keys, dtype=torch.long) if documents else None
        tokens_K = torch.empty(keys, dtype=torch.long) if tokens else None
        loan.receive(*(t for t in (document_ids_BK, tokens_K) if t is not None))
        chunks.append(LentChunk(k_BGKD, v_BGKD, document_ids_BK, tokens_K))
    return chunks


def _receive_header(loan: AttentionLoan) -> Tensor:
    size = torch.empty(1, dtype=torch.long)
    loan.receive(size)
    header = torch.empty(int(size), dtype=torch.long)
    loan.receive(header)
    return header


@dataclass(frozen=True)
class QueryPositions:
    """Where a lent query sits: its document ids (None: one document) and, for a non-causal
    pattern, each query's token index in the sequence and the pattern."""

    document_ids_BS: Tensor | None = None
    tokens_S: Tensor | None = None
    pattern: AttentionPattern | None = None


def send_request(
    loan: AttentionLoan,
    q_BHSD: Tensor,
    lent: Sequence[LentChunk],
    positions: QueryPositions,
    scale: float,
    backward: bool,
    chunks_ahead: bool,
) -> list[dist.Work]:
    """[backward, dtype, B, H, S, D, documents, ahead, pattern...], the scale (with the
    pattern's soft cap and head values), the query, its document ids and token indices, then
    the lent chunks unless they were sent ahead."""
    documents = positions.document_ids_BS is not None
    fields = [backward, _DTYPES.index(q_BHSD.dtype), *q_BHSD.shape, documents, chunks_ahead]
    fields += _pattern_fields(positions.pattern)
    header = torch.tensor(fields, dtype=torch.long)
    works = loan.send(torch.tensor([header.numel()]), header)
    works += loan.send(_pattern_numbers(scale, positions.pattern), q_BHSD)
    if positions.document_ids_BS is not None:
        works += loan.send(positions.document_ids_BS)
    if not is_causal(positions.pattern):
        assert positions.tokens_S is not None
        works += loan.send(positions.tokens_S)
    if not chunks_ahead:
        works += send_lent_chunks(loan, lent)
    return works


def wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


@dataclass
class ReceivedLoan:
    """A request as a server received it (`receive_loan`): the query, the lent chunks with the
    query's masks against them (and the lender's score modifications), the softmax scale and
    the kind."""

    q_BHSD: Tensor
    chunks: list[KVChunk]
    scale: float
    backward: bool


def receive_loan(
    loan: AttentionLoan, backward: bool, chunks_ahead: list[LentChunk] | None = None
) -> ReceivedLoan:
    """Receive `loan.peer`'s next request, a forward or a backward one as `backward` says
    (`chunks_ahead`: its lent chunks, received before it with `receive_lent_chunks`)."""
    header = _receive_header(loan)
    is_backward, dtype_index, batch, heads, queries, head_dim, documents, ahead = (
        int(x) for x in header[:8]
    )
    pattern_fields = [int(x) for x in header[8:13]]
    if bool(is_backward) != backward or bool(ahead) != (chunks_ahead is not None):
        kinds = ("backward" if is_backward else "forward", "backward" if backward else "forward")
        where = ("ahead" if ahead else "inside", "ahead" if chunks_ahead is not None else "inside")
        raise RuntimeError(
            f"attention loan: a {kinds[0]} request with its chunks sent {where[0]} arrived where "
            f"a {kinds[1]} one with its chunks {where[1]} was expected; the two ranks' plans "
            "disagree"
        )
    numbers = torch.empty(2 + (heads if pattern_fields[4] else 0), dtype=torch.float64)
    q_BHSD = torch.empty(batch, heads, queries, head_dim, dtype=_DTYPES[dtype_index])
    loan.receive(numbers, q_BHSD)
    pattern = _pattern_of(pattern_fields, numbers)
    q_docs = None
    if documents:
        q_docs = torch.empty(batch, queries, dtype=torch.long)
        loan.receive(q_docs)
    q_tokens = None
    if pattern is not None:
        q_tokens = torch.empty(queries, dtype=torch.long)
        loan.receive(q_tokens)
    lent = chunks_ahead if chunks_ahead is not None else receive_lent_chunks(loan)
    chunks = [
        KVChunk(c.k_BGKD, c.v_BGKD, lent_chunk_mask(c, q_docs, q_tokens, pattern)) for c in lent
    ]
    return ReceivedLoan(q_BHSD, chunks, float(numbers[0]), backward)
