"""Context parallelism on the (out, lse) primitive: load-balanced shards, KV all-gather, and
SlimPipe's commutated context parallelism for a chunked KV cache.

A sequence is split over `cp` ranks in 2·cp equal pieces, rank r holding pieces r and
2·cp-1-r (`load_balanced_indices`): under a causal mask an early piece has little to attend to
and a late one much, so the pairs give every rank the same work. Queries and keys then hold
tokens that are not contiguous, and masks compare the tokens' indices in the sequence
(`token_order_mask`), within packed documents when ids are given. With packed documents a
token's work is not its position, so `document_balanced_indices` deals finer pieces by their
attention work within documents, batch by batch. Both variants below work with
every attention backend: the `cpu` kernel, and FlexAttention through `ring_backend`.

- `kv_passing_context_attention` moves keys and values: every rank gathers all ranks' K/V
  (of each chunk of its cache) and attends its queries to them, one chunk per source rank; in
  backward, each source's dK/dV goes back to it (an all-to-all, then a sum). Per layer and rank
  it receives (cp-1)/cp of the K/V it attends to: for slice j of a sliced sequence, j+1
  slices' worth, the whole cache again. (`pipekit.attention.across.ring` passes the same bytes
  around a ring instead, overlapped with the attention, holding two chunks at a time.)
- `commutated_context_attention` (SlimPipe, "Commutated Context Parallelism") moves queries:
  each rank keeps its part of the K/V cache at home. A new slice's local queries go to every
  peer; each computes the partial attention of all ranks' queries against its own cached
  chunks and sends back the output and the log-sum-exp, which the owner merges. In backward the
  output gradient (with the merged output and lse) goes out, each peer runs its chunks' kernel
  backward with them (the ring identity) and sends the query gradient back, while dK/dV stay
  where the cache is. Per slice the traffic does not grow with the cache.

Under the sliced schedule, KV passing would send the whole cache again for every later slice;
with grouped-query attention, though, queries and outputs can be larger than K/V
(`context_parallel_bytes`), so `choose_context_parallel` picks, per slice, the variant that
moves fewer bytes.

Legend: B batch, H query heads, G kv heads, S local queries, K keys, D head dim, C cp ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.lending import Lending, LentChunk, QueryPositions, post_loans
from pipekit.attention.chunked import KVChunk, attention_over_chunks
from pipekit.attention.kernels.backends import (
    AttentionBackend,
    RingBackend,
    ring_backend,
    select_backend,
)
from pipekit.attention.masks import MaskMod, token_order_mask
from pipekit.attention.merge import check_sinks, merge_attention, sink_gradient
from pipekit.attention.patterns import AttentionPattern, is_causal
from pipekit.attention.work import equal_work_bins, keys_seen

__all__ = [
    "CP_BALANCES",
    "CachedShard",
    "TokenShard",
    "commutated_context_attention",
    "context_parallel_tokens",
    "document_balanced_indices",
    "gather_token_shards",
    "kv_passing_context_attention",
    "load_balanced_indices",
    "shard_mask",
]


CP_BALANCES = ("documents", "sequence")
"""How tokens are dealt to cp ranks: by attention work within documents, or head and tail."""


def load_balanced_indices(length: int, cp: int, start: int = 0) -> Tensor:
    """`[cp, length // cp]`: the sequence indices rank r holds of the tokens
    `[start, start + length)`, cut into 2·cp equal pieces: pieces r and 2·cp-1-r."""
    if cp < 1 or length % (2 * cp):
        raise ValueError(
            f"context parallelism over cp={cp} ranks cuts each sequence (or slice) into 2 x cp "
            f"= {2 * cp} equal pieces; length {length} is not a multiple of {2 * cp}: choose "
            "seq_len divisible by 2 x cp x num_slices"
        )
    pieces = torch.arange(start, start + length).view(2 * cp, -1)
    return torch.stack([torch.cat([pieces[rank], pieces[2 * cp - 1 - rank]]) for rank in range(cp)])


def document_balanced_indices(
    work_S: Tensor, cp: int, pieces_per_rank: int = 2, start: int = 0
) -> Tensor:
    """`[cp, length // cp]`: the sequence indices rank r holds of the tokens `[start, start +
    length)` whose attention work is `work_S` (summed over the rows that share the shards): the
    tokens cut into `cp x pieces_per_rank` equal pieces, dealt to ranks by their work
    (`equal_work_bins`), each rank's in order. A long document's pieces spread over the ranks,
    short documents' pieces go whole; on one causal sequence with two pieces per rank this is
    `load_balanced_indices`' head and tail."""
    length, pieces = work_S.shape[0], cp * pieces_per_rank
    if pieces_per_rank < 1 or length % pieces:
        raise ValueError(
            f"document-balanced context parallelism cuts each sequence (or slice) into cp x "
            f"cp_balance_pieces = {pieces} equal pieces; length {length} is not a multiple: "
            "choose seq_len divisible by cp x cp_balance_pieces x num_slices"
        )
    order = equal_work_bins(work_S.reshape(pieces, -1).sum(dim=1), cp)
    tokens = torch.arange(start, start + length, device=work_S.device).view(pieces, -1)
    return tokens[order].reshape(cp, -1)


