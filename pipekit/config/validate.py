"""Cross-field rules of a JobConfig, checked before any process group, file or model exists.

Each rule raises `ConfigError` with the values involved and a fix. `world_size=None` checks all
that does not depend on the launch (used by `pipekit.config.dump`).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError

if TYPE_CHECKING:
    from models.registry import ModelSpec
    from pipekit.distributed.parallel_dims import ParallelDims

__all__ = ["job_model", "validate_job_config"]

_CHOICES = {
    ("model", "attention_backend"): ("auto", "cpu", "flex"),
    ("training", "mixed_precision_param"): ("float32", "bfloat16"),
    ("training", "mixed_precision_reduce"): ("float32", "bfloat16"),
    ("training", "activation_checkpoint"): ("none", "full", "selective"),
    ("optimizer", "name"): ("AdamW", "AdamW8bit", "AdamW4bit"),
    ("lr_scheduler", "decay_type"): ("cosine", "linear", "constant"),
    ("moe", "memory_reuse"): ("none", "S1", "S2", "S3", "S4", "auto"),
}

_POSITIVE = (
    ("training", "steps"),
    ("training", "global_batch_size"),
    ("training", "seq_len"),
    ("training", "gradient_accumulation_steps"),
    ("training", "activation_checkpoint_every"),
    ("optimizer", "lr"),
    ("checkpoint", "interval"),
    ("metrics", "log_interval"),
    ("parallelism", "collective_timeout_s"),
)


def _check_choices_and_ranges(config: JobConfig) -> None:
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(config, section), key)
        if value not in choices:
            raise ConfigError(f"[{section}] {key}={value!r} is not one of {', '.join(choices)}")
    for section, key in _POSITIVE:
        value = getattr(getattr(config, section), key)
        if value <= 0:
            raise ConfigError(f"[{section}] {key}={value} must be positive")
    partitions = config.moe.partitions
    if partitions != "auto" and not (isinstance(partitions, int) and partitions >= 1):
        raise ConfigError(
            f"[moe] partitions={partitions!r} must be a positive integer or 'auto' (Algorithm 1)"
        )
    if config.checkpoint.keep_last < 0:
        raise ConfigError(f"[checkpoint] keep_last={config.checkpoint.keep_last} must be >= 0")
    if not 0.0 <= config.lr_scheduler.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"[lr_scheduler] min_lr_ratio={config.lr_scheduler.min_lr_ratio} must be in [0, 1]"
        )
    if not 0 <= config.lr_scheduler.warmup_steps <= config.training.steps:
        raise ConfigError(
            f"[lr_scheduler] warmup_steps={config.lr_scheduler.warmup_steps} must be between 0 "
            f"and training.steps={config.training.steps}"
        )
    if config.training.max_norm < 0:
        raise ConfigError(f"[training] max_norm={config.training.max_norm} must be >= 0 (0 = off)")
    trace_step = config.metrics.pipeline_trace_step
    if not 0 <= trace_step <= config.training.steps:
        raise ConfigError(
            f"[metrics] pipeline_trace_step={trace_step} must be between 0 (off) and "
            f"training.steps={config.training.steps}"
        )
    if trace_step and config.parallelism.pipeline_parallel_degree == 1:
        raise ConfigError(
            f"[metrics] pipeline_trace_step={trace_step} records a pipeline, but "
            "parallelism.pipeline_parallel_degree=1; set it above 1 or pipeline_trace_step=0"
        )


def job_model(config: JobConfig) -> tuple[ModelSpec, Any]:
    """The model family and args the job builds: the flavor, or the MoE [model.upcycle] makes of
    it."""
    from models.registry import resolve_model  # lazy: pipekit imports no model at import time

    upcycle = config.model.upcycle
    try:
        return resolve_model(
            config.model.name, config.model.flavor, upcycle.to_spec() if upcycle.enabled else None
        )
    except ValueError as error:
        section = "[model.upcycle]" if upcycle.enabled else "[model]"
        raise ConfigError(f"{section}: {error}") from None


def _check_model(config: JobConfig) -> None:
    from pipekit.config.job_config import UpcycleConfig
    from pipekit.train.data.tokenizer import build_tokenizer

    upcycle = config.model.upcycle
    if not upcycle.enabled and upcycle != UpcycleConfig(num_experts=upcycle.num_experts):
        raise ConfigError(
            f"[model.upcycle] num_experts={upcycle.num_experts} turns upcycling off, but other "
            "[model.upcycle] keys are set; set num_experts > 0 to upcycle, or remove them"
        )

    spec, args = job_model(config)
    try:
        tokenizer_vocab = build_tokenizer(config.data.tokenizer).vocab_size
    except (ValueError, ImportError) as error:
        raise ConfigError(f"[data]: {error}") from None
    if config.model.upcycle.enabled:
        _check_upcycle(config)
    hf_uses = {
        "[checkpoint] initial_load_path": (config.checkpoint.initial_load_path, spec.load_hf),
        "[checkpoint] export_hf_at_end": (config.checkpoint.export_hf_at_end, spec.save_hf),
    }
    for name, (used, adapter) in hf_uses.items():
        if used and adapter is None:
            raise ConfigError(
                f"{name}: model {config.model.name} has no Hugging Face layout adapter yet; "
                "turn it off (DCP checkpoints still save and resume)"
            )
    if config.checkpoint.export_hf_at_end and spec.check_hf_layout is not None:
        try:
            spec.check_hf_layout(args)
        except ValueError as error:
            raise ConfigError(f"[checkpoint] export_hf_at_end: {error}") from None
    if tokenizer_vocab > args.vocab_size:
        raise ConfigError(
            f"[data] tokenizer={config.data.tokenizer!r} has {tokenizer_vocab} ids but model "
            f"{config.model.name} flavor {config.model.flavor} has vocab_size={args.vocab_size}; "
            "choose a flavor with a larger vocabulary or a matching tokenizer"
        )


def _check_upcycle(config: JobConfig) -> None:
    """Upcycling reads the dense checkpoint shard by shard while the model is built, so the
    checkpoint's config and tensor headers are checked against the flavor here, before that."""
    from models.registry import get_model_spec
    from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint

    path = config.checkpoint.initial_load_path
    if not path:
        raise ConfigError(
            "[model.upcycle] num_experts > 0 upcycles the dense checkpoint of [checkpoint] "
            "initial_load_path, which is empty; set it to a Hugging Face Llama directory"
        )
    if config.parallelism.vocab_parallel:
        raise ConfigError(
            "[model.upcycle] does not combine with [parallelism] vocab_parallel yet (the "
            "vocabulary shards are initialised from the full rows); set vocab_parallel = false"
        )
    dense = get_model_spec(config.model.name)
    assert dense.upcycler is not None  # job_model checked it
    try:
        with SafetensorsCheckpoint(path) as checkpoint:
            dense.upcycler.check_dense(checkpoint, dense.flavor(config.model.flavor))
    except ValueError as error:  # CheckpointError included
        raise ConfigError(
            f"[checkpoint] initial_load_path: {error} ([model] flavor={config.model.flavor!r} "
            "must describe the dense checkpoint that is upcycled)"
        ) from None


