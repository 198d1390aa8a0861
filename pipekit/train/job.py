"""From a loaded config to a `Job`: every rule checked, everything the trainer builds resolved.

`validate_job(config, world_size)` runs before any process group, file read beyond headers, or
model exists. Each subsystem checks its own part (the config's value ranges, the model registry,
the data sources, parallel degrees, expert parallelism, the pipeline plan, upcycling); this
module runs them in order, adds the rules that combine sections, and turns every refusal into a
`ConfigError` that names the section and the fix. The trainer builds from the returned `Job`,
so what was checked is exactly what runs (`train.py --print-config` checks a config without
launching it, for the fewest ranks its degrees allow).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipekit.attention.document_lengths import parse_document_lengths
from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError
from pipekit.layers.multi_token_prediction import prediction_depth
from pipekit.models.registry import get_model_spec, import_model_module, resolve_model
from pipekit.models.spec import ModelShape, ModelSpec
from pipekit.models.upcycling import UpcycleSpec
from pipekit.train.activation_checkpoint import check_checkpoint_with_schedule
from pipekit.train.checkpoint_rules import check_checkpoints
from pipekit.train.chunked_output import check_chunked_output
from pipekit.train.config_values import check_values
from pipekit.train.parallel_rules import check_parallel_layout
from pipekit.train.replica_groups import check_fault_tolerance
from pipekit.train.weight_decay import check_no_decay

if TYPE_CHECKING:
    from torch import nn

    from pipekit.distributed.parallel_dims import ParallelDims
    from pipekit.pipelining.plan import PipelinePlan

__all__ = ["Job", "job_model", "job_pipeline", "validate_job"]


@dataclass(frozen=True)
class Job:
    """A validated job: its config and what the config resolves to."""

    config: JobConfig
    spec: ModelSpec
    """The family the job trains (the MoE family when it upcycles)."""
    args: Any
    """The model args (`spec.build(args)`)."""
    shape: ModelShape
    upcycle: UpcycleSpec | None
    """How the dense checkpoint becomes the model, when upcycling."""
    dims: ParallelDims
    """Parallel degrees."""
    pipeline: PipelinePlan | None
    """The pipeline, when pipeline_parallel_degree > 1."""
    local_batch_size: int
    """Sequences per data-parallel rank and accumulation micro-step."""
    multi_token_depth: int = 0
    """The model's multi-token prediction depths (`ModelStructure.multi_token_prediction`)."""

    @property
    def tensor_parallel(self) -> int:
        """The tp degree."""
        return self.dims.tp

    @property
    def description(self) -> str:
        """The model in a few words, for the job's first log line."""
        model = f"{self.config.model.name}/{self.config.model.flavor}"
        if self.upcycle is None:
            return model
        return (
            f"{model} upcycled to {self.spec.name} ({self.upcycle.total_experts} experts, "
            f"top-{self.upcycle.routed_experts})"
        )

    @property
    def replica_groups(self) -> int:
        """Fault-tolerant replica groups the batch is split over (1 without them)."""
        fault_tolerance = self.config.fault_tolerance
        return fault_tolerance.groups if fault_tolerance.enabled else 1

    @property
    def data_parallel_degree(self) -> int:
        """Ranks reading different rows of a step: every group's data-parallel ranks."""
        return self.replica_groups * self.dims.dp_degree

    def data_parallel_rank(self, group_dp_rank: int) -> int:
        """This rank's share of the step among `data_parallel_degree`: its group's shares
        come after the lower groups' (as dp_replicate orders them)."""
        group = self.config.fault_tolerance.replica_group if self.replica_groups > 1 else 0
        return group * self.dims.dp_degree + group_dp_rank

    @property
    def sequence_parallel(self) -> bool:
        """Whether the tp ranks split the residual stream by sequence."""
        return self.tensor_parallel > 1 and self.config.parallelism.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        """Whether the output layer (and a tied embedding) is split over the tp ranks by
        vocabulary, the cross-entropy computed on the shards."""
        return self.tensor_parallel > 1 and self.config.parallelism.loss_parallel

    @property
    def dense_spec(self) -> ModelSpec:
        """The family named in [model] (the dense one, when upcycling)."""
        return get_model_spec(self.config.model.name)


def _error(section: str, error: Exception) -> ConfigError:
    return ConfigError(f"{section} {error}" if section else str(error))


