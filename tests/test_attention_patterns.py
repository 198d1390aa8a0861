"""Attention patterns as data: the pattern's rule against its definition, the keys it bounds,
and every single-process context honouring it exactly — the whole sequence, packed documents,
slices over a KV cache (float64, outputs and gradients against one dense reference), the
chunks a windowed slice skips, and the bytes a windowed layer's cache holds in a forward-only
pass. Each has an ablation: the same path with the pattern ignored fails."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import Tensor

from pipekit.attention import AttentionPattern
from pipekit.attention.context import CausalAttention, SlicedKVCache
from pipekit.attention.kv_cache import ChunkedKVCache

B, H, G, D = 2, 4, 2, 8
PATTERNS = {
    "causal": None,
    "window": AttentionPattern(window=5),
    "chunk": AttentionPattern(chunk=6),
    "prefix": AttentionPattern(prefix=4),
    "rule": AttentionPattern(rule=lambda q, k: (q - k) % 3 != 1),
    "window+chunk": AttentionPattern(window=7, chunk=8),
    "softcap": AttentionPattern(softcap=0.5),
    "window+softcap": AttentionPattern(window=5, softcap=0.5),
}


def _allowed(pattern: AttentionPattern | None, q: int, k: int) -> bool:
    """The patterns' definitions, written out for one pair of token indices."""
    if pattern is None:
        return k <= q
    allowed = k <= q or (k < pattern.prefix and q < pattern.prefix)
    if pattern.window is not None:
        allowed = allowed and q - k < pattern.window
    if pattern.chunk is not None:
        allowed = allowed and q // pattern.chunk == k // pattern.chunk
    if pattern.rule is not None:
        allowed = allowed and bool(pattern.rule(torch.tensor(q), torch.tensor(k)))
    return allowed


def _dense_reference(q, k, v, pattern, scale, documents=None) -> Tensor:
    """softmax(q k^T · scale) v over the allowed keys, materialised (float64)."""
    length = q.shape[2]
    allowed = torch.tensor(
        [[_allowed(pattern, i, j) for j in range(length)] for i in range(length)]
    )
    allowed = allowed.expand(q.shape[0], 1, length, length)
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if pattern is not None and pattern.softcap is not None:
        scores = pattern.softcap * torch.tanh(scores / pattern.softcap)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _qkv(length: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, H, length, D), (B, G, length, D), (B, G, length, D))
    return tuple(
        torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()
        for shape in shapes
    )


def _grads(out: Tensor, *inputs: Tensor) -> list[Tensor]:
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return list(torch.autograd.grad((out * weights).sum(), inputs))


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_rule_and_key_bounds_match_the_definition(name):
    pattern = PATTERNS[name]
    if pattern is None:
        return
    q_idx, k_idx = torch.meshgrid(torch.arange(24), torch.arange(24), indexing="ij")
    want = torch.tensor([[_allowed(pattern, i, j) for j in range(24)] for i in range(24)])
    assert torch.equal(pattern.allows(q_idx, k_idx), want)
    for first, last in itertools.combinations(range(24), 2):
        low, high = pattern.visible_keys(first, last)
        seen = want[first : last + 1].any(0).nonzero().flatten()
        if len(seen):  # every key a query of the block sees lies in [low, high)
            assert low <= int(seen.min()) and int(seen.max()) < high, (first, last)
    if pattern.rule is None:  # contiguous queries: the bound is exact
        low, high = pattern.visible_keys(10, 15)
        seen = want[10:16].any(0).nonzero().flatten()
        assert (low, high) == (int(seen.min()), int(seen.max()) + 1)


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_whole_sequence_attention_honours_the_pattern_fp64(name, packed):
    pattern, length = PATTERNS[name], 20
    q, k, v = _qkv(length)
    documents = (torch.arange(length) >= torch.tensor([[7], [12]])).long() if packed else None
    want = _dense_reference(q, k, v, pattern, D**-0.5, documents)
    got = CausalAttention(documents, backend="cpu").attend("0", q, k, v, D**-0.5, pattern)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for grad, reference in zip(_grads(got, q, k, v), _grads(want, q, k, v), strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)


def _sliced(q, k, v, pattern, num_slices, documents=None):
    cache = SlicedKVCache(documents, backend="cpu")
    length = q.shape[2] // num_slices
    outs = [
        cache.attend(
            "0",
            *(t[:, :, i * length : (i + 1) * length] for t in (q, k, v)),
            D**-0.5,
            pattern,
        )
        for i in range(num_slices)
    ]
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("name", [n for n in PATTERNS if n != "prefix"] + ["prefix"])
def test_slices_over_a_kv_cache_equal_the_whole_sequence_fp64(name):
    pattern, length = PATTERNS[name], 24
    q, k, v = _qkv(length, seed=1)
    documents = (torch.arange(length) >= torch.tensor([[9], [17]])).long()
    want = _dense_reference(q, k, v, pattern, D**-0.5, documents)
    got = _sliced(q, k, v, pattern, num_slices=4, documents=documents)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for grad, reference in zip(_grads(got, q, k, v), _grads(want, q, k, v), strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)
    if pattern is not None:  # ablation: the slices ignore the pattern
        ignored = _sliced(q, k, v, None, num_slices=4, documents=documents)
        assert (ignored - want).abs().max() > 1e-3
    if pattern is not None and pattern.softcap is not None:  # ablation: the cap alone ignored
        uncapped = dataclasses.replace(pattern, softcap=None)
        ignored = _sliced(q, k, v, uncapped, num_slices=4, documents=documents)
        assert (ignored - want).abs().max() > 1e-3


