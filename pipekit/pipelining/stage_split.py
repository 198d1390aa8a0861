"""Splitting a model into pipeline stages: which layers each stage holds, and on which rank.

A stage is a copy of the model with the modules of other stages removed (top-level children set
to None, other layer keys deleted), so its state-dict names are the full model's and checkpoints,
the Hugging Face adapter and `init_weights` work on a stage unchanged. Modules without parameters
or buffers (RoPE) are shared: every stage keeps them and no stage needs to name them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from torch import nn

__all__ = [
    "build_stage_module",
    "llama_layers_per_stage",
    "llama_stage_module_names",
    "partition_layers",
    "stage_to_rank",
    "stages_of_rank",
    "validate_stage_module_names",
]

_STYLES = ("loop", "v")


def partition_layers(
    num_layers: int,
    num_stages: int,
    embedding_weight: float = 1.0,
    output_weight: float = 1.0,
) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the slowest stage's cost.

    A stage costs its number of layers, plus `embedding_weight` on stage 0 and `output_weight`
    (final norm and output head) on the last stage, both in units of one layer: the pipeline runs
    at the pace of its slowest stage. Among optimal splits the one whose per-stage layer counts
    are lexicographically smallest wins, i.e. earlier stages get fewer layers, because in 1F1B
    schedules earlier stages keep more micro-batches' activations alive.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be at least 1")
    if num_layers < num_stages:
        raise ValueError(
            f"num_layers={num_layers} is smaller than num_stages={num_stages}, and every stage "
            "needs at least one layer; use fewer stages (a smaller pipeline degree or "
            "stages_per_rank)"
        )
    for name, weight in (("embedding_weight", embedding_weight), ("output_weight", output_weight)):
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"{name}={weight} must be a finite number >= 0 (in units of a layer)")

    def cost(stage: int, count: int) -> float:
        extra = (embedding_weight if stage == 0 else 0.0) + (
            output_weight if stage == num_stages - 1 else 0.0
        )
        return count + extra

    # best[k][start]: smallest bottleneck of layers start.. over the last k stages (SlimPipe's
    # split is the same min-max problem; a suffix DP is exact and O(num_stages * num_layers^2)).
    best = [[math.inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    for start in range(num_layers):
        best[1][start] = cost(num_stages - 1, num_layers - start)
    for k in range(2, num_stages + 1):
        stage = num_stages - k
        for start in range(num_layers - k + 1):
            best[k][start] = min(
                max(cost(stage, count), best[k - 1][start + count])
                for count in range(1, num_layers - start - k + 2)
            )
    bottleneck = best[num_stages][0]

    ranges, start = [], 0
    for stage in range(num_stages - 1):
        remaining = num_stages - stage - 1
        count = next(
            count
            for count in range(1, num_layers - start - remaining + 1)
            if cost(stage, count) <= bottleneck and best[remaining][start + count] <= bottleneck
        )
        ranges.append(range(start, start + count))
        start += count
    ranges.append(range(start, num_layers))
    return ranges


def llama_stage_module_names(
    num_layers: int,
    num_stages: int,
    embedding_weight: float = 1.0,
    output_weight: float = 1.0,
    *,
    vocab_parallel: bool = False,
) -> list[list[str]]:
    """Module names of each stage of `models.llama.Llama`, split by `partition_layers`.

    With `vocab_parallel` the embedding and the output layer are split across the pipeline ranks
    outside the stages (`pipekit.pipelining.vocab_parallel`): no stage holds them or pays for them.
    """
    if vocab_parallel:
        embedding_weight = output_weight = 0.0
    ranges = partition_layers(num_layers, num_stages, embedding_weight, output_weight)
    names = [[f"layers.{layer}" for layer in layers] for layers in ranges]
    names[-1].append("norm")
    if not vocab_parallel:
        names[0].insert(0, "tok_embeddings")
        names[-1].append("output")
    return names


def llama_layers_per_stage(stage_module_names: Sequence[Sequence[str]]) -> dict[int, int]:
    """Transformer blocks (attention layers) of each stage, from its module names."""
    return {
        stage: sum(name.startswith("layers.") for name in names)
        for stage, names in enumerate(stage_module_names)
    }


def stage_to_rank(num_ranks: int, stages_per_rank: int, style: str = "loop") -> list[int]:
    """The rank holding each stage, for `num_ranks * stages_per_rank` stages.

    "loop" (interleaved 1F1B) deals stages round-robin, stage s on rank s % num_ranks. "v"
    (ZBV, DualPipeV) needs two stages per rank and folds the pipeline: stages 0..p-1 go down
    ranks 0..p-1 and stages p..2p-1 come back up ranks p-1..0, so the last stage sits on rank 0
    next to the first and each rank's two stages carry similar activation memory.
    """
    if num_ranks < 1 or stages_per_rank < 1:
        raise ValueError(
            f"num_ranks={num_ranks} and stages_per_rank={stages_per_rank} must both be >= 1"
        )
    if style not in _STYLES:
        raise ValueError(f"unknown stage placement style={style!r}; choose one of {_STYLES}")
    num_stages = num_ranks * stages_per_rank
    if style == "loop":
        return [stage % num_ranks for stage in range(num_stages)]
    if stages_per_rank != 2:
        raise ValueError(
            f"style='v' places exactly 2 stages per rank, got stages_per_rank={stages_per_rank}; "
            "set stages_per_rank=2 or use style='loop'"
        )
    return [stage if stage < num_ranks else num_stages - 1 - stage for stage in range(num_stages)]


def stages_of_rank(
    rank: int, num_ranks: int, stages_per_rank: int, style: str = "loop"
) -> list[int]:
    """The stages `rank` holds, ascending (see `stage_to_rank`)."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank} is outside 0..{num_ranks - 1} (num_ranks={num_ranks})")
    placement = stage_to_rank(num_ranks, stages_per_rank, style)
    return [stage for stage, owner in enumerate(placement) if owner == rank]


def build_stage_module(
    model: nn.Module, module_names: Sequence[str], *, share_modules: bool = False
) -> nn.Module:
    """A copy of `model` that keeps only `module_names` (plus the shared stateless modules).

    Names are top-level children ("tok_embeddings", "norm", or a whole "layers") or entries of a
    ModuleDict/ModuleList child ("layers.3"). Build stages from a meta-device model, where the
    copy costs nothing, then `to_empty` and `init_weights` each stage. A ModuleList child becomes
    a ModuleDict keyed by the original indices, so state-dict names stay the full model's.

    `share_modules=True` copies only the containers: the stage holds `model`'s own submodules.
    A rank with several stages builds one module for all its stages and shares it out, so the
    optimizer, checkpoints and gradient clipping see one model with the full model's names.
    """
    kept = _expand(model, module_names, where="build_stage_module")
    _check_tied_embeddings(model, kept)
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
    stage = type(model).__new__(type(model))
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
    missing = [unit for unit in _units(model) if unit not in owner and unit not in outside_stages]
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


def _units(model: nn.Module) -> list[str]:
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


def _check_tied_embeddings(model: nn.Module, kept: set[str]) -> None:
    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if embedding is None or output is None:
        return
    tied = bool(getattr(getattr(model, "args", None), "tie_embeddings", False)) or (
        getattr(output, "weight", None) is getattr(embedding, "weight", None)
    )
    if tied and ("tok_embeddings" in kept) != ("output" in kept):
        raise ValueError(
            "tied embeddings across pipeline stages are not supported: this stage holds only one "
            "of tok_embeddings and output, which share one weight; untie them "
            "(tie_embeddings=False in the model args) or put both on one stage"
        )
