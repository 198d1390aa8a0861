"""The value rules of the config: allowed choices and ranges, and the rules between keys that
need no subsystem. Pure: no model, file or process group.

A key's choices, and the rule of a key whose component checks it too (`[moe] partitions`), are
the component's, imported from it and never listed here, so config and component cannot
disagree. Rules that need a subsystem (the model registry, data files, parallel degrees, the
pipeline plan) are that subsystem's. `pipekit.train.job.validate_job` runs them all, this module's
first, before any process group exists.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass

from pipekit.attention.across.token_shards import CP_BALANCES
from pipekit.attention.kernels.backends import available_backends
from pipekit.checkpoint.dcp import EXPORT_DTYPES
from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError
from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES
from pipekit.moe.execution import check_partitions
from pipekit.moe.restore import MEMORY_REUSE_CHOICES
from pipekit.pipelining.features.registry import measured_pipeline_features, measured_settings
from pipekit.pipelining.runtime.measured_choice import AUTO
from pipekit.pipelining.schedules.slice_bounds import SLICINGS
from pipekit.train.activation_checkpoint import ACTIVATION_CHECKPOINT_MODES, SELECTIVE_KEEP
from pipekit.train.data.chat import DATA_FORMATS
from pipekit.train.float8 import FLOAT8_RECIPES
from pipekit.train.lr_schedule import DECAY_TYPES
from pipekit.train.muon import MUON_LR_ADJUSTMENTS
from pipekit.train.non_finite import NON_FINITE_CHOICES
from pipekit.train.optimizer import OPTIMIZERS

__all__ = ["check_values"]

_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("model", "attention_backend"): tuple(available_backends()),
    ("training", "mixed_precision_param"): tuple(MIXED_PRECISION_DTYPES),
    ("training", "mixed_precision_reduce"): tuple(MIXED_PRECISION_DTYPES),
    ("training", "activation_checkpoint"): ACTIVATION_CHECKPOINT_MODES,
    ("training", "activation_checkpoint_keep"): tuple(SELECTIVE_KEEP),
    ("training", "float8"): FLOAT8_RECIPES,
    ("optimizer", "name"): OPTIMIZERS,
    ("optimizer", "muon_adjust_lr"): MUON_LR_ADJUSTMENTS,
    ("data", "format"): DATA_FORMATS,
    ("training", "on_nonfinite"): NON_FINITE_CHOICES,
    ("lr_scheduler", "decay_type"): DECAY_TYPES,
    ("moe", "memory_reuse"): MEMORY_REUSE_CHOICES,
    ("checkpoint", "export_dtype"): tuple(EXPORT_DTYPES),
    **{("parallelism", setting): (False, True, AUTO) for setting in measured_settings()},
    ("parallelism", "slicing"): (*SLICINGS, AUTO),
    ("parallelism", "cp_balance"): CP_BALANCES,
    ("parallelism", "layout"): ("manual", AUTO),
}
"""Each key's choices, as the component that reads the key lists them."""

MODEL_ONLY = ("optimizer", "data", "progress")
"""The parts a model-only save or load leaves out: all but the model."""

LOADING_EXCLUSIONS = (*MODEL_ONLY, "router_biases")
"""Parts of a checkpoint `[checkpoint] exclude_from_loading` may leave out."""

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
    ("parallelism", "cp_balance_pieces"),
    ("validation", "interval"),
    ("validation", "steps"),
)


_AT_LEAST_ZERO = (
    ("optimizer", "weight_decay"),
    ("data", "shuffle_buffer"),
    ("parallelism", "pipeline_embedding_cost"),
    ("parallelism", "pipeline_output_cost"),
    ("parallelism", "layout_memory_gib"),
)


def _check_finite(config: JobConfig) -> None:
    """Every float key is a number (no NaN or infinity)."""
    for section in fields(config):
        values = getattr(config, section.name)
        if not is_dataclass(values):
            continue
        for key in fields(values):
            value = getattr(values, key.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"[{section.name}] {key.name}={value} must be a finite number")


def _check_optimizer(config: JobConfig) -> None:
    """AdamW's ranges: a learning rate in (0, 1], betas in [0, 1), eps > 0."""
    optimizer = config.optimizer
    if not 0.0 < optimizer.lr <= 1.0:
        raise ConfigError(
            f"[optimizer] lr={optimizer.lr} must be in (0, 1] (AdamW's step is about lr per "
            "weight; typical peaks are 1e-5 to 1e-2)"
        )
    for key in ("beta1", "beta2", "muon_momentum"):
        value = getattr(optimizer, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"[optimizer] {key}={value} must be in [0, 1)")
    if optimizer.eps <= 0.0:
        raise ConfigError(f"[optimizer] eps={optimizer.eps} must be positive")


