"""ChunkedKVCache (SlimPipe §4.1.2): slices run forward in order and go backward one at a time,
last first, each releasing its chunk; the gradients then equal unsliced attention (float64), with
and without packed documents, and with two microbatches interleaved as the sliced schedule runs
them. Dropping the cached gradients must break parity. The cache saves each slice's K/V once, so
saved bytes grow linearly in the number of slices; concatenating the cache grows quadratically.

Legend: B batch, S sequence or slice length, D model dim, H query heads, G kv heads, K head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipekit.attention import ChunkedKVCache, attention, offset_causal_mask
from pipekit.attention import kv_cache as kv_cache_module
from pipekit.attention.context import AttentionContext, CausalAttention
from pipekit.attention.kv_cache import SliceAttention
from pipekit.memory.tracker import SAVED, ActivationMemoryTracker
from pipekit.pipelining.actions import FORWARD
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

BATCH, MODEL_DIM, HEADS, KV_HEADS, HEAD_DIM, SEQ_LEN = 2, 16, 4, 2, 8, 24
SCALE, LAYER, TOLERANCE = HEAD_DIM**-0.5, "layer0", 1e-10
F64 = 8


class _TinyAttention(nn.Module):
    """One GQA attention layer's projections; the context decides what the queries see."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.wq = nn.Linear(MODEL_DIM, HEADS * HEAD_DIM, bias=False, dtype=torch.float64)
        self.wk = nn.Linear(MODEL_DIM, KV_HEADS * HEAD_DIM, bias=False, dtype=torch.float64)
        self.wv = nn.Linear(MODEL_DIM, KV_HEADS * HEAD_DIM, bias=False, dtype=torch.float64)
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=0.4, generator=generator)

    def forward(self, x_BSD: Tensor, context: AttentionContext) -> Tensor:
        def heads(projected: Tensor, num_heads: int) -> Tensor:
            return projected.unflatten(-1, (num_heads, HEAD_DIM)).transpose(1, 2)

        q_BHSK = heads(self.wq(x_BSD), HEADS)
        k_BGSK, v_BGSK = heads(self.wk(x_BSD), KV_HEADS), heads(self.wv(x_BSD), KV_HEADS)
        return context.attend(LAYER, q_BHSK, k_BGSK, v_BGSK, SCALE)


