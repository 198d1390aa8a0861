"""Chunked KV cache for slices that go backward one by one (SlimPipe §4.1.2 and §5).

In a sliced pipeline each slice is its own forward and its own backward call, and the slices of
one sequence go backward in reverse order. Slice j's keys and values therefore enter the cache as
*detached leaves* (sharing storage with the slice's own K/V, no copy): later slices attend to them
and their backwards accumulate dK/dV into the leaves' `.grad`. Slice j's own attention sees its
K/V through `_AddCachedGradients`, an identity whose backward adds those accumulated gradients,
so they flow into slice j's projections when slice j goes backward, after every later slice.
`release` then drops the chunk.

The cache is a list of slice-sized chunks per (layer, microbatch), never one concatenated tensor:
attention merges per-chunk results by log-sum-exp, and autograd saves the chunks as they are, so
the cache costs nothing beyond the slices' own K/V (which attention saves anyway) plus the
gradient accumulators. Equal-sized chunks let the caching allocator hand a released chunk's block
straight to the next microbatch's slice.

A layer's `AttentionPattern` decides which cached slices a slice attends to: a sliding window or
local chunks skip the slices no query of the slice can see, so the attention reads (and context
exchange and context parallelism move) only the chunks within reach. A forward-only pass
(evaluation) also lets go of a chunk as soon as no later slice can reach it, so a windowed
layer's cache holds about `window / slice_length + 1` chunks instead of all of them. In training
each chunk stays until its own slice's backward, which needs it whatever the window (slices go
backward in reverse order, and the slice's own attention saved its K/V).

Legend: B batch, H query heads, G kv heads, S slice length, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipekit.attention.chunked import KVChunk, attention_over_chunks
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.masks import MaskMod
from pipekit.attention.patterns import (
    AttentionPattern,
    block_mask,
    block_visible,
)

__all__ = ["CachedSlice", "ChunkedKVCache", "SliceAttention"]


@dataclass
class CachedSlice:
    """One layer's K/V of one slice, as leaves that collect the gradients of later slices, and
    where the slice lies in the sequence (`[start, start + length)`, all cp ranks' tokens)."""

    k_BGSD: Tensor
    v_BGSD: Tensor
    document_ids_BS: Tensor | None
    start: int = 0
    length: int = 0

    @property
    def keys_are_values(self) -> bool:
        """One tensor serves as keys and values (multi-head latent attention's latent form):
        it is cached, and its gradient collected, once."""
        return self.v_BGSD is self.k_BGSD

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The distinct cached tensors: K and V, or the one tensor that is both."""
        return (self.k_BGSD,) if self.keys_are_values else (self.k_BGSD, self.v_BGSD)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (shared with the slice's own tensors); 0 once released."""
        return sum(tensor.nbytes for tensor in self.tensors)


class _AddCachedGradients(torch.autograd.Function):
    """Identity on (k, v); backward adds the gradients later slices left on the cached leaves."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, k: Tensor, v: Tensor, cached: CachedSlice
    ) -> tuple[Tensor, Tensor]:
        ctx.cached = cached
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_k: Tensor | None, grad_v: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None]:
        cached: CachedSlice = ctx.cached
        ctx.cached = None  # the graph may outlive the step (a loss kept for logging)
        if cached.keys_are_values:  # one leaf collected both; k and v are one tensor upstream
            return _plus(grad_k, cached.k_BGSD.grad), grad_v, None
        return (
            _plus(grad_k, cached.k_BGSD.grad),
            _plus(grad_v, cached.v_BGSD.grad),
            None,
        )


def _plus(grad: Tensor | None, cached_grad: Tensor | None) -> Tensor | None:
    if cached_grad is None:
        return grad
    return cached_grad if grad is None else grad + cached_grad


class ChunkedKVCache:
    """Per (layer, microbatch), the cached slices in order; one cache per pipeline stage.

    `drop_cached_gradients` exists for the ablation test only: it detaches the cache from the
    owning slices' backward, which must break parity with the unsliced model.

    Deliberately not a dataclass (nor is `SliceAttention`): FSDP2 moves a module's inputs with
    torch's `_recursive_to`, which rebuilds dataclasses field by field, and a rebuilt context
    would store its chunks in a copy of the cache.
    """

    def __init__(
        self,
        backend: str | AttentionBackend = "auto",
        drop_cached_gradients: bool = False,
        slice_bounds: Sequence[int] | None = None,
    ) -> None:
        self.backend = backend
        self.drop_cached_gradients = drop_cached_gradients
        self.slice_bounds = None if slice_bounds is None else tuple(slice_bounds)
        """The slices' token offsets in the whole sequence (n + 1 of them; every context
        parallel rank's tokens counted); None: the cached slices' own lengths, one after
        another."""
        self.microbatch_bounds: tuple[tuple[int, ...], ...] | None = None
        """This step's offsets per microbatch, when each is cut by its own documents (they
        take precedence over `slice_bounds`)."""
        self.recomputing: tuple[int, int] | None = None
        """(microbatch, slice) whose backward is running: a forward of it now is a recompute."""
        self._slices: dict[tuple[str, int], list[CachedSlice]] = {}
        self.patterns: dict[str, AttentionPattern | None] = {}
        """Each layer's pattern, as its attention last gave it (what early KV exchange
        sends follows it)."""

    def __repr__(self) -> str:
        cached = sum(len(slices) for slices in self._slices.values())
        return f"ChunkedKVCache(backend={self.backend!r}, cached_chunks={cached})"

    def slice_context(
        self, microbatch: int, slice_index: int, document_ids_BS: Tensor | None = None
    ) -> SliceAttention:
        """The attention context of slice `slice_index` of `microbatch` (document ids: its own)."""
        return SliceAttention(self, microbatch, slice_index, document_ids_BS)

    def release(self, microbatch: int, slice_index: int) -> None:
        """Drop slice `slice_index`'s chunks (after its backward); it must be the newest cached."""
        for (_, cached_microbatch), slices in self._slices.items():
            if cached_microbatch != microbatch or not slices:
                continue
            if len(slices) != slice_index + 1:
                raise RuntimeError(
                    f"ChunkedKVCache: releasing slice {slice_index} of microbatch {microbatch} "
                    f"while {len(slices)} slices are cached; slices must go backward in reverse "
                    "order"
                )
            released = slices.pop()
            released.k_BGSD.grad = released.v_BGSD.grad = None

    def slice_tensors(self, microbatch: int, slice_index: int) -> list[Tensor]:
        """The cached K and V of one slice, over all layers (for memory accounting)."""
        return [
            tensor
            for (_, cached_microbatch), slices in self._slices.items()
            if cached_microbatch == microbatch and len(slices) > slice_index
            for tensor in slices[slice_index].tensors
        ]

    def layer_slices(self, microbatch: int) -> list[tuple[str, list[CachedSlice]]]:
        """Per attention layer, in the order the forward runs them, the slices of `microbatch`
        cached so far (what context exchange sends ahead of a lending pass)."""
        return [(layer, slices) for (layer, mb), slices in self._slices.items() if mb == microbatch]

    def clear(self) -> None:
        """Drop everything (end of a step, or after a forward-only pass)."""
        self._slices.clear()

    def num_cached_slices(self, layer_id: str, microbatch: int) -> int:
        """How many slices of `microbatch` one layer has cached."""
        return len(self._slices.get((layer_id, microbatch), []))

    @property
    def nbytes(self) -> int:
        """Bytes of every cached chunk (each shares storage with its slice's K/V)."""
        return sum(cached.nbytes for slices in self._slices.values() for cached in slices)

    def layer_nbytes(self, layer_id: str) -> int:
        """Bytes of one layer's cached chunks, every microbatch."""
        return sum(
            cached.nbytes
            for (layer, _), slices in self._slices.items()
            if layer == layer_id
            for cached in slices
        )

    def slice_range(
        self, past: Sequence[CachedSlice], slice_index: int, length: int, microbatch: int = 0
    ) -> range:
        """The tokens of slice `slice_index` of `microbatch` (`length` of them here) in the
        sequence."""
        bounds = self.slice_bounds
        if self.microbatch_bounds is not None:
            bounds = self.microbatch_bounds[microbatch]
        if bounds is not None:
            return range(bounds[slice_index], bounds[slice_index + 1])
        start = past[slice_index - 1].start + past[slice_index - 1].length if slice_index else 0
        return range(start, start + length)

    def _slice_chunks(
        self,
        context: SliceAttention,
        layer_id: str,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        pattern: AttentionPattern | None,
    ) -> tuple[list[CachedSlice], KVChunk]:
        """Cache the slice's K/V for one layer; return the earlier slices' cached K/V and the
        slice's own chunk (masked by `pattern`, carrying the gradients later slices leave on its
        leaves)."""
        past = self._slices.setdefault((layer_id, context.microbatch), [])
        # Activation checkpointing runs the slice's forward again inside its own backward: the
        # slice is then the newest cached one, and its recomputed K/V must collect the
        # gradients its cached leaves already hold.
        recomputing = context.recomputing
        if len(past) != context.slice_index + int(recomputing):
            raise RuntimeError(
                f"ChunkedKVCache: layer {layer_id} of microbatch {context.microbatch} runs slice "
                f"{context.slice_index} with {len(past)} earlier slices cached; slices of a "
                "microbatch must run forward in order"
            )
        q_documents = context.document_ids_BS
        tokens = self.slice_range(past, context.slice_index, k_BGSD.shape[2], context.microbatch)
        context.token_range = tokens
        self.patterns[layer_id] = pattern
        if pattern is not None and context.slice_index == 0:
            pattern.check_sliced(len(tokens))
        training = torch.is_grad_enabled() and k_BGSD.requires_grad
        if recomputing:
            cached = past[context.slice_index]
        elif training:
            k_leaf = k_BGSD.detach().requires_grad_()
            v_leaf = k_leaf if v_BGSD is k_BGSD else v_BGSD.detach().requires_grad_()
            cached = CachedSlice(k_leaf, v_leaf, q_documents, tokens.start, len(tokens))
        else:
            cached = CachedSlice(k_BGSD, v_BGSD, q_documents, tokens.start, len(tokens))
        if training and not self.drop_cached_gradients:
            shared = v_BGSD is k_BGSD
            k_BGSD, v_BGSD = _AddCachedGradients.apply(k_BGSD, v_BGSD, cached)
            v_BGSD = k_BGSD if shared else v_BGSD
        earlier = past[: context.slice_index]
        if not recomputing:
            past.append(cached)
        if not training and pattern is not None:
            _release_unreachable(past, pattern, next_query=tokens.stop)
        own = block_mask(
            pattern, tokens.start, len(tokens), tokens.start, len(tokens), q_documents,
            q_documents, k_BGSD.device,
        )  # fmt: skip
        return earlier, KVChunk(k_BGSD, v_BGSD, own)


