"""The Trainer as a whole: data-parallel layouts and gradient accumulation reproduce the
single-process losses step for step (float32, same global batch), plus initial load from a
Hugging Face checkpoint, export, activation checkpointing, the non-finite-loss stop, and a
mixing job stopped by SIGTERM and resumed."""

import math
import os
import shutil
import signal

import pytest
import torch

import pipekit.train.model_setup as model_setup
from pipekit.config import ConfigError, load_job_config
from pipekit.families.llama.hf import build_llama_from_hf, save_hf_llama
from pipekit.testing import run_on_ranks
from pipekit.train.data import stdlib_files
from pipekit.train.job import validate_job
from pipekit.train.trainer import NonFiniteLossError, Trainer

STEPS = 3
BASE = [
    "--config", "configs/debug_model.toml",
    "--training.steps", str(STEPS), "--training.global_batch_size", "4",
    "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "1",
    "--checkpoint.enable", "false", "--checkpoint.resume", "false",
    "--metrics.log_interval", "1", "--metrics.peak_flops", "1e9",
]  # fmt: skip


def _config(output_dir, *overrides, world_size=1):
    config = load_job_config([*BASE, "--job.output_dir", str(output_dir), *overrides])
    return validate_job(config, world_size=world_size)


def _losses_on_ranks(rank, world_size, output_dir, overrides):
    return Trainer(_config(output_dir, *overrides, world_size=world_size)).train()


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("single")
    return Trainer(_config(output_dir, "--parallelism.dp_shard", "1")).train()


@pytest.mark.parametrize(
    "layout",
    [
        ("--parallelism.dp_shard", "2"),
        ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"),
    ],
    ids=["dp_shard=2", "dp_replicate=2"],
)
def test_data_parallel_losses_equal_single_process(tmp_path, single_process_losses, layout):
    per_rank = run_on_ranks(_losses_on_ranks, 2, tmp_path, layout, timeout=120)
    assert per_rank[0] == per_rank[1]
    torch.testing.assert_close(per_rank[0], single_process_losses, rtol=1e-5, atol=0)


def test_mean_reduction_breaks_data_parallel_parity(tmp_path, single_process_losses, monkeypatch):
    """Ablation: FSDP's default mean reduction with the global-token loss halves the gradients."""
    real_apply = model_setup.apply_data_parallel
    monkeypatch.setattr(
        model_setup,
        "apply_data_parallel",
        lambda *args, **kwargs: real_apply(*args, **kwargs, sum_gradients=False),
    )
    per_rank = run_on_ranks(_losses_on_ranks, 2, tmp_path, ("--parallelism.dp_shard", "2"))
    assert abs(per_rank[0][0] - single_process_losses[0]) < 1e-5  # step 1 sees no update yet
    assert abs(per_rank[0][-1] - single_process_losses[-1]) > 1e-4


def test_gradient_accumulation_equals_full_batch(tmp_path, single_process_losses):
    accumulated = Trainer(
        _config(
            tmp_path, "--parallelism.dp_shard", "1", "--training.gradient_accumulation_steps", "2"
        )
    ).train()
    torch.testing.assert_close(accumulated, single_process_losses, rtol=1e-5, atol=0)


def test_full_activation_checkpointing_keeps_the_losses(tmp_path, single_process_losses):
    recomputed = Trainer(
        _config(tmp_path, "--parallelism.dp_shard", "1", "--training.activation_checkpoint", "full")
    ).train()
    torch.testing.assert_close(recomputed, single_process_losses, rtol=1e-6, atol=0)


def test_initial_load_from_hugging_face_and_export(tmp_path):
    source = Trainer(_config(tmp_path / "a", "--parallelism.dp_shard", "1"))
    save_hf_llama(source.model, source.job.args, tmp_path / "hf")
    loaded = Trainer(
        _config(
            tmp_path / "b", "--parallelism.dp_shard", "1",
            "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--job.seed", "7",
            "--checkpoint.export_hf_at_end", "true",
        )
    )  # fmt: skip
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    loaded.train()
    exported, _ = build_llama_from_hf(tmp_path / "b" / "hf")
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_non_finite_loss_stops_before_the_update_and_saves_nothing(tmp_path, monkeypatch):
    config = _config(tmp_path, "--parallelism.dp_shard", "1", "--checkpoint.enable", "true",
                     "--checkpoint.interval", "1")  # fmt: skip
    trainer = Trainer(config)
    monkeypatch.setattr(
        trainer, "_loss_fn", lambda logits, labels, count: logits.sum() * float("nan")
    )
    weights_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 1"):
        trainer.train()
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, weights_before[name]), name


def test_skip_step_leaves_the_weights_and_training_goes_on(tmp_path, monkeypatch):
    """With on_nonfinite = "skip_step", a step whose loss is NaN (the second here) changes no
    weight and no optimizer state, is counted, and the next step trains; a non-finite gradient
    norm with a finite loss is named with the parameters it came from."""
    trainer = Trainer(_config(tmp_path, "--parallelism.dp_shard", "1",
                              "--training.on_nonfinite", "skip_step"))  # fmt: skip
    loss_fn, calls = trainer._loss_fn, []

    def second_step_nan(logits, labels, count):
        calls.append(1)
        loss = loss_fn(logits, labels, count)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(trainer, "_loss_fn", second_step_nan)
    trainer.train_step()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    loss, grad_norm, _ = trainer.train_step()
    assert math.isnan(loss) and math.isnan(grad_norm) and trainer.step == 2
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    loss, _, _ = trainer.train_step()
    assert math.isfinite(loss)
    assert any(not torch.equal(t, weights[k]) for k, t in trainer.model.state_dict().items())

    stopping = Trainer(_config(tmp_path / "stop", "--parallelism.dp_shard", "1"))
    first = next(stopping.model.parameters())
    first.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(NonFiniteLossError, match=r"gradient norm is (inf|nan) \(rank 0: "):
        stopping.train_step()


