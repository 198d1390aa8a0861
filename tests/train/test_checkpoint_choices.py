"""What a job saves and loads beyond the whole training state: a model-only last save in an
export dtype (what generation and a new job read; a resume skips it), a new job that goes
on with another job's whole training state from its step folder, and a checkpoint of another
model named as such before the job starts."""

import json
import os
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from pipekit.checkpoint.dcp import COMPLETE_MARKER, CheckpointManager
from pipekit.config import ConfigError, load_job_config
from pipekit.generate.load import load_for_generation
from pipekit.train.job import Job, validate_job
from pipekit.train.trainer import Trainer

BASE = [
    "--config", "configs/debug_model.toml", "--training.global_batch_size", "4",
    "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "1",
    "--parallelism.dp_shard", "1", "--metrics.log_interval", "1",
    "--metrics.peak_flops", "1e9", "--checkpoint.interval", "2",
]  # fmt: skip


def _job(output_dir, *overrides) -> Job:
    config = load_job_config([*BASE, "--job.output_dir", str(output_dir), *overrides])
    return validate_job(config, world_size=1)


def _trainer(output_dir, *overrides) -> Trainer:
    return Trainer(_job(output_dir, *overrides))


def _folder_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.suffix == ".distcp")


def test_a_model_only_last_save_holds_the_weights_alone_in_the_export_dtype(tmp_path):
    """Steps 2 and 4 saved, the last one model-only in bf16: its marker says so, it holds the
    model's entries alone as bf16 (about a sixth of the bytes of a training save: no AdamW
    states, half-width weights); generation reads it; a resume goes on from step 2, and naming
    step 4 to resume from is one line."""
    job = tmp_path / "job"
    options = ("--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype",
               "bfloat16", "--training.steps", "4")  # fmt: skip
    trained = _trainer(job, *options)
    trained.train()
    folder = job / "checkpoints"
    assert json.loads((folder / "step-4" / COMPLETE_MARKER).read_text())["model_only"] is True
    assert not json.loads((folder / "step-2" / COMPLETE_MARKER).read_text())["model_only"]
    entries = FileSystemReader(folder / "step-4").read_metadata().state_dict_metadata
    weights = trained.model.state_dict()
    assert set(entries) == {f"model_and_optimizer.model.{name}" for name in weights}
    assert {entry.properties.dtype for entry in entries.values()} == {torch.bfloat16}
    assert _folder_bytes(folder / "step-4") < 0.2 * _folder_bytes(folder / "step-2")

    model, _, _ = load_for_generation(folder / "step-4")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name].bfloat16().float()), name

    resumed = _trainer(job, *options)
    assert resumed.step == 2
    with pytest.raises(ConfigError, match=r"load_step=4 is a model-only save .* \[2\]"):
        _trainer(job, *options, "--checkpoint.load_step", "4")


def test_a_new_job_goes_on_with_another_jobs_whole_training_state(tmp_path):
    """initial_load_model_only = false: a job in a new folder started from step 2 of another
    trains steps 3 and 4 exactly as the other did (optimizer, data position, schedule and
    random states carried); the model alone (the default) does not. A Hugging Face folder or
    a model-only save cannot give a training state: one line each."""
    first = _trainer(tmp_path / "first", "--training.steps", "4")
    reference = first.train()
    step = tmp_path / "first" / "checkpoints" / "step-2"
    whole = _trainer(tmp_path / "whole", "--training.steps", "4",
                     "--checkpoint.initial_load_path", str(step),
                     "--checkpoint.initial_load_model_only", "false")  # fmt: skip
    assert whole.step == 2
    assert whole.train() == reference[2:]
    weights_only = _trainer(tmp_path / "weights", "--training.steps", "2",
                            "--checkpoint.initial_load_path", str(step))  # fmt: skip
    assert weights_only.step == 0 and weights_only.train() != reference[2:]

    first.export_hf(tmp_path / "hf")
    with pytest.raises(ConfigError, match="is a Hugging Face folder"):
        _trainer(tmp_path / "x", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                 "--checkpoint.initial_load_model_only", "false")  # fmt: skip
    _trainer(tmp_path / "m", "--training.steps", "2", "--checkpoint.last_save_model_only",
             "true").train()  # fmt: skip
    with pytest.raises(ConfigError, match="is a model-only save; set it true"):
        _trainer(tmp_path / "y",
                 "--checkpoint.initial_load_path", str(tmp_path / "m" / "checkpoints" / "step-2"),
                 "--checkpoint.initial_load_model_only", "false")  # fmt: skip
    with pytest.raises(ConfigError, match="export_dtype='int8' is not one of"):
        _trainer(tmp_path / "z", "--checkpoint.export_dtype", "int8")


