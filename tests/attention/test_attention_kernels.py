"""Every attention backend against the float64 reference: out, lse and (where it has a
backward) every gradient, for causal, offset-causal, document, sliding-window and GQA cases;
the guard that keeps compiled FlexAttention on CPU from returning wrong values."""

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
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
from pipekit.attention.kernels import flex as flex_module
from pipekit.attention.kernels.cpu_flash import CpuFlashBackend
from pipekit.attention.kernels.flex import (
    MIN_CPU_HEAD_DIM,
    MIN_CUDA_HEAD_DIM,
    FlexKernelMismatchError,
    refuse_unsupported_cuda_shape,
)
from pipekit.memory_plan.forked import in_forked_child

BATCH, Q_LEN, KV_LEN, HEAD_DIM = 2, 24, 24, 8
# Compiled FlexAttention on CPU is tested at the head dims its guard admits; 24 is not a
# multiple of the kernel's blocks, 128 is.
FLEX_HEAD_DIMS = (32, 64)
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

# Tiles much smaller than the problem exercise skipping, causal tiles, dense tiles and merging;
# aligned square tiles also running the whole problem as one call where the tiles allow it.
TILED_CPU = CpuFlashBackend(q_block=8, kv_block=5)
ALIGNED_CPU = CpuFlashBackend(q_block=8, kv_block=8)


def _inputs(heads, kv_heads, kv_len, dtype=torch.float64, seed=0, head_dim=HEAD_DIM, q_len=Q_LEN):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, q_len, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(BATCH, kv_heads, kv_len, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(BATCH, kv_heads, kv_len, head_dim, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "backend", [get_backend("cpu"), TILED_CPU, ALIGNED_CPU], ids=["cpu", "cpu_tiled", "cpu_aligned"]
)
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


def _check_flex_on_cpu(mask, heads, kv_heads, q_len, kv_len, head_dim, allowed):
    q, k, v = _inputs(heads, kv_heads, kv_len, torch.float32, head_dim=head_dim, q_len=q_len)
    with torch.no_grad():
        out, lse = attention(q, k, v, mask, backend="flex")
        cpu_out, cpu_lse = attention(q, k, v, mask, backend="cpu")
    ref_out, ref_lse = reference_attention(
        q.double(), k.double(), v.double(), allowed, head_dim**-0.5
    )
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, cpu_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_flex_forward_on_cpu_matches_reference_unaligned_length(case):
    mask, heads, kv_heads, kv_len = CASES[case]
    allowed = dense_allowed(mask, BATCH, heads, Q_LEN, kv_len)
    for head_dim in FLEX_HEAD_DIMS if case in ("causal", "gqa_causal") else FLEX_HEAD_DIMS[:1]:
        _check_flex_on_cpu(mask, heads, kv_heads, Q_LEN, kv_len, head_dim, allowed)


@pytest.mark.parametrize("head_dim", FLEX_HEAD_DIMS)
def test_compiled_flex_forward_on_cpu_matches_reference_aligned_length(head_dim):
    length = 128
    allowed = dense_allowed(None, 1, 1, length, length).expand(BATCH, 4, -1, -1)
    causal_allowed = allowed.tril()
    _check_flex_on_cpu(None, 4, 4, length, length, head_dim, allowed)
    _check_flex_on_cpu(causal_mask, 4, 2, length, length, head_dim, causal_allowed)


@pytest.mark.parametrize("head_dim", [8, 16, MIN_CPU_HEAD_DIM - 1])
def test_flex_on_cpu_refuses_head_dims_its_kernel_gets_wrong(head_dim):
    q, k, v = _inputs(4, 4, KV_LEN, torch.float32, head_dim=head_dim)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"head_dim={head_dim}.*backend='cpu'"):
        attention(q, k, v, causal_mask, backend="flex")


def test_flex_on_cuda_refuses_heads_its_kernel_cannot_lower():
    """The check runs before the kernel, on the shape alone (so it runs here without a GPU)."""
    q, _, _ = _inputs(4, 4, KV_LEN, torch.float32, head_dim=MIN_CUDA_HEAD_DIM - 8)
    with pytest.raises(ValueError, match=r"on CUDA needs head_dim >= 16, got 8.*wider heads"):
        refuse_unsupported_cuda_shape(q)
    refuse_unsupported_cuda_shape(_inputs(4, 4, KV_LEN, head_dim=MIN_CUDA_HEAD_DIM)[0])


def _corrupting_kernel(corrupt):
    """Ablation: a stand-in for compiled FlexAttention that is right except where `corrupt`
    changes its output (SDPA underneath, so nothing compiles)."""

    def kernel(q, k, v, *, block_mask, score_mod, scale, enable_gqa):
        assert block_mask is None and score_mod is None
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
        return corrupt(out.clone())

    return lambda: kernel


