"""What surrounds a training job: metric writers (JSONL, TensorBoard, W&B) that never repeat a
step after a resume, the console line, graceful stops on SIGTERM/SIGINT (with synchronous and
asynchronous saves), `checkpoint.load_step`, `pipekit.tools.plot` (curves and compare),
profiled pipeline steps, and validation loss under the sliced pipeline and FSDP."""

import importlib.machinery
import json
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pipekit.train.trainer as trainer_module
from pipekit.config import ConfigError, load_job_config
from pipekit.testing import run_on_ranks
from pipekit.tools import plot
from pipekit.train.job import validate_job
from pipekit.train.metric_writers import JsonlWriter, read_jsonl_rows
from pipekit.train.metrics import console_line
from pipekit.train.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]

STEPS = 4
BASE = [
    "--config", "configs/debug_model.toml",
    "--training.steps", str(STEPS), "--training.global_batch_size", "2",
    "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "1",
    "--checkpoint.interval", "2", "--checkpoint.keep_last", "0",
    "--metrics.log_interval", "1", "--metrics.peak_flops", "1e9",
    "--parallelism.dp_shard", "1",
]  # fmt: skip


def _trainer(output_dir, *overrides):
    config = load_job_config([*BASE, "--job.output_dir", str(output_dir), *overrides])
    return Trainer(validate_job(config, world_size=1))


def _tensorboard_losses(output_dir):
    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars("train/loss")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four steps with checkpoints at 2 and 4, logged to JSONL and TensorBoard."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    losses = _trainer(output_dir, "--metrics.tensorboard", "true").train()
    return output_dir, losses


def test_tensorboard_events_hold_the_logged_losses(uninterrupted):
    output_dir, losses = uninterrupted
    rows = read_jsonl_rows(output_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["loss"] for row in rows] == losses
    tensorboard = _tensorboard_losses(output_dir)
    assert sorted(tensorboard) == [1, 2, 3, 4]
    for step, loss in tensorboard.items():
        assert loss == pytest.approx(losses[step - 1], rel=1e-6)  # events store float32


def test_resuming_an_earlier_step_supersedes_the_rows_after_it(uninterrupted, tmp_path):
    """load_step=2 redoes steps 3 and 4: each logged step appears once, with the new values."""
    output_dir, losses = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(output_dir, copy)
    resumed = _trainer(copy, "--metrics.tensorboard", "true", "--checkpoint.load_step", "2")
    assert resumed.step == 2
    redone = resumed.train()
    assert redone == losses[2:]
    rows = read_jsonl_rows(copy / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert sorted(_tensorboard_losses(copy)) == [1, 2, 3, 4]


def test_jsonl_writer_drops_rows_after_the_start_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3)))
    JsonlWriter(path, start_step=2).write({"step": 3, "loss": 30.0})
    assert read_jsonl_rows(path) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 30.0},
    ]
    JsonlWriter(path, start_step=0)  # a fresh start keeps nothing of an earlier run
    assert read_jsonl_rows(path) == []


def test_a_torn_last_row_does_not_block_a_resume_but_a_bad_middle_row_does(tmp_path):
    """A kill while a row is written leaves half a line: the resuming writer drops it; a bad
    row before others is not a kill's and stays an error naming its line."""
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2))
    path.write_text(rows + '{"step": 3, "lo')
    JsonlWriter(path, start_step=2)
    assert read_jsonl_rows(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    path.write_text('{"step": 1, "lo\n' + rows)
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a JSON object"):
        JsonlWriter(path, start_step=2)


def test_console_line_shows_throughput_mfu_memory_and_eta():
    record = {
        "step": 10, "loss": 3.21456, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 8000.0,
        "tokens_per_s_per_device": 2000.0, "step_time_s": 1.5, "mfu": 0.123,
        "peak_rss_gib": 1.5,
    }  # fmt: skip
    line = console_line(record, total_steps=100)
    assert line == (
        "step 10/100  loss 3.2146  grad_norm 0.5  lr 0.001  tokens/s/device 2000  mfu 12.30%  "
        "memory 1.50 GiB  eta 2m15s"
    )


def test_wandb_writer_logs_offline_and_resumes_the_same_run(tmp_path, monkeypatch):
    """W&B is optional and not installed for the tests: a recording stand-in checks the calls."""
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values["train/loss"]))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["id"], kwargs["mode"], kwargs["resume"]))
        return Run()

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", loader=None)
    wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    trainer = _trainer(tmp_path, "--metrics.wandb", "true", "--training.steps", "2")
    losses = trainer.train()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert calls == [
        ("init", run_id, "offline", "allow"),
        ("log", 1, losses[0]),
        ("log", 2, losses[1]),
        ("finish",),
    ]
    _trainer(tmp_path, "--metrics.wandb", "true", "--training.steps", "3")
    assert calls[-1] == ("init", run_id, "offline", "allow")


