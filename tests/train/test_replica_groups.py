"""`[fault_tolerance]` before launch: each rule's one-line error, the groups' share of the
batch, and torchft left unimported when the section is off (the drills themselves are in
tests/integration/test_fault_tolerance.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from pipekit.config import ConfigError, load_job_config
from pipekit.train.job import validate_job
from pipekit.train.replica_groups import LIGHTHOUSE_VARIABLE, check_fault_tolerance

CONFIG = ["--config", "configs/debug_model.toml", "--fault_tolerance.enabled", "true"]
LIGHTHOUSE = ["--fault_tolerance.lighthouse", "http://localhost:29510"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--fault_tolerance.replica_group", "2"], r"replica_group=2 must be in 0 \.\. groups - 1"),
        (["--fault_tolerance.min_replicas", "3"], r"min_replicas=3 must be in 1 \.\. groups = 2"),
        (["--fault_tolerance.groups", "0"], "groups=0 must be >= 1"),
        (["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"],
         "take the place of dp_replicate=2"),
        (["--fault_tolerance.timeout_s", "0"], "must be > 0"),
        (["--training.global_batch_size", "6"], "data-parallel degree 4"),
    ],
)  # fmt: skip
def test_each_rule_is_one_line_naming_the_fix(overrides, message):
    config = load_job_config([*CONFIG, *LIGHTHOUSE, *overrides])
    with pytest.raises(ConfigError, match=message) as error:
        validate_job(config, world_size=2)
    assert "\n" not in str(error.value)


def test_the_lighthouse_and_torchft_must_be_there(monkeypatch):
    monkeypatch.delenv(LIGHTHOUSE_VARIABLE, raising=False)
    section = load_job_config(CONFIG).fault_tolerance
    with pytest.raises(ConfigError, match="needs the lighthouse's address"):
        check_fault_tolerance(section, dp_replicate=1)
    monkeypatch.setenv(LIGHTHOUSE_VARIABLE, "http://localhost:29510")
    assert check_fault_tolerance(section, dp_replicate=1) == 2
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'pipekit\[ft\]'"):
        check_fault_tolerance(section, dp_replicate=1)


def test_the_groups_split_the_batch_as_dp_replicate_does():
    """Group 1 of 2, 2 ranks each: ranks 2 and 3 of 4 data-parallel shares, a quarter of the
    global batch each; the section off, nothing changes."""
    job = validate_job(load_job_config([*CONFIG, *LIGHTHOUSE, "--fault_tolerance.replica_group",
                                        "1"]), world_size=2)  # fmt: skip
    assert job.data_parallel_degree == 4 and job.replica_groups == 2
    assert [job.data_parallel_rank(rank) for rank in (0, 1)] == [2, 3]
    assert job.local_batch_size == job.config.training.global_batch_size // 4
    plain = validate_job(load_job_config(CONFIG[:2]), world_size=2)
    assert (plain.data_parallel_degree, plain.data_parallel_rank(1)) == (2, 1)


def test_torchft_is_not_imported_when_the_section_is_off():
    code = (
        "import sys; from pipekit.config import load_job_config; "
        "from pipekit.train.job import validate_job; import pipekit.train.trainer; "
        "validate_job(load_job_config(['--config', 'configs/debug_model.toml']), 2); "
        "assert 'torchft' not in sys.modules, 'torchft imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_process_without_torchrun_hosts_its_groups_store(monkeypatch):
    """`python train.py` with the section on (no torchrun, so no MASTER_ADDR): the group's
    store is hosted in the process, the quorum forms, and torchft's sync count follows the step
    the job starts at."""
    from torchft.coordination import LighthouseServer

    from pipekit.config.fault_tolerance import FaultToleranceConfig
    from pipekit.train.replica_groups import ReplicaGroups

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    config = FaultToleranceConfig(
        enabled=True, groups=1, lighthouse=lighthouse.address(), quorum_timeout_s=2
    )
    groups = ReplicaGroups(config, torch.device("cpu"), dict)
    try:
        groups.start_step()
        assert groups.participants == 1
        groups.start_at(6)
        assert groups.manager.current_step() == 6
    finally:
        groups.shutdown()
        lighthouse.shutdown()
