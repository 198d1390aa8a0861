"""Document-length distributions for planning: what `[data] document_lengths` names, how a
corpus's histogram is measured and read back, and rows drawn as the loader packs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipekit.attention.document_lengths import (
    HistogramLengths,
    LogNormalLengths,
    corpus_histogram,
    packed_document_ids,
    parse_document_lengths,
    positions_in_documents,
)
from pipekit.config import ConfigError, load_job_config
from pipekit.train.data.corpus_lengths import main
from pipekit.train.job import validate_job

REPO_ROOT = Path(__file__).resolve().parents[2]

# drawing rows starts torch's intra-op threads; each test runs in a forked child, so the pytest
# process, from which later tests fork their rank groups, does not carry them
pytestmark = pytest.mark.own_process


def test_named_distributions_parse_with_their_arguments() -> None:
    assert parse_document_lengths("") is None
    assert parse_document_lengths("lognormal") == LogNormalLengths()
    parsed = parse_document_lengths("lognormal: median=300, sigma=0.5,minimum=8")
    assert parsed == LogNormalLengths(median=300, sigma=0.5, minimum=8)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("zipf", "is not a distribution"),
        ("lognormal:mean=3", "lognormal takes median, sigma, minimum, not 'mean'"),
        ("lognormal:median=big", "median='big' is not a number"),
        ("lognormal:median=0", "need median >= 1"),
        ("missing.json", "no file missing.json"),
    ],
)
def test_a_bad_distribution_is_one_line_naming_the_fix(text: str, names: str) -> None:
    with pytest.raises(ValueError, match=r"document.lengths") as error:
        parse_document_lengths(text)
    message = str(error.value)
    assert names in message and "\n" not in message
    assert "write" in message or "measure" in message


def test_a_job_with_a_bad_distribution_is_refused_before_it_starts(tmp_path: Path) -> None:
    broken = tmp_path / "lengths.json"
    broken.write_text('{"lengths": [10, 20]}')
    argv = ["--config", str(REPO_ROOT / "configs/debug_model.toml")]
    with pytest.raises(ConfigError, match=r"lengths.json is not a document-length histogram"):
        validate_job(load_job_config([*argv, "--data.document_lengths", str(broken)]), 2)
    job = validate_job(load_job_config([*argv, "--data.document_lengths", "lognormal"]), 2)
    assert job.config.data.document_lengths == "lognormal"


def test_a_histogram_keeps_a_corpus_in_eighth_octave_bins_at_their_means() -> None:
    lengths_D = torch.tensor([100, 101, 102, 105, 1000, 1000, 4000])
    histogram = corpus_histogram(lengths_D, source="test")
    assert sum(histogram.counts) == 7
    # 100..105 share a bin (log2 6.64..6.71, bin 53), 1000 and 4000 have their own
    assert histogram.lengths == (102, 1000, 4000) and histogram.counts == (4, 2, 1)
    generator = torch.Generator().manual_seed(0)
    drawn = [histogram.draw(generator) for _ in range(7000)]
    assert set(drawn) == {102, 1000, 4000}
    assert abs(drawn.count(102) / 7000 - 4 / 7) < 0.02


def test_rows_are_drawn_reproducibly_and_packed_as_the_loader_packs() -> None:
    lengths = LogNormalLengths(median=128)
    document_ids_BS = packed_document_ids(lengths, 3, 2048, seed=1)
    assert torch.equal(document_ids_BS, packed_document_ids(lengths, 3, 2048, seed=1))
    assert not torch.equal(document_ids_BS, packed_document_ids(lengths, 3, 2048, seed=2))
    assert (document_ids_BS[:, 0] == 0).all()  # ids restart per row
    steps_BS = document_ids_BS[:, 1:] - document_ids_BS[:, :-1]
    assert torch.isin(steps_BS, torch.tensor([0, 1])).all()
    assert int(document_ids_BS.max()) > 3  # several documents per row
    starts_BS = torch.cat([torch.ones(3, 1, dtype=torch.bool), steps_BS == 1], dim=1)
    assert torch.equal(positions_in_documents(document_ids_BS) == 0, starts_BS)  # RoPE restarts
    # a document crossing a row edge continues in the next row: the stream's boundaries are
    # the rows' boundaries plus the row edges
    single = HistogramLengths((3000,), (1,))
    across_BS = packed_document_ids(single, 2, 2048, seed=0)
    assert across_BS[0].eq(0).all() and across_BS[1, :952].eq(0).all()
    assert across_BS[1, 952:].eq(1).all()


def test_the_corpus_histogram_command_writes_what_a_job_reads(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("short one\n\n" + "a much longer document " * 40)
    config = tmp_path / "job.toml"
    config.write_text(f'[data]\nsource = "{corpus}"\n')
    out = tmp_path / "lengths.json"
    assert main(["--config", str(config), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "documents" in printed and f'document_lengths = "{out}"' in printed
    record = json.loads(out.read_text())
    histogram = parse_document_lengths(str(out))
    assert isinstance(histogram, HistogramLengths)
    assert list(histogram.lengths) == record["lengths"]
    assert sum(histogram.counts) >= 1
    assert main(["--config", str(tmp_path / "none.toml"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
