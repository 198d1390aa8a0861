"""Pipeline parallelism: stage split, SlimPipe's sliced schedule, and torch's schedules as
baselines."""

from pipekit.pipelining.actions import (
    peak_units_in_flight,
    read_actions_csv,
    sliced_pipeline_actions,
    sliced_warmup_forwards,
    unit_index,
    unit_microbatch_and_slice,
    write_actions_csv,
)
from pipekit.pipelining.build import build_rank_stages
from pipekit.pipelining.memory import ActivationMemoryTracker, MemoryReport, active_memory_tracker
from pipekit.pipelining.schedule import (
    TORCH_SCHEDULES,
    PipelineRunner,
    SlicedPipelineSchedule,
    build_pipeline_runner,
)
from pipekit.pipelining.simulate import (
    CostModel,
    ScheduleDeadlockError,
    SimulationResult,
    simulate,
)
from pipekit.pipelining.split import split_into_units
from pipekit.pipelining.stage import SlicedPipelineStage, StageShapes
from pipekit.pipelining.stage_split import (
    build_stage_module,
    llama_stage_module_names,
    partition_layers,
    stage_to_rank,
    stages_of_rank,
    validate_stage_module_names,
)
from pipekit.pipelining.timeline import ScheduledAction, chrome_trace, write_chrome_trace
from pipekit.pipelining.torch_actions import torch_schedule_actions
from pipekit.pipelining.user_schedule import (
    ScheduleError,
    Task,
    UserPipelineSchedule,
    check_schedule,
    load_schedule_file,
    tasks_to_actions,
)

__all__ = [
    "TORCH_SCHEDULES",
    "ActivationMemoryTracker",
    "CostModel",
    "MemoryReport",
    "PipelineRunner",
    "ScheduleDeadlockError",
    "ScheduleError",
    "ScheduledAction",
    "SimulationResult",
    "SlicedPipelineSchedule",
    "SlicedPipelineStage",
    "StageShapes",
    "Task",
    "UserPipelineSchedule",
    "active_memory_tracker",
    "build_pipeline_runner",
    "build_rank_stages",
    "build_stage_module",
    "check_schedule",
    "chrome_trace",
    "llama_stage_module_names",
    "load_schedule_file",
    "partition_layers",
    "peak_units_in_flight",
    "read_actions_csv",
    "simulate",
    "sliced_pipeline_actions",
    "sliced_warmup_forwards",
    "split_into_units",
    "stage_to_rank",
    "stages_of_rank",
    "tasks_to_actions",
    "torch_schedule_actions",
    "unit_index",
    "unit_microbatch_and_slice",
    "validate_stage_module_names",
    "write_actions_csv",
    "write_chrome_trace",
]
