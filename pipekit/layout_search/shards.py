"""Each pipeline rank's share of the model by arithmetic, for layouts the search never builds.

`pipekit.memory_plan.layout` builds a rank's share for real (meta device, simulated process
group, one forked child per pipeline rank): exact, but seconds per layout. The search prices
hundreds of layouts, so it counts the same shares from the whole model on the meta device and
the rules the builders follow:

- tensor parallelism splits the weights the family's plan names (column- or row-wise) and the
  per-head values, the embedding by rows, the output too under loss parallelism;
- expert parallelism gives each of `ep` ranks `1/ep` of every MoE layer's experts, and expert
  tensor parallelism splits those over `etp`;
- FSDP2 shards every parameter by rows over `dp_shard x cp` (padding its rows to a multiple);
  experts over the token ranks that do not already hold other experts;
- a pipeline rank holds its stages' modules; vocabulary parallelism gives every pipeline rank
  `1/pp` of the embedding's and output's rows instead.

A test compares these counts with `rank_layouts` on the debug configs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipekit.memory_plan.layout import RankLayout
from pipekit.moe.layer import MoE
from pipekit.train.job import Job

__all__ = ["ShareCounter"]

_SPLIT_STYLES = (ColwiseParallel, RowwiseParallel)


class ShareCounter:
    """Counts local shards of one model (built once on the meta device) for any layout."""

    def __init__(self, job: Job, meta_model: nn.Module) -> None:
        self.spec, self.model = job.spec, meta_model
        structure = job.spec.structure
        self._tp_split: dict[str, bool] = {}
        self._experts: set[str] = set()
        for block in structure.blocks_of(meta_model):
            prefix = _module_name(meta_model, block)
            plan = (
                job.spec.tensor_parallel_plan(block, True) if job.spec.tensor_parallel_plan else {}
            )
            split_modules = [
                name for name, style in plan.items() if isinstance(style, _SPLIT_STYLES)
            ]
            for name, _ in block.named_parameters():
                owner = name.rsplit(".", 1)[0] if "." in name else ""
                self._tp_split[f"{prefix}.{name}"] = owner in split_modules or name.endswith(
                    ".sinks"
                )
            for module_name, module in block.named_modules():
                if isinstance(module, MoE):
                    for name, _ in module.experts.named_parameters():
                        self._experts.add(f"{prefix}.{module_name}.experts.{name}")

    def layouts(self, job: Job) -> list[RankLayout]:
        """One layout per pipeline rank (one for a job without a pipeline), as
        `rank_layouts(job)` would measure them."""
        plan = job.pipeline
        if plan is None:
            structure = job.spec.structure
            blocks = [structure.block_name(i) for i in range(job.shape.num_layers)]
            names = [name for name, _ in self.model.named_children() if name != structure.blocks]
            return [self._layout(job, 0, 0, (), [*blocks, *names], vocab_rows=None)]
        layouts = []
        for pipeline_rank in range(plan.num_ranks):
            stages = tuple(sorted(plan.stage_indices(pipeline_rank)))
            names = [name for stage in stages for name in plan.module_names_per_stage[stage]]
            vocab_rows = None
            if plan.modules_outside_stages:
                vocab_rows = math.ceil(job.shape.vocab_size / plan.num_ranks)
                names += [n for n in plan.modules_outside_stages if n not in names]
            rank = pipeline_rank * (job.dims.world_size // plan.num_ranks)
            layouts.append(self._layout(job, rank, pipeline_rank, stages, names, vocab_rows))
        return layouts

    def _layout(
        self,
        job: Job,
        rank: int,
        pipeline_rank: int,
        stages: tuple[int, ...],
        module_names: Iterable[str],
        vocab_rows: int | None,
    ) -> RankLayout:
        structure, dims = job.spec.structure, job.dims
        names = list(dict.fromkeys(module_names))
        fsdp = dims.dp_shard * dims.cp
        seen: set[int] = set()
        numel = element_bytes = 0
        units: dict[str, int] = {}
        for module_name in names:
            module = self.model.get_submodule(module_name)
            vocabulary_shard = (
                vocab_rows is not None and module_name in structure.vocabulary_modules
            )
            # blocks and vocabulary shards are units of their own, the rest the stage's root
            unit = module_name if structure.is_block(module_name) or vocabulary_shard else ""
            for name, param in module.named_parameters():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                full = f"{module_name}.{name}"
                rows, cols = param.shape[0], param.numel() // max(param.shape[0], 1)
                if vocab_rows is not None and module_name in structure.vocabulary_modules:
                    rows = vocab_rows
                rows = self._tp_rows(job, full, module_name, rows)
                shards = fsdp
                if full in self._experts and dims.ep > 1:
                    unit = full.rsplit(".experts.", 1)[0] + ".experts"  # a unit of its own
                if full in self._experts:
                    experts_per_rank = rows // dims.ep
                    rows = experts_per_rank
                    cols //= dims.etp
                    token_ranks = dims.dp_shard * dims.cp * (dims.tp if dims.tp > 1 else 1)
                    shards = max(1, token_ranks // (dims.ep * dims.etp))
                local_rows = math.ceil(rows / shards) if shards > 1 else rows
                numel += local_rows * cols
                element_bytes = param.element_size()
                units[unit] = units.get(unit, 0) + rows * cols  # FSDP2 gathers a unit whole
        blocks = tuple(name for name in names if structure.is_block(name) and name.count(".") == 1)
        output_rows = 0
        if structure.output in names:  # a DTensor's global rows; vocabulary shards are local
            output_rows = job.shape.vocab_size
            if vocab_rows is not None:
                output_rows = self._tp_rows(job, "", structure.output, vocab_rows)
        largest = max(units.values(), default=0) if self._fsdp_wrapped(job) else 0
        return RankLayout(
            rank=rank,
            pipeline_rank=pipeline_rank,
            stages=stages,
            param_numel=numel,
            param_bytes=numel * (element_bytes or 4),
            largest_unit_numel=largest,
            block_names=blocks,
            output_rows=output_rows,
        )

    @staticmethod
    def _fsdp_wrapped(job: Job) -> bool:
        """Whether FSDP2 wraps the blocks: data parallelism, or a pipeline stage computing in a
        lower precision (FSDP2's mixed precision over one rank)."""
        dims = job.dims
        if dims.dp_shard * dims.cp * dims.dp_replicate > 1:
            return True
        return job.pipeline is not None and job.config.training.mixed_precision_param != "float32"

    def _tp_rows(self, job: Job, full_name: str, module_name: str, rows: int) -> int:
        """Rows a tp rank keeps (Colwise and Rowwise both shard dim 0 of the local shape's
        storage for counting: the element count divides by tp either way)."""
        tp = job.dims.tp
        if tp == 1:
            return rows
        structure = job.spec.structure
        if module_name == structure.embedding:
            return (
                math.ceil(rows / tp)
                if (job.loss_parallel or not job.shape.tied_embeddings)
                else rows
            )
        if module_name == structure.output:
            return math.ceil(rows / tp) if job.loss_parallel else rows
        if self._tp_split.get(full_name, False):
            return rows // tp
        return rows


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)
