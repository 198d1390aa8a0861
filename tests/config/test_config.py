"""Config loading: precedence, errors that name the fix, help, dump round trip, validation."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipekit.attention.kernels.backends import available_backends
from pipekit.config import ConfigError, JobConfig, help_text, load_job_config
from pipekit.config.dump import dump_toml
from pipekit.config.loader import field_docs, to_dict
from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models.upcycling import UpcycleSpec
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.restore import MEMORY_REUSE_CHOICES
from pipekit.train.activation_checkpoint import ACTIVATION_CHECKPOINT_MODES, SELECTIVE_KEEP
from pipekit.train.config_values import check_values
from pipekit.train.job import validate_job
from pipekit.train.lr_schedule import DECAY_TYPES
from pipekit.train.optimizer import OPTIMIZERS

REPO_ROOT = Path(__file__).resolve().parents[2]


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n")
    config = load_job_config(["--config", path, "--training.steps", "9", "--job.name=x"])
    assert config.training.steps == 9  # CLI wins
    assert config.training.seq_len == 64  # TOML wins over the default
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)  # int -> float
    assert config.training.global_batch_size == JobConfig().training.global_batch_size
    assert config.job.name == "x"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[trainig]\nsteps = 1\n", r"unknown config section \[trainig\] \(did you mean 'training'"),
        ("[training]\nstep = 1\n", r"unknown key 'step' in \[training\] \(did you mean 'steps'"),
        ("[training]\nsteps = 'ten'\n", r"\[training\] steps expects int, got 'ten'"),
        ("[checkpoint]\nenable = 1\n", r"\[checkpoint\] enable expects bool, got 1"),
        ("[training]\nsteps = 1.5\n", r"steps expects int, got 1.5"),
        ("steps = 3\n", "must be a \\[section\\]"),
        ("[training\n", "not valid TOML"),
        ("[moe]\npartitions = 2.5\n", r"\[moe\] partitions expects int or str, got 2.5"),
    ],
)
def test_bad_toml_names_the_problem(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--config", _toml(tmp_path, text)])


def test_union_fields_take_the_first_member_that_fits(tmp_path):
    """`[moe] partitions` is `int | str`: 4 and "4" are ints, "auto" stays text."""
    assert (
        load_job_config(["--config", _toml(tmp_path, "[moe]\npartitions = 4\n")]).moe.partitions
        == 4
    )
    assert load_job_config(["--moe.partitions", "4"]).moe.partitions == 4
    assert load_job_config(["--moe.partitions", "auto"]).moe.partitions == "auto"


def test_bad_cli_names_the_problem():
    with pytest.raises(ConfigError, match=r"--training.steps expects int, got 'x'"):
        load_job_config(["--training.steps", "x"])
    with pytest.raises(ConfigError, match=r"valid names: .*seq_len"):
        load_job_config(["--training.sequence_length", "8"])
    with pytest.raises(ConfigError, match="needs a value"):
        load_job_config(["--training.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_job_config(["--config", "nowhere.toml"])
    assert load_job_config(["--checkpoint.enable", "false"]).checkpoint.enable is False


def test_every_field_has_a_doc_and_appears_in_help():
    text = help_text()
    pending = [
        (section.name, getattr(JobConfig(), section.name))
        for section in dataclasses.fields(JobConfig)
    ]
    while pending:
        name, section = pending.pop()
        docs = field_docs(type(section))
        for field in dataclasses.fields(section):
            assert docs.get(field.name), f"[{name}] {field.name} has no docstring"
            value = getattr(section, field.name)
            if dataclasses.is_dataclass(value):  # a sub-section: its keys are listed instead
                assert f"[{name}.{field.name}]" in text
                pending.append((f"{name}.{field.name}", value))
                continue
            assert f"--{name}.{field.name} " in text
            assert docs[field.name] in text


def test_sub_sections_load_from_toml_and_command_line(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama"\n[model.upcycle]\nnum_experts = 4\nlayers = 2\n')
    config = load_job_config(["--config", str(path), "--model.upcycle.top_k", "1"])
    upcycle = config.model.upcycle
    assert (upcycle.num_experts, upcycle.layers, upcycle.top_k) == (4, 2, 1)
    assert UpcycleSpec.from_config(upcycle).moe_every == 2
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(dump_toml(to_dict(config)))
    assert load_job_config(["--config", str(dumped)]) == config
    with pytest.raises(ConfigError, match=r"unknown key 'expertz' in \[model.upcycle\]"):
        load_job_config(["--model.upcycle.expertz", "3"])
    with pytest.raises(ConfigError, match=r"\[model\] upcycle is a section"):
        load_job_config(["--model.upcycle", "3"])
    with pytest.raises(ConfigError, match=r"\[model\] has no sub-section 'upcycel'"):
        load_job_config(["--model.upcycel.num_experts", "3"])


def test_dump_round_trips(tmp_path):
    config = load_job_config(["--training.steps", "3", "--data.source", "stdlib"])
    path = _toml(tmp_path, dump_toml(to_dict(config)))
    assert load_job_config(["--config", path]) == config


def test_print_config_prints_the_checked_resolved_config():
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/debug_model.toml",
            "--training.steps",
            "50",
            "--print-config",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "[training]\nsteps = 50\n" in result.stdout
    assert result.stderr == "# checked for 1 rank(s)\n"  # dp_shard=-1 takes the least


TP3 = ("--parallelism.tp", "3")


def test_print_config_runs_the_rules_that_need_a_world_size():
    """tp=3 needs a world size to be checked at all; the model's heads refuse it."""
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/debug_model.toml",
            *TP3,
            "--print-config",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "tp=3 must divide the model's heads" in result.stderr
    assert (
        ParallelDims.smallest_world_size(
            load_job_config(["--parallelism.ep", "4", "--parallelism.cp", "2"]).parallelism
        )
        == 4
    )  # dp_shard=-1 takes 2, so ep=4 divides the 2 x 2 ranks that hold tokens


_PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.mark.parametrize(
    ("argv", "world_size", "message"),
    [
        (
            ["--training.global_batch_size", "6", "--parallelism.dp_shard", "4"],
            4,
            "global_batch_size=6 must be divisible by data-parallel degree 4",
        ),
        (["--parallelism.dp_shard", "2", "--parallelism.dp_replicate", "2"], 2, "world size"),
        (["--parallelism.tp", "3"], 3, "tp=3 must divide the model's heads"),
        (["--data.source", "/no/such/*.jsonl"], 1, "matches no file"),
        (["--data.tokenizer", "/no/tokenizer.json"], 1, "is not a file"),
        (["--checkpoint.initial_load_path", "/no/dir"], 1, "has no config.json"),
        (["--model.flavor", "9B"], 1, "unknown llama flavor '9B'"),
        (["--model.name", "gpt5"], 1, r"unknown model 'gpt5'; known models: \['deepseek_v3'"),
        (["--model.module", "no_such_pkg.model"], 1, "module='no_such_pkg.model' cannot be"),
        (["--training.seq_len", "9000"], 1, "seq_len=9000 is longer than model llama"),
        (["--model.attention_backend", "fast"], 1, "attention_backend='fast' is not one of"),
        (["--lr_scheduler.warmup_steps", "500", "--training.steps", "10"], 1, "warmup_steps=500"),
        (["--training.seq_len", "0"], 1, "seq_len=0 must be positive"),
        (["--optimizer.lr", "nan"], 1, r"\[optimizer\] lr=nan must be a finite number"),
        (["--optimizer.lr", "inf"], 1, r"\[optimizer\] lr=inf must be a finite number"),
        (["--optimizer.lr", "1e39"], 1, r"\[optimizer\] lr=1e\+39 must be in \(0, 1\]"),
        (["--optimizer.beta2", "1.5"], 1, r"\[optimizer\] beta2=1.5 must be in \[0, 1\)"),
        (["--optimizer.eps", "0"], 1, r"\[optimizer\] eps=0.0 must be positive"),
        (["--optimizer.weight_decay", "-1"], 1, r"weight_decay=-1.0 must be >= 0"),
        (["--data.shuffle_buffer", "-1"], 1, r"\[data\] shuffle_buffer=-1 must be >= 0"),
        (
            ["--parallelism.pipeline_embedding_cost", "-3"],
            1,
            r"\[parallelism\] pipeline_embedding_cost=-3.0 must be >= 0",
        ),
        (["--job.output_dir", str(REPO_ROOT / "README.md" / "out")], 1, "is a file, not a"),
        (["--parallelism.activation_offload", "0.5"], 1, "follows a pipeline's schedule"),
        ([*_PP2, "--parallelism.activation_offload", "1.5"], 2, r"must be in \[0, 1\]"),
        ([*_PP2, "--parallelism.activation_offload", "0.5;0.5;0.5"], 2, "3 ratios for 2"),
        ([*_PP2, "--parallelism.activation_offload", "most"], 2, "must be a number in"),
        (
            [
                *_PP2,
                "--parallelism.activation_offload",
                "auto",
                "--training.activation_checkpoint",
                "selective",
            ],
            2,
            "out of the offload's reach",
        ),
        (
            [
                *_PP2,
                "--parallelism.pipeline_schedule",
                "ZBVZeroBubble",
                "--parallelism.stages_per_rank",
                "2",
                "--training.activation_checkpoint",
                "full",
            ],
            2,
            r"\[training\] activation_checkpoint='full' with pipeline_schedule='ZBVZeroBubble', "
            "which splits backwards",
        ),
        (
            [
                *_PP2,
                "--parallelism.activation_offload",
                "0.5",
                "--parallelism.activation_offload_dir",
                "/no/such/folder",
            ],
            2,
            "is not a writable folder",
        ),
    ],
)
def test_cross_field_rules_say_how_to_fix(argv, world_size, message):
    config = load_job_config(argv)
    with pytest.raises(ConfigError, match=message):
        validate_job(config, world_size=world_size)