@pytest.mark.parametrize(
    ("stop_signal", "async_save"), [(signal.SIGTERM, "true"), (signal.SIGINT, "false")]
)
def test_a_stop_signal_ends_the_step_saves_and_resumes_exactly(
    uninterrupted, tmp_path, monkeypatch, stop_signal, async_save
):
    """The checkpoint of the last step is published before the job returns, written in the
    background or not."""
    _, losses = uninterrupted
    real_step = trainer_module.Trainer.train_step

    def step_then_signal(self):
        result = real_step(self)
        if self.step == 1:  # arrives mid-run, while the next step's work is still ahead
            signal.raise_signal(stop_signal)
        return result

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step_then_signal)
    stopped = _trainer(tmp_path, "--checkpoint.async_save", async_save).train()
    assert stopped == losses[:1]
    assert (tmp_path / "checkpoints" / "step-1" / "COMPLETE").is_file()
    assert signal.getsignal(stop_signal) is not None  # handlers are put back
    monkeypatch.setattr(trainer_module.Trainer, "train_step", real_step)
    resumed = _trainer(tmp_path)
    assert resumed.step == 1
    assert resumed.train() == losses[1:]


def test_a_missing_writer_package_is_named_before_the_job_starts(tmp_path):
    """W&B is not installed for the tests: asking for it is refused up front."""
    with pytest.raises(ConfigError, match=r"wandb = true needs the wandb package; pip install"):
        _trainer(tmp_path, "--metrics.wandb", "true")


def test_load_step_must_name_a_complete_checkpoint(uninterrupted, tmp_path):
    output_dir, _ = uninterrupted
    with pytest.raises(Exception, match=r"load_step=3: .* complete steps: \[2, 4\]"):
        _trainer(output_dir, "--checkpoint.load_step", "3")
    with pytest.raises(Exception, match="needs resume = true"):
        _trainer(tmp_path, "--checkpoint.load_step", "2", "--checkpoint.resume", "false")


