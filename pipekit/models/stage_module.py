"""A pipeline stage as a module: the model with the modules of other stages removed.

Top-level children a stage does not name are set to None and other keys of a
ModuleDict/ModuleList child are deleted, so a stage's state-dict names are the whole model's, and
checkpoints, Hugging Face adapters and `init_weights` work on a stage unchanged. A stage holds
exactly the modules it names, stateless ones included: a module without parameters (an
embedding scale, a soft-cap) runs only where the model's `ModelStructure` places it, and a
module every stage needs (RoPE) is named on every stage (`ModelStructure.shared`).
`check_structure` refuses a model whose structure leaves a module unplaced.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from pipekit.models.spec import ModelStructure

__all__ = [
    "build_stage_module",
    "check_structure",
    "model_units",
    "validate_stage_module_names",
]


def build_stage_module(
    model: nn.Module, module_names: Sequence[str], *, share_modules: bool = False
) -> nn.Module:
    """A copy of `model` that keeps exactly `module_names` (stateless modules too).

    Names are top-level children (an embedding, a norm, or a whole blocks container) or entries
    of a ModuleDict/ModuleList child ("<blocks>.3"). Build stages from a meta-device model,
    where the copy costs nothing, then `to_empty` and `init_weights` each stage. A ModuleList
    child becomes a ModuleDict keyed by the original indices, so state-dict names stay the full
    model's.

    `share_modules=True` copies only the containers: the stage holds `model`'s own submodules.
    A rank with several stages builds one module for all its stages and shares it out, so the
    optimizer, checkpoints and gradient clipping see one model with the full model's names.
    """
    kept = _expand(model, module_names, where="build_stage_module") | set(module_names)
    _check_shared_parameters(model, kept)
    stage = _shallow_copy(model) if share_modules else copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            entries = {
                key: entry for key, entry in child.named_children() if f"{name}.{key}" in kept
            }
            setattr(stage, name, _container_of(child, entries) if entries else None)
        elif name not in kept:
            setattr(stage, name, None)
    return stage


def _container_of(child: nn.Module, entries: dict[str, nn.Module]) -> nn.Module:
    """A ModuleDict holding `entries`: of `child`'s own class and attributes when `child` is a
    ModuleDict (a subclass's methods, e.g. multi-token prediction's, stay), else a plain one."""
    if not isinstance(child, nn.ModuleDict):
        return nn.ModuleDict(entries)
    container = _shallow_copy(child)
    container._modules = dict(entries)
    return container


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
    shared: Sequence[str] = (),
) -> None:
    """Check that the stages hold every module of `model` once, with layers in model order;
    the modules named in `outside_stages` (those a pipeline feature holds itself) must be in
    none, and only the stateless `shared` ones (`ModelStructure.shared`) may be in several.

    Catches hand-written splits that would silently drop or duplicate weights, run a stateless
    module (an embedding scale) twice, or run layers out of order, before any process group or
    memory is spent on them.
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
                    f"module {unit!r} is in stage {stage} but a pipeline feature holds it "
                    "outside the stages; remove it from the stage's list"
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
    _check_stateless_placement(model, names_per_stage, outside_stages, shared)


def check_structure(model: nn.Module, structure: ModelStructure) -> None:
    """Check that `structure` places every module of `model` exactly once, so that no layout
    drops a piece of the model or runs it twice; ValueError naming the module and the fix.

    The model must hold no parameter or buffer of its own (outside a placed module), every
    top-level child must be named by one field of the structure, and the modules that may run
    on several stages or vocabulary shards (`shared`, `logits_transforms`) must be stateless.
    """
    model_name = type(model).__name__
    direct = [name for name, _ in model.named_parameters(recurse=False)]
    direct += [name for name, _ in model.named_buffers(recurse=False)]
    if direct:
        raise ValueError(
            f"{model_name} holds {direct} directly, where no pipeline stage or vocabulary split "
            "can place it; move each into a submodule that its ModelStructure names"
        )
    placed = structure.placed
    twice = sorted({name for name in placed if placed.count(name) > 1})
    if twice:
        raise ValueError(f"ModelStructure names {twice} more than once; give each module one place")
    missing = object()
    absent = [name for name in placed if getattr(model, name, missing) is missing]
    if absent:
        children = [name for name, _ in model.named_children()]
        raise ValueError(
            f"ModelStructure names {absent}, which {model_name} does not have; its modules are "
            f"{children}"
        )
    unplaced = [name for name, _ in model.named_children() if name not in placed]
    if unplaced:
        raise ValueError(
            f"module(s) {unplaced} of {model_name} are placed by no field of its ModelStructure, "
            "so no layout knows which stage runs them; name each in before_blocks (first stage, "
            "after the embedding), after_blocks (last stage, before the output), "
            "logits_transforms (after the output) or shared (stateless, every stage)"
        )
    for field in ("shared", "logits_transforms"):
        stateful = [
            name
            for name in getattr(structure, field)
            if getattr(model, name) is not None and _has_state(getattr(model, name))
        ]
        if stateful:
            raise ValueError(
                f"ModelStructure.{field} names {stateful}, which hold parameters or buffers; "
                f"{field} modules run on several stages or vocabulary shards, so they must be "
                "stateless: move a learned scale into the output layer or a last-stage module"
            )


def _check_stateless_placement(
    model: nn.Module,
    names_per_stage: Sequence[Sequence[str]],
    outside_stages: Sequence[str],
    shared: Sequence[str],
) -> None:
    """A stateless top-level module runs where it is named: on exactly one stage, on none when
    it is outside the stages, or on every stage when it is shared."""
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)) or _has_state(child):
            continue
        stages = [index for index, names in enumerate(names_per_stage) if name in names]
        if name in shared:
            if len(stages) != len(names_per_stage):
                raise ValueError(
                    f"shared module {name!r} is on stages {stages} of {len(names_per_stage)}; "
                    "every stage needs it: name it on each"
                )
        elif name in outside_stages and stages:
            raise ValueError(
                f"module {name!r} is in stage {stages[0]} but a pipeline feature runs it "
                "outside the stages; remove it from the stage"
            )
        elif name not in outside_stages and len(stages) != 1:
            raise ValueError(
                f"stateless module {name!r} is on stages {stages}; it must run once, on exactly "
                "one stage (name it in ModelStructure.shared if every stage needs it)"
            )


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
