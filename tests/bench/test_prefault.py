"""Prefaulting fresh storage: the bytes become resident before any write, values untouched."""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform

import pytest
import torch
from torch import nn

from pipekit.bench._rss import current_rss
from pipekit.memory.prefault import MIN_PREFAULT_BYTES, prefault_tensors, prefaulting

MIB = 2**20
SIZE = 64 * MIB  # above glibc's largest mmap threshold: every allocation is a fresh mapping


def _kernel_has_populate() -> bool:
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


needs_populate = pytest.mark.skipif(
    not _kernel_has_populate(), reason="MADV_POPULATE_WRITE needs Linux 5.14 or later"
)


def _fresh(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


@needs_populate
def test_prefault_makes_fresh_storage_resident_and_the_ablation_does_not() -> None:
    before = current_rss()
    untouched = _fresh(SIZE)
    grown_without = current_rss() - before
    assert grown_without < SIZE / 8  # the ablation: allocating alone maps (almost) nothing

    before = current_rss()
    assert prefault_tensors([untouched]) == SIZE
    assert current_rss() - before > 0.95 * SIZE


@needs_populate
def test_prefault_keeps_values_and_counts_each_storage_once_on_cpu_only() -> None:
    values = torch.arange(SIZE // 8, dtype=torch.float64)
    expected = values.clone()
    half = values[: values.numel() // 2]  # a view of the same storage
    small = torch.zeros(MIN_PREFAULT_BYTES // 8 - 1, dtype=torch.float64)
    not_on_cpu = torch.empty(SIZE, dtype=torch.uint8, device="meta")
    assert prefault_tensors([values, half, small, not_on_cpu]) == SIZE
    torch.testing.assert_close(values, expected, rtol=0, atol=0)


@needs_populate
def test_prefaulting_a_module_populates_its_parameters_beside_the_body() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2048, 4096, bias=False), nn.Linear(4096, 2048))
    model.to_empty(device="cpu")
    large = [param for param in model.parameters() if param.nbytes >= MIN_PREFAULT_BYTES]
    for param in large:  # 32 MiB may come from heap pages an earlier test touched: drop them
        _libc().madvise(*_whole_pages(param), _MADV_DONTNEED)
    assert sum(_resident_bytes(param) for param in large) < 0.05 * SIZE  # the ablation
    with prefaulting(model):
        pass  # the body fills nothing: only the helper thread touches the storage
    for param in large:
        assert _resident_bytes(param) == _whole_pages(param)[1]


_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    return libc


def _whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """Start and length of the pages lying wholly inside the tensor's storage."""
    address, size = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + size) // mmap.PAGESIZE * mmap.PAGESIZE
    return start, end - start


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's whole pages the kernel holds in memory (mincore(2))."""
    start, length = _whole_pages(tensor)
    pages = ctypes.create_string_buffer(length // mmap.PAGESIZE)
    assert _libc().mincore(start, length, pages) == 0
    return sum(byte & 1 for byte in pages.raw) * mmap.PAGESIZE