def context_parallel_tokens(
    length: int,
    cp: int,
    num_slices: int = 1,
    document_ids_BS: Tensor | None = None,
    pieces_per_rank: int = 2,
    bounds: Sequence[int] | None = None,
) -> Tensor:
    """`[cp, length // cp]`: the sequence indices each cp rank holds of a sequence of `length`
    tokens cut into `num_slices` equal slices (or at `bounds`, n + 1 token offsets: a
    pipeline's unequal slices), each slice balanced over the cp ranks: slice by slice, so a
    rank's tokens of slice j follow its tokens of slice j - 1. Without document ids,
    `load_balanced_indices` (the same for every batch); with them, `document_balanced_indices`
    by the rows' causal attention work within their documents."""
    if bounds is None:
        if length % num_slices:
            raise ValueError(f"sequence length {length} does not split into {num_slices} slices")
        bounds = range(0, length + 1, length // num_slices)
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"slice bounds {tuple(bounds)} must run from 0 to the length {length}")
    work_S = None if document_ids_BS is None else keys_seen(document_ids_BS).sum(dim=0)
    parts = []
    for start, end in itertools.pairwise(bounds):
        if work_S is None:
            parts.append(load_balanced_indices(end - start, cp, start=start))
        else:
            piece_S = work_S[start:end]
            parts.append(document_balanced_indices(piece_S, cp, pieces_per_rank, start=start))
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class TokenShard:
    """Which tokens of the sequence a rank's block holds: their indices (one per row of the
    block, the same for every batch row) and, for packed documents, their document ids."""

    tokens_S: Tensor
    document_ids_BS: Tensor | None = None


@dataclass(frozen=True)
class CachedShard:
    """One chunk of a rank's KV cache: keys, values and the tokens they belong to."""

    k_BGKD: Tensor
    v_BGKD: Tensor
    shard: TokenShard