def _check_measured_choices(config: JobConfig) -> None:
    """`num_slices` is a count or "auto"; a deterministic job takes no timed choice (two runs
    could time differently and so round differently)."""
    parallelism = config.parallelism
    num_slices = parallelism.num_slices
    if num_slices != AUTO and not (isinstance(num_slices, int) and num_slices >= 0):
        raise ConfigError(
            f"[parallelism] num_slices={num_slices!r} must be a count >= 0 (0 = the schedule's "
            f'default) or "{AUTO}"'
        )
    timed = [key for key in ("num_slices", "slicing") if getattr(parallelism, key) == AUTO]
    timed += [feature.measured_setting for feature in measured_pipeline_features(parallelism)]
    if timed and config.debug.deterministic:
        raise ConfigError(
            f'[parallelism] {", ".join(timed)} = "{AUTO}" chooses by timing, which can differ '
            "between runs, but [debug] deterministic = true asks for the same bits every run; "
            "set explicit values"
        )


def check_values(config: JobConfig) -> None:
    """ConfigError for the first value outside its choices or range, or breaking a rule."""
    _check_finite(config)
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(config, section), key)
        if value not in choices:
            shown = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in choices)
            raise ConfigError(f"[{section}] {key}={value!r} is not one of {shown}")
    try:
        check_partitions(config.moe.partitions)
    except ValueError as error:
        raise ConfigError(f"[moe] {error}") from None
    for section, key in _POSITIVE:
        value = getattr(getattr(config, section), key)
        if value <= 0:
            raise ConfigError(f"[{section}] {key}={value} must be positive")
    for section, key in _AT_LEAST_ZERO:
        value = getattr(getattr(config, section), key)
        if value < 0:
            raise ConfigError(f"[{section}] {key}={value} must be >= 0")
    _check_optimizer(config)
    _check_measured_choices(config)
    unknown = set(config.checkpoint.exclude_from_loading) - set(LOADING_EXCLUSIONS)
    if unknown:
        raise ConfigError(
            f"[checkpoint] exclude_from_loading names {sorted(unknown)}; choose among "
            f"{', '.join(LOADING_EXCLUSIONS)} (the model's weights are always loaded)"
        )
    load_step = config.checkpoint.load_step
    if load_step < 0 or (load_step and not config.checkpoint.resume):
        raise ConfigError(
            f"[checkpoint] load_step={load_step} names the step to resume from: it must be >= 0 "
            "(0 = the newest) and needs resume = true"
        )
    if config.model.vocab_size < 0:
        raise ConfigError(
            f"[model] vocab_size={config.model.vocab_size} must be >= 0 (0 = the flavor's)"
        )
    if config.validation.enable and config.data.streaming:
        raise ConfigError(
            "[validation] enable = true holds out rows of a corpus packed in memory; with "
            "[data] streaming = true there is no row count to hold out from: turn one off"
        )
    if config.validation.enable and not 0.0 < config.validation.fraction < 1.0:
        raise ConfigError(
            f"[validation] fraction={config.validation.fraction} must be between 0 and 1 "
            "(the share of rows held out)"
        )
    if config.checkpoint.keep_last < 0:
        raise ConfigError(f"[checkpoint] keep_last={config.checkpoint.keep_last} must be >= 0")
    if not 0.0 <= config.lr_scheduler.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"[lr_scheduler] min_lr_ratio={config.lr_scheduler.min_lr_ratio} must be in [0, 1]"
        )
    if not 0.0 <= config.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(
            f"[lr_scheduler] decay_ratio={config.lr_scheduler.decay_ratio} must be in [0, 1] "
            "(0 = decay after the warm-up)"
        )
    if not 0 <= config.lr_scheduler.warmup_steps <= config.training.steps:
        raise ConfigError(
            f"[lr_scheduler] warmup_steps={config.lr_scheduler.warmup_steps} must be between 0 "
            f"and training.steps={config.training.steps}"
        )
    if config.training.max_norm < 0:
        raise ConfigError(f"[training] max_norm={config.training.max_norm} must be >= 0 (0 = off)")
    outside = [step for step in config.profiling.steps if not 1 <= step <= config.training.steps]
    if outside:
        raise ConfigError(
            f"[profiling] steps={config.profiling.steps}: {outside} outside 1..training.steps="
            f"{config.training.steps}; name steps the job runs (empty = off)"
        )
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
