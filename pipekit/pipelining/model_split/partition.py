"""Which blocks each pipeline stage holds, and on which rank each stage runs.

Pure functions of counts and a `ModelStructure`: config validation runs them before any process
group or model exists.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from pipekit.models.spec import ModelStructure

__all__ = [
    "blocks_per_stage",
    "partition_layers",
    "stage_module_names",
    "stage_to_rank",
    "stages_of_rank",
    "with_shared_modules",
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
    return list(_optimal_split(num_layers, num_stages, embedding_weight, output_weight))


@functools.lru_cache(maxsize=256)  # pure; the layout search asks for a few splits many times
def _optimal_split(
    num_layers: int, num_stages: int, embedding_weight: float, output_weight: float
) -> tuple[range, ...]:

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
    return tuple(ranges)


def stage_module_names(
    structure: ModelStructure,
    num_layers: int,
    num_stages: int,
    embedding_weight: float = 1.0,
    output_weight: float = 1.0,
    *,
    outside: Sequence[str] = (),
    multi_token_prediction: bool = False,
) -> list[list[str]]:
    """Module names of each stage, its blocks split by `partition_layers`: the first stage also
    holds the embedding and `before_blocks`, the last `after_blocks`, the output, the
    `logits_transforms` and (for a model with them) the multi-token prediction modules, and
    every stage the `shared` modules.

    `outside`: modules a pipeline feature holds outside the stages (vocabulary parallelism's
    embedding, output and logits transforms); no stage holds them or pays for them.
    """
    if structure.embedding in outside:
        embedding_weight = 0.0
    if structure.output in outside:
        output_weight = 0.0
    ranges = partition_layers(num_layers, num_stages, embedding_weight, output_weight)
    names = [[structure.block_name(layer) for layer in layers] for layers in ranges]
    names[0][:0] = [
        name for name in (structure.embedding, *structure.before_blocks) if name not in outside
    ]
    ends = (*structure.after_blocks, structure.output, *structure.logits_transforms)
    if multi_token_prediction:
        ends += structure.multi_token_prediction
    names[-1] += [name for name in ends if name not in outside]
    return with_shared_modules(structure, names)


def with_shared_modules(
    structure: ModelStructure, names_per_stage: Sequence[Sequence[str]]
) -> list[list[str]]:
    """`names_per_stage` with the structure's `shared` modules on every stage (a hand-written
    split need not list them)."""
    return [
        [*(name for name in structure.shared if name not in names), *names]
        for names in names_per_stage
    ]


def blocks_per_stage(
    structure: ModelStructure, stage_module_names: Sequence[Sequence[str]]
) -> dict[int, int]:
    """Blocks (attention layers) of each stage, from its module names."""
    return {
        stage: sum(structure.is_block(name) for name in names)
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
