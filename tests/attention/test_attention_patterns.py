"""Attention patterns as data: the pattern's rule against its definition, the keys it bounds,
and every single-process context honouring it exactly — the whole sequence, packed documents,
slices over a KV cache (float64, outputs and gradients against one dense reference, score
biases and soft caps included), compiled FlexAttention's forward applying the same score
modifications, the chunks a windowed slice skips, and the bytes a windowed layer's cache
holds in a forward-only pass. Each has an ablation: the same path with the pattern ignored
(or its cap, or the bias of the cached chunks) fails."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from attention_reference import alibi_bias
from torch import Tensor

from pipekit.attention import ALIBI, AttentionPattern, alibi_slopes
from pipekit.attention.context import CausalAttention, SlicedKVCache, attend
from pipekit.attention.kv_cache import ChunkedKVCache

B, H, G, D = 2, 4, 2, 8
SLOPES_H = torch.tensor(alibi_slopes(H), dtype=torch.float64)
HEAD_INDEX_H = torch.arange(H, dtype=torch.float64)


def _head_parity_bias(head: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """A score-bias rule of the general kind: by the head's value (its index) and both tokens."""
    return 0.3 * head * ((q + k) % 3) - 0.1 * (q - k)


PATTERNS = {
    "causal": None,
    "window": AttentionPattern(window=5),
    "chunk": AttentionPattern(chunk=6),
    "prefix": AttentionPattern(prefix=4),
    "rule": AttentionPattern(rule=lambda q, k: (q - k) % 3 != 1),
    "window+chunk": AttentionPattern(window=7, chunk=8),
    "softcap": AttentionPattern(softcap=0.5),
    "window+softcap": AttentionPattern(window=5, softcap=0.5),
    "alibi": AttentionPattern(score_bias=ALIBI, bias_H=SLOPES_H),
    "alibi+window+softcap": AttentionPattern(
        window=7, softcap=0.5, score_bias=ALIBI, bias_H=SLOPES_H
    ),
    "prefix+alibi": AttentionPattern(prefix=4, score_bias=ALIBI, bias_H=SLOPES_H),
    "bias rule": AttentionPattern(score_bias=_head_parity_bias, bias_H=HEAD_INDEX_H),
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


def _dense_bias(pattern: AttentionPattern, length: int) -> Tensor:
    """The pattern's score bias `[1, H, S, S]`, written out."""
    tokens = torch.arange(length)
    if pattern.score_bias == ALIBI:
        return alibi_bias(pattern.bias_H, tokens, tokens)
    return pattern.score_bias(pattern.bias_H.view(1, -1, 1, 1), tokens[:, None], tokens[None, :])


def _dense_reference(q, k, v, pattern, scale, documents=None) -> Tensor:
    """softmax(cap(q k^T · scale + bias)) v over the allowed keys, materialised (float64)."""
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
    if pattern is not None and pattern.score_bias is not None:
        scores = scores + _dense_bias(pattern, length)
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


class _BiasDroppedOnCachedChunks(SlicedKVCache):
    """Ablation: the slice's queries meet the cached chunks without the pattern's score bias."""

    def _mask(self, pattern, q_start, q_length, kv_start, k_BGKD):
        if kv_start != q_start:
            pattern = dataclasses.replace(pattern, score_bias=None, bias_H=None)
        return super()._mask(pattern, q_start, q_length, kv_start, k_BGKD)


def _sliced(q, k, v, pattern, num_slices, documents=None, cache_type=SlicedKVCache):
    cache = cache_type(documents, backend="cpu")
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
    if pattern is not None and pattern.score_bias is not None:  # ablation: the cache unbiased
        dropped = _sliced(q, k, v, pattern, 4, documents, _BiasDroppedOnCachedChunks)
        assert (dropped - want).abs().max() > 1e-3


def test_compiled_flex_forward_on_cpu_applies_the_score_modification():
    """FlexAttention's score_mod carries the bias and the cap: slices over a KV cache on the
    `flex` backend (compiled, forward only on CPU; head dim 32, the smallest it admits) equal
    the dense reference, and `flex`'s own check against the `cpu` kernel passes; with the
    cached chunks' bias dropped they do not."""
    pattern, length, head_dim = PATTERNS["alibi+window+softcap"], 24, 32
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, heads, length, head_dim, generator=generator) for heads in (H, G, G))
    want = _dense_reference(q.double(), k.double(), v.double(), pattern, head_dim**-0.5)
    with torch.no_grad():
        cache = SlicedKVCache(backend="flex")
        slices = [
            attend(cache, "0", *(t[:, :, i : i + 6] for t in (q, k, v)), head_dim**-0.5, pattern)
            for i in range(0, length, 6)
        ]
    got = torch.cat(slices, dim=2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    unbiased = dataclasses.replace(pattern, score_bias=None, bias_H=None)
    ignored = _dense_reference(q.double(), k.double(), v.double(), unbiased, head_dim**-0.5)
    assert (got.double() - ignored).abs().max() > 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_on_cuda_applies_the_score_modification_with_gradients():
    """On CUDA FlexAttention trains through its score_mod: output and the gradients of q, k
    and v of the whole sequence with ALiBi, a window and a soft cap equal the dense float64
    reference."""
    pattern, length, head_dim = PATTERNS["alibi+window+softcap"], 24, 16
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(B, heads, length, head_dim, generator=generator) for heads in (H, G, G)]
    q, k, v = (t.cuda().requires_grad_() for t in inputs)
    on_device = pattern.with_bias_values(pattern.bias_H.cuda())
    got = CausalAttention(backend="flex").attend("0", q, k, v, head_dim**-0.5, on_device)
    leaves = [t.double().requires_grad_() for t in inputs]
    want = _dense_reference(*leaves, pattern, head_dim**-0.5)
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-4, atol=2e-4)
    weights = torch.randn(want.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((got.double() * weights.cuda()).sum(), (q, k, v))
    references = torch.autograd.grad((want * weights).sum(), leaves)
    for grad, reference in zip(grads, references, strict=True):
        torch.testing.assert_close(grad.double().cpu(), reference, rtol=1e-3, atol=1e-3)


def test_score_bias_values_are_checked_before_any_attention():
    """A score bias without its head values, values that do not fit the call's heads, values
    without a bias, or an unknown bias: one line each."""
    q, k, v = _qkv(8)
    alibi = AttentionPattern(score_bias=ALIBI)
    with pytest.raises(ValueError, match=r"takes one score-bias value per query head, 4 here"):
        attend(None, "0", q, k, v, 1.0, alibi)
    with pytest.raises(ValueError, match=r"4 here .* got \(2,\)"):
        attend(None, "0", q, k, v, 1.0, alibi, bias_H=SLOPES_H[:2])
    with pytest.raises(ValueError, match="no score_bias to use it"):
        attend(None, "0", q, k, v, 1.0, AttentionPattern(window=3), bias_H=SLOPES_H)
    with pytest.raises(ValueError, match="score_bias needs one value per query head"):
        CausalAttention(backend="cpu").attend("0", q, k, v, 1.0, alibi)  # bypassing attend
    with pytest.raises(ValueError, match=r"2 head values \(bias_H\) do not fit 4 query heads"):
        two_values = alibi.with_bias_values(SLOPES_H[:2])
        CausalAttention(backend="cpu").attend("0", q, k, v, 1.0, two_values)
    with pytest.raises(ValueError, match="score_bias='alibi2' must be 'alibi' or a rule"):
        AttentionPattern(score_bias="alibi2")


@pytest.mark.parametrize("name", ["rule", "bias rule"])
def test_context_exchange_refuses_a_pattern_made_of_code(name):
    """What a peer cannot rebuild from numbers is refused before anything is sent."""
    from pipekit.attention.across.lending import AttentionLoan, QueryPositions
    from pipekit.attention.across.loan_wire import send_request

    q, _, _ = _qkv(8)
    positions = QueryPositions(None, torch.arange(8), PATTERNS[name])
    with pytest.raises(ValueError, match="has a rule \\(code\\), which cannot be sent"):
        send_request(AttentionLoan(1), q.detach(), [], positions, 1.0, False, False)


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
        sent = lent_chunks(cache, "0", cached, (0, 3), [0, 1, 2])
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
