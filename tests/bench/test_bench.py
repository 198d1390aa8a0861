"""Benchmarks keep running and end with their RESULT line (tiny sizes; numbers not asserted)."""

import re

import pytest

from pipekit.bench.__main__ import main


def test_attention_bench_prints_table_and_result(capsys):
    main(["attention", "--seq", "64", "--heads", "2", "--head-dim", "32", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("flex (compiled)") for line in lines)
    assert re.fullmatch(
        r"RESULT backend=cpu fwd_ratio_vs_sdpa=\S+ max_err=\S+ train_ratio_vs_sdpa=\S+ "
        r"flex_fwd_ratio_vs_sdpa=\S+ flex_max_err=\S+",
        lines[-1],
    )
    max_err = float(re.search(r" max_err=(\S+)", lines[-1]).group(1))
    assert max_err < 1e-5


def test_attention_bench_refuses_head_dims_flex_refuses(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["attention", "--head-dim", "8"])
    assert exit_.value.code == 2
    assert "--head-dim 8: flex on CPU refuses head dims below 32" in capsys.readouterr().err


def test_flex_cpu_bench_finds_no_wrong_case_the_guard_admits(capsys):
    sweep = ["--head-dims", "8,32", "--lengths", "24", "--masks", "causal", "--calls", "1"]
    main(["flex-cpu", *sweep])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("CPU ") and "capability" in lines[0]
    assert re.fullmatch(r"RESULT capability=\S+ cases=2 wrong=[012] wrong_admitted=0", lines[-1])


def test_unknown_benchmark_exits_with_usage(capsys):
    try:
        main(["nope"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("an unknown benchmark must exit with status 2")
    assert "attention" in capsys.readouterr().out


def test_moe_bench_prints_table_and_result(capsys):
    shape = ["--tokens", "256", "--dim", "32", "--hidden", "64", "--experts", "4"]
    main(["moe", "--ep", "2", *shape, "--partitions", "1,2,4", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("auto (n=") for line in lines)
    assert re.fullmatch(
        r"RESULT pipelined_speedup=\S+ native_speedup=\S+ memory_saving=\S+ eq6=\S+ "
        r"sharing_saving=\S+ best_n=\d auto_n=\d",
        lines[-1],
    )
    eq6 = float(re.search(r" eq6=(\S+)", lines[-1]).group(1))
    assert -1 < eq6 < 1


def test_moe_bench_rejects_experts_not_divisible_by_ep(capsys):
    try:
        main(["moe", "--ep", "3", "--experts", "8"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("--ep 3 with 8 experts must exit with status 2")
    assert "divide --experts 8" in capsys.readouterr().err


def test_context_parallel_bench_counts_the_bytes_the_formula_predicts(capsys):
    """The bytes the collectives carry (counted) are the formula's, within the few token
    indices and float32 lse it leaves out; "auto" never moves more than either variant."""
    sizes = ["--measure-slice-tokens", "64", "--measure-heads", "8", "--head-dim", "32"]
    main(["context-parallel", "--slices", "6", "--measure-slices", "4", *sizes])
    result = capsys.readouterr().out.strip().splitlines()[-1]
    figures = dict(item.split("=") for item in result.removeprefix("RESULT ").split())
    assert set(figures) == {
        "auto_vs_commutated", "auto_vs_kv_passing", "mha_commutated_vs_kv_bytes",
        "whole_auto_vs_best", "whole_ulysses_vs_kv_passing", "mla_auto_vs_expanded_auto",
        "mla_kv_passing_vs_expanded", "mla_chosen_vs_best", "whole_hierarchical_vs_kv_passing",
        "hierarchical_vs_flat_auto", "hierarchical_chosen_vs_best",
        "commutated_vs_kv_bytes", "formula", "chosen_vs_best", "measured_vs_formula",
    }  # fmt: skip
    assert float(figures["whole_auto_vs_best"]) == 1.0
    assert float(figures["hierarchical_chosen_vs_best"]) == 1.0
    # DeepSeek-V3's latent (512 + 64) once per token against 128 heads x 2 x 192 (padded values)
    assert float(figures["mla_kv_passing_vs_expanded"]) == pytest.approx(
        576 / (128 * 2 * 192), 1e-3
    )
    assert float(figures["mla_chosen_vs_best"]) == 1.0
    assert float(figures["measured_vs_formula"]) < 0.05
    measured, predicted = float(figures["commutated_vs_kv_bytes"]), float(figures["formula"])
    assert measured == pytest.approx(predicted, rel=0.05)
    assert float(figures["chosen_vs_best"]) == 1.0
    assert float(figures["auto_vs_commutated"]) <= 1 and float(figures["auto_vs_kv_passing"]) <= 1


def test_tensor_parallel_bench_meets_megatrons_formulas(capsys):
    """On 2 ranks: sequence parallelism halves what the norms save, and tensor parallelism
    sends Megatron's 8 (t-1)/t b s h bytes per layer (one reduction per attention and per FFN,
    not one per projection), with or without sequence parallelism. (The blocks as a whole keep
    more with it: the column-split projections keep their gathered input; see
    docs/tensor_parallel.md.)"""
    sizes = ["--dim", "128", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "256", "--seq", "64"]
    main(["tensor-parallel", "--tp", "2", "--layers", "1", *sizes])
    result = capsys.readouterr().out.strip().splitlines()[-1]
    figures = {
        k: float(v) for k, v in (i.split("=") for i in result.removeprefix("RESULT ").split())
    }
    assert figures["sp_activation_ratio"] == pytest.approx(0.5, abs=0.01)
    assert figures["tp_bytes_vs_formula"] == pytest.approx(1.0, abs=0.01)
    assert figures["tp_without_sp_bytes_vs_formula"] == pytest.approx(1.0, abs=0.01)


def test_step_bench_compares_compiled_with_eager(capsys):
    config = "configs/debug_model.toml"
    tiny = ["--training.seq_len", "32", "--training.global_batch_size", "4"]
    main(["step", "--config", config, "--compile", "--warmup", "1", "--timed", "2", *tiny])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[3:5]] == ["eager", "compiled"]
    assert re.fullmatch(
        r"RESULT tokens_per_s=\S+ mfu_vs_matmul_peak=\S+ compiled_tokens_per_s=\S+ "
        r"compile_speedup=\S+ max_loss_rel_difference=\S+",
        lines[-1],
    )
    assert float(re.search(r"max_loss_rel_difference=(\S+)", lines[-1]).group(1)) < 1e-5


def test_chunked_loss_bench_counts_both_heads_as_their_formulas(capsys):
    """The whole head beyond this size is counted on the meta device; the small size shows the
    meta count equal to the CPU's, and the chunked head's CPU peak is its formula's."""
    main(["chunked-loss", "--tokens", "2048", "--vocab", "4096", "--dim", "16", "--chunk", "256",
          "--check-tokens", "512"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = dict(part.split("=") for part in last.removeprefix("RESULT ").split())
    assert result["meta_equals_cpu"] == "yes"
    assert abs(float(result["chunked_vs_formula"]) - 1) < 0.1
    assert float(result["whole_over_chunked"]) > 4


def test_muon_bench_gathers_the_matrices_bytes_per_step(capsys):
    """On 2 FSDP2 ranks Muon's step sends (t-1)/t of the matrices' bytes, AdamW's nothing."""
    main(["muon", "--ranks", "2", "--layers", "1", "--dim", "128", "--ffn-dim", "256"])
    out = capsys.readouterr().out
    assert re.search(r"^AdamW +\S+ +0 ", out, re.MULTILINE)
    last = out.strip().splitlines()[-1]
    result = dict(part.split("=") for part in last.removeprefix("RESULT ").split())
    assert float(result["muon_bytes_vs_formula"]) == 1
    assert 0 < float(result["muon_bytes_over_fsdp_step"]) < 1 / 3