DEBUG_WORLD_SIZES = {
    "debug_deepseek_v3.toml": 4,
    "debug_gpt_oss.toml": 4,
    "debug_moe_balanced.toml": 4,
    "debug_moe_sliced_pp.toml": 4,
    "debug_cp_sliced_pp.toml": 4,
    "debug_5d.toml": 8,
}
"""Debug configs written for other than 2 ranks."""


def test_shipped_configs_load_and_debug_configs_validate():
    for path in sorted((REPO_ROOT / "configs").glob("*.toml")):
        config = load_job_config(["--config", str(path)])
        if path.name.startswith("debug") and not config.checkpoint.initial_load_path:
            # the others name files not shipped
            validate_job(config, world_size=DEBUG_WORLD_SIZES.get(path.name, 2))


def test_paper_upcycling_config_runs_a_layout_the_trainer_supports():
    """configs/llama3_8b_e8t2_upcycle.toml: the paper's E8T2 with capacity factor 4, laid out
    as EP 8 over FSDP2 on 512 ranks (what the trainer runs); tp 2 with an MoE model needs
    sequence parallelism (each tp rank routes its own tokens)."""
    config = load_job_config(["--config", str(REPO_ROOT / "configs/llama3_8b_e8t2_upcycle.toml")])
    spec = UpcycleSpec.from_config(config.model.upcycle)
    assert (spec.num_experts, spec.top_k, spec.capacity_factor) == (8, 2, 4.0)
    dims = validate_job(config, world_size=512, check_files=False).dims
    assert (dims.dp_shard, dims.ep, dims.tp, dims.pp) == (512, 8, 1, 1)
    config.parallelism.tp = 2
    assert validate_job(config, world_size=512, check_files=False).dims.tp == 2
    config.parallelism.sequence_parallel = False
    with pytest.raises(ConfigError, match="mixture-of-experts model needs sequence_parallel"):
        validate_job(config, world_size=512, check_files=False)


