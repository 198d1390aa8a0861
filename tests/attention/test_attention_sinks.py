"""Attention sinks (a learned logit per head in the softmax's denominator, no value) are counted
exactly once wherever partial attentions merge by log-sum-exp: over KV chunks, across the
slices of a chunked KV cache, and (in `test_context_parallel.py`) across context-parallel
ranks by every variant and with context exchange. Each against a dense float64 reference that
appends the sink as one more score; each ablation counts the sink twice or drops it.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference_attention
from torch import Tensor

from pipekit.attention import KVChunk, attention_over_chunks, merge_attention
from pipekit.attention.context import CausalAttention, SlicedKVCache
from pipekit.attention.kv_cache import ChunkedKVCache
from pipekit.layers import GroupedQueryAttention, RotaryEmbedding

BATCH, HEADS, KV_HEADS, LENGTH, HEAD_DIM, CHUNKS = 2, 4, 2, 24, 8, 3


def _draw(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _inputs() -> dict[str, Tensor]:
    return {
        "q": _draw(BATCH, HEADS, LENGTH, HEAD_DIM, seed=1),
        "k": _draw(BATCH, KV_HEADS, LENGTH, HEAD_DIM, seed=2),
        "v": _draw(BATCH, KV_HEADS, LENGTH, HEAD_DIM, seed=3),
        "sinks": _draw(HEADS, seed=4),
        "upstream": _draw(BATCH, HEADS, LENGTH, HEAD_DIM, seed=5),
    }


def _allowed() -> Tensor:
    """Causal, and the first query of the second row sees nothing (its keys are masked), so a
    fully masked row meets the sink."""
    tokens = torch.arange(LENGTH)
    allowed = (tokens[:, None] >= tokens[None, :]).expand(BATCH, HEADS, LENGTH, LENGTH).clone()
    allowed[1, :, 0, :] = False
    return allowed


def _grads(run) -> dict[str, Tensor]:
    inputs = _inputs()
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("q", "k", "v", "sinks")}
    out, lse = run(leaves)
    (out * inputs["upstream"]).sum().backward()
    return {"out": out.detach(), "lse": lse.detach()} | {n: t.grad for n, t in leaves.items()}


def _reference(leaves: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    q, k, v, sinks = (leaves[n] for n in ("q", "k", "v", "sinks"))
    return reference_attention(q, k, v, _allowed(), HEAD_DIM**-0.5, sinks)


def _chunks(leaves: dict[str, Tensor]) -> list[KVChunk]:
    """The keys in CHUNKS chunks, each masked like the reference."""
    allowed, size, chunks = _allowed(), LENGTH // CHUNKS, []
    for index in range(CHUNKS):
        keys = slice(index * size, (index + 1) * size)
        allowed_chunk = allowed[:, :, :, keys]

        def mask(b, h, q, kv, allowed_chunk=allowed_chunk):
            return allowed_chunk[b, h, q, kv]

        chunks.append(KVChunk(leaves["k"][:, :, keys], leaves["v"][:, :, keys], mask))
    return chunks


def _worst(result: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    return max(
        ((result[name] - want).abs().max() / want.abs().max()).item()
        for name, want in reference.items()
    )


def test_sinks_merge_once_over_chunks_fp64() -> None:
    """Over three KV chunks (the CPU kernel, differentiated by the ring identity): output,
    lse and every gradient, the sinks' included, equal the dense reference; a row with no
    visible key attends to its sink alone (output 0, lse = sink). Adding the sink to every
    chunk's partial (the naive merge) does not match."""
    reference = _grads(_reference)

    def chunked(leaves: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return attention_over_chunks(
            leaves["q"], _chunks(leaves), HEAD_DIM**-0.5, "cpu", leaves["sinks"]
        )

    result = _grads(chunked)
    assert _worst(result, reference) < 1e-12
    assert torch.equal(result["lse"][1, :, 0], _inputs()["sinks"])

    def sink_per_chunk(leaves: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        partials = [
            attention_over_chunks(leaves["q"], [chunk], HEAD_DIM**-0.5, "cpu", leaves["sinks"])
            for chunk in _chunks(leaves)
        ]
        return merge_attention(partials)

    assert _worst(_grads(sink_per_chunk), reference) > 1e-2


def _layer(sinks: bool) -> GroupedQueryAttention:
    torch.manual_seed(0)
    layer = GroupedQueryAttention(16, HEADS, KV_HEADS, HEAD_DIM, sinks=sinks).double()
    layer.reset_parameters()
    if sinks:
        with torch.no_grad():
            layer.sinks.copy_(_draw(HEADS, seed=6))
    return layer


def _layer_grads(
    layer: GroupedQueryAttention, contexts, one_backward: bool = False
) -> dict[str, Tensor]:
    """Slices forward in order with their contexts, backward in reverse (or, for a cache that
    keeps the slices' autograd history, one backward of their sum); every gradient."""
    layer.zero_grad()
    rope, x_BSD = RotaryEmbedding(HEAD_DIM, 10000.0), _draw(BATCH, LENGTH, 16, seed=7)
    slice_len, losses = LENGTH // len(contexts), []
    for index, context in enumerate(contexts):
        positions = torch.arange(index * slice_len, (index + 1) * slice_len)
        out_BSD = layer(x_BSD[:, positions], rope(positions), "0", context)
        losses.append(out_BSD.square().sum())
    if one_backward:
        sum(losses).backward()
    for index in [] if one_backward else reversed(range(len(contexts))):
        losses[index].backward()
    return {name: p.grad.clone() for name, p in layer.named_parameters()}


def test_sinks_count_once_across_the_slices_of_a_kv_cache_fp64() -> None:
    """A grouped-query layer with sinks, sliced over the chunked KV cache (slices going backward
    in reverse, as the sliced pipeline runs them) and over the forward-order cache, gives the
    unsliced layer's every gradient, the sinks' included; without the cache's gradients it
    does not; and the sinks change the output (they are in effect)."""
    layer = _layer(sinks=True)
    reference = _layer_grads(layer, [CausalAttention(backend="cpu")])
    cache = ChunkedKVCache(backend="cpu")
    sliced = _layer_grads(layer, [cache.slice_context(0, index) for index in range(CHUNKS)])
    assert _worst(sliced, reference) < 1e-12
    forward_cache = SlicedKVCache(backend="cpu")
    assert (
        _worst(_layer_grads(layer, [forward_cache] * CHUNKS, one_backward=True), reference) < 1e-12
    )
    ablated = ChunkedKVCache(backend="cpu", drop_cached_gradients=True)
    contexts = [ablated.slice_context(0, index) for index in range(CHUNKS)]
    assert _worst(_layer_grads(layer, contexts), reference) > 1e-3
    without = _layer(sinks=False)
    x_BSD, positions = _draw(1, 8, 16, seed=8), torch.arange(8)
    rope = RotaryEmbedding(HEAD_DIM, 10000.0)
    assert not torch.allclose(
        layer(x_BSD, rope(positions), "0"), without(x_BSD, rope(positions), "0")
    )


def test_sinks_of_the_wrong_size_are_refused() -> None:
    inputs = _inputs()
    with pytest.raises(ValueError, match=r"attention sinks of shape \(2,\) do not fit 4 query"):
        attention_over_chunks(
            inputs["q"], [KVChunk(inputs["k"], inputs["v"])], backend="cpu", sinks_H=torch.zeros(2)
        )