def validate_job(config: JobConfig, world_size: int, *, check_files: bool = True) -> Job:
    """Check `config` (for `world_size` ranks) and resolve it; ConfigError for the first rule
    it breaks. `check_files=False` skips what reads the files the config names (data,
    tokenizer, checkpoints): planning a job for machines that hold them."""
    check_values(config)
    _check_metric_writers(config)
    tokenizer_vocab = _tokenizer_vocab(config) if check_files else 0
    spec, args, upcycle, meta_model = _checked_model(config, tokenizer_vocab)
    check_no_decay(config.optimizer.no_decay, meta_model)
    shape = spec.shape(args)
    _check_data(config, shape, tokenizer_vocab)
    check_checkpoints(config, spec, args, check_files, meta_model)
    if upcycle is not None:
        _check_upcycle(config, check_files)
    dims = check_parallel_layout(
        config.parallelism,
        world_size,
        spec,
        args,
        seq_len=config.training.seq_len,
        model=_model_description(config),
        meta_model=meta_model,
        upcycling=upcycle is not None,
    )
    _check_float8(config, dims.tp)
    check_chunked_output(config.training.loss_chunk_tokens, spec.structure, meta_model, dims.pp)
    groups = check_fault_tolerance(config.fault_tolerance, dims.dp_replicate)
    data_parallel = groups * dims.dp_degree
    per_step = data_parallel * config.training.gradient_accumulation_steps
    if config.training.global_batch_size % per_step:
        raise ConfigError(
            f"[training] global_batch_size={config.training.global_batch_size} must be divisible "
            f"by data-parallel degree {data_parallel} x gradient_accumulation_steps="
            f"{config.training.gradient_accumulation_steps} = {per_step}; try "
            f"{per_step * max(1, config.training.global_batch_size // per_step)}"
        )
    local_batch = config.training.global_batch_size // per_step
    pipeline = None
    if dims.pp > 1:
        pipeline = job_pipeline(config, spec, meta_model, shape, dims, local_batch)
    if config.parallelism.pipeline_features and pipeline is None:
        raise ConfigError(
            f"[parallelism] pipeline_features={config.parallelism.pipeline_features} are "
            "pipeline features: set pipeline_parallel_degree >= 2, or pipeline_features = []"
        )
    depth = prediction_depth(meta_model, spec.structure.multi_token_prediction)
    return Job(config, spec, args, shape, upcycle, dims, pipeline, local_batch, depth)


def job_model(
    config: JobConfig, *, check_files: bool = True
) -> tuple[ModelSpec, Any, UpcycleSpec | None, nn.Module]:
    """The family, args and upcycling of the model `config` trains, checked, and the model
    built on the meta device: what every layout of the config shares (the layout search reads
    them once). ConfigError for the first rule broken."""
    check_values(config)
    return _checked_model(config, _tokenizer_vocab(config) if check_files else 0)


def _checked_model(
    config: JobConfig, tokenizer_vocab: int
) -> tuple[ModelSpec, Any, UpcycleSpec | None, nn.Module]:
    spec, args, upcycle = _model(config, tokenizer_vocab)
    return spec, args, upcycle, _check_structure(spec, args)


def _check_metric_writers(config: JobConfig) -> None:
    """A writer's package must be there before the job starts, not at its first log line."""
    import importlib.util

    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(config.metrics, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"[metrics] {key} = true needs the {package} package; "
                f"pip install 'pipekit[{key}]' or set {key} = false"
            )


def _tokenizer_vocab(config: JobConfig) -> int:
    """The [data] tokenizer's number of ids (the source and tokenizer files checked first)."""
    from pipekit.train.data.loader import check_data_config

    try:
        return check_data_config(config.data)
    except (ValueError, ImportError) as error:
        raise _error("[data]:", error) from None


def _model(config: JobConfig, tokenizer_vocab: int) -> tuple[ModelSpec, Any, UpcycleSpec | None]:
    from pipekit.config.job_config import UpcycleConfig

    model = config.model
    upcycle = model.upcycle
    if not upcycle.enabled and upcycle != UpcycleConfig(num_experts=upcycle.num_experts):
        raise ConfigError(
            f"[model.upcycle] num_experts={upcycle.num_experts} turns upcycling off, but other "
            "[model.upcycle] keys are set; set num_experts > 0 to upcycle, or remove them"
        )
    section = "[model.upcycle]" if upcycle.enabled else "[model]"
    try:
        if model.module:
            import_model_module(model.module)
        upcycle_spec = UpcycleSpec.from_config(upcycle) if upcycle.enabled else None
        vocab_size = model.vocab_size
        if not vocab_size and model.flavor.startswith("debug") and config.data.tokenizer != "bytes":
            vocab_size = tokenizer_vocab
        spec, args = resolve_model(model.name, model.flavor, upcycle_spec, vocab_size)
        args = _with_multi_token_prediction(args, model.mtp_depth, model.mtp_loss_weight)
    except ValueError as error:
        raise _error(f"{section}:", error) from None
    return spec, args, upcycle_spec


def _with_multi_token_prediction(args: Any, depth: int, weight: float) -> Any:
    """`args` with `[model] mtp_depth` and `mtp_loss_weight` where set (-1: the args')."""
    changes = {key: value for key, value in (("mtp_depth", depth), ("mtp_loss_weight", weight))
               if value != -1}  # fmt: skip
    if not changes:
        return args
    if any(value < 0 for value in changes.values()):
        raise ValueError(f"{changes} must be >= 0 (or -1 for the model's own)")
    fields = {field.name for field in dataclasses.fields(args)}
    if "mtp_depth" not in fields:
        raise ValueError(
            f"mtp_depth: the model's args ({type(args).__name__}) have no multi-token "
            "prediction; leave mtp_depth and mtp_loss_weight at -1"
        )
    return dataclasses.replace(args, **changes)