def test_context_parallel_pipelines_are_checked_before_launch():
    """cp inside the sliced pipeline is planned, with context exchange on top; a seq_len the
    slices and cp ranks do not divide, and exchange with KV passing, are refused with the
    fix."""
    argv = ["--config", str(REPO_ROOT / "configs/debug_sliced_pp.toml"), "--parallelism.cp", "2"]
    job = validate_job(load_job_config(argv), world_size=4, check_files=False)
    assert job.pipeline is not None and job.pipeline.context_parallel == 2
    assert job.pipeline.slice_length == 256 // 4 // 2
    exchange = [*argv, "--parallelism.context_exchange", "true"]
    job = validate_job(load_job_config(exchange), world_size=4, check_files=False)
    assert job.pipeline is not None and "context_exchange" in job.pipeline.features
    for overrides, message in [
        (("--training.seq_len", "248"), "seq_len=248 must be a multiple of 2 x cp x num_slices"),
        (
            ("--parallelism.context_exchange", "true", "--parallelism.cp_variant", "kv_passing"),
            "use cp_variant = 'auto' or 'commutated'",
        ),
        (
            ("--parallelism.cp_variant", "hybrid"),
            r"\[parallelism\] cp_variant='hybrid' is not one of auto, commutated, hierarchical",
        ),
        (
            ("--parallelism.cp_balance_pieces", "3"),
            "multiple of cp_balance_pieces x cp x num_slices = 24: .* change cp, "
            "cp_balance_pieces or num_slices",
        ),
        (
            ("--parallelism.cp_balance", "rows"),
            "cp_balance='rows' is not one of documents, sequence",
        ),
        (("--parallelism.cp_balance_pieces", "0"), "cp_balance_pieces=0 must be positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_job(load_job_config([*argv, *overrides]), world_size=4, check_files=False)


@pytest.mark.parametrize(
    ("section", "key", "choices"),
    [
        ("model", "attention_backend", available_backends()),
        ("training", "mixed_precision_param", MIXED_PRECISION_DTYPES),
        ("training", "mixed_precision_reduce", MIXED_PRECISION_DTYPES),
        ("training", "activation_checkpoint", ACTIVATION_CHECKPOINT_MODES),
        ("training", "activation_checkpoint_keep", SELECTIVE_KEEP),
        ("optimizer", "name", OPTIMIZERS),
        ("lr_scheduler", "decay_type", DECAY_TYPES),
        ("moe", "memory_reuse", MEMORY_REUSE_CHOICES),
    ],
)
def test_a_keys_choices_are_its_components(section, key, choices):
    """The config accepts exactly the choices the component that reads the key lists, and its
    help names each of them."""
    config = JobConfig()
    for value in choices:
        setattr(getattr(config, section), key, value)
        check_values(config)
        assert value in field_docs(type(getattr(config, section)))[key]
    setattr(getattr(config, section), key, "none_of_these")
    listed = re.escape(", ".join(choices))
    message = rf"\[{section}\] {key}='none_of_these' is not one of {listed}$"
    with pytest.raises(ConfigError, match=message):
        check_values(config)


@pytest.mark.parametrize("partitions", [0, -2, "most", 2.5])
def test_moe_partitions_rule_is_the_experts(partitions):
    """The config refuses the partitions `ExpertExecution` refuses, with its words."""
    with pytest.raises(ValueError) as refused:
        ExpertExecution(partitions=partitions)
    config = JobConfig()
    config.moe.partitions = partitions
    with pytest.raises(ConfigError) as error:
        check_values(config)
    assert str(error.value) == f"[moe] {refused.value}"
    for accepted in (1, 4, "auto"):
        config.moe.partitions = accepted
        check_values(config)


def test_config_reference_doc_is_current():
    from pipekit.config.loader import reference_markdown

    current = (REPO_ROOT / "docs" / "config.md").read_text()
    assert current == reference_markdown(), (
        "docs/config.md is stale: python -m pipekit.config.reference > docs/config.md"
    )


def test_offload_rules_apply_only_where_the_plan_offloads() -> None:
    """Ratios that are all 0 turn activation offload off at planning: checkpointing and a
    missing offload folder are then no conflict (the feature's rules run where it is on)."""
    argv = [*_PP2, "--parallelism.activation_offload", "0;0"]
    argv += ["--training.activation_checkpoint", "selective"]
    argv += ["--parallelism.activation_offload_dir", "/no/such/folder"]
    job = validate_job(load_job_config(argv), world_size=2)
    assert job.pipeline is not None and "activation_offload" not in job.pipeline.features
