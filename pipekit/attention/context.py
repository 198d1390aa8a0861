"""Attention contexts: who decides what a layer's queries attend to.

Models are parallelism-agnostic: an attention layer projects q, k, v and hands them to the
context it was given (`None` means attention over what it is given), with its
`AttentionPattern` (causal by default; a sliding window, local chunks, a prefix, any rule on
positions). Contexts supply everything outside one layer's view: document boundaries of packed
sequences, the KV cache of earlier slices, the exchange plan of context exchange, the other
context-parallel ranks, and they honour the layer's pattern in each. The same model therefore
runs unsliced, sliced or pipelined without change.

Legend: B batch, H query heads, G kv heads, S slice length, K cached keys, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across import WholeSequenceCall, context_parallel_variant_entry
from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.token_shards import TokenShard
from pipekit.attention.chunked import KVChunk, attention_over_chunks
from pipekit.attention.context_protocol import AttentionContext
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.masks import MaskMod
from pipekit.attention.patterns import (
    AttentionPattern,
    block_mask,
    block_visible,
)

__all__ = [
    "AttentionContext",
    "CausalAttention",
    "ContextParallelAttention",
    "SlicedKVCache",
    "attend",
]


@dataclass
class CausalAttention:
    """Attention over the given sequence by the layer's pattern (causal by default),
    optionally confined to packed documents."""

    document_ids_BS: Tensor | None = None
    backend: str | AttentionBackend = "auto"

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
        documents, length = self.document_ids_BS, q_BHSD.shape[2]
        mask = block_mask(pattern, 0, length, 0, length, documents, documents, q_BHSD.device)
        chunk = KVChunk(k_BGSD, v_BGSD, mask)
        return attention_over_chunks(q_BHSD, [chunk], scale, self.backend, sinks_H)[0]


class SlicedKVCache:
    """Consecutive slices of one batch of sequences, attending to a chunked KV cache.

    Each call for a layer is the next slice: its queries attend causally to its own keys and fully
    to every earlier slice's keys (within documents, if ids are given), merged by LSE. The chunks
    are kept as separate tensors (never concatenated) and keep their autograd history, so a
    backward through the last slice reaches the earlier slices' projections.
    `document_ids_BS` covers the whole sequence, all slices. Not a dataclass, so FSDP2's input
    handling (which rebuilds dataclasses) passes this stateful object through as it is.
    """

    def __init__(
        self, document_ids_BS: Tensor | None = None, backend: str | AttentionBackend = "auto"
    ) -> None:
        self.document_ids_BS, self.backend = document_ids_BS, backend
        self.chunks: dict[str, list[tuple[int, Tensor, Tensor]]] = {}

    def cached_length(self, layer_id: str) -> int:
        """Number of key positions cached for a layer (= the next slice's start)."""
        return sum(k.shape[2] for _, k, _ in self.chunks.get(layer_id, []))

    def _documents(self, start: int, length: int) -> Tensor | None:
        if self.document_ids_BS is None:
            return None
        return self.document_ids_BS[:, start : start + length]

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
        q_start, slice_len = self.cached_length(layer_id), q_BHSD.shape[2]
        if self.document_ids_BS is not None and q_start + slice_len > self.document_ids_BS.shape[1]:
            raise ValueError(
                f"SlicedKVCache: slice ends at {q_start + slice_len}, beyond the "
                f"{self.document_ids_BS.shape[1]} positions that document_ids_BS covers"
            )
        if pattern is not None and q_start == 0:
            pattern.check_sliced(slice_len)
        past = self.chunks.setdefault(layer_id, [])
        past.append((q_start, k_BGSD, v_BGSD))
        kv_chunks = [
            KVChunk(k_BGKD, v_BGKD, self._mask(pattern, q_start, slice_len, kv_start, k_BGKD))
            for kv_start, k_BGKD, v_BGKD in past
            if block_visible(pattern, q_start, slice_len, kv_start, k_BGKD.shape[2])
        ]
        return attention_over_chunks(q_BHSD, kv_chunks, scale, self.backend, sinks_H)[0]

    def _mask(
        self,
        pattern: AttentionPattern | None,
        q_start: int,
        q_length: int,
        kv_start: int,
        k_BGKD: Tensor,
    ) -> MaskMod | None:
        """The slice's mask against one cached chunk (or its own)."""
        kv_length = k_BGKD.shape[2]
        q_documents = self._documents(q_start, q_length)
        kv_documents = self._documents(kv_start, kv_length)
        return block_mask(
            pattern, q_start, q_length, kv_start, kv_length, q_documents, kv_documents,
            k_BGKD.device,
        )  # fmt: skip


class ContextParallelAttention:
    """The attention context of a context-parallel rank: its load-balanced share of each
    sequence (`tokens_S`, with their document ids) attends to every cp rank's keys by the
    layer's pattern over `group`, by `variant` (an entry of the variant table,
    `pipekit.attention.across`; hierarchical ones use `hierarchy`'s groups). Not a dataclass,
    so FSDP2's input handling passes it through as it is."""

    def __init__(
        self,
        tokens_S: Tensor,
        document_ids_BS: Tensor | None,
        group: dist.ProcessGroup | None,
        backend: str | AttentionBackend = "auto",
        variant: str = "auto",
        hierarchy: HierarchicalGroups | None = None,
    ) -> None:
        self.entry = context_parallel_variant_entry(variant)
        self.shard, self.group = TokenShard(tokens_S, document_ids_BS), group
        self.backend, self.hierarchy = backend, hierarchy

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
        call = WholeSequenceCall(
            q_BHSD, k_BGSD, v_BGSD, self.shard, self.group, scale, self.backend, pattern,
            sinks_H, self.hierarchy,
        )  # fmt: skip
        return self.entry.attend_whole_sequence(call)


@torch.compiler.disable  # compiled blocks run it eagerly (pipekit.train.compile says why)
def attend(
    context: AttentionContext | None,
    layer_id: str,
    q_BHSD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    scale: float,
    pattern: AttentionPattern | None = None,
    sinks_H: Tensor | None = None,
    bias_H: Tensor | None = None,
) -> Tensor:
    """A layer's attention under `context` (None: over the given tokens alone), seeing what
    `pattern` allows (None: causal), with attention sinks `sinks_H` (one logit per query head)
    if the layer has them. `bias_H`: one value per query head of `q_BHSD` for the pattern's
    `score_bias` (ALiBi: the slopes; under tensor parallelism this rank's heads' values, as
    `pipekit.layers.HeadValues` returns them)."""
    pattern = _with_bias_values(pattern, bias_H, q_BHSD.shape[1])
    if context is None:
        context = CausalAttention(backend="auto")
    if sinks_H is None:
        return context.attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale, pattern=pattern)
    return context.attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale, pattern=pattern, sinks_H=sinks_H)


def _with_bias_values(
    pattern: AttentionPattern | None, bias_H: Tensor | None, heads: int
) -> AttentionPattern | None:
    """`pattern` with the call's head values bound (`bias_H`, or those already bound), after
    checking that they fit its query heads."""
    if pattern is None or pattern.score_bias is None:
        if bias_H is not None:
            raise ValueError(
                f"attend: bias_H given with pattern {pattern}, which has no score_bias to use "
                "it; give the pattern a score_bias (e.g. 'alibi') or drop bias_H"
            )
        return pattern
    values_H = pattern.bias_H if bias_H is None else bias_H
    if values_H is None or tuple(values_H.shape) != (heads,):
        shape = None if values_H is None else tuple(values_H.shape)
        raise ValueError(
            f"attend: {pattern} takes one score-bias value per query head, {heads} here "
            f"(under tensor parallelism, this rank's heads), as bias_H; got {shape}"
        )
    return pattern.with_bias_values(values_H)
