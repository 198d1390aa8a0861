"""Job configuration: dataclass sections, TOML + CLI loading, validation, dump."""

from pipekit.config.job_config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    JobSection,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)
from pipekit.config.loader import ConfigError, help_text, load_job_config, to_dict
from pipekit.config.validate import validate_job_config

__all__ = [
    "CheckpointConfig",
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
    "TrainingConfig",
    "help_text",
    "load_job_config",
    "to_dict",
    "validate_job_config",
]
