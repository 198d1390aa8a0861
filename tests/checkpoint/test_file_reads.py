"""Checkpoint byte ranges read into caller buffers through the page cache or past it
(O_DIRECT): the same bytes at any offset and split, no page-cache pages for a direct read, the
cache used where it already holds the range, and a file system without O_DIRECT read buffered."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pipekit.checkpoint import SafetensorsCheckpoint, file_reads
from pipekit.checkpoint.file_reads import DirectReader, evict, read_buffered, resident_fraction

SIZE = 100_003  # not a multiple of any block size


def _evicted(path: Path, data: bytes) -> Path:
    """`data` written to `path`, synced, and dropped from the page cache."""
    path.write_bytes(data)
    evict(path)
    return path


def _splits(total: int, cuts: list[int]) -> list[np.ndarray]:
    """Byte buffers of the sizes between `cuts`, together `total` bytes, filled with a marker."""
    edges = [0, *cuts, total]
    return [np.full(b - a, 0xAB, dtype=np.uint8) for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize(
    ("offset", "total", "cuts"),
    [(0, SIZE, []), (13, 50_000, [1, 4096, 30_001]), (8192, 20_000, [10_000]), (99_000, 1003, [])],
)
def test_direct_reads_give_the_files_bytes_and_leave_the_page_cache_empty(
    direct_read_dir: Path, offset: int, total: int, cuts: list[int]
) -> None:
    """Unaligned offsets and lengths, split over buffers and over several bounce-buffer chunks,
    give exactly the file's bytes; no page of the file is cached afterwards. Ablation: the
    buffered read gives the same bytes and leaves the range cached."""
    data = torch.randint(0, 256, (SIZE,), generator=torch.Generator().manual_seed(0))
    data = data.to(torch.uint8).numpy().tobytes()
    path = _evicted(direct_read_dir / "data", data)
    reader = DirectReader(bounce_bytes=8192)
    buffers = _splits(total, cuts)
    assert reader.read(path, offset, buffers)
    assert b"".join(buffer.tobytes() for buffer in buffers) == data[offset : offset + total]
    assert reader.bytes_read == total
    assert resident_fraction(path) == 0

    buffered = _splits(total, cuts)
    read_buffered(path, offset, buffered)
    assert b"".join(buffer.tobytes() for buffer in buffered) == data[offset : offset + total]
    assert resident_fraction(path, offset, total) == 1
    # Now cached: the direct reader leaves the range to the cache.
    assert not reader.read(path, offset, _splits(total, cuts))
    assert reader.bytes_read == total


def test_a_read_past_the_end_of_the_file_says_so(direct_read_dir: Path) -> None:
    path = _evicted(direct_read_dir / "data", bytes(SIZE))
    reader = DirectReader(bounce_bytes=8192)
    with pytest.raises(EOFError, match=f"ends at byte {SIZE}"):
        reader.read(path, SIZE - 10, [np.empty(20, dtype=np.uint8)])
    with pytest.raises(EOFError, match=f"ends at byte {SIZE}"):  # over several bounce chunks
        reader.read(path, 100, [np.empty(SIZE, dtype=np.uint8)])
    assert reader.supported  # the end of a file is not a file system without O_DIRECT
    with pytest.raises(EOFError, match="ends at byte"):
        read_buffered(path, SIZE - 10, [np.empty(20, dtype=np.uint8)])


def test_a_file_system_without_o_direct_is_read_buffered(tmp_path: Path, monkeypatch) -> None:
    """EINVAL on an O_DIRECT open (tmpfs on older kernels) turns direct reads off for the
    reader, and the checkpoint reads the same values buffered; another error is raised."""
    values = torch.randn(64, 33, dtype=torch.float32)
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    _evicted(tmp_path / "model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    monkeypatch.setattr(file_reads, "resident_fraction", lambda *args: 0.0)
    real_open = os.open

    def refusing_open(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(file_reads.os, "open", refusing_open)
    with SafetensorsCheckpoint(tmp_path, direct_reads=True) as checkpoint:
        out = torch.empty(60, 33)
        checkpoint.read_block_into("w", (slice(4, 64),), out)
        assert checkpoint.direct is not None and not checkpoint.direct.supported
        assert checkpoint.direct.bytes_read == 0
    torch.testing.assert_close(out, values[4:], rtol=0, atol=0)

    def failing_open(path, flags, *args):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(file_reads.os, "open", failing_open)
    with pytest.raises(OSError, match="Input/output error"):
        DirectReader().read(tmp_path / "model.safetensors", 0, [np.empty(8, dtype=np.uint8)])
