"""The schedules benchmark: simulated bubbles and activation memory equal SlimPipe Table 2's
formulas under uniform costs, and the bench says so in its RESULT line."""

from __future__ import annotations

import pytest

from pipekit.bench.schedules import attention_to_linear_ratio, main
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions


def _result_figures(output: str) -> dict[str, str]:
    last = output.strip().splitlines()[-1]
    assert last.startswith("RESULT "), output
    return dict(part.split("=", 1) for part in last.removeprefix("RESULT ").split())


def test_schedules_bench_matches_table2_and_reports_causal_bubbles(capsys):
    main(["--pp", "2", "4", "--microbatches", "4", "--slices-per-rank", "1", "2",
          "--contexts", "4096", "65536", "--dim", "512"])  # fmt: skip
    output = capsys.readouterr().out
    figures = _result_figures(output)
    assert list(figures) == [
        "max_rel_dev_uniform",
        "zbv_bubble_inside_range",
        "sliced_bubble_uniform",
        "sliced_bubble_causal_4k",
        "sliced_bubble_causal_64k",
        "sliced_bubble_attn_only",
        "paper_attn_dominated",
    ]
    assert float(figures["max_rel_dev_uniform"]) < 1e-9
    assert figures["zbv_bubble_inside_range"] == "2/2"
    p, m, n = 2, 4, 4  # the first --pp and --microbatches, the largest n
    assert float(figures["sliced_bubble_uniform"]) == pytest.approx((p - 1) / (n * m))
    assert float(figures["paper_attn_dominated"]) == pytest.approx((p - 1) * p / ((n + 1) * n * m))
    # equal slices under causal attention: later slices are heavier and ranks wait for each other
    short, long = (float(figures[f"sliced_bubble_causal_{s}"]) for s in ("4k", "64k"))
    assert float(figures["sliced_bubble_uniform"]) < short < long
    assert "V-Half" in output and "max |change| = 0 " in output


def test_uniform_cost_simulation_equals_table2_formulas():
    for p, m in ((2, 2), (4, 4), (4, 8), (8, 8)):
        one_f_one_b = simulate(torch_schedule_actions("1F1B", p, m))
        reference = one_f_one_b.peak_memory[0]["activations"]
        assert one_f_one_b.max_bubble_fraction == pytest.approx((p - 1) / m)
        gpipe = simulate(torch_schedule_actions("GPipe", p, m))
        assert gpipe.max_bubble_fraction == pytest.approx((p - 1) / m)
        assert gpipe.peak_memory[0]["activations"] / reference == pytest.approx(m / p)
        interleaved = simulate(torch_schedule_actions("Interleaved1F1B", p, m, 2))
        assert interleaved.max_bubble_fraction == pytest.approx((p - 1) / (2 * m))
        zbv = simulate(torch_schedule_actions("ZBVZeroBubble", p, m, 2))
        assert 0 < zbv.max_bubble_fraction < 2 * (p - 1) / (3 * m)
        for n in (p, 2 * p, 4 * p):
            for v in (1, 2):
                sliced = simulate(sliced_pipeline_actions(p, m, n, v), num_slices=n)
                assert sliced.max_bubble_fraction == pytest.approx((p - 1) / (n * v * m))
                assert sliced.peak_memory[0]["activations"] / reference == pytest.approx(
                    1 / p + 2 * (p - 1) / (n * v * p)  # SlimPipe Eq. 1 / Table 2
                )
    # with warm-ups that fill (interleaved: m a multiple of p, 2m > 3p - 2; ZB-V: m >= 2p - 1)
    for p, m in ((2, 4), (4, 8), (8, 16)):
        reference = simulate(torch_schedule_actions("1F1B", p, m)).peak_memory[0]["activations"]
        interleaved = simulate(torch_schedule_actions("Interleaved1F1B", p, m, 2))
        assert interleaved.peak_memory[0]["activations"] / reference == pytest.approx(
            1 + (p - 1) / (2 * p)
        )
        zbv = simulate(torch_schedule_actions("ZBVZeroBubble", p, m, 2))
        assert zbv.peak_memory[0]["activations"] / reference == pytest.approx(1.0)


def test_causal_costs_make_equal_slices_imbalanced_but_leave_memory_unchanged():
    p, m, n = 4, 2, 8
    actions = sliced_pipeline_actions(p, m, n)
    uniform = simulate(actions, num_slices=n)
    causal = simulate(
        actions,
        num_slices=n,
        cost=CostModel(forward_attention=attention_to_linear_ratio(524288, 5120)),
    )
    assert attention_to_linear_ratio(524288, 5120) == pytest.approx(524288 / (12 * 5120))
    assert causal.max_bubble_fraction > uniform.max_bubble_fraction
    assert causal.peak_memory == uniform.peak_memory


def test_schedules_bench_rejects_a_one_rank_pipeline(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pp", "1"])
    assert exit_info.value.code == 2
    assert "--pp 1 must be at least 2" in capsys.readouterr().err