def test_plot_draws_two_runs_and_compare_prints_the_largest_difference(
    uninterrupted, tmp_path, capsys
):
    output_dir, _ = uninterrupted
    shifted = tmp_path / "shifted.jsonl"
    rows = read_jsonl_rows(output_dir / "metrics.jsonl")
    rows[2]["loss"] += 0.25
    shifted.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "curves.png"
    assert plot.main([str(output_dir), str(shifted), "--out", str(out), "--labels", "a", "b"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert plot.main(["compare", str(output_dir), str(shifted)]) == 0
    result = capsys.readouterr().out.strip().splitlines()[-1]
    assert result == "RESULT max_difference=0.25 at_step=3 common_steps=4"
    assert plot.main(["compare", str(output_dir), str(shifted), "--tolerance", "0.1"]) == 1
    assert plot.main(["compare", str(output_dir), str(output_dir), "--tolerance", "0"]) == 0
    assert plot.main(["compare", str(output_dir), str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


PROFILED_PIPELINE = [
    "--config", "configs/debug_sliced_pp.toml",
    "--training.steps", "2", "--training.global_batch_size", "4",
    "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1",
    "--parallelism.microbatches", "2", "--parallelism.num_slices", "2",
    "--checkpoint.enable", "false", "--metrics.peak_flops", "1e9",
    "--profiling.steps", "2", "--profiling.memory", "true",
]  # fmt: skip


def _profiled_pipeline_rank(rank, world_size, output_dir):
    config = load_job_config([*PROFILED_PIPELINE, "--job.output_dir", str(output_dir)])
    trainer = Trainer(validate_job(config, world_size=world_size))
    trainer.train()
    schedule = trainer.pipeline.schedule
    return [str(action) for action in schedule.pipeline_order[rank]], trainer.pipeline.num_slices


def test_a_profiled_sliced_pipeline_step_names_every_scheduled_action_once(tmp_path):
    per_rank = run_on_ranks(_profiled_pipeline_rank, 2, tmp_path, timeout=180)
    folder = tmp_path / "profile_traces" / "step-2"
    for rank, (scheduled, num_slices) in enumerate(per_rank):
        trace = json.loads((folder / f"rank{rank}_trace.json").read_text())
        names = [event["name"] for event in trace["traceEvents"] if "name" in event]
        pipekit_actions = [name for name in names if name.startswith("pipekit: ")]
        expected = []
        for action in scheduled:  # "0F3": stage 0, forward of unit 3 (microbatch 1, slice 1)
            stage, kind, unit = re.fullmatch(r"(\d+)([FBIW])(\d+)", action).groups()
            microbatch, slice_index = divmod(int(unit), num_slices)
            expected.append(
                f"pipekit: {kind} stage {stage} microbatch {microbatch} slice {slice_index}"
            )
        assert len(expected) == 2 * 2 * 2  # F and B of 2 microbatches x 2 slices
        assert sorted(pipekit_actions) == sorted(expected)
        assert {f"PP:{action}" for action in scheduled} <= set(names)  # torch's own names

        memory = json.loads((folder / f"rank{rank}_memory.json").read_text())["traceEvents"]
        activations = [e["args"] for e in memory if e["name"] == "activation memory (MiB)"]
        assert max(sample["kv_cache"] for sample in activations) > 0
        assert max(sample["saved"] for sample in activations) > 0
        assert activations[-1]["saved"] == 0  # every saved tensor freed by the step's end
        assert all(e["args"]["rss"] > 0 for e in memory if e["name"] == "rss (MiB)")
    assert not (tmp_path / "profile_traces" / "step-1").exists()  # only the named step


VALIDATED = [
    "--training.steps", "4", "--training.global_batch_size", "4", "--training.seq_len", "64",
    "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "false",
    "--metrics.log_interval", "1", "--metrics.peak_flops", "1e9",
    "--validation.enable", "true", "--validation.interval", "2", "--validation.steps", "2",
]  # fmt: skip
SLICED_PIPELINE = [
    "--config", "configs/debug_sliced_pp.toml",
    "--parallelism.microbatches", "2", "--parallelism.num_slices", "2",
]  # fmt: skip


def _validated_run(output_dir, argv, world_size=1):
    config = load_job_config([*argv, *VALIDATED, "--job.output_dir", str(output_dir)])
    losses = Trainer(validate_job(config, world_size=world_size)).train()
    rows = read_jsonl_rows(output_dir / "metrics.jsonl")
    return losses, {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}


def _validated_pipeline_rank(rank, world_size, output_dir, drop_gradients):
    if not drop_gradients:  # ablation: the pipeline's validation gradients reach the update
        real = trainer_module.Trainer.validation_loss

        def keeping_gradients(self):
            zero_grad, self.optimizer.zero_grad = self.optimizer.zero_grad, lambda **_: None
            try:
                return real(self)
            finally:
                self.optimizer.zero_grad = zero_grad

        trainer_module.Trainer.validation_loss = keeping_gradients
    return _validated_run(output_dir, SLICED_PIPELINE, world_size)


def _validated_fsdp_rank(rank, world_size, output_dir):
    return _validated_run(output_dir, ["--config", "configs/debug_model.toml"], world_size)


def test_validation_loss_of_the_sliced_pipeline_equals_one_process_and_leaves_training(tmp_path):
    """Held-out rows, evaluated at steps 2 and 4: the pipeline (which runs its training
    schedule and drops the gradients) and FSDP over 2 ranks give one process's val_loss, and
    the pipeline its training losses; kept, its validation gradients would change the steps
    after it."""
    single = ["--config", "configs/debug_model.toml", "--parallelism.dp_shard", "1"]
    losses, validation = _validated_run(tmp_path / "single", single)
    assert sorted(validation) == [2, 4]
    assert validation[4] < validation[2]
    piped = run_on_ranks(_validated_pipeline_rank, 2, tmp_path / "pipeline", True, timeout=180)
    piped_losses, piped_validation = piped[0]
    assert piped_losses == pytest.approx(losses, rel=1e-5)
    assert piped_validation == pytest.approx(validation, rel=1e-5)
    sharded = run_on_ranks(_validated_fsdp_rank, 2, tmp_path / "fsdp", timeout=180)
    assert sharded[0][1] == pytest.approx(validation, rel=1e-5)  # forward only, no gradients
    leaked = run_on_ranks(_validated_pipeline_rank, 2, tmp_path / "leaked", False, timeout=180)
    leaked_losses = leaked[0][0]
    assert leaked_losses[:2] == pytest.approx(losses[:2], rel=1e-5)
    assert abs(leaked_losses[3] - losses[3]) > 1e-4


_HOLD_LOCK = (
    "import sys; from pipekit.train.output_lock import lock_output_dir; "
    "lock_output_dir(sys.argv[1]); print('locked', flush=True); sys.stdin.read()"
)


def test_a_second_job_on_a_folder_in_use_is_refused_before_it_touches_it(tmp_path):
    """While a job holds the output folder, train.py on it exits 2 with one line naming the
    holder and writes nothing there; once the holder ends (the OS drops its lock, even on a
    kill), the folder is free again."""
    output = tmp_path / "job"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(output)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    config = str(REPO_ROOT / "configs" / "debug_model.toml")
    second = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "--config", config,
         "--job.output_dir", str(output)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert "is in use by a running job (pid" in lines[0]
    assert sorted(path.name for path in output.iterdir()) == [".pipekit.lock"]
    holder.kill()
    holder.wait()
    again = subprocess.run(
        [sys.executable, "-c", _HOLD_LOCK, str(output)],
        input="", capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert again.returncode == 0 and again.stdout.strip() == "locked", again.stderr


def test_learning_rate_schedules_warm_up_hold_and_decay_to_the_floor():
    """Warm-up ramps to the peak; cosine and linear decay over the rest to the floor; with
    decay_ratio (warmup-stable-decay) the peak holds until the last fifth, then decays."""
    from pipekit.config.job_config import LRSchedulerConfig
    from pipekit.train.lr_schedule import lr_multiplier

    def rates(**options) -> list[float]:
        config = LRSchedulerConfig(warmup_steps=4, min_lr_ratio=0.1, **options)
        return [lr_multiplier(step, 100, config) for step in range(100)]

    cosine, linear = rates(), rates(decay_type="linear")
    wsd = rates(decay_type="linear", decay_ratio=0.2)
    for schedule in (cosine, linear, wsd):
        assert schedule[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]
        assert schedule[-1] == pytest.approx(0.1)
    assert 0.1 < cosine[50] < 1.0 and linear[50] == pytest.approx(1 - 0.9 * 46 / 95)
    assert wsd[4:80] == [1.0] * 76 and wsd[80] == 1.0 and 0.1 < wsd[90] < 1.0
    assert rates(decay_type="constant")[4:] == [1.0] * 96
    with pytest.raises(ConfigError, match=r"decay_ratio=1.5 must be in \[0, 1\]"):
        validate_job(load_job_config(["--lr_scheduler.decay_ratio", "1.5"]), 1, check_files=False)