def _microbatch(
    seed: int, packed: bool, splits: tuple[int, int] = (5, 14)
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Input leaf, document ids (two documents split at `splits`, one per row) and fixed
    random weights of the output in the loss."""
    generator = torch.Generator().manual_seed(seed)
    x_BSD = torch.randn(BATCH, SEQ_LEN, MODEL_DIM, generator=generator, dtype=torch.float64)
    weights_BHSK = torch.randn(
        BATCH, HEADS, SEQ_LEN, HEAD_DIM, generator=generator, dtype=torch.float64
    )
    split_B1 = torch.tensor(splits)[:, None]
    document_ids_BS = (torch.arange(SEQ_LEN) >= split_B1).long() if packed else None
    return x_BSD.requires_grad_(), document_ids_BS, weights_BHSK


def _reference_grads(model: _TinyAttention, microbatches: list) -> dict[str, Tensor]:
    model.zero_grad()
    grads = {}
    for index, (x_BSD, document_ids_BS, weights_BHSK) in enumerate(microbatches):
        x_BSD = x_BSD.detach().requires_grad_()
        out_BHSK = model(x_BSD, CausalAttention(document_ids_BS, backend="cpu"))
        (out_BHSK * weights_BHSK).sum().backward()
        grads[f"x{index}"] = x_BSD.grad
    return grads | {name: p.grad.clone() for name, p in model.named_parameters()}


def _schedule_order(num_ranks: int, num_microbatches: int, num_slices: int, rank: int) -> list:
    """(is_forward, microbatch, slice) in the order `rank` of the sliced schedule runs them."""
    actions = sliced_pipeline_actions(num_ranks, num_microbatches, num_slices)[rank]
    return [
        (a.computation_type == FORWARD, *unit_microbatch_and_slice(a.microbatch_index, num_slices))
        for a in actions
    ]


def _sliced_grads(
    model: _TinyAttention, microbatches: list, num_slices: int, order: list, cache: ChunkedKVCache
) -> dict[str, Tensor]:
    model.zero_grad()
    inputs = [(x.detach().requires_grad_(), ids, w) for x, ids, w in microbatches]
    slice_len, losses = SEQ_LEN // num_slices, {}
    for is_forward, microbatch, slice_index in order:
        x_BSD, document_ids_BS, weights_BHSK = inputs[microbatch]
        positions = slice(slice_index * slice_len, (slice_index + 1) * slice_len)
        if is_forward:
            ids_BS = None if document_ids_BS is None else document_ids_BS[:, positions]
            context = cache.slice_context(microbatch, slice_index, ids_BS)
            out_BHSK = model(x_BSD[:, positions], context)
            losses[microbatch, slice_index] = (out_BHSK * weights_BHSK[:, :, positions]).sum()
        else:
            losses.pop((microbatch, slice_index)).backward()
            cache.release(microbatch, slice_index)
    grads = {f"x{index}": x_BSD.grad for index, (x_BSD, _, _) in enumerate(inputs)}
    return grads | {name: p.grad.clone() for name, p in model.named_parameters()}


def _relative_differences(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> dict:
    assert grads.keys() == reference.keys()
    return {
        name: ((grads[name] - ref).abs().max() / ref.abs().max()).item()
        for name, ref in reference.items()
    }


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "two_documents"])
@pytest.mark.parametrize("num_slices", [1, 2, 4])
def test_sliced_grads_equal_unsliced_fp64(num_slices, packed):
    model, microbatches = _TinyAttention(), [_microbatch(1, packed)]
    cache = ChunkedKVCache(backend="cpu")
    order = _schedule_order(1, 1, num_slices, rank=0)  # all forwards, then last slice first
    grads = _sliced_grads(model, microbatches, num_slices, order, cache)
    differences = _relative_differences(grads, _reference_grads(model, microbatches))
    assert max(differences.values()) <= TOLERANCE, differences
    assert cache.nbytes == 0 and cache.num_cached_slices(LAYER, 0) == 0


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "two_documents"])
def test_interleaved_microbatches_keep_separate_caches(packed):
    model, microbatches = _TinyAttention(), [_microbatch(1, packed), _microbatch(2, packed)]
    # The last of two ranks: microbatch 1's slices start while microbatch 0's are cached.
    order = _schedule_order(2, 2, 4, rank=1)
    forwards_of_microbatch_0 = [(True, 0, slice_index) for slice_index in range(4)]
    assert order[:6] == [*forwards_of_microbatch_0, (False, 0, 3), (True, 1, 0)]
    cache = ChunkedKVCache(backend="cpu")
    grads = _sliced_grads(model, microbatches, 4, order, cache)
    differences = _relative_differences(grads, _reference_grads(model, microbatches))
    assert max(differences.values()) <= TOLERANCE, differences
    assert cache.nbytes == 0
    assert cache.num_cached_slices(LAYER, 0) == cache.num_cached_slices(LAYER, 1) == 0


def test_slices_skip_the_cached_chunks_no_document_reaches(monkeypatch):
    """Both rows start their second document at token 12 (4 slices of 6): slices 2 and 3 hand
    the kernel none of slices 0 and 1's chunks (their masks are empty), and the gradients still
    equal unsliced attention; leaving out a chunk a document does reach (the ablation) breaks
    parity."""
    model, microbatches = _TinyAttention(), [_microbatch(1, packed=True, splits=(12, 12))]
    reference = _reference_grads(model, microbatches)
    order = _schedule_order(1, 1, 4, rank=0)
    chunks_per_call = []
    original = kv_cache_module.attention_over_chunks

    def counting(q_BHSD, chunks, *args):
        chunks_per_call.append(len(chunks))
        return original(q_BHSD, chunks, *args)

    monkeypatch.setattr(kv_cache_module, "attention_over_chunks", counting)
    grads = _sliced_grads(model, microbatches, 4, order, ChunkedKVCache(backend="cpu"))
    assert chunks_per_call == [1, 2, 1, 2]  # all four earlier chunks: [1, 2, 3, 4]
    assert max(_relative_differences(grads, reference).values()) <= TOLERANCE
    monkeypatch.setattr(
        SliceAttention, "_shares_a_document", lambda self, cached: cached.start != 0
    )
    grads = _sliced_grads(model, microbatches, 4, order, ChunkedKVCache(backend="cpu"))
    assert max(_relative_differences(grads, reference).values()) > 1e-3


def test_dropping_kv_cache_gradients_breaks_parity():
    model, microbatches = _TinyAttention(), [_microbatch(1, packed=True)]
    cache = ChunkedKVCache(backend="cpu", drop_cached_gradients=True)
    grads = _sliced_grads(model, microbatches, 4, _schedule_order(1, 1, 4, rank=0), cache)
    differences = _relative_differences(grads, _reference_grads(model, microbatches))
    assert differences["wk.weight"] > 1e-3 and differences["wv.weight"] > 1e-3, differences
    assert differences["wq.weight"] <= TOLERANCE  # queries never see the cache's gradients


def test_slices_out_of_order_raise_and_release_empties_the_cache():
    model, cache = _TinyAttention(), ChunkedKVCache(backend="cpu")
    x_BSD = _microbatch(1, packed=False)[0]
    slice_len = SEQ_LEN // 4
    slices_BSD = [x_BSD[:, start : start + slice_len] for start in range(0, SEQ_LEN, slice_len)]
    model(slices_BSD[0], cache.slice_context(0, 0))
    with pytest.raises(RuntimeError, match="must run forward in order"):
        model(slices_BSD[2], cache.slice_context(0, 2))
    model(slices_BSD[1], cache.slice_context(0, 1))
    with pytest.raises(RuntimeError, match="reverse order"):
        cache.release(0, 0)
    slice_kv_bytes = 2 * BATCH * KV_HEADS * slice_len * HEAD_DIM * F64
    assert cache.num_cached_slices(LAYER, 0) == 2 and cache.nbytes == 2 * slice_kv_bytes
    cache.release(0, 1)
    cache.release(0, 0)
    assert cache.num_cached_slices(LAYER, 0) == 0 and cache.nbytes == 0


class _ConcatenatedKVCache:
    """The ablation: each slice attends to `torch.cat` of every K/V so far, inside the graph."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def attend(self, layer_id, q_BHSK, k_BGSK, v_BGSK, scale, pattern=None):
        q_start = sum(k.shape[2] for k in self.keys)
        self.keys.append(k_BGSK)
        self.values.append(v_BGSK)
        k_all, v_all = torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)
        return attention(q_BHSK, k_all, v_all, offset_causal_mask(q_start, 0), scale, "cpu")[0]


