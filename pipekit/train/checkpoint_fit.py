"""Whether the checkpoint a job is about to load was written for its model, checked before any
process group exists: a job started in a folder that holds another model's checkpoints (another
family, flavor or vocabulary) is told so in one line, with the `[model]` keys that changed,
instead of failing inside the load and calling a good checkpoint corrupt.

What decides is the state: the checkpoint's model entries (names and global shapes, from its
metadata) against those of the job's model on the meta device. Settings that leave the state as
it is (the attention kernel, a RoPE model's longer `max_seq_len`, any parallel layout: DCP
reshards) never refuse a checkpoint. The `[model]` settings of the job that wrote it (the
`config.toml` every checkpoint holds; for older checkpoints, the output folder's, if it was
written before them) only explain the difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli
from torch import nn

from pipekit.checkpoint.dcp import COMPLETE_MARKER
from pipekit.checkpoint.state_fit import checkpoint_shapes, state_mismatch
from pipekit.config.dump import JOB_CONFIG_FILE
from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError, to_dict

__all__ = ["check_checkpoint_fits"]

_MODEL_ENTRIES = "model_and_optimizer.model."
"""How a job's checkpoint names its model's entries (the trainer's state key, then "model")."""

_STATE_FREE_KEYS = frozenset({"attention_backend"})
"""`[model]` keys that never change a model's state (left out of the keys a message lists)."""


def check_checkpoint_fits(
    config: JobConfig, model: nn.Module, path: Path, *, resuming: bool, kept: tuple[str, ...]
) -> None:
    """ConfigError unless the complete checkpoint `path` holds exactly the entries of `model`
    (the job's, on the meta device) with their shapes, less those ending in `kept` (left as
    built by the load); `resuming`: the job resumes from it, else it starts from it
    (initial_load_path)."""
    if resuming:
        named = f"[checkpoint] {path} (the step this job resumes from)"
        elsewhere = "train this model in another folder ([job] output_dir, or [checkpoint] folder)"
        other_step = "resume from another step ([checkpoint] load_step) or " + elsewhere
    else:
        named = f"[checkpoint] initial_load_path={str(path)!r}"
        elsewhere = other_step = "point initial_load_path at a checkpoint of this model"
    try:
        saved = checkpoint_shapes(path, _MODEL_ENTRIES)
    except Exception as error:  # the metadata file's own error, whatever it is
        raise ConfigError(
            f"{named} cannot be read ({type(error).__name__}: {error}): its .metadata file is "
            f"damaged or not a DCP checkpoint's; {other_step}"
        ) from None
    wanted = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    saved, wanted = ({n: s for n, s in d.items() if not n.endswith(kept)} for d in (saved, wanted))
    mismatch = state_mismatch(saved, wanted, unexpected=True)
    if not mismatch:
        return
    changed = _changed_model_keys(_writer_model_settings(config, path, resuming), config)
    use = "resume it" if resuming else "start from it"
    if changed:
        differ = ", ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changed.items())
        again = ", ".join(f"{name} = {old!r}" for name, (old, _) in changed.items())
        raise ConfigError(
            f"{named} was written by a job with a different model ([model] {differ}), so it "
            f"does not fit this one ({mismatch.describe()}); the checkpoint is intact: "
            f"{elsewhere}, or set [model] {again} again to {use}"
        )
    why = (
        "the job that wrote it had the same [model] settings, so the model's code has changed "
        "since, or the layout that wrote it did not save those entries"
        if changed is not None
        else f"no {JOB_CONFIG_FILE} of the job that wrote it says which [model] settings did"
    )
    raise ConfigError(
        f"{named} does not fit this job's model ({mismatch.describe()}); {why}; the checkpoint "
        f"is intact: {elsewhere}, or {use} with the model and code that wrote it"
    )


def _writer_model_settings(
    config: JobConfig, path: Path, resuming: bool
) -> Mapping[str, Any] | None:
    """The `[model]` table of the job that wrote `path`: its own `config.toml`; for a
    checkpoint without one (older pipekit) that this job resumes, the output folder's, if
    written before the checkpoint was completed (every job rewrites it when it starts, so a
    newer one may be a job that saved nothing). None where neither can be read."""
    written = path / JOB_CONFIG_FILE
    if not written.is_file() and resuming:
        folder_config = Path(config.job.output_dir) / JOB_CONFIG_FILE
        marker = path / COMPLETE_MARKER
        if folder_config.is_file() and folder_config.stat().st_mtime <= marker.stat().st_mtime:
            written = folder_config
    try:
        table = tomli.loads(written.read_text()).get("model")
    except (OSError, tomli.TOMLDecodeError):
        return None
    return table if isinstance(table, dict) else None


def _changed_model_keys(
    writer: Mapping[str, Any] | None, config: JobConfig
) -> dict[str, tuple[Any, Any]] | None:
    """`[model]` keys (sub-sections dotted: upcycle.num_experts) whose value differs between
    the writer's settings and this job's (keys the writer's pipekit did not have left out):
    (old, new) by key; None without the writer's."""
    if writer is None:
        return None
    old, new = _flat(writer), _flat(to_dict(config)["model"])
    return {
        name: (old[name], value)
        for name, value in new.items()
        if name in old and name not in _STATE_FREE_KEYS and old[name] != value
    }


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in table.items():
        if isinstance(value, Mapping):
            flat |= _flat(value, f"{prefix}{name}.")
        else:
            flat[f"{prefix}{name}"] = value
    return flat
