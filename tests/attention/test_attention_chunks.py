"""Attention over a KV split into chunks, merged by LSE, equals attention over the whole:
values and gradients, for the ring-identity backend and for the autograd merge."""

import itertools

import pytest
import torch
from attention_reference import dense_allowed, reference_attention

from pipekit.attention import (
    KVChunk,
    and_masks,
    attention_over_chunks,
    document_mask,
    get_backend,
    merge_attention,
    offset_causal_mask,
)

BATCH, HEADS, KV_HEADS, Q_LEN, HEAD_DIM = 2, 4, 2, 12, 8
SCALE = HEAD_DIM**-0.5


def _qkv(kv_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, Q_LEN, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, KV_HEADS, kv_len, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, KV_HEADS, kv_len, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def _chunk_bounds(kv_len, num_chunks):
    edges = torch.linspace(0, kv_len, num_chunks + 1).round().long().tolist()
    return list(itertools.pairwise(edges))


def _sliced_sequence_chunks(q_start, kv_len, num_chunks, k, v, docs_BS=None):
    """Chunks of keys 0..kv_len for queries at q_start.., each with its offset-causal mask."""
    chunks = []
    for start, stop in _chunk_bounds(kv_len, num_chunks):
        mask = offset_causal_mask(q_start, start)
        if docs_BS is not None:
            mask = and_masks(
                mask, document_mask(docs_BS[:, q_start : q_start + Q_LEN], docs_BS[:, start:stop])
            )
        chunks.append(KVChunk(k[:, :, start:stop], v[:, :, start:stop], mask))
    return chunks


def _whole_mask(q_start, docs_BS=None):
    mask = offset_causal_mask(q_start, 0)
    if docs_BS is None:
        return mask
    return and_masks(mask, document_mask(docs_BS[:, q_start : q_start + Q_LEN], docs_BS))


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 5])
@pytest.mark.parametrize("with_documents", [False, True], ids=["causal", "documents"])
def test_ring_identity_chunks_equal_whole_fp64(num_chunks, with_documents):
    kv_len, q_start = 30, 18  # the query block is the last 12 positions of 30
    docs = torch.tensor([[0] * 10 + [1] * 20, [0] * 25 + [1] * 5]) if with_documents else None
    q, k, v = _qkv(kv_len)
    chunks = _sliced_sequence_chunks(q_start, kv_len, num_chunks, k, v, docs)
    out, lse = attention_over_chunks(q, chunks, SCALE, backend="cpu")
    allowed = dense_allowed(_whole_mask(q_start, docs), BATCH, HEADS, Q_LEN, kv_len)
    ref_out, ref_lse = reference_attention(q, k, v, allowed, SCALE)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref_out, (q, k, v), grad_out)
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"d{name} differs")


def test_chunk_backward_needs_the_merged_out_and_lse():
    """Ablation: differentiating each chunk with its own (out, lse) instead of the merged ones,
    which is what a naive per-chunk autograd would do, gives wrong gradients."""
    kv_len, q_start = 30, 18
    q, k, v = _qkv(kv_len)
    chunks = _sliced_sequence_chunks(q_start, kv_len, 3, k, v)
    backend = get_backend("cpu")
    grad_out = torch.randn(BATCH, HEADS, Q_LEN, HEAD_DIM, dtype=torch.float64)
    with torch.no_grad():
        naive_dq = sum(
            backend.backward_chunk(
                grad_out,
                q,
                c.k_BGKD,
                c.v_BGKD,
                *backend.forward_chunk(q, c.k_BGKD, c.v_BGKD, c.mask, SCALE),
                c.mask,
                SCALE,
            )[0]
            for c in chunks
        )
    out, _ = attention_over_chunks(q, chunks, SCALE, backend=backend)
    (exact_dq,) = torch.autograd.grad(out, (q,), grad_out)
    assert (naive_dq - exact_dq).abs().max() > 1e-2


def test_autograd_merge_of_differentiable_partials_equals_whole_fp64():
    """The path used when a backend's lse carries gradients (flex on CUDA): both partial
    outputs differentiable, merged by autograd."""
    kv_len, q_start = 30, 18
    q, k, v = _qkv(kv_len)
    partials = []
    for start, stop in _chunk_bounds(kv_len, 3):
        allowed = dense_allowed(
            offset_causal_mask(q_start, start), BATCH, HEADS, Q_LEN, stop - start
        )
        partials.append(
            reference_attention(q, k[:, :, start:stop], v[:, :, start:stop], allowed, SCALE)
        )
    out, lse = merge_attention(partials)
    allowed = dense_allowed(_whole_mask(q_start), BATCH, HEADS, Q_LEN, kv_len)
    ref_out, ref_lse = reference_attention(q, k, v, allowed, SCALE)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(lse)
    loss, ref_loss = (
        (out**2).sum() + (lse * weights).sum(),
        (ref_out**2).sum() + (ref_lse * weights).sum(),
    )
    for g, w in zip(
        torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(ref_loss, (q, k, v)), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_merge_with_fully_masked_chunks_has_no_nan():
    out_a, lse_a = (
        torch.randn(1, 1, 3, 4, dtype=torch.float64),
        torch.randn(1, 1, 3, dtype=torch.float64),
    )
    out_b = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    lse_b = torch.tensor([[[float("-inf"), 0.5, float("-inf")]]], dtype=torch.float64)
    lse_a[0, 0, 2] = float("-inf")
    out_a[0, 0, 2] = 0
    for t in (out_a, lse_a, out_b, lse_b):
        t.requires_grad_()
    out, lse = merge_attention([(out_a, lse_a), (out_b, lse_b)])
    torch.testing.assert_close(out[0, 0, 0], out_a[0, 0, 0])  # chunk b masked: a alone
    assert torch.isneginf(lse[0, 0, 2]) and torch.all(out[0, 0, 2] == 0)  # masked everywhere
    expected_lse = torch.logaddexp(lse_a[0, 0, 1], lse_b[0, 0, 1])
    torch.testing.assert_close(lse[0, 0, 1], expected_lse)
    grads = torch.autograd.grad((out.sum() + lse[0, 0, :2].sum()), (out_a, lse_a, out_b, lse_b))
    assert all(torch.isfinite(g).all() for g in grads)


def test_chunk_validation_errors():
    q, k, v = _qkv(6)
    with pytest.raises(ValueError, match="at least one KV chunk"):
        attention_over_chunks(q, [], SCALE, backend="cpu")
    with pytest.raises(ValueError, match="chunk 1"):
        attention_over_chunks(q, [KVChunk(k, v), KVChunk(k, v[:, :, :3])], SCALE, backend="cpu")
    with pytest.raises(ValueError, match="at least one partial"):
        merge_attention([])