def test_exclude_from_loading_leaves_those_parts_fresh(tmp_path):
    """A resume loads the model always; `optimizer` leaves the optimizer's states empty,
    `progress` and `data` start the step counter and the loader over; unknown parts are one
    line before launch."""
    saving = ("--parallelism.dp_shard", "1", "--checkpoint.enable", "true",
              "--checkpoint.interval", "2", "--checkpoint.resume", "true")  # fmt: skip
    first = Trainer(_config(tmp_path, *saving, "--training.steps", "2"))
    first.train()
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}

    cases = {
        "optimizer": lambda t: not t.optimizer.state and t.step == 2,
        "progress;data": lambda t: bool(t.optimizer.state) and t.step == 0 and t.data.step == 0,
    }
    for parts, expected in cases.items():
        resumed = Trainer(_config(tmp_path, *saving, "--checkpoint.exclude_from_loading", parts))
        for name, tensor in resumed.model.state_dict().items():
            assert torch.equal(tensor, saved[name]), (parts, name)
        assert expected(resumed), parts
    with pytest.raises(ConfigError, match=r"exclude_from_loading names \['model'\]"):
        _config(tmp_path, "--checkpoint.exclude_from_loading", "model")


def test_a_mixing_job_stopped_by_sigterm_resumes_to_the_uninterrupted_losses(tmp_path):
    """Two corpora mixed 1:3: a job stopped by SIGTERM after step 2 saves, and the same
    command resumes it to the uninterrupted run's losses bit for bit (the mixture's position
    travels in the checkpoint)."""
    for name, files in (("a.txt", stdlib_files()[:6]), ("b.txt", stdlib_files()[6:12])):
        (tmp_path / name).write_text("".join(path.read_text(errors="replace") for path in files))
    mixing = ("--parallelism.dp_shard", "1", "--training.steps", "4", "--checkpoint.enable",
              "true", "--checkpoint.interval", "10", "--checkpoint.resume", "true",
              "--data.mix_sources", f"{tmp_path / 'a.txt'};{tmp_path / 'b.txt'}",
              "--data.mix_weights", "1;3")  # fmt: skip
    reference = Trainer(_config(tmp_path / "reference", *mixing)).train()
    stopped = Trainer(_config(tmp_path / "stopped", *mixing))
    step = stopped.train_step

    def step_then_stop_after_two() -> tuple[float, float, int]:
        taken = step()
        if stopped.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return taken

    stopped.train_step = step_then_stop_after_two
    assert stopped.train() == reference[:2]
    shutil.copytree(tmp_path / "stopped", tmp_path / "restarted")
    assert Trainer(_config(tmp_path / "stopped", *mixing)).train() == reference[2:]
    # ablation: the loader starting over gives other batches, so other losses
    restart = ("--checkpoint.exclude_from_loading", "data")
    assert Trainer(_config(tmp_path / "restarted", *mixing, *restart)).train() != reference[2:]


def test_initial_load_from_a_pipekit_checkpoint_starts_a_new_run_from_its_weights(tmp_path):
    """`initial_load_path` naming another job's step folder: the new job (its own folder)
    starts at step 0 with that model's weights and a fresh optimizer, data and schedule."""
    first = Trainer(_config(tmp_path / "pretrain", "--parallelism.dp_shard", "1",
                            "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                            "--training.steps", "2"))  # fmt: skip
    first.train()
    step = tmp_path / "pretrain" / "checkpoints" / "step-2"
    tuned = Trainer(_config(tmp_path / "tune", "--parallelism.dp_shard", "1",
                            "--checkpoint.initial_load_path", str(step)))  # fmt: skip
    for name, tensor in tuned.model.state_dict().items():
        assert torch.equal(tensor, first.model.state_dict()[name]), name
    assert tuned.step == 0 and tuned.data.step == 0 and not tuned.optimizer.state
    assert math.isfinite(tuned.train_step()[0])


def test_low_bit_adamw_from_torchao_trains(tmp_path):
    losses = Trainer(
        _config(tmp_path, "--parallelism.dp_shard", "1", "--optimizer.name", "AdamW8bit")
    ).train()
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize(
    ("world_size", "layout"),
    [
        (1, ("--parallelism.dp_shard", "1")),
        (2, ("--parallelism.dp_shard", "2")),
        (2, ("--parallelism.dp_shard", "1", "--parallelism.pipeline_parallel_degree", "2")),
        (4, ("--parallelism.dp_shard", "2", "--parallelism.pipeline_parallel_degree", "2")),
    ],
    ids=["autocast", "fsdp", "sliced pipeline", "sliced pipeline x fsdp"],
)
def test_bfloat16_mixed_precision_tracks_float32(
    tmp_path, single_process_losses, world_size, layout
):
    """bf16 compute with float32 weights and reductions: autocast on one process, FSDP2's
    mixed precision otherwise (over one rank for a pipeline without data parallelism), the
    pipeline's stages sending bf16."""
    overrides = ("--training.mixed_precision_param", "bfloat16", *layout)
    per_rank = run_on_ranks(_losses_on_ranks, world_size, tmp_path, overrides, timeout=180)
    losses = next(losses for losses in per_rank if losses)  # the pipeline's last stage logs
    torch.testing.assert_close(losses, single_process_losses, rtol=2e-2, atol=0)
    assert losses != single_process_losses  # bfloat16 compute really happened
