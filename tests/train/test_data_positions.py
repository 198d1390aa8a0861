"""Packed positions restart where a row continues a document, on every data source: every
row's positions lie in [0, seq_len), its first token has position 0, and within the row they
count on by one per document and start at 0 at each BOS. Rows that continue a document are
there in each source (else the property would be empty). The stdlib corpus, local text and
JSONL files, chat data, a mixture and the streaming packer (the Hugging Face streaming path's)
run here; the Hugging Face datasets reader is in test_data.py. On the old packing (positions
counted from the document's start in the stream) every case fails."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from packed_rows import assert_positions_restart_per_row

import pipekit.train.data.loader as loader_module
from pipekit.config.job_config import DataConfig
from pipekit.train.data import ByteTokenizer, PackedDataLoader, build_data_loader, pack_documents
from pipekit.train.data.streaming import StreamingPackedLoader

BYTES = ByteTokenizer()
SEQ_LEN, ROWS = 16, 8


def _texts(count: int, seed: int) -> list[str]:
    """Documents of 1 to 60 characters: many longer than a row."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (count,), generator=generator).tolist()
    return [f"{index}:" + "xyz \n"[index % 5] * length for index, length in enumerate(lengths)]


def _options(**overrides: int) -> dict[str, int]:
    return dict(seq_len=SEQ_LEN, local_batch_size=ROWS, dp_rank=0, dp_world_size=1) | overrides


def _stdlib(tmp_path: Path) -> DataConfig:
    return DataConfig()


def _local_files(tmp_path: Path) -> DataConfig:
    texts = _texts(120, seed=1)
    (tmp_path / "a.txt").write_text(texts[0] * 40)  # one document of many rows
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[1:]))
    return DataConfig(source=str(tmp_path))


def _chat(tmp_path: Path) -> DataConfig:
    lines = [
        json.dumps({"messages": [{"role": "user", "content": text},
                                 {"role": "assistant", "content": text[::-1]}]})
        for text in _texts(60, seed=2)
    ]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("\n".join(lines))
    return DataConfig(source=str(tmp_path / "chat.jsonl"), format="chat")


def _mixture(tmp_path: Path) -> DataConfig:
    for name, seed in (("one", 3), ("two", 4)):
        (tmp_path / f"{name}.jsonl").write_text(
            "\n".join(json.dumps({"text": t}) for t in _texts(80, seed))
        )
    sources = [str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")]
    return DataConfig(mix_sources=sources, mix_weights=[1.0, 2.0])


@pytest.mark.parametrize(
    ("make_config", "seq_len"),
    [(_stdlib, 128), (_local_files, SEQ_LEN), (_chat, SEQ_LEN), (_mixture, SEQ_LEN)],
    ids=["stdlib", "local_files", "chat", "mixture"],
)
def test_packed_positions_restart_at_each_row_and_stay_below_seq_len(
    make_config: Callable[[Path], DataConfig],
    seq_len: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loader_module, "_STREAM_CACHE", OrderedDict())  # dropped afterwards
    loader = build_data_loader(make_config(tmp_path), **_options(seq_len=seq_len), seed=0)
    rows = min(loader.num_rows, 256)  # the whole small corpora; 256 rows of the stdlib's
    batch = loader.stream.rows(torch.arange(loader.rows.start, loader.rows.start + rows), seq_len)
    assert_positions_restart_per_row(batch, seq_len, BYTES.bos_id)
    assert_positions_restart_per_row(next(loader), seq_len, BYTES.bos_id)  # a shuffled batch


def test_streamed_positions_restart_at_each_row_as_the_packed_corpus_does() -> None:
    """The streaming packer cuts rows from a rolling buffer whose first document began in rows
    already cut: its rows equal the packed corpus's, positions included."""
    texts = _texts(300, seed=5)
    streamed = StreamingPackedLoader(lambda epoch: texts, BYTES, **_options())
    in_memory = PackedDataLoader(pack_documents(texts, BYTES), **_options(), shuffle=False)
    for _ in range(in_memory.steps_per_epoch):
        batch = next(streamed)
        assert (batch == next(in_memory)).all()
        assert_positions_restart_per_row(batch, SEQ_LEN, BYTES.bos_id)
