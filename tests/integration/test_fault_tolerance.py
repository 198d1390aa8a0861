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
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from job_runs import (
    CONFIG,
    SLICED_PP_CONFIG,
    descendants,
    job_command,
    job_env,
    kill_process_tree,
    train_job,
)
from safetensors.torch import load_file
from torchft.coordination import LighthouseServer

STEPS, KILL_AFTER = 16, 8
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


def _signal_trees(jobs: list[subprocess.Popen], signum: int) -> None:
    """Send `signum` to every process of the jobs (torchrun and its workers)."""
    for job in jobs:
        for pid in [job.pid, *descendants(job.pid)]:
            os.kill(pid, signum)


def _weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return {
        name: tensor
        for path in sorted((output_dir / "hf").glob("*.safetensors"))
        for name, tensor in load_file(path).items()
    }


@pytest.mark.parametrize(
    ("groups", "config", "layout"),
    [(3, CONFIG, ("--parallelism.dp_shard", "2", "--training.global_batch_size", "6")),
     (2, SLICED_PP_CONFIG, ("--parallelism.microbatches", "2", "--parallelism.num_slices", "2"))],
    ids=["3_groups_fsdp", "2_groups_sliced_pipeline"],
)  # fmt: skip
def test_a_killed_replica_group_rejoins_from_a_live_peer_and_the_groups_agree(
    tmp_path, groups, config, layout
):
    """`groups` groups of 2 ranks (FSDP, or a sliced pipeline of 2 stages): until the kill all
    log the losses of dp_replicate = groups on one torchrun (to float32 rounding: the sum over
    groups adds one reduction); the last group SIGKILLed after step 8 (its torchrun with it),
    the others drop the step they were in and train on without it (no restart); the group
    restarted joins at a step boundary, receives the training state from a live group (not
    from a checkpoint), and from then on all log the same losses bit for bit and end with
    bitwise equal weights. The rejoin time includes the seconds the others were held.

    With two survivors, one may have committed the step the victim died in and the other not
    (each group decides by its own sums): the one behind then heals from the other at the next
    step, as a restarted group does, and skips that step in its log. Every step is logged by
    some survivor, and survivors that logged a step logged the same loss."""
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    run = (
        *RUN, *layout, "--training.steps", str(STEPS), "--checkpoint.export_hf_at_end", "true",
        "--fault_tolerance.enabled", "true", "--fault_tolerance.groups", str(groups),
        "--fault_tolerance.lighthouse", lighthouse.address(), "--fault_tolerance.timeout_s", "10",
    )  # fmt: skip
    folders = [tmp_path / f"group{group}" for group in range(groups)]
    logs = [tmp_path / f"group{group}.log" for group in range(groups)]
    victim = groups - 1

    def start(group: int, log: Path) -> subprocess.Popen:
        command = job_command(folders[group], *run, "--fault_tolerance.replica_group", str(group),
                              config=config)  # fmt: skip
        return subprocess.Popen(
            command, env=job_env(), cwd=tmp_path, stdout=log.open("w"), stderr=subprocess.STDOUT
        )

    jobs = [start(group, logs[group]) for group in range(groups)]
    try:
        deadline = time.monotonic() + 300
        _wait_for_step(folders[victim], KILL_AFTER, jobs[victim], deadline)
        kill_process_tree(jobs[victim].pid)
        killed = time.monotonic()
        jobs[victim].wait()
        before_kill = {r["step"]: r["loss"] for r in _records(folders[victim])}
        # the others go on without it; then they are held (SIGSTOP) while the group restarts,
        # so that on a busy machine they cannot finish before it is up
        _wait_for_step(folders[0], KILL_AFTER + 3, jobs[0], deadline)
        _signal_trees(jobs[:victim], signal.SIGSTOP)
        jobs[victim] = start(victim, tmp_path / "restarted.log")
        while "training " not in (tmp_path / "restarted.log").read_text():
            assert jobs[victim].poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        _signal_trees(jobs[:victim], signal.SIGCONT)
        _wait_for_step(folders[victim], KILL_AFTER + 1, jobs[victim], deadline)
        rejoin_s = time.monotonic() - killed
        assert all(job.wait(timeout=300) == 0 for job in jobs)
    finally:
        lighthouse.shutdown()
        for job in jobs:
            if job.poll() is None:
                kill_process_tree(job.pid)

    survivor: dict[int, float] = {}
    for folder in folders[:victim]:
        records = {r["step"]: r["loss"] for r in _records(folder)}
        assert max(records) == STEPS and sorted(records) == list(records)
        assert all(survivor.setdefault(step, loss) == loss for step, loss in records.items())
        assert all(records[step] == before_kill[step] for step in range(1, KILL_AFTER + 1))
    assert sorted(survivor) == list(range(1, STEPS + 1))  # the dropped step was taken again
    reference = train_job(
        tmp_path / "reference", *RUN, *layout, "--training.steps", str(KILL_AFTER),
        "--parallelism.dp_replicate", str(groups), nproc=2 * groups, config=config,
    )  # fmt: skip
    for step in range(1, KILL_AFTER + 1):
        assert abs(survivor[step] - reference[step]) <= 1e-6 * abs(reference[step])

    survivor_log, restarted_log = logs[0].read_text(), (tmp_path / "restarted.log").read_text()
    quorums = [
        (int(step), int(size))
        for step, size in re.findall(rf"step (\d+): (\d) of {groups} replica groups", survivor_log)
    ]
    smaller = [step for step, size in quorums if size == groups - 1]
    rejoined = [step for step, size in quorums if size == groups and smaller and step > smaller[0]]
    assert smaller and rejoined, quorums
    recovery = re.search(r"training state of step (\d+).*: (\d+) bytes", restarted_log)
    assert recovery is not None, restarted_log[-2000:]
    recovered_at, received = int(recovery.group(1)), int(recovery.group(2))
    rejoined_group = {r["step"]: r["loss"] for r in _records(folders[victim])}
    assert min(rejoined_group) == recovered_at + 1 >= KILL_AFTER + 1
    assert all(rejoined_group[step] == survivor[step] for step in rejoined_group)
    weights = [_weights(folder) for folder in folders]
    assert weights[0] and all(each.keys() == weights[0].keys() for each in weights)
    assert all(torch.equal(each[name], weights[0][name]) for each in weights for name in each)
    print(
        f"\ndrill ({groups} groups, {Path(config).stem}): the others completed steps "
        f"{smaller[0]}..{rejoined[0] - 1} without group {victim} "
        f"({rejoined[0] - smaller[0]} steps); it logged step {recovered_at + 1} "
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
    steps = 12
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


def _train_groups(tmp_path: Path, folders: list[Path], *run: str) -> None:
    """Every group of `folders` (one torchrun of 2 ranks each) through the whole run, under a
    lighthouse that waits for all of them."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=len(folders), join_timeout_ms=2000)
    run = (*run, "--fault_tolerance.enabled", "true", "--fault_tolerance.groups",
           str(len(folders)), "--fault_tolerance.lighthouse", lighthouse.address())  # fmt: skip
    jobs = []
    try:
        for group, folder in enumerate(folders):
            command = job_command(folder, *run, "--fault_tolerance.replica_group", str(group))
            log = (tmp_path / f"{folder.name}.log").open("a")
            jobs.append(subprocess.Popen(command, env=job_env(), cwd=tmp_path, stdout=log,
                                         stderr=subprocess.STDOUT))  # fmt: skip
        assert all(job.wait(timeout=300) == 0 for job in jobs)
    finally:
        lighthouse.shutdown()
        for job in jobs:
            if job.poll() is None:
                kill_process_tree(job.pid)


def _start_lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse command, as users run it, in a process of its own (one that can
    be killed), and its address."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}",
               "--min_replicas", str(min_replicas), "--join_timeout_ms", "2000"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as client:
            if client.connect_ex(("localhost", port)) == 0:
                return server, f"http://localhost:{port}"
        assert server.poll() is None and time.monotonic() < deadline, "no lighthouse"
        time.sleep(0.05)


def test_a_lost_lighthouse_stops_the_groups_and_the_restarted_job_resumes_exactly(tmp_path):
    """The lighthouse killed once both groups saved step 3: no quorum forms, and within
    `quorum_timeout_s` each group stops with one line naming the lighthouse. Started again
    (a new lighthouse, the same commands) they resume from step 3: steps 4..6 and the final
    weights bit for bit those of a run that went through. Then dp_replicate = 2 without torchft
    (one torchrun of 4 ranks) to step 3, its checkpoint in both groups' folders: the groups go
    on from it to the same losses (to float32 rounding: its weights went through one reduction
    fewer); the checkpoints of jobs with and without fault tolerance are interchangeable."""
    run = (*RUN, "--training.steps", "6", "--checkpoint.enable", "true",
           "--checkpoint.interval", "3", "--checkpoint.export_hf_at_end", "true")  # fmt: skip
    through_folders = [tmp_path / f"through{group}" for group in range(2)]
    _train_groups(tmp_path, through_folders, *run)
    through = [{r["step"]: r["loss"] for r in _records(folder)} for folder in through_folders]
    assert sorted(through[0]) == list(range(1, 7)) and through[0] == through[1]
    weights = _weights(through_folders[0])

    folders = [tmp_path / f"group{group}" for group in range(2)]
    lighthouse, address = _start_lighthouse(min_replicas=2)
    logs = [tmp_path / f"{folder.name}.log" for folder in folders]
    jobs = []
    try:
        for group, (folder, log) in enumerate(zip(folders, logs, strict=True)):
            command = job_command(
                folder, *run, "--training.steps", "40", "--fault_tolerance.enabled", "true",
                "--fault_tolerance.groups", "2", "--fault_tolerance.lighthouse", address,
                "--fault_tolerance.replica_group", str(group),
                "--fault_tolerance.quorum_timeout_s", "5",
            )  # fmt: skip
            output = log.open("w")
            jobs.append(subprocess.Popen(command, env=job_env(), cwd=tmp_path, stdout=output,
                                         stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + 300
        while not all((folder / "checkpoints" / "step-3").exists() for folder in folders):
            assert all(job.poll() is None for job in jobs) and time.monotonic() < deadline
            time.sleep(0.02)
        lighthouse.kill()
        lost = time.monotonic()
        assert all(job.wait(timeout=120) != 0 for job in jobs)
        stopped_s = time.monotonic() - lost
    finally:
        lighthouse.kill()
        for job in jobs:
            if job.poll() is None:
                kill_process_tree(job.pid)
    for folder, log in zip(folders, logs, strict=True):
        assert max(r["step"] for r in _records(folder)) < 6
        assert "no quorum from the lighthouse at " + address in log.read_text()
    _train_groups(tmp_path, folders, *run)
    for folder in folders:
        assert "(step 3)" in (tmp_path / f"{folder.name}.log").read_text()
        assert {r["step"]: r["loss"] for r in _records(folder)} == through[0]
        resumed = _weights(folder)
        assert resumed.keys() == weights.keys()
        assert all(torch.equal(resumed[name], weights[name]) for name in weights)
    print(f"\ndrill (lighthouse lost): both groups stopped {stopped_s:.1f} s after it")

    plain = tmp_path / "plain"
    first = train_job(
        plain, *run, "--training.steps", "3", "--parallelism.dp_replicate", "2",
        "--parallelism.dp_shard", "2", nproc=4,
    )  # fmt: skip
    assert first == pytest.approx({step: through[0][step] for step in (1, 2, 3)}, rel=1e-6)
    continued = [tmp_path / f"continued{group}" for group in range(2)]
    for folder in continued:
        shutil.copytree(plain / "checkpoints" / "step-3", folder / "checkpoints" / "step-3")
    _train_groups(tmp_path, continued, *run)
    for folder in continued:
        losses = {r["step"]: r["loss"] for r in _records(folder)}
        assert sorted(losses) == [4, 5, 6]
        assert losses == pytest.approx({step: through[0][step] for step in (4, 5, 6)}, rel=1e-5)


def _restart_from_step(folders: list[Path], step: int) -> None:
    """Leave each group's folder as a job stopped after its step-`step` checkpoint leaves it."""
    for folder in folders:
        for later in (folder / "checkpoints").glob("step-*"):
            if int(later.name.removeprefix("step-")) > step:
                shutil.rmtree(later)
        shutil.rmtree(folder / "hf", ignore_errors=True)


def test_local_sgd_groups_train_apart_agree_after_each_sync_and_resume_between_syncs(tmp_path):
    """`sync_every = 3`: between syncs each group steps on its own rows (each logs its own
    loss, where synchronous groups log the quorum's); after the sync that ends step 6 both hold
    bitwise the same weights (trained apart, they would not). Started again from step 4,
    between two syncs, the groups sync after step 6 as before: the same losses and weights bit
    for bit (counting 3 steps from the restart, they would not sync at all)."""
    run = (*RUN, "--training.steps", "6", "--checkpoint.export_hf_at_end", "true",
           "--fault_tolerance.sync_every", "3", "--checkpoint.enable", "true",
           "--checkpoint.interval", "2")  # fmt: skip
    folders = [tmp_path / f"group{group}" for group in range(2)]
    _train_groups(tmp_path, folders, *run)
    losses = [{r["step"]: r["loss"] for r in _records(folder)} for folder in folders]
    assert all(losses[0][step] != losses[1][step] for step in range(2, 7))
    weights = [_weights(folder) for folder in folders]
    assert weights[0] and weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])

    _restart_from_step(folders, 4)
    _train_groups(tmp_path, folders, *run)
    for folder, through in zip(folders, losses, strict=True):
        assert "(step 4)" in (tmp_path / f"{folder.name}.log").read_text()
        assert {r["step"]: r["loss"] for r in _records(folder)} == through
        resumed = _weights(folder)
        assert all(torch.equal(resumed[name], weights[0][name]) for name in weights[0])
