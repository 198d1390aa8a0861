"""Every attention backend against the float64 reference: out, lse and (where it has a
backward) every gradient, for causal, offset-causal, document, sliding-window and GQA cases."""

import pytest
import torch
from attention_reference import dense_allowed, reference_attention

from pipekit.attention import (
    and_masks,
    attention,
    causal_mask,
    document_mask,
    get_backend,
    offset_causal_mask,
    select_backend,
    sliding_window_mask,
    use_backend,
)
from pipekit.attention.cpu_flash import CpuFlashBackend

BATCH, Q_LEN, KV_LEN, HEAD_DIM = 2, 24, 24, 8
DOCS_BS = torch.tensor([[0] * 7 + [1] * 12 + [2] * 5, [0] * 20 + [1] * 4])

CASES = {
    "full": (None, 4, 4, KV_LEN),
    "causal": (causal_mask, 4, 4, KV_LEN),
    # queries at 16..39 against keys 8..31: partially overlapping blocks of a long sequence
    "offset_causal": (offset_causal_mask(16, 8), 4, 4, KV_LEN),
    "document": (and_masks(causal_mask, document_mask(DOCS_BS, DOCS_BS)), 4, 4, KV_LEN),
    "sliding_window": (and_masks(causal_mask, sliding_window_mask(5)), 4, 4, KV_LEN),
    "gqa_causal": (causal_mask, 6, 2, KV_LEN),
    "gqa_offset_shorter_kv": (offset_causal_mask(10, 0), 4, 1, 13),
}

# Tiles much smaller than the problem exercise skipping, causal tiles, dense tiles and merging.
TILED_CPU = CpuFlashBackend(q_block=8, kv_block=5)


def _inputs(heads, kv_heads, kv_len, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, Q_LEN, HEAD_DIM, generator=gen, dtype=dtype)
    k = torch.randn(BATCH, kv_heads, kv_len, HEAD_DIM, generator=gen, dtype=dtype)
    v = torch.randn(BATCH, kv_heads, kv_len, HEAD_DIM, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("backend", [get_backend("cpu"), TILED_CPU], ids=["cpu", "cpu_tiled"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_matches_reference_fp64(case, backend):
    mask, heads, kv_heads, kv_len = CASES[case]
    q, k, v = (t.requires_grad_() for t in _inputs(heads, kv_heads, kv_len))
    allowed = dense_allowed(mask, BATCH, heads, Q_LEN, kv_len)
    scale = 0.3
    out, lse = attention(q, k, v, mask, scale, backend=backend)
    ref_out, ref_lse = reference_attention(q, k, v, allowed, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad_out)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"d{name} differs")


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_flex_forward_on_cpu_matches_reference_and_cpu_backend(case):
    mask, heads, kv_heads, kv_len = CASES[case]
    q, k, v = _inputs(heads, kv_heads, kv_len, dtype=torch.float32)
    allowed = dense_allowed(mask, BATCH, heads, Q_LEN, kv_len)
    with torch.no_grad():
        out, lse = attention(q, k, v, mask, backend="flex")
        cpu_out, cpu_lse = attention(q, k, v, mask, backend="cpu")
    ref_out, ref_lse = reference_attention(
        q.double(), k.double(), v.double(), allowed, HEAD_DIM**-0.5
    )
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, cpu_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_finite_grads():
    # Query rows 0..3 sit before every key (positions 0..3 against keys at 4..); they see nothing.
    mask = offset_causal_mask(0, 4)
    q, k, v = (t.requires_grad_() for t in _inputs(2, 2, 10))
    out, lse = attention(q, k, v, mask, backend=TILED_CPU)
    assert torch.all(out[:, :, :4] == 0) and torch.all(torch.isneginf(lse[:, :, :4]))
    assert torch.all(torch.isfinite(lse[:, :, 4:]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][:, :, :4] == 0)
    with torch.no_grad():
        flex_out, flex_lse = attention(q.float(), k.float(), v.float(), mask, backend="flex")
    assert torch.all(flex_out[:, :, :4] == 0) and torch.all(torch.isneginf(flex_lse[:, :, :4]))


def test_cpu_backend_lse_carries_no_gradient():
    q, k, v = (t.requires_grad_() for t in _inputs(2, 2, KV_LEN))
    out, lse = attention(q, k, v, causal_mask, backend="cpu")
    assert out.requires_grad and not lse.requires_grad


def test_flex_refuses_to_train_on_cpu():
    q, k, v = (t.float().requires_grad_() for t in _inputs(2, 2, KV_LEN))
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        attention(q, k, v, causal_mask, backend="flex")


def test_automatic_backend_choice_and_override():
    q, k, v = _inputs(2, 2, KV_LEN, dtype=torch.float32)
    assert select_backend("auto", q, k, v).name == "flex"  # CPU inference
    assert select_backend("auto", q.requires_grad_(), k, v).name == "cpu"  # CPU training
    with torch.no_grad():
        assert select_backend("auto", q, k, v).name == "flex"
    with use_backend("cpu"), torch.no_grad():
        assert select_backend("auto", q, k, v).name == "cpu"
    assert select_backend("flex", q, k, v).name == "flex"
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'.*cpu"):
        select_backend("fast", q, k, v)


def test_shape_errors_name_the_problem():
    q, k, v = _inputs(4, 3, KV_LEN)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q, k, v, backend="cpu")
    q, k, v = _inputs(4, 2, KV_LEN)
    with pytest.raises(ValueError, match="dtype"):
        attention(q, k.float(), v.float(), backend="cpu")
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        attention(q[0], k, v, backend="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["causal", "document", "gqa_causal"])
def test_flex_on_cuda_matches_reference_with_lse_gradients(case):
    mask, heads, kv_heads, kv_len = CASES[case]
    if case == "document":
        docs = DOCS_BS.cuda()
        mask = and_masks(causal_mask, document_mask(docs, docs))
    q, k, v = (t.cuda().float().requires_grad_() for t in _inputs(heads, kv_heads, kv_len))
    allowed = dense_allowed(CASES[case][0], BATCH, heads, Q_LEN, kv_len).cuda()
    out, lse = attention(q, k, v, mask, backend="flex")
    ref_out, ref_lse = reference_attention(
        q.double(), k.double(), v.double(), allowed, HEAD_DIM**-0.5
    )
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-4, atol=2e-4)
    weights = torch.randn_like(lse)
    loss = (out * out).sum() + (lse * weights).sum()
    ref_loss = (ref_out * ref_out).sum() + (ref_lse * weights.double()).sum()
    for got, want in zip(
        torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(ref_loss, (q, k, v)), strict=True
    ):
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3)