def _check_paths(config: JobConfig) -> None:
    source = config.data.source
    if source != "stdlib" and not (os.path.exists(source) or glob.glob(source, recursive=True)):
        raise ConfigError(
            f"[data] source={source!r} matches no file; give a file, a folder, a glob, or 'stdlib'"
        )
    tokenizer = config.data.tokenizer
    if tokenizer != "bytes" and not Path(tokenizer).is_file():
        raise ConfigError(
            f"[data] tokenizer={tokenizer!r} is not a file; use 'bytes' or a tokenizer.json path"
        )
    initial = config.checkpoint.initial_load_path
    if initial and not (Path(initial) / "config.json").is_file():
        raise ConfigError(
            f"[checkpoint] initial_load_path={initial!r} has no config.json; point it at a "
            "Hugging Face checkpoint directory"
        )


def _check_parallelism(config: JobConfig, world_size: int) -> None:
    from pipekit.distributed.parallel_dims import ParallelDims

    try:
        dims = ParallelDims.from_config(config.parallelism, world_size)
    except ValueError as error:
        raise ConfigError(f"[parallelism] {error}") from None
    for name in ("cp", "tp"):
        if getattr(dims, name) > 1:
            raise ConfigError(
                f"[parallelism] {name}={getattr(dims, name)}: the trainer does not support "
                f"{name} > 1 yet; set {name} = 1"
            )
    if dims.ep > 1:
        _check_expert_parallel(config, dims)
    per_step = dims.dp_degree * config.training.gradient_accumulation_steps
    if config.training.global_batch_size % per_step:
        raise ConfigError(
            f"[training] global_batch_size={config.training.global_batch_size} must be divisible "
            f"by data-parallel degree {dims.dp_degree} x gradient_accumulation_steps="
            f"{config.training.gradient_accumulation_steps} = {per_step}; try "
            f"{per_step * max(1, config.training.global_batch_size // per_step)}"
        )
    if dims.pp > 1:
        _check_pipeline(config, config.training.global_batch_size // per_step)
    if config.parallelism.vocab_parallel:
        _check_vocab_parallel(config, dims.pp)


def _check_expert_parallel(config: JobConfig, dims: ParallelDims) -> None:
    ep = dims.ep
    moe = getattr(job_model(config)[1], "moe", None)
    if moe is None:
        raise ConfigError(
            f"[parallelism] ep={ep} needs a mixture-of-experts model; model "
            f"{config.model.name!r} has no experts (use llama_moe, or set ep = 1)"
        )
    if moe.num_experts % ep:
        upcycle = config.model.upcycle
        source = (
            f"[model.upcycle] num_experts x granularity = {upcycle.num_experts} x "
            f"{upcycle.granularity}"
            if upcycle.enabled
            else f"{config.model.name} {config.model.flavor}"
        )
        raise ConfigError(
            f"[parallelism] ep={ep} must divide the {moe.num_experts} experts of {source}; "
            f"choose a divisor of {moe.num_experts}"
        )
    if dims.pp > 1:
        raise ConfigError(
            f"[parallelism] ep={ep}: the trainer does not run expert parallelism inside "
            "pipeline stages yet; set pipeline_parallel_degree = 1 or ep = 1"
        )


def _check_pipeline(config: JobConfig, local_batch_size: int) -> None:
    from pipekit.pipelining.plan import plan_pipeline
    from pipekit.pipelining.stage_split import validate_stage_module_names

    spec, args = job_model(config)
    try:
        plan = plan_pipeline(
            config.parallelism, args.n_layers, local_batch_size, config.training.seq_len
        )
        with torch.device("meta"):
            model = spec.build(args)
        validate_stage_module_names(model, plan.module_names_per_stage, plan.modules_outside_stages)
    except ValueError as error:
        raise ConfigError(f"[parallelism] {error}") from None
    if args.tie_embeddings:
        raise ConfigError(
            f"[model] flavor {config.model.flavor} ties the embedding and output weights, which "
            "pipeline stages cannot share yet; use an untied flavor or pipeline_parallel_degree=1"
        )
    unsupported = {
        "[training] mixed_precision_param": config.training.mixed_precision_param != "float32",
        "[checkpoint] export_hf_at_end": config.checkpoint.export_hf_at_end,
    }
    for name, used in unsupported.items():
        if used:
            raise ConfigError(
                f"{name} is not supported with pipeline_parallel_degree > 1 yet; turn it off "
                "(the pipelined run still writes DCP checkpoints)"
            )


def _check_vocab_parallel(config: JobConfig, pp: int) -> None:
    """Vocabulary parallelism needs pipeline ranks to split the vocabulary over."""
    if pp < 2:
        raise ConfigError(
            "[parallelism] vocab_parallel = true splits the vocabulary across pipeline ranks; set "
            "pipeline_parallel_degree >= 2 or vocab_parallel = false"
        )
    from pipekit.layers.vocab_parallel import dtensor_shard_sizes

    vocab_size = job_model(config)[1].vocab_size
    try:
        dtensor_shard_sizes(vocab_size, pp)
    except ValueError as error:
        raise ConfigError(f"[parallelism] vocab_parallel = true: {error}") from None


def validate_job_config(config: JobConfig, world_size: int | None) -> None:
    """Raise ConfigError for the first rule the config breaks."""
    _check_choices_and_ranges(config)
    _check_paths(config)
    _check_model(config)
    if world_size is not None:
        _check_parallelism(config, world_size)