def test_excluding_the_router_biases_leaves_balancing_to_start_over(tmp_path):
    """A bias-balanced MoE resumed with exclude_from_loading = ["router_biases"]: every
    router's bias is as built (zero) and every other entry as saved; without it, the biases
    are the saved, moved ones."""
    balanced = ("--config", "configs/debug_moe_balanced.toml", "--parallelism.ep", "1",
                "--parallelism.pipeline_parallel_degree", "1", "--training.steps", "2",
                "--checkpoint.resume", "true")  # fmt: skip
    first = _trainer(tmp_path, *balanced)
    first.train()
    saved = {name: tensor.clone() for name, tensor in first.model.state_dict().items()}
    biases = [name for name in saved if name.endswith(".expert_bias")]
    assert biases and all(saved[name].abs().sum() > 0 for name in biases)
    for excluded in ("router_biases", ""):
        resumed = _trainer(tmp_path, *balanced, "--checkpoint.exclude_from_loading", excluded)
        for name, tensor in resumed.model.state_dict().items():
            fresh = excluded and name in biases
            assert torch.equal(tensor, torch.zeros_like(tensor) if fresh else saved[name]), name


def _refusal(output_dir, *overrides) -> str:
    with pytest.raises(ConfigError) as error:
        _job(output_dir, *overrides)
    message = str(error.value)
    assert "is intact" in message and not re.search("corrupt|delete", message), message
    return message


def test_a_checkpoint_of_another_model_is_named_as_such_before_the_job_starts(tmp_path):
    """A llama job's step 2 in the folder: a job with another family or vocabulary is refused
    in one line naming the step, the [model] keys that changed (old -> new) and the entries
    that differ, with the fix, and nothing in the folder is touched; so is a new job that would
    start from it. A setting that keeps the state (the attention kernel) resumes. An older
    checkpoint without its own config.toml is explained by the folder's, unless that is newer
    than the checkpoint; one lacking an entry under the same settings (a layout that did not
    save it) is named too."""
    _trainer(tmp_path, "--training.steps", "2").train()
    step = tmp_path / "checkpoints" / "step-2"
    folder_config = (tmp_path / "config.toml").read_text()
    assert (step / "config.toml").read_text() == folder_config
    resumes = f"[checkpoint] {step} (the step this job resumes from) was written by a job with"
    message = _refusal(tmp_path, "--model.name", "qwen3")
    assert f"{resumes} a different model ([model] name: 'llama' -> 'qwen3')" in message
    assert "missing layers.0.attention.k_norm.weight" in message
    assert "another folder ([job] output_dir, or [checkpoint] folder)" in message
    assert "set [model] name = 'llama' again to resume it" in message
    message = _refusal(tmp_path, "--model.vocab_size", "300")
    assert "([model] vocab_size: 0 -> 300)" in message
    assert "other shapes for output.weight (saved (258, 128), wanted (300, 128))" in message
    assert (tmp_path / "config.toml").read_text() == folder_config
    assert _job(tmp_path, "--model.attention_backend", "cpu").config.model.name == "llama"
    initial = ("--checkpoint.initial_load_path", str(step), "--model.name", "qwen3")
    message = _refusal(tmp_path / "new", *initial)
    assert f"initial_load_path={str(step)!r} was written by a job with a different" in message

    (step / "config.toml").unlink()  # as pipekit wrote checkpoints before
    assert "name: 'llama' -> 'qwen3'" in _refusal(tmp_path, "--model.name", "qwen3")
    later = (step / COMPLETE_MARKER).stat().st_mtime + 60
    os.utime(tmp_path / "config.toml", (later, later))  # a job that started later saved nothing
    assert "no config.toml of the job that wrote it" in _refusal(tmp_path, "--model.name", "qwen3")

    trained = CheckpointManager(tmp_path / "checkpoints", job_config=folder_config)
    weights = _job(tmp_path).spec.build(_job(tmp_path).args).state_dict()
    del weights["output.weight"]
    trained.save(4, {"model_and_optimizer": {"model": weights}})
    message = _refusal(tmp_path)
    assert "does not fit this job's model (missing output.weight); the job that wrote it" in message
    assert "did not save those entries" in message
