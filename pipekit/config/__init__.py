"""Job configuration: dataclass sections, TOML + CLI loading, validation, dump."""

from pipekit.config.job_config import (
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    JobConfig,
    JobSection,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelismConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
)
from pipekit.config.loader import ConfigError, help_text, load_job_config, to_dict
from pipekit.config.validate import check_values

__all__ = [
    "CheckpointConfig",
    "CompileConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "JobSection",
    "LRSchedulerConfig",
    "MetricsConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "ValidationConfig",
    "check_values",
    "help_text",
    "load_job_config",
    "to_dict",
]
