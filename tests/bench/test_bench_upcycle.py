"""The upcycle bench at a tiny shape: it prints its table and a RESULT line in which each rank
read less than it owns (E/ep local experts copy one dense FFN read), with the fresh-process
first touches beside."""

import re

import pytest

from pipekit.bench.__main__ import main

_TINY = ["--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128"]


def test_upcycle_bench_reads_less_than_it_owns_and_prints_result(capsys):
    main(["upcycle", *_TINY, "--ffn-dim", "128", "--ep", "2", "--fresh-rounds", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = next(line for line in lines if line.startswith("rank "))
    assert "read/owned" in header and "peak/owned" in header and "plain read s" in header
    rows = [line for line in lines if re.match(r"[01] ", line)]
    assert len(rows) == 4, "one row per rank in each table"
    assert any(line.startswith("page cache (mincore)") for line in lines)
    assert any(
        line.startswith("rank  1st plain read s  1st upcycle s  1st fill s") for line in lines
    )
    match = re.fullmatch(
        r"RESULT first_upcycle_vs_first_plain_read=(\S+) first_fill_vs_first_plain_read=(\S+) "
        r"first_upcycle_vs_first_fill=(\S+) peak_rss_vs_owned=(\S+) read_bytes_vs_owned=(\S+) "
        r"time_vs_plain_read=(\S+) first_upcycle_vs_plain_read=(\S+)",
        lines[-1],
    )
    assert match is not None, lines[-1]
    first, fill, first_vs_fill, peak, read, *time_ratios = map(float, match.groups())
    time_ratios += [first, fill, first_vs_fill]
    assert 0 < read < 1
    assert peak > 1 and all(ratio > 0 for ratio in time_ratios)


def test_upcycle_bench_rejects_experts_not_divisible_by_ep(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["upcycle", *_TINY, "--ep", "3", "--experts", "8"])
    assert exit_.value.code == 2
    assert "divide --experts 8" in capsys.readouterr().err
