"""A step's rows dealt by attention work (`[data] balance_attention`): the same rows, bins of
near-equal work, deterministic; a job trains the same losses with it."""

from __future__ import annotations

import pytest
import torch
from job_runs import LAYOUT_RUN, NO_CHECKPOINTS, train_job

from pipekit.attention.work import equal_work_bins
from pipekit.config.job_config import DataConfig
from pipekit.train.data import PackedDataLoader, build_data_loader, pack_documents
from pipekit.train.data.balance import row_attention_work
from pipekit.train.data.tokenizer import ByteTokenizer


def _bin_work(work_G: torch.Tensor, order_G: torch.Tensor, bins: int) -> list[float]:
    return [float(part.sum()) for part in work_G[order_G].chunk(bins)]


def test_rows_are_dealt_into_bins_of_near_equal_work():
    work_G = torch.tensor([900.0, 500, 400, 10, 10, 10, 10, 10])
    order_G = equal_work_bins(work_G, 2)
    assert sorted(order_G.tolist()) == list(range(8))
    assert _bin_work(work_G, torch.arange(8), 2) == [1810.0, 40.0]
    assert _bin_work(work_G, order_G, 2) == [930.0, 920.0]
    assert torch.equal(order_G, equal_work_bins(work_G, 2))
    with pytest.raises(ValueError, match="do not deal into 3 equal bins"):
        equal_work_bins(work_G, 3)


def test_row_work_counts_keys_within_documents():
    one_document = torch.zeros(1, 8, dtype=torch.long)
    four_documents = torch.arange(8).div(2, rounding_mode="floor")[None]
    assert row_attention_work(torch.cat([one_document, four_documents])).tolist() == [36, 12]


def _loader(text_lengths: list[int], dp_rank: int, balance_bins: int) -> PackedDataLoader:
    documents = ["x" * length for length in text_lengths]
    stream = pack_documents(documents, ByteTokenizer())
    return PackedDataLoader(
        stream, seq_len=64, local_batch_size=4, dp_rank=dp_rank, dp_world_size=2, seed=0,
        balance_bins=balance_bins,
    )  # fmt: skip


def _rows(batches: list) -> list[tuple[int, ...]]:
    return sorted(map(tuple, torch.cat([batch["tokens"] for batch in batches]).tolist()))


def _largest_bin(batches: list) -> float:
    """The costliest microbatch (2 per rank) of a step's ranks."""
    work = [row_attention_work(batch["document_ids"]) for batch in batches]
    return max(float(part.sum()) for rank_work in work for part in rank_work.chunk(2))


def test_the_loader_keeps_each_steps_rows_and_evens_the_ranks_work():
    lengths = [5, 300, 7, 9, 3, 120, 4, 6, 8, 200, 2, 5] * 6
    dealt_loaders = [_loader(lengths, rank, 2) for rank in (0, 1)]
    plain_loaders = [_loader(lengths, rank, 0) for rank in (0, 1)]
    lighter = 0
    for step in range(3):
        dealt = [loader.batch_of_step(step) for loader in dealt_loaders]
        plain = [loader.batch_of_step(step) for loader in plain_loaders]
        assert _rows(dealt) == _rows(plain)
        assert _largest_bin(dealt) <= _largest_bin(plain)
        lighter += _largest_bin(dealt) < _largest_bin(plain)
        again = _loader(lengths, 0, 2).batch_of_step(step)  # a resumed job deals the same
        assert torch.equal(dealt[0]["tokens"], again["tokens"])
    assert lighter > 0


def test_a_balanced_job_trains_the_same_losses(tmp_path):
    """2 FSDP ranks: the same rows per step, dealt by work, give the same losses (float32)."""
    plain = train_job(tmp_path / "plain", *LAYOUT_RUN, *NO_CHECKPOINTS)
    balanced = train_job(
        tmp_path / "balanced", *LAYOUT_RUN, *NO_CHECKPOINTS, "--data.balance_attention", "true"
    )
    assert balanced == pytest.approx(plain, rel=1e-5)


def test_balancing_a_streamed_corpus_is_refused_in_one_line():
    config = DataConfig(source="hf", hf_path="x", streaming=True, balance_attention=True)
    with pytest.raises(ValueError, match=r"set data\.streaming = false or data\.balance_attention"):
        build_data_loader(config, seq_len=8, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0)