def _row_5_copies_row_0(out):
    return out.index_copy_(2, torch.tensor([5]), out[:, :, :1])


def _row_7_is_nan(out):
    return out.index_fill_(2, torch.tensor([7]), float("nan"))


def _one_percent_too_large(out):
    return out.mul_(1.01)


@pytest.mark.parametrize("corrupt", [_row_5_copies_row_0, _row_7_is_nan, _one_percent_too_large])
def test_flex_output_check_catches_a_wrong_kernel(monkeypatch, corrupt):
    q, k, v = _inputs(4, 2, KV_LEN, torch.float32, head_dim=32)
    monkeypatch.setattr(flex_module, "compiled_flex_attention", _corrupting_kernel(lambda o: o))
    with torch.no_grad():  # the uncorrupted stand-in passes the check
        torch.testing.assert_close(
            attention(q, k, v, None, backend="flex")[0],
            attention(q, k, v, None, backend="cpu")[0],
        )
    monkeypatch.setattr(flex_module, "compiled_flex_attention", _corrupting_kernel(corrupt))
    with torch.no_grad(), pytest.raises(FlexKernelMismatchError, match="backend='cpu'"):
        attention(q, k, v, None, backend="flex")


# Run with AVX2 code generation (ATEN_CPU_CAPABILITY also steers inductor), which reproduces,
# on any x86 CPU with AVX2, the kernel bug of AVX2-only machines. On a CPU whose best path is
# AVX2 already, that is what this process generates: the probe runs in a child forked from it,
# with the suite's inductor cache. On a wider CPU it runs in a fresh process with the capability
# forced and an inductor cache of its own: torch 2.13's cache key leaves out
# ATEN_CPU_CAPABILITY, and a kernel compiled for one capability and loaded under the other gave
# wrong values and crashes here (so never share an inductor cache between machines of different
# ISAs). The bug reads memory it never wrote, so a given call may come out right: the probe makes
# 6 calls at head dims 8 and 16 and 8 at head dim 32, and prints, per call, whether the output
# is truly wrong (against float64) and whether the check flagged it.
_AVX2_PROBE = textwrap.dedent(
    """
    import torch
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from pipekit.attention import causal_mask
    from pipekit.attention.kernels.cpu_flash import CpuFlashBackend
    from pipekit.attention.kernels.flex import FlexKernelMismatchError, check_flex_against_reference

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    torch._dynamo.config.recompile_limit = 64
    kernel = torch.compile(flex_attention, dynamic=False)
    for head_dim, lengths in ((8, (72,)), (16, (8,)), (32, (24, 72))):
        for length in lengths:
            block_mask = create_block_mask(causal_mask, None, None, length, length, device="cpu")
            for seed in range(3 if head_dim < 32 else 4):
                gen = torch.Generator().manual_seed(seed)
                q, k, v = (torch.randn(2, 4, length, head_dim, generator=gen) for _ in range(3))
                out = kernel(q, k, v, block_mask=block_mask)
                exact = torch.nn.functional.scaled_dot_product_attention(
                    q.double(), k.double(), v.double(), is_causal=True
                )
                error = ((out.double() - exact).abs() / v.abs().max()).nan_to_num(1.0).max()
                reference = CpuFlashBackend().forward_chunk(q, k, v, causal_mask, head_dim**-0.5)
                try:
                    check_flex_against_reference(out, reference[0], v)
                    flagged = False
                except FlexKernelMismatchError:
                    flagged = True
                print(head_dim, int(error > 1e-3), int(flagged))
    """
)


