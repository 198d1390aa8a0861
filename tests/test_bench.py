"""Benchmarks keep running and end with their RESULT line (tiny sizes; numbers not asserted)."""

import re

from pipekit.bench.__main__ import main


def test_attention_bench_prints_table_and_result(capsys):
    main(["attention", "--seq", "64", "--heads", "2", "--head-dim", "8", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("flex (compiled)") for line in lines)
    assert re.fullmatch(
        r"RESULT backend=cpu fwd_ratio_vs_sdpa=\S+ max_err=\S+ train_ratio_vs_sdpa=\S+ "
        r"flex_fwd_ratio_vs_sdpa=\S+ flex_max_err=\S+",
        lines[-1],
    )
    max_err = float(re.search(r" max_err=(\S+)", lines[-1]).group(1))
    assert max_err < 1e-5


def test_unknown_benchmark_exits_with_usage(capsys):
    try:
        main(["nope"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("an unknown benchmark must exit with status 2")
    assert "attention" in capsys.readouterr().out
