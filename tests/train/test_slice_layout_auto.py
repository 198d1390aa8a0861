"""`num_slices` and `slicing = "auto"`: every slice layout the job can run is planned, each is
timed over the first steps on the same modules, and the fastest is kept. The losses are the
single process's whichever layout each step ran, every rank keeps the same layout, and a job
whose features fix the layout, a torch schedule, or a deterministic job is refused in one line."""

import copy
import importlib
import json
from pathlib import Path

import pytest
import torch

from pipekit.config import ConfigError, load_job_config
from pipekit.testing import run_on_ranks
from pipekit.train.job import validate_job
from pipekit.train.trainer import Trainer

ARGS = [
    "--config", "configs/debug_sliced_pp.toml", "--training.steps", "18",
    "--training.global_batch_size", "4", "--training.seq_len", "256",
    "--parallelism.microbatches", "2", "--lr_scheduler.warmup_steps", "1",
    "--checkpoint.enable", "false", "--checkpoint.resume", "false",
    "--metrics.peak_flops", "1e9", "--metrics.log_interval", "1",
]  # fmt: skip
AUTO = ["--parallelism.num_slices", "auto", "--parallelism.slicing", "auto"]


def _plan(*overrides, world_size=2):
    return validate_job(load_job_config([*ARGS, *overrides]), world_size=world_size).pipeline


def test_auto_plans_every_layout_the_job_can_run_the_default_first():
    plan = _plan(*AUTO)
    layouts = [(layout.num_slices, layout.slices.slicing) for layout in plan.layouts]
    # 2p and 4p slices (8p would be 16 tokens), each cut both ways; the default first
    assert layouts == [(4, "equal_length"), (4, "equal_cost"), (8, "equal_length"),
                       (8, "equal_cost")]  # fmt: skip
    assert (plan.num_slices, plan.slices.slicing) == (4, "equal_length")
    assert plan.layouts[1].slice_bounds != plan.layouts[0].slice_bounds  # early slices longer
    only_counts = _plan("--parallelism.num_slices", "auto")
    assert [layout.slices.label for layout in only_counts.layouts] == [
        "num_slices=4 equal_length",
        "num_slices=8 equal_length",
    ]
    assert _plan("--parallelism.slicing", "auto", "--parallelism.num_slices", "2").layouts[
        1
    ].slices.slicing == ("equal_cost")
    assert _plan().layouts == ()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("--parallelism.context_exchange", "true"), "without features, but this one runs"),
        (("--parallelism.pipeline_schedule", "1F1B"), "times layouts of the sliced schedule"),
        (("--debug.deterministic", "true"), "chooses by timing"),
    ],
)
def test_auto_is_refused_in_one_line_where_it_cannot_be_timed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*AUTO, *overrides)


def test_num_slices_takes_a_count_or_auto():
    with pytest.raises(ConfigError, match="num_slices='some' must be a count >= 0"):
        _plan("--parallelism.num_slices", "some")
    with pytest.raises(ConfigError, match="slicing='sometimes' is not one of"):
        _plan("--parallelism.slicing", "sometimes")


def _copying_layouts(monkeypatch):
    """The ablation: every layout but the default runs copies of the modules, so the steps it
    runs train nothing the optimizer holds."""
    build = importlib.import_module("pipekit.pipelining.build")
    real_layout, built = build._layout, []

    def layout(plan, stage_modules, *args):
        modules = stage_modules if not built else [copy.deepcopy(m) for m in stage_modules]
        built.append(plan)
        return real_layout(plan, modules, *args)

    monkeypatch.setattr(build, "_layout", layout)


def _train(rank, world_size, output_dir, overrides, ablation=False):
    if ablation:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _copying_layouts(monkeypatch)
            return _train(rank, world_size, output_dir, overrides)
    config = load_job_config([*ARGS, "--job.output_dir", str(output_dir), *overrides])
    trainer = Trainer(validate_job(config, world_size))
    losses = trainer.train()
    pipeline = trainer.pipeline
    choice = pipeline.layout_choice if pipeline is not None else None
    trace = Path(output_dir) / "pipeline_trace.json"
    return {
        "losses": losses,
        "trace": json.loads(trace.read_text()) if trace.exists() else None,
        "chosen": None if choice is None else choice.chosen,
        "trials": None if choice is None else len(choice.trials),
        "timed_steps": None if choice is None else len(choice.step_seconds),
        "layouts_kept": None if pipeline is None else len(pipeline.layouts),
        "num_slices": None if pipeline is None else pipeline.num_slices,
    }


def test_an_auto_job_trains_the_single_process_losses_and_its_ranks_agree(tmp_path):
    single = _train(0, 1, tmp_path / "single", ["--parallelism.pipeline_parallel_degree", "1",
                                                 "--parallelism.num_slices", "0"])  # fmt: skip
    traced = ["--metrics.pipeline_trace_step", "6"]  # the second layout's first timed step
    ranks = run_on_ranks(_train, 2, tmp_path / "auto", [*AUTO, *traced], timeout=240)
    assert ranks[0]["chosen"] is not None and ranks[0]["chosen"] == ranks[1]["chosen"]
    assert ranks[0]["trials"] == ranks[0]["timed_steps"] == 16  # 4 layouts: a warm-up, 3 rounds
    assert ranks[0]["layouts_kept"] == 1
    trace = ranks[0]["trace"] or ranks[1]["trace"]
    passes = [event["args"] for event in trace["traceEvents"] if event["ph"] == "X"]
    # step 6 ran layout 1 (4 equal-cost slices): 2 ranks x 2 microbatches x 4 slices, F and B
    assert len(passes) == 32 and {args["slice"] for args in passes} == {0, 1, 2, 3}
    assert ranks[0]["num_slices"] == (4, 4, 8, 8)[ranks[0]["chosen"]]
    losses = next(rank["losses"] for rank in ranks if rank["losses"])
    assert len(losses) == 18
    torch.testing.assert_close(losses, single["losses"], rtol=1e-5, atol=0)
    broken = run_on_ranks(_train, 2, tmp_path / "ablation", AUTO, True, timeout=240)
    broken_losses = next(rank["losses"] for rank in broken if rank["losses"])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(broken_losses, single["losses"], rtol=1e-5, atol=0)