def test_a_prefix_longer_than_the_first_slice_is_refused():
    q, k, v = _qkv(24)
    with pytest.raises(ValueError, match="prefix of 8 tokens reaches past the first slice"):
        _sliced(q, k, v, AttentionPattern(prefix=8), num_slices=4)


def test_a_windowed_slice_attends_only_to_the_chunks_its_window_reaches(monkeypatch):
    """Slice 3 of 4 (tokens 18..23) with a window of 5 sees only tokens 14..23: the cached
    slices 0 and 1 (tokens 0..11) are not attended to at all."""
    import pipekit.attention.context as context_module

    seen: list[int] = []
    original = context_module.attention_over_chunks

    def counting(q, chunks, *args, **kwargs):
        seen.append(len(chunks))
        return original(q, chunks, *args, **kwargs)

    monkeypatch.setattr(context_module, "attention_over_chunks", counting)
    q, k, v = _qkv(24)
    _sliced(q, k, v, AttentionPattern(window=5), num_slices=4)
    assert seen == [1, 2, 2, 2]
    seen.clear()
    _sliced(q, k, v, None, num_slices=4)
    assert seen == [1, 2, 3, 4]


def _cache_bytes_over_slices(window: int | None, num_slices: int, slice_length: int) -> list:
    """A forward-only pass of one layer's slices through the pipeline's chunked KV cache:
    the bytes the cache holds after each slice."""
    cache = ChunkedKVCache("cpu")
    pattern = None if window is None else AttentionPattern(window=window)
    q, k, v = (t.detach() for t in _qkv(num_slices * slice_length))
    held = []
    with torch.no_grad():
        for index in range(num_slices):
            part = slice(index * slice_length, (index + 1) * slice_length)
            context = cache.slice_context(0, index)
            context.attend("0", q[:, :, part], k[:, :, part], v[:, :, part], D**-0.5, pattern)
            held.append(cache.layer_nbytes("0"))
    return held


@pytest.mark.parametrize("window", [1, 8, 9, 16, 17, 40])
def test_a_windowed_layer_holds_only_the_chunks_its_window_reaches(window, capsys):
    """Forward only (evaluation): after slice j the cache keeps the chunks the next slice's
    window can reach, min(j + 1, ceil((window - 1) / L)) of L tokens, where a full causal
    layer keeps all j + 1."""
    num_slices, slice_length = 6, 8
    chunk_bytes = 2 * B * G * slice_length * D * 8  # K and V of one slice, float64
    full = _cache_bytes_over_slices(None, num_slices, slice_length)
    windowed = _cache_bytes_over_slices(window, num_slices, slice_length)
    reach = -(-(window - 1) // slice_length)
    assert full == [(j + 1) * chunk_bytes for j in range(num_slices)]
    assert windowed == [min(j + 1, reach) * chunk_bytes for j in range(num_slices)]
    with capsys.disabled():
        print(
            f"\nwindow {window}, slices of {slice_length}: cache bytes after each slice "
            f"{windowed} against full causal {full}; formula min(j+1, ceil((w-1)/L)) x "
            f"{chunk_bytes} B"
        )


def test_early_kv_exchange_sends_only_the_slices_a_window_reaches():
    """What a lending slice sends ahead follows the layer's pattern: slice 3 of 4 (tokens
    18..23) with a window of 5 sends the visible slice 2 only (with token indices), where a
    causal layer sends all three earlier slices."""
    from pipekit.pipelining.features.context_exchange import lent_chunks

    q, k, v = (t.detach() for t in _qkv(24))
    for pattern, want in ((AttentionPattern(window=5), [2]), (None, [0, 1, 2])):
        cache = ChunkedKVCache("cpu", slice_bounds=range(0, 25, 6))
        with torch.no_grad():
            for index in range(3):
                part = slice(index * 6, (index + 1) * 6)
                context = cache.slice_context(0, index)
                context.attend("0", q[:, :, part], k[:, :, part], v[:, :, part], 1.0, None)
        cache.patterns["0"] = pattern
        ((_, cached),) = cache.layer_slices(0)
        sent = lent_chunks(cache, "0", cached, 3, [0, 1, 2])
        sent_slices = [chunk.k_BGKD.data_ptr() for chunk in sent]
        assert sent_slices == [cached[index].k_BGSD.data_ptr() for index in want]
        assert all((chunk.tokens_K is None) == (pattern is None) for chunk in sent)


def test_vocabulary_parallelism_refuses_transforms_it_cannot_split():
    from torch import nn

    from examples.local_global.model import SoftCap
    from pipekit.pipelining.features.vocab_rules import check_elementwise

    check_elementwise(SoftCap(2.0), "softcap")  # acts on each logit alone
    with pytest.raises(ValueError, match="'normalise' does not act on each logit alone"):
        check_elementwise(nn.LogSoftmax(dim=-1), "normalise")
    with pytest.raises(ValueError, match="'scale' holds parameters"):
        check_elementwise(nn.Linear(16, 16), "scale")