def _forward_saved_bytes(num_slices: int, slice_len: int, concatenate: bool) -> tuple:
    """Peak bytes saved for backward over the forwards of all slices of one microbatch, each
    slice's input its own tensor (as a pipeline stage receives it)."""
    model = _TinyAttention()
    generator = torch.Generator().manual_seed(3)
    slices_BSD = [
        torch.randn(
            BATCH, slice_len, MODEL_DIM, generator=generator, dtype=torch.float64
        ).requires_grad_()
        for _ in range(num_slices)
    ]
    cache = _ConcatenatedKVCache() if concatenate else ChunkedKVCache(backend="cpu")
    outputs = []
    with ActivationMemoryTracker(exclude=model.parameters()) as tracker:
        for slice_index, x_BSD in enumerate(slices_BSD):
            context = cache if concatenate else cache.slice_context(0, slice_index)
            outputs.append(model(x_BSD, context))
    return tracker.peak_bytes(SAVED), torch.cat(outputs, dim=2)


def test_saved_bytes_grow_linearly_in_slices_and_quadratically_when_concatenated():
    slice_len = 8
    cached = {n: _forward_saved_bytes(n, slice_len, concatenate=False) for n in (2, 4, 8)}
    concatenated = {n: _forward_saved_bytes(n, slice_len, concatenate=True) for n in (2, 4, 8)}
    for n in cached:  # the same attention, so a fair comparison
        torch.testing.assert_close(cached[n][1], concatenated[n][1], rtol=1e-12, atol=1e-12)

    # Every slice saves its input (once for three projections), q, the output, the lse and its
    # own K/V, and nothing else: saved(n) = n * one slice's bytes, exactly.
    slice_kv_bytes = 2 * BATCH * KV_HEADS * slice_len * HEAD_DIM * F64
    slice_bytes = slice_kv_bytes + F64 * BATCH * slice_len * (
        MODEL_DIM + HEADS * (2 * HEAD_DIM + 1)
    )
    saved = {n: nbytes for n, (nbytes, _) in cached.items()}
    assert saved == {n: n * slice_bytes for n in saved}
    # Concatenating saves slice j's K/V again in every later slice: n(n+1)/2 slices' K/V.
    saved = {n: nbytes for n, (nbytes, _) in concatenated.items()}
    quadratic = {n: n * slice_bytes + (n * (n + 1) // 2 - n) * slice_kv_bytes for n in saved}
    assert saved == quadratic
    second_difference = (saved[8] - saved[4]) - 2 * (saved[4] - saved[2])
    assert second_difference == (36 - 10 - 2 * (10 - 3)) * slice_kv_bytes > 0
