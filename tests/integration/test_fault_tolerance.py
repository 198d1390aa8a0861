"""Fault-tolerant replica groups under torchft, drilled as users run them: a lighthouse, one
torchrun of 2 ranks (FSDP inside) per group, a group SIGKILLed mid-run and restarted.

The drill prints what it measured: the steps the surviving group completed while the other was
down, the seconds from the kill to the restarted group's first step, and the bytes it received
from its peer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import torch
from job_runs import descendants, job_command, job_env, kill_process_tree, train_job
from safetensors.torch import load_file
from torchft.coordination import LighthouseServer

STEPS, KILL_AFTER = 140, 8
"""Enough steps that the survivor is still training when the restarted group is up (its
interpreters and process group take seconds, the survivor's steps a fraction of one)."""
RUN = (
    "--training.seq_len", "64", "--training.global_batch_size", "4",
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
    "--metrics.log_interval", "1", "--checkpoint.enable", "false",
)  # fmt: skip
"""A constant learning rate after the warm-up: the reference's first steps are the same
whatever its length."""


def _records(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def _wait_for_step(output_dir: Path, step: int, job: subprocess.Popen, deadline: float) -> None:
    while not (records := _records(output_dir)) or records[-1]["step"] < step:
        assert job.poll() is None and time.monotonic() < deadline, f"no step {step} logged"
        time.sleep(0.05)


def _weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return {
        name: tensor
        for path in sorted((output_dir / "hf").glob("*.safetensors"))
        for name, tensor in load_file(path).items()
    }


def test_a_killed_replica_group_rejoins_from_a_live_peer_and_the_groups_agree(tmp_path):
    """Two groups of 2 ranks: until the kill both log the losses of dp_replicate = 2 on 4
    ranks (to float32 rounding: the sum over groups adds one reduction); group 1 SIGKILLed
    after step 8 (its torchrun with it), group 0 drops the step it was in and trains on alone
    (no restart); group 1 restarted joins at a step boundary, receives the training state
    from group 0 (not from a checkpoint), and from then on both log the same losses bit for
    bit and end with bitwise equal weights."""
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    run = (
        *RUN, "--training.steps", str(STEPS), "--checkpoint.export_hf_at_end", "true",
        "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse",
        lighthouse.address(), "--fault_tolerance.timeout_s", "10",
    )  # fmt: skip
    folders = [tmp_path / f"group{group}" for group in range(2)]
    logs = [tmp_path / f"group{group}.log" for group in range(2)] + [tmp_path / "restarted.log"]

    def start(group: int, log: Path) -> subprocess.Popen:
        command = job_command(folders[group], *run, "--fault_tolerance.replica_group", str(group))
        return subprocess.Popen(
            command, env=job_env(), cwd=tmp_path, stdout=log.open("w"), stderr=subprocess.STDOUT
        )

    try:
        jobs = [start(group, logs[group]) for group in range(2)]
        deadline = time.monotonic() + 300
        _wait_for_step(folders[1], KILL_AFTER, jobs[1], deadline)
        kill_process_tree(jobs[1].pid)
        killed = time.monotonic()
        jobs[1].wait()
        before_kill = {r["step"]: r["loss"] for r in _records(folders[1])}
        restarted = start(1, logs[2])
        _wait_for_step(folders[1], KILL_AFTER + 1, restarted, deadline)
        rejoin_s = time.monotonic() - killed
        assert jobs[0].wait(timeout=300) == 0 and restarted.wait(timeout=300) == 0
    finally:
        lighthouse.shutdown()
        for job in [*jobs, restarted] if "restarted" in locals() else jobs:
            if job.poll() is None:
                kill_process_tree(job.pid)

    survivor = {r["step"]: r["loss"] for r in _records(folders[0])}
    assert sorted(survivor) == list(range(1, STEPS + 1))  # the dropped step was taken again
    reference = train_job(
        tmp_path / "reference", *RUN, "--training.steps", str(KILL_AFTER),
        "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", nproc=4,
    )  # fmt: skip
    for step in range(1, KILL_AFTER + 1):
        assert before_kill[step] == survivor[step]
        assert abs(survivor[step] - reference[step]) <= 1e-6 * abs(reference[step])

    survivor_log, restarted_log = logs[0].read_text(), logs[2].read_text()
    quorums = [
        (int(step), int(groups))
        for step, groups in re.findall(r"step (\d+): (\d) of 2 replica groups", survivor_log)
    ]
    alone = [step for step, groups in quorums if groups == 1]
    rejoined = [step for step, groups in quorums if groups == 2 and alone and step > alone[0]]
    assert alone and rejoined, quorums
    recovery = re.search(r"training state of step (\d+).*: (\d+) bytes", restarted_log)
    assert recovery is not None, restarted_log[-2000:]
    recovered_at, received = int(recovery.group(1)), int(recovery.group(2))
    rejoined_group = {r["step"]: r["loss"] for r in _records(folders[1])}
    assert min(rejoined_group) == recovered_at + 1 > KILL_AFTER + 1
    assert all(rejoined_group[step] == survivor[step] for step in rejoined_group)
    weights = [_weights(folder) for folder in folders]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    print(
        f"\ndrill: group 0 completed steps {alone[0]}..{rejoined[0] - 1} alone "
        f"({rejoined[0] - alone[0]} steps); group 1 logged step {recovered_at + 1} "
        f"{rejoin_s:.1f} s after the kill, having received {received} bytes on rank 0"
    )


def test_a_hung_group_is_dropped_after_the_timeout_and_without_torchft_a_lost_one_stops_all(
    tmp_path,
):
    """Group 1 SIGSTOPped after step 4: group 0's sum waits `timeout_s` (3 s), drops that step,
    and trains every step to the end alone. The ablation: the same 4 ranks as dp_replicate = 2
    without torchft, two ranks killed after step 4: the job stops (torchrun ends it, no step
    after the kill is logged)."""
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    steps = 30
    run = (
        *RUN, "--training.steps", str(steps), "--fault_tolerance.enabled", "true",
        "--fault_tolerance.lighthouse", lighthouse.address(), "--fault_tolerance.timeout_s", "3",
    )  # fmt: skip
    folders = [tmp_path / f"group{group}" for group in range(2)]
    log = tmp_path / "group0.log"
    jobs = []
    try:
        for group, folder in enumerate(folders):
            command = job_command(folder, *run, "--fault_tolerance.replica_group", str(group))
            output = log.open("w") if group == 0 else subprocess.DEVNULL
            jobs.append(subprocess.Popen(command, env=job_env(), cwd=tmp_path, stdout=output,
                                         stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + 300
        _wait_for_step(folders[1], 4, jobs[1], deadline)
        hung = [*descendants(jobs[1].pid), jobs[1].pid]
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)
        assert jobs[0].wait(timeout=300) == 0
    finally:
        lighthouse.shutdown()
        for job in jobs:
            if job.poll() is None:
                kill_process_tree(job.pid)
    survivor = [r["step"] for r in _records(folders[0])]
    assert survivor == list(range(1, steps + 1))
    assert re.search(r"step \d+: 1 of 2 replica groups", log.read_text())

    single = tmp_path / "single"
    job = subprocess.Popen(
        job_command(single, *RUN, "--training.steps", str(steps), "--parallelism.dp_replicate",
                    "2", "--parallelism.dp_shard", "2", nproc=4),
        env=job_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for_step(single, 4, job, time.monotonic() + 300)
        workers = descendants(job.pid)
        for pid in workers[-2:]:
            os.kill(pid, signal.SIGKILL)
        assert job.wait(timeout=120) != 0
    finally:
        if job.poll() is None:
            kill_process_tree(job.pid)
    assert max(r["step"] for r in _records(single)) < steps
