"""A pipeline stage as a module: the model with the modules of other stages removed.

Top-level children of other stages are set to None and other keys of a ModuleDict/ModuleList
child are deleted, so a stage's state-dict names are the whole model's, and checkpoints,
Hugging Face adapters and `init_weights` work on a stage unchanged. Modules without parameters
or buffers (RoPE) are shared: every stage keeps them and no stage needs to name them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

__all__ = ["build_stage_module", "model_units", "validate_stage_module_names"]


def build_stage_module(
    model: nn.Module, module_names: Sequence[str], *, share_modules: bool = False
) -> nn.Module:
    """A copy of `model` that keeps only `module_names` (plus the shared stateless modules).

    Names are top-level children (an embedding, a norm, or a whole blocks container) or entries
    of a ModuleDict/ModuleList child ("<blocks>.3"). Build stages from a meta-device model,
    where the copy costs nothing, then `to_empty` and `init_weights` each stage. A ModuleList
    child becomes a ModuleDict keyed by the original indices, so state-dict names stay the full
    model's.

    `share_modules=True` copies only the containers: the stage holds `model`'s own submodules.
    A rank with several stages builds one module for all its stages and shares it out, so the
    optimizer, checkpoints and gradient clipping see one model with the full model's names.
    """
    kept = _expand(model, module_names, where="build_stage_module")
    _check_shared_parameters(model, kept)
    stage = _shallow_copy(model) if share_modules else copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            entries = {
                key: entry for key, entry in child.named_children() if f"{name}.{key}" in kept
            }
            setattr(stage, name, nn.ModuleDict(entries) if entries else None)
        elif name not in kept and _has_state(child):
            setattr(stage, name, None)
    return stage


def _shallow_copy(model: nn.Module) -> nn.Module:
    """A new module object of the same class whose registries (modules, parameters, hooks) are
    copies of `model`'s, so pruning or wrapping the copy leaves `model` untouched."""
    stage = object.__new__(type(model))  # not the class's __new__ (FSDP's re-runs __init__)
    stage.__dict__.update(
        {
            key: copy.copy(value) if isinstance(value, dict) else value
            for key, value in model.__dict__.items()
        }
    )
    return stage


def validate_stage_module_names(
    model: nn.Module,
    names_per_stage: Sequence[Sequence[str]],
    outside_stages: Sequence[str] = (),
) -> None:
    """Check that the stages hold every module of `model` once, with layers in model order;
    the modules named in `outside_stages` (vocabulary parallelism's) must be in none.

    Catches hand-written splits that would silently drop or duplicate weights or run layers out
    of order, before any process group or memory is spent on them.
    """
    if not names_per_stage:
        raise ValueError("names_per_stage is empty; give at least one stage")
    owner: dict[str, int] = {}
    for stage, names in enumerate(names_per_stage):
        units = _expand(model, names, where=f"stage {stage}")
        if not units:
            raise ValueError(
                f"stage {stage} holds no module with parameters (names {list(names)}); "
                "every stage needs at least one"
            )
        for unit in sorted(units):
            if unit in outside_stages:
                raise ValueError(
                    f"module {unit!r} is in stage {stage} but is split across the pipeline ranks "
                    "outside the stages (vocab_parallel); remove it from the stage's list"
                )
            if unit in owner:
                raise ValueError(f"module {unit!r} is in stage {owner[unit]} and stage {stage}")
            owner[unit] = stage
    placed = set(owner) | set(outside_stages)
    missing = [unit for unit in model_units(model) if unit not in placed]
    if missing:
        raise ValueError(f"modules {missing} are in no stage; add each to exactly one stage")
    for name, child in model.named_children():
        if not isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            continue
        previous = None
        for key, _ in child.named_children():
            unit = f"{name}.{key}"
            if previous is not None and owner[unit] < owner[previous]:
                raise ValueError(
                    f"{unit!r} is in stage {owner[unit]} but the earlier {previous!r} is in "
                    f"stage {owner[previous]}; stages must hold consecutive layers in model order"
                )
            previous = unit


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _name_table(model: nn.Module) -> dict[str, list[str]]:
    """Every name a stage may list -> the stateful modules ("units") it stands for."""
    table: dict[str, list[str]] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            entries = [f"{name}.{key}" for key, _ in child.named_children()]
            table[name] = entries
            table.update({entry: [entry] for entry in entries})
        else:
            table[name] = [name] if _has_state(child) else []
    return table


def model_units(model: nn.Module) -> list[str]:
    """The stateful modules of `model` in model order; each belongs to exactly one stage."""
    table = _name_table(model)
    return [unit for name, _ in model.named_children() for unit in table[name]]


def _expand(model: nn.Module, names: Sequence[str], where: str) -> set[str]:
    table = _name_table(model)
    unknown = [name for name in names if name not in table]
    if unknown:
        top_level = [name for name, _ in model.named_children()]
        containers = {
            name: _describe_keys([key for key, _ in child.named_children()])
            for name, child in model.named_children()
            if isinstance(child, (nn.ModuleDict, nn.ModuleList))
        }
        entries = "".join(
            f", or '{name}.<key>' with key in {keys}" for name, keys in containers.items()
        )
        raise ValueError(
            f"{where}: unknown module names {unknown}; valid names are {top_level}{entries}"
        )
    return {unit for name in names for unit in table[name]}


def _describe_keys(keys: list[str]) -> str:
    """'0..79' for consecutive integer keys (a big model's layers), else the list itself."""
    numbered = keys and all(key.isdigit() for key in keys)
    if numbered and [int(key) for key in keys] == list(range(int(keys[0]), int(keys[-1]) + 1)):
        return f"{keys[0]}..{keys[-1]}"
    return str(keys)


def _check_shared_parameters(model: nn.Module, kept: set[str]) -> None:
    """A parameter shared by a kept module and a dropped one (tied embeddings split across
    stages) would become two independent copies: refuse it."""
    owner: dict[int, str] = {}
    for unit in model_units(model):
        for param in model.get_submodule(unit).parameters():
            other = owner.setdefault(id(param), unit)
            if other != unit and (other in kept) != (unit in kept):
                held, dropped = (other, unit) if other in kept else (unit, other)
                raise ValueError(
                    f"{held!r} and {dropped!r} share a weight (tied embeddings) but would sit "
                    "in different pipeline stages; put both on one stage, untie them, or use "
                    "vocabulary parallelism (which splits both across the pipeline ranks)"
                )
