"""The registry of model families: built-in ones and users' alike, found by name.

A family registers one `ModelSpec`, in either of two ways, without editing pipekit:
- an installed package declares an entry point in the group `pipekit.models` whose object is
  the spec (pipekit's own families do this in its pyproject.toml), found at the first lookup;
- any module calls `register_model(spec)` when imported; a job names that module in
  `[model] module = "my_pkg.my_model"` (or `--model.module`), which is imported before the
  model is looked up.

Explicit registrations win over entry points of the same name; registering another spec under a
taken name needs `replace=True`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pipekit.models.spec import ModelSpec
from pipekit.models.upcycling import UpcycleSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "get_model_spec",
    "import_model_module",
    "known_models",
    "register_model",
    "resolve_model",
    "spec_for_checkpoint",
    "spec_for_hf_model_type",
]

ENTRY_POINT_GROUP = "pipekit.models"

_MODELS: dict[str, ModelSpec] = {}
_entry_points_loaded = False


def register_model(spec: ModelSpec, *, replace: bool = False) -> None:
    """Make `spec` findable by `spec.name`."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_model takes a pipekit.models.ModelSpec, not {type(spec)}")
    current = _MODELS.get(spec.name)
    if current is not None and current is not spec and not replace:
        raise ValueError(
            f"a model named {spec.name!r} is already registered; pick another name or pass "
            "replace=True"
        )
    _MODELS[spec.name] = spec


def _load_entry_points() -> None:
    """Register every installed family declared under `ENTRY_POINT_GROUP` (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _MODELS:  # registered explicitly: that one wins
            continue
        spec = entry.load()
        if not isinstance(spec, ModelSpec) or spec.name != entry.name:
            raise TypeError(
                f"entry point {entry.name!r} = {entry.value!r} of group {ENTRY_POINT_GROUP!r} "
                f"must be a ModelSpec named {entry.name!r}"
            )
        _MODELS[spec.name] = spec


def known_models() -> list[str]:
    """Every registered family's name (entry points included), sorted."""
    _load_entry_points()
    return sorted(_MODELS)


def get_model_spec(name: str) -> ModelSpec:
    """The registered family `name`, with an error listing the known ones."""
    _load_entry_points()
    if name not in _MODELS:
        raise ValueError(
            f"unknown model {name!r}; known models: {sorted(_MODELS)} (a model of your own: "
            "register it and name its module in [model] module)"
        )
    return _MODELS[name]


def spec_for_checkpoint(directory: str | os.PathLike[str]) -> ModelSpec:
    """The family whose Hugging Face adapter reads the checkpoint in `directory` (by its
    config.json's `model_type`)."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(
            f"cannot read the model_type of {path} ({error}); point at a Hugging Face "
            "checkpoint directory"
        ) from None
    return spec_for_hf_model_type(str(model_type))


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The family whose Hugging Face adapter reads config.json's `model_type`."""
    _load_entry_points()
    for spec in _MODELS.values():
        if spec.hf is not None and model_type in spec.hf.model_types:
            return spec
    readable = sorted(t for spec in _MODELS.values() if spec.hf for t in spec.hf.model_types)
    raise ValueError(
        f"model_type={model_type!r}: no registered family reads it; pipekit reads {readable}"
    )


def import_model_module(module_name: str) -> None:
    """Import the module that registers a model (`[model] module`); a clear error if it is not
    importable."""
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"[model] module={module_name!r} cannot be imported ({error}); give a module on "
            "the Python path (e.g. run from the folder that holds its package)"
        ) from None


def resolve_model(
    name: str, flavor: str, upcycle: UpcycleSpec | None = None, vocab_size: int = 0
) -> tuple[ModelSpec, Any]:
    """The family and args a job builds: `name`'s `flavor` (with `vocab_size` rows when not
    0), or the MoE `upcycle` makes of it."""
    spec = get_model_spec(name)
    args = spec.flavor(flavor)
    if vocab_size:
        fields = {field.name for field in dataclasses.fields(args)}
        if "vocab_size" not in fields:
            raise ValueError(
                f"vocab_size={vocab_size}: model {name!r}'s args ({type(args).__name__}) have "
                "no vocab_size field; leave vocab_size = 0 or add the field to the family"
            )
        args = dataclasses.replace(args, vocab_size=vocab_size)
    if upcycle is None:
        return spec, args
    if spec.upcycler is None:
        dense = sorted(known for known, candidate in _MODELS.items() if candidate.upcycler)
        raise ValueError(f"model {name!r} cannot be upcycled; upcycle one of {dense}")
    return get_model_spec(spec.upcycler.moe_model), spec.upcycler.moe_args(args, upcycle)