def _model_description(config: JobConfig) -> str:
    """How messages name the model: its family and flavor, or what upcycling makes of it."""
    model = config.model
    upcycle = model.upcycle
    if upcycle.enabled:
        return (
            f"[model.upcycle] num_experts x granularity = {upcycle.num_experts} x "
            f"{upcycle.granularity}"
        )
    return f"{model.name} {model.flavor}"


def _check_data(config: JobConfig, shape: ModelShape, tokenizer_vocab: int) -> None:
    model = config.model
    if tokenizer_vocab > shape.vocab_size:
        raise ConfigError(
            f"[data] tokenizer={config.data.tokenizer!r} has {tokenizer_vocab} ids but model "
            f"{model.name} flavor {model.flavor} has vocab_size={shape.vocab_size}; choose a "
            f"flavor with a larger vocabulary, set [model] vocab_size >= {tokenizer_vocab}, or "
            "use a matching tokenizer"
        )
    if config.training.seq_len > shape.max_seq_len:
        raise ConfigError(
            f"[training] seq_len={config.training.seq_len} is longer than model {model.name} "
            f"flavor {model.flavor} is built for (max_seq_len={shape.max_seq_len}); use "
            f"seq_len <= {shape.max_seq_len}"
        )
    try:
        parse_document_lengths(config.data.document_lengths)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_upcycle(config: JobConfig, check_files: bool) -> None:
    """Upcycling reads the dense checkpoint shard by shard while the model is built, so the
    checkpoint's config and tensor headers are checked against the flavor here, before that."""
    from pipekit.checkpoint.upcycle import check_dense_checkpoint

    path = config.checkpoint.initial_load_path
    if not path:
        raise ConfigError(
            "[model.upcycle] num_experts > 0 upcycles the dense checkpoint of [checkpoint] "
            "initial_load_path, which is empty; set it to a Hugging Face checkpoint directory"
        )
    if not check_files:
        return
    dense = get_model_spec(config.model.name)
    assert dense.upcycler is not None  # resolve_model checked it
    try:
        check_dense_checkpoint(path, dense.upcycler, dense.flavor(config.model.flavor))
    except ValueError as error:  # CheckpointError included
        raise ConfigError(
            f"[checkpoint] initial_load_path: {error} ([model] flavor={config.model.flavor!r} "
            "must describe the dense checkpoint that is upcycled)"
        ) from None


def _check_float8(config: JobConfig, tp: int) -> None:
    from pipekit.train.float8 import check_float8

    try:
        check_float8(config.training.float8, tp)
    except ValueError as error:
        raise _error("[training]", error) from None


def _check_structure(spec: ModelSpec, args: Any) -> nn.Module:
    """The model on the meta device, once its structure is checked to place every module, in
    the order its own forward runs them."""
    import torch

    from pipekit.models.forward_order import check_forward_order
    from pipekit.models.stage_module import check_structure

    with torch.device("meta"):
        model = spec.build(args)
    try:
        check_structure(model, spec.structure)
        check_forward_order(model, spec.structure)
    except ValueError as error:
        raise _error(f"[model] {spec.name}:", error) from None
    return model


def job_pipeline(
    config: JobConfig,
    spec: ModelSpec,
    model: nn.Module,
    shape: ModelShape,
    dims: ParallelDims,
    local_batch_size: int,
) -> PipelinePlan:
    """The pipeline plan of a job with degrees `dims` (ConfigError "[parallelism] ..." when
    the plan refuses them)."""
    import dataclasses

    import torch

    from pipekit.attention.kernels.backends import attention_work_block
    from pipekit.models.stage_module import validate_stage_module_names
    from pipekit.pipelining.features.multi_token_units import check_multi_token_stage
    from pipekit.pipelining.plan import plan_pipeline
    from pipekit.train.metrics import attention_to_linear_flops

    seq_len = config.training.seq_len
    try:
        resolved = dataclasses.replace(
            config.parallelism, dp_shard=dims.dp_shard, dp_replicate=dims.dp_replicate
        )
        plan = plan_pipeline(
            resolved,
            spec.structure,
            shape,
            local_batch_size,
            seq_len,
            attention_to_linear=attention_to_linear_flops(model, shape, spec.structure, seq_len),
            attention_work_block=attention_work_block(
                config.model.attention_backend, "cuda" if torch.cuda.is_available() else "cpu"
            ),
            activation_checkpoint=config.training.activation_checkpoint,
        )
        validate_stage_module_names(
            model, plan.module_names_per_stage, plan.modules_outside_stages, spec.structure.shared
        )
        check_multi_token_stage(model, spec.structure, plan.module_names_per_stage)
    except ValueError as error:
        raise _error("[parallelism]", error) from None
    try:
        check_checkpoint_with_schedule(
            config.training.activation_checkpoint, plan.schedule, plan.splits_backward
        )
    except ValueError as error:
        raise _error("[training]", error) from None
    return plan
