"""Job configuration: dataclass sections, TOML + CLI loading, dump (torch-free; the values
are checked by `pipekit.train.config_values`)."""

from pipekit.config.job_config import (
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    DebugConfig,
    FaultToleranceConfig,
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

__all__ = [
    "CheckpointConfig",
    "CompileConfig",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "FaultToleranceConfig",
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
    "help_text",
    "load_job_config",
    "to_dict",
]
