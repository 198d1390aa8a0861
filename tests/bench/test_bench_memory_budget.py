"""Every schedule at the same memory budget (`pipeline-throughput --schedules all
--memory-budget`): the policy each schedule gets is the cheapest the memory plan predicts to
fit, the measured peaks stay within the budget and agree with the prediction, and the sweep
draws every schedule's front. Times are not asserted; bytes are."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from pipekit.bench.__main__ import main
from pipekit.bench._memory_budget import Policy, parse_budget, policies
from pipekit.memory_plan.forked import in_forked_child

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "64", "--vocab", "64"]
SHAPE = ["--pp", "2", "--slices", "4", "--microbatches", "2", "--seq", "512", "--layers", "4"]
ONCE = ["--warmup", "0", "--repeats", "1"]


def _stdout(argv: list[str]) -> str:
    """The bench's printout, run in a forked child (its ranks and threads end with it)."""

    def run(args: list[str]) -> str:
        os.chdir(REPO_ROOT)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            main(args)
        return printed.getvalue()

    return in_forked_child(run, argv)


def _result(stdout: str) -> dict[str, str]:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), stdout
    return dict(part.split("=", 1) for part in last.removeprefix("RESULT ").split())


def _rows(stdout: str, first_header: str) -> list[list[str]]:
    """The table's rows split on runs of two or more spaces (it ends at the first line that
    does not split into the header's columns)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    columns = len(re.split(r"\s{2,}", lines[start].strip()))
    rows = []
    for line in lines[start + 2 :]:
        row = re.split(r"\s{2,}", line.strip())
        if len(row) != columns:
            break
        rows.append(row)
    return rows


def test_budget_forms_are_bytes_with_units_or_a_fraction_of_1f1b():
    assert parse_budget("0.45") == (0.45, "fraction")
    assert parse_budget("768MiB") == (768 * 2**20, "bytes")
    assert parse_budget("1.5GiB") == (1.5 * 2**30, "bytes")
    assert parse_budget("805306368") == (805306368.0, "bytes")
    for bad in ("half", "0", "12 parsecs", "-1"):
        with pytest.raises(ValueError, match=r"--memory-budget=.* (is not a budget|above 0)"):
            parse_budget(bad)


def test_policies_go_from_cheapest_to_full_recomputation():
    """Nothing first; the sliced schedule tries more slices before offload; checkpointing last,
    full at the very end; torch's schedules keep one slice."""
    sliced = policies("sliced", 4)
    assert sliced[:3] == [Policy(4), Policy(8), Policy(16)]
    assert [p.activation_offload for p in sliced[3:7]] == [0.25, 0.5, 0.75, 1.0]
    assert [p.activation_checkpoint for p in sliced[7:]] == ["selective", "every_k", "full"]
    torch_1f1b = policies("1F1B", 4)
    assert torch_1f1b[0] == Policy() and torch_1f1b[-1] == Policy(activation_checkpoint="full")
    assert {p.num_slices for p in torch_1f1b} == {1}
    assert Policy(8, activation_offload=0.5).label() == "n8 | offload 0.5"


def test_a_bad_budget_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["pipeline-throughput", "--schedules", "all", "--memory-budget", "lots", *TINY])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"python -m pipekit\.bench pipeline-throughput: error: .+\n", err)
    assert "--memory-budget='lots' is not a budget" in err


def test_the_sweep_measures_what_the_plan_predicts_and_each_budget_choice_fits():
    """The sweep: every schedule under every policy, predicted and measured peaks within 25%
    (at this 2 MiB model fixed costs the plan leaves out weigh more than at the bench's 8K,
    where the plan is within 5%; keeping weight-backward activations at half, as the
    simulator once did, under-predicts the zero-bubble schedules by 37%), full checkpointing
    below no recomputation for 1F1B, a PNG. Then a budget of 0.6 of 1F1B's peak: each schedule runs
    the first policy predicted to fit, measured within the budget or said to be above it, and
    1F1B, whose peak
    without recomputation the sweep measured above the budget (the ablation: the budget
    binds), recomputes."""
    out = REPO_ROOT / "build" / "test_memory_budget_sweep.png"
    out.parent.mkdir(exist_ok=True)
    sweep = _stdout([
        "pipeline-throughput", "--schedules", "all", "--memory-budget", "sweep",
        "--out", str(out), *SHAPE, *ONCE, *TINY,
    ])  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = {row[0]: [float(v) for v in row[1:]] for row in _rows(sweep, "schedule | policy")}
    for key, (predicted, measured, tokens_per_s) in points.items():
        assert abs(measured / predicted - 1) < 0.25, (key, predicted, measured)
        assert tokens_per_s > 0
    assert points["1F1B | full"][1] < points["1F1B | none"][1]
    assert points["sliced | n16 | none"][1] < points["sliced | n4 | none"][1]
    assert points["sliced | n4 | offload 1"][1] < points["sliced | n4 | none"][1]
    assert {key.split(" | ")[0] for key in points} >= {"sliced", "sliced v=2", "1F1B", "GPipe"}
    assert "1F1B | offload 0.5" not in points  # at m = p 1F1B keeps nothing long enough to move
    assert "Interleaved1F1B | offload 0.5" in points
    result = _result(sweep)
    assert int(result["torch_points_faster_at_equal_or_lower_memory"]) >= 0
    assert result["best_sliced_point"].startswith("sliced")

    budget = _stdout([
        "pipeline-throughput", "--schedules", "all", "--memory-budget", "0.6",
        *SHAPE, *ONCE, *TINY,
    ])  # fmt: skip
    mib = float(re.search(r"^budget ([\d.]+) MiB", budget, re.MULTILINE).group(1))
    rows = {row[0]: row for row in _rows(budget, "schedule ")}
    assert rows["1F1B"][5] == "yes" and rows["sliced"][5] == "yes", budget
    for name, (_, _, policy, predicted, measured, within, *_) in rows.items():
        assert float(predicted) <= mib, (name, budget)
        if within == "yes":
            assert float(measured) <= mib * 1.0001, (name, budget)
        else:  # a prediction a few percent low at the edge: said, and left out of the ratios
            assert f"{name} measured above the budget" in budget, budget
        cheaper = policies("sliced" if name.startswith("sliced") else name, 4)
        labels = [p.label() for p in cheaper]
        for skipped in labels[: labels.index(policy)]:  # every cheaper policy was too big
            key = f"{name} | {skipped}"
            if key in points:
                assert points[key][0] > mib, (key, points[key], mib)
    assert points["1F1B | none"][1] > mib  # measured: without recomputation 1F1B would not fit
    assert rows["1F1B"][2] != "none"
    result = _result(budget)
    assert float(result["budget_best_sliced_vs_best_torch"]) > 0
    assert float(result["max_measured_over_predicted"]) < 1.1