def _all_gather(tensor: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def _exchange(parts: Sequence[Tensor], group: dist.ProcessGroup | None) -> list[Tensor]:
    """All-to-all of equally shaped tensors: `parts[r]` goes to rank r; returns what each rank
    sent here, by source."""
    send = torch.stack([part.contiguous() for part in parts])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return list(received.unbind(0))


def gather_token_shards(shard: TokenShard, group: dist.ProcessGroup | None) -> list[TokenShard]:
    """Every rank's `shard`, by rank."""
    tokens = _all_gather(shard.tokens_S, group)
    if shard.document_ids_BS is None:
        return [TokenShard(t) for t in tokens]
    documents = _all_gather(shard.document_ids_BS, group)
    return [TokenShard(t, d) for t, d in zip(tokens, documents, strict=True)]


def shard_mask(q: TokenShard, kv: TokenShard, pattern: AttentionPattern | None = None) -> MaskMod:
    """Attention of `q`'s tokens to `kv`'s by `pattern` (None: causal), within documents if
    ids are given."""
    if is_causal(pattern):
        return token_order_mask(q.tokens_S, kv.tokens_S, q.document_ids_BS, kv.document_ids_BS)
    assert pattern is not None
    return pattern.mask(q.tokens_S, kv.tokens_S, q.document_ids_BS, kv.document_ids_BS)


class _GatherFromRanks(torch.autograd.Function):
    """All ranks' copies of each tensor (K and V, or one tensor that is both); in backward
    each source's gradients return to it and are summed."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, *tensors: Tensor):
        ctx.group, ctx.count = group, len(tensors)
        return tuple(part for tensor in tensors for part in _all_gather(tensor, group))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        ranks = len(grads) // ctx.count  # autograd gives zeros for chunks no attention used
        return None, *(
            torch.stack(_exchange(grads[index * ranks : (index + 1) * ranks], ctx.group)).sum(0)
            for index in range(ctx.count)
        )


def gather_keys_values(
    k_BGKD: Tensor, v_BGKD: Tensor, group: dist.ProcessGroup | None
) -> tuple[list[Tensor], list[Tensor]]:
    """Every rank's keys and values, by rank; keys that are their own values (multi-head
    latent attention's latent form) travel once."""
    if v_BGKD is k_BGKD:
        keys = list(_GatherFromRanks.apply(group, k_BGKD))
        return keys, keys
    gathered = _GatherFromRanks.apply(group, k_BGKD, v_BGKD)
    ranks = len(gathered) // 2
    return list(gathered[:ranks]), list(gathered[ranks:])


def kv_passing_context_attention(
    q_BHSD: Tensor,
    shard: TokenShard,
    cache: Sequence[CachedShard],
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    drop_remote: bool = False,
    pattern: AttentionPattern | None = None,
    sinks_H: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries (`shard`) over every rank's KV cache by `pattern`
    (None: causal) and attention sinks `sinks_H` (if given), passing the keys and values:
    every chunk of `cache` (this rank's, the current slice's or the whole sequence's
    included) is gathered from all ranks.
    `(out_BHSD, lse_BHS)` with exact gradients for q and for the local chunks' k and v (each
    source's dK/dV returns to it). `drop_remote` (an ablation) attends to this rank's chunks
    only."""
    rank = dist.get_rank(group)
    chunks = []
    for cached in cache:
        keys, values = gather_keys_values(cached.k_BGKD, cached.v_BGKD, group)
        sources = gather_token_shards(cached.shard, group)
        chunks += [
            KVChunk(keys[source], values[source], shard_mask(shard, sources[source], pattern))
            for source in range(len(keys))
            if not drop_remote or source == rank
        ]
    return attention_over_chunks(q_BHSD, chunks, scale, backend, sinks_H)


def _partial(
    backend: RingBackend,
    q_BHSD: Tensor,
    q_shard: TokenShard,
    cache: Sequence[CachedShard],
    scale: float,
    pattern: AttentionPattern | None,
) -> tuple[Tensor, Tensor]:
    """One rank's queries against this rank's cached chunks, merged."""
    return merge_attention(
        [
            backend.forward_chunk(
                q_BHSD, c.k_BGKD, c.v_BGKD, shard_mask(q_shard, c.shard, pattern), scale
            )
            for c in cache
        ]
    )


@dataclass(frozen=True)
class _Commutated:
    """What `_CommutatedAttention` needs besides tensors."""

    backend: RingBackend
    group: dist.ProcessGroup | None
    scale: float
    shard: TokenShard
    cache_shards: tuple[TokenShard, ...]
    drop_remote: bool
    lendings: tuple[Lending, Lending]
    """Forward and backward: which of the first `lendable` cached chunks pipeline peers
    compute (context exchange)."""
    lendable: int
    pattern: AttentionPattern | None
    has_sinks: bool
    """The last input is the attention sinks, counted once in the owner's final merge."""


def _all_queries(
    queries: Sequence[Tensor], shards: Sequence[TokenShard], pattern: AttentionPattern | None
) -> tuple[Tensor, QueryPositions]:
    """Every rank's queries in one block, with their document ids (and token indices, for a
    non-causal pattern): what a lent chunk's peer attends."""
    documents = [s.document_ids_BS for s in shards]
    all_documents = None if documents[0] is None else torch.cat(documents, dim=1)
    tokens = None if is_causal(pattern) else torch.cat([s.tokens_S for s in shards])
    return torch.cat(list(queries), dim=2), QueryPositions(all_documents, tokens, pattern)


def _split_by_rank(tensor: Tensor, ranks: int) -> tuple[Tensor, ...]:
    """An all-queries block (`_all_queries`) back into each rank's queries."""
    return tensor.chunk(ranks, dim=2)


class _CommutatedAttention(torch.autograd.Function):
    """Forward: queries out, partial (out, lse) back, merged. Backward: dO with the merged
    (O, lse) out, each peer's dQ share back; dK/dV of the local cache stay here. Lent chunks
    (context exchange) are computed by a pipeline peer for every rank's queries at once."""

    @staticmethod
    def forward(ctx, settings: _Commutated, q_BHSD: Tensor, *kv_tensors: Tensor):
        group, forward = settings.group, settings.lendings[0]
        kv_tensors, sinks_H = _split_sinks(kv_tensors, settings.has_sinks)
        cache = _cache(kv_tensors, settings.cache_shards)
        queries, shards = _all_gather(q_BHSD, group), gather_token_shards(settings.shard, group)
        loans = None
        if forward.parts:
            q_all, positions = _all_queries(queries, shards, settings.pattern)
            lendable = _lendable(cache, settings)
            loans = post_loans(forward, q_all, lendable, positions, settings.scale)
        kept = [cache[i] for i in forward.kept(settings.lendable)] + cache[settings.lendable :]
        partials = [
            _partial(settings.backend, q, s, kept, settings.scale, settings.pattern)
            for q, s in zip(queries, shards, strict=True)
        ]
        if loans is not None:
            for out_all, lse_all in loans.collect():
                ranks = len(queries)
                lent = zip(
                    _split_by_rank(out_all, ranks), _split_by_rank(lse_all, ranks), strict=True
                )
                partials = [merge_attention([*pair]) for pair in zip(partials, lent, strict=True)]
        outs = _exchange([out for out, _ in partials], group)
        lses = _exchange([lse for _, lse in partials], group)
        if settings.drop_remote:  # ablation: keep only this rank's own cache
            rank = dist.get_rank(group)
            outs, lses = outs[rank : rank + 1], lses[rank : rank + 1]
        out_BHSD, lse_BHS = merge_attention(list(zip(outs, lses, strict=True)), sinks_H)
        ctx.settings, ctx.sinks_H = settings, sinks_H
        ctx.save_for_backward(q_BHSD, out_BHSD, lse_BHS, *kv_tensors)
        ctx.mark_non_differentiable(lse_BHS)
        return out_BHSD, lse_BHS

    @staticmethod
    def backward(ctx, grad_out_BHSD: Tensor, _grad_lse: Tensor | None):
        settings: _Commutated = ctx.settings
        group, backward = settings.group, settings.lendings[1]
        q_BHSD, out_BHSD, lse_BHS, *kv_tensors = ctx.saved_tensors
        grad_out_BHSD = grad_out_BHSD.contiguous()
        queries, shards = _all_gather(q_BHSD, group), gather_token_shards(settings.shard, group)
        grad_outs, outs = _all_gather(grad_out_BHSD, group), _all_gather(out_BHSD, group)
        lses = _all_gather(lse_BHS, group)
        loans = None
        if backward.parts:
            cache = _cache(kv_tensors, settings.cache_shards)
            q_all, positions = _all_queries(queries, shards, settings.pattern)
            merged = (torch.cat(grad_outs, dim=2), torch.cat(outs, dim=2), torch.cat(lses, dim=2))
            lendable = _lendable(cache, settings)
            loans = post_loans(backward, q_all, lendable, positions, settings.scale, merged)
        own = range(settings.lendable, len(settings.cache_shards))
        kept = [*backward.kept(settings.lendable), *own]
        kv_grads = [torch.zeros_like(t) for t in kv_tensors]
        grad_queries = []
        for q, s, grad_out, out, lse in zip(queries, shards, grad_outs, outs, lses, strict=True):
            grad_q = torch.zeros_like(q)
            for index in kept:
                k, v = kv_tensors[2 * index], kv_tensors[2 * index + 1]
                mask = shard_mask(s, settings.cache_shards[index], settings.pattern)
                dq, dk, dv = settings.backend.backward_chunk(
                    grad_out, q, k, v, out, lse, mask, settings.scale
                )
                grad_q += dq
                kv_grads[2 * index] += dk
                kv_grads[2 * index + 1] += dv
            grad_queries.append(grad_q)
        if loans is not None:
            for (_, indices), remote in zip(backward.parts, loans.collect(), strict=True):
                lent_dqs = _split_by_rank(remote[0], len(queries))
                for grad_q, lent_dq in zip(grad_queries, lent_dqs, strict=True):
                    grad_q += lent_dq
                for position, index in enumerate(indices):
                    kv_grads[2 * index] += remote[1 + 2 * position]
                    kv_grads[2 * index + 1] += remote[2 + 2 * position]
        grad_q_BHSD = torch.stack(_exchange(grad_queries, group)).sum(0)
        if not settings.has_sinks:
            return None, grad_q_BHSD, *kv_grads
        grad_sinks = sink_gradient(grad_out_BHSD, out_BHSD, lse_BHS, ctx.sinks_H)
        return None, grad_q_BHSD, *kv_grads, grad_sinks


def _split_sinks(
    tensors: Sequence[Tensor], has_sinks: bool
) -> tuple[Sequence[Tensor], Tensor | None]:
    """The K/V tensors and the sinks that follow them (if any) among a function's inputs."""
    return (tensors[:-1], tensors[-1]) if has_sinks else (tensors, None)


def _cache(kv_tensors: Sequence[Tensor], shards: Sequence[TokenShard]) -> list[CachedShard]:
    pairs = zip(kv_tensors[0::2], kv_tensors[1::2], shards, strict=True)
    return [CachedShard(k, v, shard) for k, v, shard in pairs]


def _lendable(cache: Sequence[CachedShard], settings: _Commutated) -> list[LentChunk]:
    """The lendable cached chunks, with their token indices under a non-causal pattern."""
    with_tokens = not is_causal(settings.pattern)
    return [
        LentChunk(
            c.k_BGKD, c.v_BGKD, c.shard.document_ids_BS, c.shard.tokens_S if with_tokens else None
        )
        for c in cache[: settings.lendable]
    ]


def commutated_context_attention(
    q_BHSD: Tensor,
    shard: TokenShard,
    cache: Sequence[CachedShard],
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
    backend: str | AttentionBackend = "auto",
    drop_remote: bool = False,
    lendings: tuple[Lending, Lending] = (Lending(), Lending()),
    lendable: int = 0,
    pattern: AttentionPattern | None = None,
    sinks_H: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries (`shard`) over every rank's KV cache by `pattern`
    (None: causal) and attention sinks `sinks_H` (if given), the cache staying where it is
    (`cache`: this rank's chunks, the current slice's included):
    `(out_BHSD, lse_BHS)`, exact gradients for q and for the local chunks' k and v. Every rank
    of `group` calls it with queries of the same shape. `drop_remote` (an ablation) merges only
    this rank's partial.

    Context exchange on top: the first `lendable` chunks of `cache` are earlier slices (every
    query attends to all their keys, within documents); `lendings` (forward, backward) name
    the pipeline peers that compute some of them, for all cp ranks' queries at once, each
    peer calling `serve_attention_loan` (`_backward`)."""
    if not cache:
        raise ValueError("commutated_context_attention needs the local KV cache (a chunk)")
    if not 0 <= lendable < len(cache):
        raise ValueError(
            f"lendable={lendable}: only earlier slices may be lent, never the last chunk (the "
            f"slice's own, causal); give 0 to {len(cache) - 1}"
        )
    for lending in lendings:
        lending.check(lendable)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    kv_tensors = [t for c in cache for t in (c.k_BGKD, c.v_BGKD)]
    if isinstance(backend, str):
        backend = select_backend(backend, q_BHSD, *kv_tensors)
    settings = _Commutated(
        ring_backend(backend),
        group,
        scale,
        shard,
        tuple(c.shard for c in cache),
        drop_remote,
        lendings,
        lendable,
        pattern,
        has_sinks=sinks_H is not None,
    )
    check_sinks(sinks_H, q_BHSD)
    sinks = () if sinks_H is None else (sinks_H,)
    return _CommutatedAttention.apply(settings, q_BHSD, *kv_tensors, *sinks)
