"""`python -m pipekit.check` on the debug configs: the custom example and the debug Llama match
one process under FSDP and the sliced pipeline (2 ranks, float64), the table and the RESULT
line say so and the exit status is 0; a layout the model cannot express or the config rules
refuse is skipped with its reason; a layout that raises is an error row beside the others; a
failure of a model whose routers drop tokens over capacity names the drops, and --dropless
checks without them. Ablation: a structure that puts the final norm on the first stage (let
past the validation that refuses it) fails the pipeline layout, and the check exits 1."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch.distributed as dist

import examples.custom_model.model as custom
import pipekit.models.forward_order as forward_order
import pipekit.testing.pipeline as pipeline
from pipekit.check.__main__ import main
from pipekit.models import register_model
from pipekit.moe import MoEArgs

REPO_ROOT = Path(__file__).resolve().parents[2]
CUSTOM = ["--config", "examples/custom_model/debug.toml"]
LLAMA = ["--config", "configs/debug_model.toml"]


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configs' paths (and `[model] module`) are relative to it, as for train.py."""
    monkeypatch.chdir(REPO_ROOT)


def _rows(output: str) -> dict[str, list[str]]:
    """The table's rows by layout name."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = {}
    for line in lines[start + 2 :]:
        if line.startswith("RESULT"):
            break
        rows[line.split()[0]] = line.split()
    return rows


def _result(output: str) -> dict[str, str]:
    line = output.strip().splitlines()[-1]
    assert line.startswith("RESULT "), output
    return dict(re.findall(r"(\w+)=(\S+)", line))


@pytest.mark.parametrize("config", [CUSTOM, LLAMA], ids=["custom_model", "debug_llama"])
def test_the_debug_models_match_one_process_under_fsdp_and_the_sliced_pipeline_fp64(
    config: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status = main([*config, "--layouts", "fsdp,pp_sliced,ep"])
    output = capsys.readouterr().out
    rows = _rows(output)
    assert rows["fsdp"][-1] == rows["pp_sliced"][-1] == "pass", output
    assert rows["pp_sliced"][2:4] == ["pp", "2"], output  # the mesh column
    result = _result(output)
    assert float(result["worst"]) <= 1e-10, output
    if config == LLAMA:  # a dense model has no expert-parallel layout
        assert "skipped ep: the model has no MoE layers" in output
        assert result | {"worst": ""} == {"layouts": "2", "passed": "2", "failed": "0",
                                          "worst": "", "skipped": "1"}  # fmt: skip
    else:
        assert rows["ep"][-1] == "pass" and result["passed"] == "3", output
    assert status == 0


def test_layouts_the_model_or_the_config_rules_refuse_are_skipped_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    register_model(dataclasses.replace(custom.TINY_GPT, name="tiny_gpt_without_tp",
                                       tensor_parallel_plan=None), replace=True)  # fmt: skip
    status = main([*CUSTOM, "--model.name", "tiny_gpt_without_tp", "--layouts", "tp"])
    captured = capsys.readouterr()
    assert "skipped tp: the family has no tensor_parallel_plan" in captured.out
    assert status == 2 and "no layout can run" in captured.err  # nothing was compared
    # an MoE split over tp ranks needs sequence parallelism: the job's rules refuse it
    status = main([*CUSTOM, "--layouts", "tp", "--parallelism.sequence_parallel", "false"])
    out = capsys.readouterr().out
    assert re.search(r"skipped tp: config error: .*needs sequence_parallel = true", out), out
    assert status == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--world-size", "8"], "--world-size 8: the check runs 2 to 4"),
        (["--layouts", "fsdp,zero3"], "unknown zero3; choose among fsdp, tp, cp"),
        (["--training.seq_lenn", "64"], "did you mean 'seq_len'"),
    ],
)
def test_bad_options_end_with_one_error_line_and_status_2(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*CUSTOM, *options]) == 2
    assert message in capsys.readouterr().err


def test_a_final_norm_placed_on_the_first_stage_fails_the_pipeline_layout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The structure says ln_f belongs before the blocks, so the first stage applies it and the
    last does not: one process (which ignores placement) differs from the pipeline. Validation
    refuses the structure (forward runs ln_f after the blocks); past that check, the pipeline
    layout fails."""
    wrong = dataclasses.replace(custom.STRUCTURE, before_blocks=("wpe", "ln_f"), after_blocks=())
    register_model(dataclasses.replace(custom.TINY_GPT, name="tiny_gpt_norm_first",
                                       structure=wrong), replace=True)  # fmt: skip
    options = [*CUSTOM, "--model.name", "tiny_gpt_norm_first", "--layouts", "fsdp,pp_sliced"]
    assert main(options) == 2
    assert "places 'ln_f' in before_blocks" in capsys.readouterr().err
    monkeypatch.setattr(forward_order, "check_forward_order", lambda model, structure: None)
    status = main(options)
    output = capsys.readouterr().out
    rows = _rows(output)
    assert rows["fsdp"][-1] == "pass" and rows["pp_sliced"][-1] == "FAIL", output
    assert float(rows["pp_sliced"][5]) > 1e-3, output  # the largest gradient difference
    result = _result(output)
    assert (result["layouts"], result["passed"], result["failed"]) == ("2", "1", "1")
    assert status == 1


