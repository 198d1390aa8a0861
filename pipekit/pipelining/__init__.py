"""Pipeline parallelism: SlimPipe's sliced schedule, torch's schedules as baselines, user
schedules, features as extensions, and one builder.

Subpackages, lowest first (each imports only those above it in this list):
- `schedules`: action lists as data, the schedule registry, the checker and the simulator;
- `model_split`: which blocks each stage holds, on which rank, and the stage as a module;
- `runtime`: the sliced stage, torch's runtime fed with action lists, the extension hooks,
  the runner;
- `features`: the feature table (`features.registry`) and pipekit's features (vocabulary
  parallelism, context exchange, context parallelism, activation offload) as extensions;
- `plan.py` (config -> plan, pure) and `build.py` (plan + model -> runner);
- `tools`: recorded timelines, traces and pictures.
"""

from pipekit.models.stage_module import (
    build_stage_module,
    validate_stage_module_names,
)
from pipekit.pipelining.actions import BACKWARD, FORWARD, Action
from pipekit.pipelining.build import StageSetup, build_pipeline
from pipekit.pipelining.features.context_exchange import PipelineContextExchange
from pipekit.pipelining.features.registry import (
    FeatureBuilding,
    FeatureLayout,
    FeaturePlanning,
    PipelineFeature,
    enabled_pipeline_features,
    get_pipeline_feature,
    pipeline_feature_names,
    register_pipeline_feature,
)
from pipekit.pipelining.features.vocab_parallel import PipelineVocabParallel
from pipekit.pipelining.model_split.partition import (
    blocks_per_stage,
    partition_layers,
    stage_module_names,
    stage_to_rank,
    stages_of_rank,
)
from pipekit.pipelining.plan import PipelinePlan, plan_pipeline
from pipekit.pipelining.runtime.action_runtime import (
    ActionListSchedule,
    SlicedPipelineSchedule,
    UserPipelineSchedule,
)
from pipekit.pipelining.runtime.batch_split import split_into_units
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.runtime.runner import PipelineRunner, make_schedule
from pipekit.pipelining.runtime.stage import SlicedPipelineStage, StageShapes
from pipekit.pipelining.schedules.check import ScheduleError, check_schedule
from pipekit.pipelining.schedules.registry import (
    SCHEDULES,
    ScheduleEntry,
    ScheduleShape,
    get_schedule,
    register_schedule,
)
from pipekit.pipelining.schedules.simulate import (
    CostModel,
    ScheduleDeadlockError,
    SimulationResult,
    simulate,
)
from pipekit.pipelining.schedules.sliced import (
    peak_units_in_flight,
    sliced_pipeline_actions,
    sliced_warmup_forwards,
)
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions
from pipekit.pipelining.schedules.units import unit_index, unit_microbatch_and_slice
from pipekit.pipelining.schedules.user import (
    Task,
    load_schedule_file,
    read_actions_csv,
    tasks_to_actions,
    write_actions_csv,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "SCHEDULES",
    "Action",
    "ActionListSchedule",
    "CostModel",
    "FeatureBuilding",
    "FeatureLayout",
    "FeaturePlanning",
    "PipelineContextExchange",
    "PipelineExtension",
    "PipelineFeature",
    "PipelinePlan",
    "PipelineRunner",
    "PipelineVocabParallel",
    "ScheduleDeadlockError",
    "ScheduleEntry",
    "ScheduleError",
    "ScheduleShape",
    "SimulationResult",
    "SlicedPipelineSchedule",
    "SlicedPipelineStage",
    "StageSetup",
    "StageShapes",
    "Task",
    "UserPipelineSchedule",
    "blocks_per_stage",
    "build_pipeline",
    "build_stage_module",
    "check_schedule",
    "enabled_pipeline_features",
    "get_pipeline_feature",
    "get_schedule",
    "load_schedule_file",
    "make_schedule",
    "partition_layers",
    "peak_units_in_flight",
    "pipeline_feature_names",
    "plan_pipeline",
    "read_actions_csv",
    "register_pipeline_feature",
    "register_schedule",
    "simulate",
    "sliced_pipeline_actions",
    "sliced_warmup_forwards",
    "split_into_units",
    "stage_module_names",
    "stage_to_rank",
    "stages_of_rank",
    "tasks_to_actions",
    "torch_schedule_actions",
    "unit_index",
    "unit_microbatch_and_slice",
    "validate_stage_module_names",
    "write_actions_csv",
]