def _probe_here() -> str:
    """The probe's printed lines, run in this process (its code path is AVX2 already)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(_AVX2_PROBE, {})
    return printed.getvalue()


def _probe_in_a_fresh_avx2_process(cache_dir: Path) -> str:
    """The probe's printed lines from a new interpreter forced to AVX2, with its own cache."""
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    result = subprocess.run(
        [sys.executable, "-c", _AVX2_PROBE],
        env={**os.environ, **avx2, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="AVX2 code generation needs an x86 CPU with AVX2",
)
def test_output_check_flags_exactly_the_wrong_outputs_of_the_avx2_kernel(tmp_path):
    if (
        "ATEN_CPU_CAPABILITY" not in os.environ
        and torch.backends.cpu.get_cpu_capability() == "AVX2"
    ):
        printed = in_forked_child(_probe_here)
    else:
        printed = _probe_in_a_fresh_avx2_process(tmp_path / "inductor")
    calls = [tuple(map(int, line.split())) for line in printed.splitlines()]
    assert len(calls) == 14
    assert all(wrong == flagged for _, wrong, flagged in calls), calls
    assert not any(wrong for head_dim, wrong, _ in calls if head_dim >= MIN_CPU_HEAD_DIM), calls
    # not vacuous: the bug showed (if torch fixes it, this fails and the guard can be relaxed)
    assert any(wrong for head_dim, wrong, _ in calls if head_dim < MIN_CPU_HEAD_DIM), calls


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
    q, k, v = _inputs(2, 2, 10, torch.float32, head_dim=32)
    with torch.no_grad():
        flex_out, flex_lse = attention(q, k, v, mask, backend="flex")
    assert torch.all(flex_out[:, :, :4] == 0) and torch.all(torch.isneginf(flex_lse[:, :, :4]))


def _counting(mask):
    """`mask`, counting the tiles it is evaluated on."""
    calls = []

    def counted(b, h, q_idx, kv_idx):
        calls.append(1)
        return mask(b, h, q_idx, kv_idx)

    return counted, calls


def test_cpu_backend_evaluates_a_sliced_sequences_masks_once_across_layers_and_backward():
    # A slice attends to unmasked cached chunks and causally to its own: every layer, forward and
    # backward, asks for the same masks in turn, with unmasked chunks between them.
    backend = CpuFlashBackend(q_block=8, kv_block=8)
    own, own_calls = _counting(causal_mask)
    docs, docs_calls = _counting(document_mask(DOCS_BS[:, :8], DOCS_BS[:, 8:16]))
    q, k, v = (t.requires_grad_() for t in _inputs(2, 2, 8, q_len=8))
    for _layer in range(3):
        for mask in (None, docs, own):
            attention(q, k, v, mask, backend=backend)[0].sum().backward()
    assert (len(own_calls), len(docs_calls)) == (1, 1)
    # a plan is dropped when more masks than the cache holds come between its uses
    small = CpuFlashBackend(q_block=8, kv_block=8)
    small._plans.max_plans = 1
    for _layer in range(2):
        for mask in (docs, own):
            attention(q, k, v, mask, backend=small)
    assert (len(own_calls), len(docs_calls)) == (3, 3)


def test_cpu_backend_plan_cache_is_bounded_by_its_dense_tile_masks():
    backend = CpuFlashBackend(q_block=8, kv_block=8)
    q, k, v = _inputs(2, 2, 8, q_len=8)
    dense = document_mask(DOCS_BS[:, :8], DOCS_BS[:, 8:16])  # partially masked: a bool tile
    attention(q, k, v, dense, backend=backend)
    tile_bytes = backend._plans._mask_bytes
    assert tile_bytes == 2 * 8 * 8  # [batch, 1, q, kv] bools
    backend._plans.max_mask_bytes = tile_bytes  # room for one dense plan
    masks = [document_mask(DOCS_BS[:, :8], DOCS_BS[:, 8:16]) for _ in range(3)]
    for mask in [*masks, causal_mask]:
        attention(q, k, v, mask, backend=backend)
    assert backend._plans._mask_bytes <= tile_bytes
    assert len(backend._plans._entries) == 2  # the last dense plan and causal (no dense tile)


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
    # On CPU flex runs the cpu kernel too (lse, output check): auto never picks it there.
    assert select_backend("auto", q, k, v).name == "cpu"  # CPU inference
    assert select_backend("auto", q.requires_grad_(), k, v).name == "cpu"  # CPU training
    with torch.no_grad():
        assert select_backend("auto", q, k, v).name == "cpu"
    with use_backend("flex"), torch.no_grad():
        assert select_backend("auto", q, k, v).name == "flex"
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
    inputs = _inputs(heads, kv_heads, kv_len, head_dim=MIN_CUDA_HEAD_DIM)
    q, k, v = (t.cuda().float().requires_grad_() for t in inputs)
    allowed = dense_allowed(CASES[case][0], BATCH, heads, Q_LEN, kv_len).cuda()
    out, lse = attention(q, k, v, mask, backend="flex")
    ref_out, ref_lse = reference_attention(
        q.double(), k.double(), v.double(), allowed, MIN_CUDA_HEAD_DIM**-0.5
    )
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-4, atol=2e-4)
    weights = torch.randn_like(lse)
    loss = (out * out).sum() + (lse * weights).sum()
    ref_loss = (ref_out * ref_out).sum() + (ref_lse * weights.double()).sum()
    for got, want in zip(
        torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(ref_loss, (q, k, v)), strict=True
    ):
        # the reference ran on float64 casts, so its gradients come back float32: compare in 64
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-3, atol=1e-3)