def test_a_capacity_dropping_models_failure_names_the_drops_and_dropless_passes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each expert takes at most its capacity of a forward's tokens: the sliced pipeline's
    forwards are slices, the reference's whole microbatches, so other tokens are dropped. The
    row and a note name that; --dropless (capacity_factor None) then matches one process."""
    capped = custom.TinyGPTArgs(moe=MoEArgs(num_experts=4, top_k=2, capacity_factor=1.0))
    register_model(dataclasses.replace(custom.TINY_GPT, name="tiny_gpt_capacity",
                                       flavors={"debug": capped}), replace=True)  # fmt: skip
    config = [*CUSTOM, "--model.name", "tiny_gpt_capacity", "--layouts", "pp_sliced"]
    status = main(config)
    output = capsys.readouterr().out
    assert "MoE with capacity drops" in output.splitlines()[0], output
    assert _rows(output)["pp_sliced"][-3:] == ["FAIL", "(capacity", "drops?)"], output
    assert "capacity drops: 2 MoE routers have capacity_factor 1" in output
    assert "run again with --dropless" in output and status == 1
    status = main([*config, "--dropless"])
    output = capsys.readouterr().out
    assert _rows(output)["pp_sliced"][-1] == "pass" and "capacity drops" not in output, output
    assert status == 0


def test_a_layout_that_raises_is_an_error_row_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 of the pipeline raises: the shared process group fails, each layout runs again in
    its own, and the table shows FSDP's verdict and the pipeline's exception."""
    step = pipeline.runner_step

    def raising_on_rank_0(runner, batch, **keywords):
        if dist.get_rank() == 0:
            raise ValueError("a fault on rank 0")
        return step(runner, batch, **keywords)

    monkeypatch.setattr(pipeline, "runner_step", raising_on_rank_0)
    status = main([*CUSTOM, "--layouts", "fsdp,pp_sliced", "--timeout", "60"])
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert rows["fsdp"][-1] == "pass" and rows["pp_sliced"][-1] == "error", captured.out
    assert "error in pp_sliced: ValueError: a fault on rank 0" in captured.out
    assert "Traceback" in captured.err
    assert _result(captured.out)["failed"] == "1" and status == 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_falcon_style_model_matches_one_process_under_every_layout(
    world_size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parallel blocks, learned positions, ALiBi on even layers, multi-query attention, biased
    LayerNorms and projections, a biased untied output (kept under vocabulary parallelism) and
    switch experts: every layout passes at 1e-10 (it has no tensor-parallel plan: one KV head
    cannot be split over tensor ranks)."""
    config = ["--config", "examples/parallel_blocks/debug.toml", "--model.flavor", "debug_dropless"]
    status = main([*config, "--world-size", str(world_size)])
    output = capsys.readouterr().out
    rows = _rows(output)
    assert status == 0, output
    assert set(rows) == {"fsdp", "cp", "pp_sliced", "pp_exchange_vocab", "ep"}, output
    assert all(row[-1] == "pass" for row in rows.values()), output
    assert "skipped tp: the family has no tensor_parallel_plan" in output, output
    assert _result(output)["passed"] == "5", output
