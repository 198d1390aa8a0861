"""ActivationMemoryTracker and PeakTensorMemory against byte counts worked out by hand (float64: 8
bytes an element unless a test says otherwise)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from pipekit.memory.live_tensors import PeakTensorMemory
from pipekit.memory.tracker import (
    KV_CACHE,
    SAVED,
    STAGE_INPUTS,
    ActivationMemoryTracker,
    active_memory_tracker,
    track_tensor,
    untrack_tensor,
)

N, D = 6, 5
F64 = 8


def _x(requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(N, D, dtype=torch.float64, requires_grad=requires_grad)


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(D, D, bias=False), nn.ReLU(), nn.Linear(D, D, bias=False)
    ).double()


def test_peak_saved_bytes_is_linear_input_plus_relu_output():
    model, x = _mlp(), _x()
    with ActivationMemoryTracker(exclude=model.parameters()) as tracker:
        loss = model(x).sum()
        # Saved: x (first linear's input) and relu's result (relu's own save and the second
        # linear's input: one storage). Not saved: the first linear's output, the weights.
        assert tracker.live_bytes(SAVED) == 2 * N * D * F64
        loss.backward()
        assert tracker.live_bytes(SAVED) == 0
    assert tracker.report().peak_saved_bytes == 2 * N * D * F64
    assert tracker.live_bytes() == 0


def test_saved_bytes_freed_when_graph_dies_without_backward():
    model, x = _mlp(), _x()
    with ActivationMemoryTracker(exclude=model.parameters()) as tracker:
        out = model(x)
        assert tracker.live_bytes(SAVED) == 2 * N * D * F64
        del out
        assert tracker.live_bytes(SAVED) == 0


def test_same_storage_saved_twice_counts_once_until_last_release():
    x = _x()
    with ActivationMemoryTracker() as tracker:
        square = x * x  # saves x as both operands
        assert tracker.live_bytes(SAVED) == N * D * F64
        sine, cosine = x.sin(), x.cos()  # two more graphs saving x
        del square, sine
        assert tracker.live_bytes(SAVED) == N * D * F64
        del cosine
        assert tracker.live_bytes(SAVED) == 0
    assert tracker.peak_bytes(SAVED) == N * D * F64


def test_parameters_excluded_without_exclude_argument():
    linear, x = nn.Linear(D, D, bias=False).double(), _x()
    with ActivationMemoryTracker() as tracker:
        linear(x).sum().backward()  # saves x and weight.t(), a view of a Parameter
    assert tracker.peak_bytes(SAVED) == N * D * F64


def test_exclude_drops_plain_tensor_storage():
    weight = torch.randn(D, D, dtype=torch.float64, requires_grad=True)
    with ActivationMemoryTracker() as counted:
        (_x() @ weight).sum().backward()
    with ActivationMemoryTracker(exclude=[weight]) as excluded:
        (_x() @ weight).sum().backward()
    assert counted.peak_bytes(SAVED) == N * D * F64 + D * D * F64
    assert excluded.peak_bytes(SAVED) == N * D * F64


def test_saved_view_counts_whole_storage():
    base = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    with ActivationMemoryTracker() as tracker:
        base[:2].sin().sum().backward()  # saves a 2x16 view of the 8x16 storage
    assert tracker.peak_bytes(SAVED) == 8 * 16 * F64


def test_meta_tensors_are_not_counted():
    with ActivationMemoryTracker() as tracker:
        torch.empty(N, D, device="meta", requires_grad=True).sin()
    assert tracker.peak_bytes() == 0


def test_kv_cache_track_untrack_refcounts_storage():
    cache = torch.zeros(2, 4, 8)  # float32: 256 bytes
    with ActivationMemoryTracker() as tracker:
        tracker.track(KV_CACHE, cache)
        tracker.track(KV_CACHE, cache[0])  # a view: same storage, a second reference
        assert tracker.live_bytes(KV_CACHE) == 256
        tracker.untrack(KV_CACHE, cache[0])
        assert tracker.live_bytes(KV_CACHE) == 256
        tracker.untrack(KV_CACHE, cache)
        assert tracker.live_bytes(KV_CACHE) == 0
        tracker.untrack(KV_CACHE, cache)  # unknown storage: ignored
    report = tracker.report()
    assert report.peak_kv_cache_bytes == 256
    assert report.peak_saved_bytes == report.peak_stage_input_bytes == 0


def test_total_counts_storage_in_two_categories_once():
    keys = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    stage_input = torch.randn(N, D, dtype=torch.float64)
    with ActivationMemoryTracker() as tracker:
        track_tensor(KV_CACHE, keys)
        track_tensor(STAGE_INPUTS, stage_input)
        keys.sin().sum().backward()  # keys is also saved for backward
        untrack_tensor(KV_CACHE, keys)
        untrack_tensor(STAGE_INPUTS, stage_input)
    report = tracker.report()
    assert report.peak_saved_bytes == report.peak_kv_cache_bytes == N * D * F64
    assert report.peak_stage_input_bytes == N * D * F64
    assert report.peak_total_bytes == 2 * N * D * F64
    assert tracker.live_bytes() == 0


def test_nested_trackers_both_see_inner_tensors():
    x, y = _x(), _x()
    with ActivationMemoryTracker() as outer:
        with ActivationMemoryTracker() as inner:
            assert active_memory_tracker() is inner
            x_sine = x.sin()
            track_tensor(STAGE_INPUTS, y)
        assert active_memory_tracker() is outer
        y_sine = y.sin()
        assert outer.live_bytes(SAVED) == 2 * N * D * F64
        del x_sine, y_sine
    assert active_memory_tracker() is None
    assert inner.peak_bytes(SAVED) == N * D * F64
    assert inner.peak_bytes(STAGE_INPUTS) == outer.peak_bytes(STAGE_INPUTS) == N * D * F64
    assert outer.peak_bytes(SAVED) == 2 * N * D * F64
    assert inner.live_bytes(SAVED) == outer.live_bytes(SAVED) == 0


def test_gradients_unchanged_under_tracker():
    model, x = _mlp(), _x()
    expected = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    with ActivationMemoryTracker(exclude=model.parameters()):
        got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_in_place_change_of_saved_tensor_still_raises():
    x = _x()
    with ActivationMemoryTracker():
        hidden = x.exp()
        out = hidden.sin()  # saves hidden
        hidden.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_untrackable_category_rejected_without_tracker():
    with pytest.raises(ValueError, match="category='saved'"):
        track_tensor(SAVED, _x())
    track_tensor(KV_CACHE, _x())  # no tracker active: no-op


def test_report_format_and_rss():
    with ActivationMemoryTracker() as tracker:
        _x().sin()
    report = tracker.report()
    assert set(report.as_dict()) >= {"peak_total_bytes", "rss_now_bytes", "rss_peak_bytes"}
    assert report.format().startswith("rank 0: peak saved")
    if sys.platform.startswith("linux"):
        assert report.rss_now_bytes is not None and report.rss_peak_bytes is not None
        assert report.rss_peak_bytes >= report.rss_now_bytes > 0


def test_peak_tensor_memory_counts_allocations_not_views_of_outside_tensors():
    """A weight's transposed view, a slice of a dataset and an in-place update of a gradient
    allocate nothing; new results do, once per storage, until freed."""
    weight, data = torch.randn(4, 8), torch.arange(100)
    with PeakTensorMemory(timeline=True) as memory:
        weight.t()
        data[10:20]
        weight.mul_(2.0)
        x = torch.randn(3, 8)  # 96 bytes
        y = x @ weight.t()  # 48 bytes
        y.view(-1)
        del x
        z = torch.ones(2, 2)  # 16 bytes, after x is freed
    assert memory.peak_bytes == 96 + 48
    assert memory.current_bytes == 48 + 16
    assert memory.timeline is not None and memory.timeline[-1] == 48 + 16
    assert max(memory.timeline) == memory.peak_bytes
    del y, z
