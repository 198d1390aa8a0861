"""The `[checkpoint]` section's rules that read the file system: where the job writes, the
step it resumes from, what `initial_load_path` names (a Hugging Face folder or a pipekit
step, whole or model-only), and that the pipekit checkpoint it loads was written for its model
(`checkpoint_fit`), checked before any process group exists so that a bad path costs no
work."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from pipekit.checkpoint.dcp import COMPLETE_MARKER, CheckpointManager, holds_model_only
from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError
from pipekit.models.registry import get_model_spec
from pipekit.models.spec import ModelSpec
from pipekit.moe.bias_balance import ROUTER_BIAS_NAMES
from pipekit.train.checkpoint_fit import check_checkpoint_fits

__all__ = ["check_checkpoints", "is_pipekit_checkpoint", "step_to_resume"]


def is_pipekit_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete pipekit (DCP) checkpoint step, not a Hugging Face folder."""
    return (path / COMPLETE_MARKER).is_file()


def step_to_resume(config: JobConfig) -> int | None:
    """The step the job resumes from: `load_step`, else the newest training checkpoint in its
    folder; None when it does not resume."""
    checkpoint = config.checkpoint
    if not checkpoint.resume:
        return None
    folder = Path(config.job.output_dir) / checkpoint.folder
    return checkpoint.load_step or CheckpointManager(folder).latest_step()


def check_checkpoints(
    config: JobConfig, spec: ModelSpec, args: Any, check_files: bool, model: nn.Module
) -> None:
    """ConfigError for the first `[checkpoint]` rule broken: folders the job cannot write, a
    load_step without a complete checkpoint, an initial_load_path that is neither kind of
    checkpoint or cannot serve as asked, a Hugging Face key on a family without an adapter,
    a pipekit checkpoint to load that another model wrote (`model`: the job's, on meta)."""
    checkpoint = config.checkpoint
    if check_files:
        output = Path(config.job.output_dir)
        _check_writable("[job] output_dir", output)
        if checkpoint.enable:
            _check_writable("[checkpoint] folder", output / checkpoint.folder)
        if checkpoint.load_step:
            _check_load_step(output / checkpoint.folder, checkpoint.load_step)
    initial = checkpoint.initial_load_path
    pipekit_step = bool(initial) and is_pipekit_checkpoint(Path(initial))
    if pipekit_step and config.model.upcycle.enabled:
        raise ConfigError(
            f"[checkpoint] initial_load_path={initial!r} is a pipekit checkpoint; upcycling "
            "reads a dense Hugging Face checkpoint (export one with export_hf_at_end)"
        )
    hf_folder = bool(initial) and (Path(initial) / "config.json").is_file()
    if check_files and initial and not pipekit_step and not hf_folder:
        raise ConfigError(
            f"[checkpoint] initial_load_path={initial!r} has no config.json; point it at a "
            "Hugging Face checkpoint directory, or a pipekit checkpoint step (step-N)"
        )
    if initial and not checkpoint.initial_load_model_only:
        _check_whole_initial_load(Path(initial), pipekit_step, check_files)
    dense = get_model_spec(config.model.name)
    uses = {
        "[checkpoint] initial_load_path": (bool(initial) and not pipekit_step, dense),
        "[checkpoint] export_hf_at_end": (checkpoint.export_hf_at_end, spec),
    }
    for name, (used, family) in uses.items():
        if used and family.hf is None:
            raise ConfigError(
                f"{name}: model {family.name} has no Hugging Face layout adapter; turn it off "
                "(DCP checkpoints still save and resume)"
            )
    if checkpoint.export_hf_at_end and spec.hf is not None and spec.hf.check_layout is not None:
        try:
            spec.hf.check_layout(args)
        except ValueError as error:
            raise ConfigError(f"[checkpoint] export_hf_at_end: {error}") from None
    if check_files:
        _check_loaded_checkpoint_fits(config, model, pipekit_step)


def _check_loaded_checkpoint_fits(config: JobConfig, model: nn.Module, pipekit_step: bool) -> None:
    """The checkpoint the trainer will load first (the step it resumes from, else a pipekit
    initial_load_path) holds `model`'s entries, less those the load leaves as built."""
    checkpoint = config.checkpoint
    step = step_to_resume(config)
    if step is not None:
        path = CheckpointManager(Path(config.job.output_dir) / checkpoint.folder).path(step)
        excluded = checkpoint.exclude_from_loading
    elif pipekit_step:
        path = Path(checkpoint.initial_load_path)
        excluded = () if checkpoint.initial_load_model_only else checkpoint.exclude_from_loading
    else:
        return
    kept = ROUTER_BIAS_NAMES if "router_biases" in excluded else ()
    check_checkpoint_fits(config, model, path, resuming=step is not None, kept=kept)


def _check_whole_initial_load(initial: Path, pipekit_step: bool, check_files: bool) -> None:
    """initial_load_model_only = false takes a training state: only a pipekit step that is
    not a model-only save holds one."""
    if check_files and not pipekit_step:
        raise ConfigError(
            f"[checkpoint] initial_load_model_only = false loads a whole training state, and "
            f"{initial} is a Hugging Face folder (weights only); set it true, or name a "
            "pipekit step folder"
        )
    if pipekit_step and holds_model_only(initial):
        raise ConfigError(
            f"[checkpoint] initial_load_model_only = false loads a whole training state, and "
            f"{initial} is a model-only save; set it true, or name a training step"
        )


def _check_writable(key: str, folder: Path) -> None:
    """The job writes into `folder` (or creates it): refused now, not at the first save,
    after the steps before it are lost."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is a file, not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == folder else f"cannot be created in {existing}"
        raise ConfigError(
            f"{key}: {folder} {what}; choose a folder you can write to (or fix its permissions)"
        )


def _check_load_step(folder: Path, step: int) -> None:
    manager = CheckpointManager(folder)
    complete = manager.complete_steps()
    if step not in complete:
        raise ConfigError(
            f"[checkpoint] load_step={step}: {folder} has no complete checkpoint of that step; "
            f"complete steps: {complete or 'none'}"
        )
    if holds_model_only(manager.path(step)):
        raise ConfigError(
            f"[checkpoint] load_step={step} is a model-only save (last_save_model_only), "
            f"nothing to resume from; training steps: {manager.training_steps() or 'none'}"
        )
