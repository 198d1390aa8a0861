"""`[parallelism]` pipeline keys resolve to a concrete plan, and each broken rule is reported
before any process group exists, with the fix in the message."""

import pytest

from pipekit.config.job_config import JobConfig, ParallelismConfig
from pipekit.config.loader import ConfigError
from pipekit.models import get_model_spec
from pipekit.pipelining.plan import plan_pipeline
from pipekit.train.job import validate_job


def _plan(num_layers: int = 8, local_batch: int = 4, seq_len: int = 64, **keys):
    keys.setdefault("dp_shard", 1)
    config = ParallelismConfig(pipeline_parallel_degree=keys.pop("pp", 2), **keys)
    llama = get_model_spec("llama")
    shape = llama.shape(llama.flavor("debug").with_updates(n_layers=num_layers))
    return plan_pipeline(config, llama.structure, shape, local_batch, seq_len)


def test_defaults_resolve_to_two_slices_per_rank_and_one_sequence_per_microbatch():
    plan = _plan(pp=4)
    assert (plan.schedule, plan.num_slices, plan.num_microbatches) == ("sliced", 8, 4)
    assert plan.num_stages == 4 and plan.stage_style == "loop"
    assert plan.module_names_per_stage[0][:2] == ["rope", "tok_embeddings"]
    assert plan.module_names_per_stage[-1][-2:] == ["norm", "output"]


def test_torch_schedules_run_whole_microbatches_and_v_schedules_place_a_v():
    assert _plan(pipeline_schedule="1F1B").num_slices == 1
    plan = _plan(pipeline_schedule="ZBVZeroBubble", stages_per_rank=2)
    assert plan.stage_style == "v" and plan.num_stages == 4


def test_explicit_stage_modules_are_parsed_per_stage():
    entries = ["tok_embeddings, layers.0, layers.1", "layers.2,layers.3,norm,output"]
    plan = _plan(num_layers=4, pipeline_stage_modules=entries)
    assert plan.module_names_per_stage == [  # the shared RoPE added on every stage
        ["rope", "tok_embeddings", "layers.0", "layers.1"],
        ["rope", "layers.2", "layers.3", "norm", "output"],
    ]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"num_slices": 3}, "num_slices=3 must be a multiple of pipeline_parallel_degree=2"),
        ({"num_slices": 6}, "seq_len=64 does not split into num_slices=6"),
        ({"microbatches": 3}, "microbatches=3 must divide the local batch of 4"),
        ({"pipeline_schedule": "1F1B", "num_slices": 4}, "num_slices=4 needs a sliced schedule"),
        ({"pipeline_schedule": "1F1B", "stages_per_rank": 2}, "set stages_per_rank=1"),
        ({"pipeline_schedule": "ZBVZeroBubble"}, "set stages_per_rank=2"),
        ({"pipeline_schedule": "Zero"}, "pipeline_schedule='Zero' is not known"),
        ({"pipeline_stage_modules": ["tok_embeddings,layers.0"]}, "give one entry per stage"),
        ({"stages_per_rank": 8}, "num_layers=8 is smaller than num_stages=16"),
        (
            {"pipeline_schedule": "1F1B", "microbatches": 1},
            "needs num_microbatches=1 >= num_ranks=2",
        ),
        (
            {"pipeline_schedule": "DualPipeV", "stages_per_rank": 2, "microbatches": 2},
            "rejects pipeline_parallel_degree=2, stages_per_rank=2, microbatches=2",
        ),
    ],
)
def test_broken_pipeline_rules_name_the_fix(keys, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _plan(**keys)


def _job(**parallelism) -> JobConfig:
    config = JobConfig()
    config.model.flavor = "debug"
    config.training.global_batch_size, config.training.seq_len = 4, 64
    config.parallelism = ParallelismConfig(dp_shard=1, pipeline_parallel_degree=2, **parallelism)
    return config


def test_job_validation_checks_the_pipeline_before_any_process_group():
    validate_job(_job(), world_size=2)
    with pytest.raises(ConfigError, match=r"\[parallelism\] num_slices=3 must be a multiple"):
        validate_job(_job(num_slices=3), world_size=2)
    bad_modules = ["tok_embeddings,layers.0,layers.1", "layers.3,layers.2,norm,output,extra"]
    with pytest.raises(ConfigError, match="unknown module names"):
        validate_job(_job(pipeline_stage_modules=bad_modules), world_size=2)
    config = _job()
    config.training.mixed_precision_param = "bfloat16"
    validate_job(config, world_size=2)  # bf16 stages: FSDP2's mixed precision, bf16 messages
    config.checkpoint.export_hf_at_end = True
    validate_job(config, world_size=2)  # every rank exports its stages' tensors


def test_context_exchange_needs_sliced_passes_and_a_layer_on_every_stage():
    assert _plan(context_exchange=True).features == ("context_exchange",)
    with pytest.raises(ValueError, match="'1F1B' cannot carry context_exchange"):
        _plan(context_exchange=True, pipeline_schedule="1F1B")
    entries = ["tok_embeddings", "layers.0,layers.1,norm,output"]
    with pytest.raises(ValueError, match=r"stages \[0\] hold no transformer layer"):
        _plan(num_layers=2, context_exchange=True, pipeline_stage_modules=entries)


def test_vocab_parallel_output_passes_fit_an_exchanging_schedule():
    plan = _plan(pp=4, context_exchange=True, vocab_parallel=True, local_batch=8)
    assert plan.features == ("context_exchange", "vocab_parallel")


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_split_backward_schedules_are_refused_on_data_parallel_stages(schedule: str) -> None:
    """torch's runtime gives FSDP-sharded stages wrong weight gradients under I/W actions (the
    parity matrix measured it); the plan refuses before anything runs."""
    keys = {"pipeline_schedule": schedule, "stages_per_rank": 2, "microbatches": 2}
    assert _plan(**keys).schedule == schedule  # one data rank: fine
    with pytest.raises(ValueError, match="splits backwards into input and weight parts"):
        _plan(dp_shard=2, **keys)
    config = JobConfig()
    config.parallelism.pipeline_parallel_degree, config.parallelism.stages_per_rank = 2, 2
    config.parallelism.pipeline_schedule = schedule
    config.training.global_batch_size = 8
    with pytest.raises(ConfigError, match=r"\[parallelism\].*full backwards"):
        validate_job(config, world_size=4)
    config.parallelism.dp_shard = 1
    assert validate_job(config, world_size=2).pipeline is not None


@pytest.mark.parametrize("setting", [[0.0, 0.0], "auto"])
def test_offload_that_moves_nothing_is_off(setting) -> None:
    """Ratios that are all 0 (given, or what "auto" finds on ranks already even) turn the
    feature off at planning: it is not built, and torch's own schedule class runs."""
    plan = _plan(
        pipeline_schedule="GPipe", microbatches=1, num_slices=1, activation_offload=setting
    )
    assert "activation_offload" not in plan.features
    assert "activation_offload" not in plan.feature_plans