def _release_unreachable(
    past: list[CachedSlice], pattern: AttentionPattern, next_query: int
) -> None:
    """Forward only: drop the K/V of cached slices that no query from `next_query` on can see
    (keeping their entries, so slice indices stay positions)."""
    low, _ = pattern.visible_keys(next_query, next_query)
    for cached in past:
        if cached.start + cached.length <= low and cached.k_BGSD.numel():
            empty_k = cached.k_BGSD[:, :, :0]
            cached.v_BGSD = empty_k if cached.keys_are_values else cached.v_BGSD[:, :, :0]
            cached.k_BGSD = empty_k


class SliceAttention:
    """AttentionContext of one slice: its own chunk and the cached ones by the layer's pattern
    (causal: all of every earlier slice; within documents when ids are given)."""

    def __init__(
        self,
        cache: ChunkedKVCache,
        microbatch: int,
        slice_index: int,
        document_ids_BS: Tensor | None = None,
    ) -> None:
        self.cache, self.microbatch, self.slice_index = cache, microbatch, slice_index
        self.document_ids_BS = document_ids_BS
        self.token_range = range(0)
        """This slice's tokens in the sequence (every cp rank's), known once it cached K/V."""
        self._reached: dict[int, bool] = {}
        """`_shares_a_document` by cached slice start: every layer asks the same."""

    def __repr__(self) -> str:
        return f"SliceAttention(microbatch={self.microbatch}, slice_index={self.slice_index})"

    @property
    def recomputing(self) -> bool:
        """Whether this forward is activation checkpointing's recompute inside the backward."""
        return self.cache.recomputing == (self.microbatch, self.slice_index)

    def chunks(
        self,
        layer_id: str,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        pattern: AttentionPattern | None = None,
    ) -> tuple[list[CachedSlice], KVChunk]:
        """Cache this slice's K/V for `layer_id`; return the earlier slices' cached K/V and this
        slice's own chunk (masked by `pattern`, None: causal)."""
        return self.cache._slice_chunks(self, layer_id, k_BGSD, v_BGSD, pattern)

    def attend(
        self,
        layer_id: str,
        q_BHSD: Tensor,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        scale: float,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> Tensor:
        """This slice's attention output, caching its K/V for the later slices."""
        earlier, own = self.chunks(layer_id, k_BGSD, v_BGSD, pattern)
        return self.attention(q_BHSD, earlier, own, scale, pattern, sinks_H)

    @property
    def backend(self) -> str | AttentionBackend:
        return self.cache.backend

    def attention(
        self,
        q_BHSD: Tensor,
        earlier: list[CachedSlice],
        own: KVChunk,
        scale: float,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> Tensor:
        """Attention over the cached earlier slices that `pattern` lets the slice see (within
        its documents) and the slice's own chunk, merged by LSE (with the sinks, if any). A
        cached slice no row's document reaches is left out: its mask is empty, and evaluating
        it tile by tile costs like the full causal attention the documents avoid."""
        visible = [
            earlier[index]
            for index in self.visible_indices(earlier, pattern)
            if self._shares_a_document(earlier[index])
        ]
        chunks = [
            KVChunk(cached.k_BGSD, cached.v_BGSD, self.earlier_mask(cached, pattern))
            for cached in visible
        ]
        backend = self.cache.backend
        return attention_over_chunks(q_BHSD, [*chunks, own], scale, backend, sinks_H)[0]

    def _shares_a_document(self, cached: CachedSlice) -> bool:
        """Whether some row's first query is in the document of the cached slice's last key:
        where ids never decrease along the row (packing's), no query sees any of its keys
        otherwise. Ids in any other order share a document wherever: always True."""
        q_ids_BS, kv_ids_BS = self.document_ids_BS, cached.document_ids_BS
        if q_ids_BS is None or kv_ids_BS is None or not cached.length:
            return True
        if cached.start not in self._reached:
            ordered = torch.cat([kv_ids_BS, q_ids_BS], dim=1)
            self._reached[cached.start] = not bool(
                (ordered[:, 1:] >= ordered[:, :-1]).all()
            ) or bool((q_ids_BS[:, 0] == kv_ids_BS[:, -1]).any())
        return self._reached[cached.start]

    def earlier_mask(self, cached: CachedSlice, pattern: AttentionPattern | None) -> MaskMod | None:
        """This slice's queries against an earlier slice's keys."""
        tokens = self.token_range
        return block_mask(
            pattern, tokens.start, len(tokens), cached.start, cached.length,
            self.document_ids_BS, cached.document_ids_BS, cached.k_BGSD.device,
        )  # fmt: skip

    def visible_indices(
        self, earlier: list[CachedSlice], pattern: AttentionPattern | None
    ) -> list[int]:
        """Indices of the earlier slices some query of this slice may see: the only ones
        context exchange lends."""
        tokens = self.token_range
        return [
            index
            for index, cached in enumerate(earlier)
            if block_visible(pattern, tokens.start, len(tokens), cached.start, cached.length)
        ]
