"""The training job end to end, as users run it: torchrun train.py with a config.

Exact resume after SIGKILL, one-line errors with non-zero exits, metrics and checkpoints written.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_runs import (
    CONFIG,
    CP_SLICED_PP_CONFIG,
    EXCHANGE_PP_CONFIG,
    FIVE_D_CONFIG,
    LAYOUT_RUN,
    MOE_CONFIG,
    NO_CHECKPOINTS,
    REPO_ROOT,
    SHORT_RUN,
    SHORT_RUN_STEPS,
    SLICED_PP_CONFIG,
    TP_CONFIG,
    VOCAB_PP_CONFIG,
    descendants,
    job_command,
    job_env,
    kill_process_tree,
    logged_losses,
    single_process_error,
    train_job,
    write_debug_llama,
)

from pipekit.config import ConfigError, load_job_config
from pipekit.train.data import stdlib_files
from pipekit.train.job import validate_job


def test_resume_after_sigkill_or_sigterm_reproduces_the_uninterrupted_losses(tmp_path, monkeypatch):
    """Read through Hugging Face datasets (a local JSONL file) by 2 loader workers per rank,
    which run ahead of the step, checkpoints written in the background: a job killed with
    SIGKILL resumes, is stopped with SIGTERM, resumes again, and logs the uninterrupted run's
    losses."""
    corpus = tmp_path / "corpus.jsonl"
    texts = [path.read_text(errors="replace") for path in stdlib_files()[:200]]
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    run = (
        *SHORT_RUN, "--data.source", "hf", "--data.hf_path", "json",
        "--data.hf_data_files", str(corpus), "--data.num_workers", "2",
        "--checkpoint.async_save", "true",
    )  # fmt: skip
    reference_dir, interrupted_dir = tmp_path / "reference", tmp_path / "interrupted"
    reference = train_job(reference_dir, *run)  # uninterrupted, on forked ranks
    assert sorted(reference) == list(range(1, SHORT_RUN_STEPS + 1))
    assert sorted(p.name for p in (reference_dir / "checkpoints").iterdir()) == [
        "step-20",
        "step-24",
    ]

    job = _start_until_checkpoint(interrupted_dir, run, 8)
    kill_process_tree(job.pid)  # torchrun starts each worker in a session of its own
    job.communicate()  # drains its pipes
    killed_at = max(logged_losses(interrupted_dir))
    assert killed_at < SHORT_RUN_STEPS, "the job finished before it was killed; nothing was tested"

    # The resumed job is stopped as a scheduler preempts: SIGTERM to every worker. The step
    # ends, a checkpoint is saved, the job exits 0, and the next start resumes from it.
    job = _start_until_checkpoint(interrupted_dir, run, 12)
    for worker in descendants(job.pid):
        os.kill(worker, signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr[-3000:]
    assert "(step 8)" in stdout  # "resumed from .../step-8 (step 8)" after the SIGKILL
    stopped_at = max(logged_losses(interrupted_dir))
    assert 12 <= stopped_at < SHORT_RUN_STEPS
    assert f"stopped on SIGTERM after step {stopped_at}" in stdout
    assert (interrupted_dir / "checkpoints" / f"step-{stopped_at}" / "COMPLETE").is_file()
    resume = subprocess.run(
        job_command(interrupted_dir, *run), env=job_env(), cwd=tmp_path, capture_output=True,
        text=True,
    )  # fmt: skip
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert f"(step {stopped_at})" in resume.stdout
    assert logged_losses(interrupted_dir) == pytest.approx(reference, rel=0, abs=0)
    _assert_each_step_logged_once(interrupted_dir)


def _start_until_checkpoint(output_dir: Path, run: tuple[str, ...], step: int) -> subprocess.Popen:
    """Start a job in the background; return once its step-`step` checkpoint is published."""
    job = subprocess.Popen(
        job_command(output_dir, *run),
        env=job_env(),
        cwd=output_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (output_dir / "checkpoints" / f"step-{step}").exists():
        assert job.poll() is None and time.monotonic() < deadline, f"job ended before step {step}"
        time.sleep(0.02)
    return job


def _assert_each_step_logged_once(output_dir: Path) -> None:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(1, SHORT_RUN_STEPS + 1))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("--training.stepz", "3"), "did you mean 'steps'"),
        (("--training.steps", "three"), "expects int"),
        (("--parallelism.dp_shard", "4"), "world size"),
        (("--data.source", "/nonexistent/*.txt"), "matches no file"),
        (
            (
                "--parallelism.dp_shard",
                "1",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.num_slices",
                "3",
            ),
            "num_slices=3 must be a multiple of pipeline_parallel_degree=2",
        ),
        (
            (
                "--parallelism.dp_shard",
                "1",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.microbatches",
                "3",
            ),
            "microbatches=3 must divide the local batch of 16",
        ),
        (
            (
                "--parallelism.dp_shard",
                "1",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_schedule",
                "1F1F",
            ),
            "pipeline_schedule='1F1F' is not known",
        ),
        (
            ("--parallelism.dp_shard", "2", "--parallelism.vocab_parallel", "true"),
            "vocab_parallel = true splits the vocabulary across pipeline ranks",
        ),
        (("--parallelism.ep", "2"), "ep=2 needs a mixture-of-experts model"),
        (
            ("--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--training.seq_len", "250"),
            "seq_len=250 must be a multiple of 2 x cp = 4",
        ),
        (("--moe.partitions", "0"), "partitions=0 must be a positive integer or 'auto'"),
        (("--moe.memory_reuse", "S9"), "memory_reuse='S9' is not one of"),
    ],
)
def test_bad_input_is_named_before_launch(tmp_path, overrides, message):
    """What train.py checks before any process group exists (in-process here; the command
    line's one line and exit status 2 are checked below)."""
    argv = ["--config", CONFIG, "--job.output_dir", str(tmp_path), *overrides]
    with pytest.raises(ConfigError) as error:
        validate_job(load_job_config(argv), world_size=2)
    assert message in str(error.value)


def test_a_config_error_on_another_machine_reaches_its_console(tmp_path):
    """Rank 2, the first rank of a second machine, whose data path is missing there."""
    env = {**job_env(), "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}
    missing = str(tmp_path / "none.txt")
    command = [sys.executable, str(REPO_ROOT / "train.py"), "--config", CONFIG,
               "--job.output_dir", str(tmp_path), "--data.source", missing]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("config error (rank 2 on ")
    assert "matches no file" in result.stderr
    quiet = subprocess.run(command, env={**env, "LOCAL_RANK": "1"}, capture_output=True, text=True)
    assert quiet.returncode == 2 and quiet.stderr == ""  # one line per machine, not per rank


def test_bad_input_gives_one_error_line_and_exit_2(tmp_path):
    stepz = ("--training.stepz", "3")
    assert "did you mean 'steps'" in single_process_error(tmp_path, *stepz, fresh=True)
    ep = ("--parallelism.ep", "2")
    assert "ep=2 needs a mixture-of-experts" in single_process_error(tmp_path, *ep, world_size=2)


def test_unreadable_checkpoint_gives_one_error_line(tmp_path):
    step = tmp_path / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not a checkpoint")
    (step / "COMPLETE").write_text("")
    assert "step-4" in single_process_error(tmp_path, "--parallelism.dp_shard", "1")


LAYOUT_FIRST_HALF = (*LAYOUT_RUN[:-4], "--training.steps", "2", *LAYOUT_RUN[-2:])
"""LAYOUT_RUN's first 2 steps, with the checkpoint of step 2."""


@pytest.fixture(scope="module")
def data_parallel_losses(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """FSDP2 over 2 ranks, LAYOUT_RUN: the losses the parallel layouts below must give."""
    return train_job(tmp_path_factory.mktemp("dp"), *LAYOUT_RUN, *NO_CHECKPOINTS)


@pytest.fixture(scope="module")
def sliced_pipeline_losses(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """configs/debug_sliced_pp.toml (2 pipeline ranks, 4 slices), LAYOUT_RUN: the losses the
    pipeline features below must give."""
    output_dir = tmp_path_factory.mktemp("sliced_pp")
    return train_job(output_dir, *LAYOUT_RUN, *NO_CHECKPOINTS, config=SLICED_PP_CONFIG)


def _matches_data_parallel_and_resumes(
    tmp_path: Path,
    data_parallel: dict,
    layout: tuple[str, ...],
    resume_layout: tuple[str, ...],
    *,
    config: str = CONFIG,
) -> None:
    """`layout` (of `config`) on 2 ranks gives FSDP2's losses on 2 ranks up to float32
    rounding for 2 steps, and its step-2 checkpoint resumed in `resume_layout` (of
    debug_model.toml; DCP reshards) gives FSDP2's steps 3 and 4."""
    losses = train_job(tmp_path, *LAYOUT_FIRST_HALF, *layout, config=config)
    assert losses == pytest.approx({step: data_parallel[step] for step in (1, 2)}, rel=1e-5)
    resumed = train_job(tmp_path, *LAYOUT_RUN, *resume_layout)
    assert resumed == pytest.approx(data_parallel, rel=1e-5)


def test_context_parallel_job_matches_the_data_parallel_job_and_resumes(
    tmp_path: Path, data_parallel_losses: dict
) -> None:
    """cp = 2 on 2 ranks (each rank its half of every sequence, dealt by documents, both
    reading the whole batch) against FSDP2 over 2 ranks (each half of the rows); its
    checkpoint resumed under tp = 2."""
    cp = ("--parallelism.dp_shard", "1", "--parallelism.cp", "2")
    tp = ("--parallelism.dp_shard", "1", "--parallelism.tp", "2")
    _matches_data_parallel_and_resumes(tmp_path, data_parallel_losses, cp, tp)


def test_document_balanced_context_parallel_job_resumes_exactly(
    tmp_path: Path, data_parallel_losses: dict
) -> None:
    """cp = 2 dealing each batch's tokens by their attention work in 4 pieces per rank: the
    deal is a function of the batch alone, so a job stopped at step 2 and resumed trains the
    uninterrupted run's losses bit for bit; those equal FSDP2's up to float32 rounding."""
    cp = ("--parallelism.dp_shard", "1", "--parallelism.cp", "2")
    dealt = (*cp, "--parallelism.cp_balance", "documents", "--parallelism.cp_balance_pieces", "4")
    whole = train_job(tmp_path / "whole", *LAYOUT_RUN, *NO_CHECKPOINTS, *dealt)
    train_job(tmp_path / "stopped", *LAYOUT_FIRST_HALF, *dealt)
    assert train_job(tmp_path / "stopped", *LAYOUT_RUN, *dealt) == whole
    assert whole == pytest.approx(data_parallel_losses, rel=1e-5)


def test_a_job_on_two_nodes_matches_the_same_ranks_on_one(
    tmp_path: Path, data_parallel_losses: dict
) -> None:
    """Two torchrun processes of one rank each, meeting through a c10d rendezvous on
    127.0.0.1 as two machines would, train FSDP2's two-rank losses exactly."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
    ]  # fmt: skip
    job = [str(REPO_ROOT / "train.py"), "--config", CONFIG, "--job.output_dir", str(tmp_path)]
    nodes = [
        subprocess.Popen(
            [*launch, *job, *LAYOUT_RUN, *NO_CHECKPOINTS],
            env=job_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-3000:]
    assert logged_losses(tmp_path) == data_parallel_losses


def test_tensor_parallel_job_matches_the_data_parallel_job_and_resumes(
    tmp_path: Path, data_parallel_losses: dict
) -> None:
    """configs/debug_tp.toml (tp = 2 with sequence parallelism on 2 ranks) against FSDP2 over 2
    ranks; its checkpoint (2-D DTensors, sequence-parallel norms) resumed by FSDP2 alone."""
    _matches_data_parallel_and_resumes(
        tmp_path, data_parallel_losses, (), ("--parallelism.dp_shard", "2"), config=TP_CONFIG
    )


def test_tensor_parallelism_composes_with_fsdp_and_cp(
    tmp_path: Path, data_parallel_losses: dict
) -> None:
    """On 4 ranks each: FSDP2 over 2 data ranks x tp 2, and tp 2 beside context parallelism
    with its K/V passed around the ring (cp 2 x tp 2): the data-parallel job's losses up to
    float32 rounding. (tp inside the sliced pipeline: the 5-D test below.)"""
    tp = ("--parallelism.tp", "2")
    ring = ("--parallelism.cp_variant", "ring")
    layouts = {
        "fsdp_tp": ("--parallelism.dp_shard", "2", *tp),
        "cp_tp": ("--parallelism.dp_shard", "1", "--parallelism.cp", "2", *tp, *ring),
    }
    for name, overrides in layouts.items():
        losses = train_job(tmp_path / name, *LAYOUT_RUN, *overrides, *NO_CHECKPOINTS, nproc=4)
        assert losses == pytest.approx(data_parallel_losses, rel=1e-5), name


def test_five_dimensional_moe_job_matches_one_rank_and_resumes_there(tmp_path: Path) -> None:
    """configs/debug_5d.toml on 8 ranks (sliced pipeline 2 x cp 2 x tp 2 with sequence
    parallelism, MoE with ep 2 folded over the cp x tp ranks) gives the one-rank job's losses
    (4 accumulation steps: the pipeline's 4 microbatches, whose MoE statistics are per
    microbatch) to float32 rounding, and its step-2 checkpoint resumed on one rank gives the
    one-rank job's step 3."""
    run = (*SHORT_RUN[:6], "--lr_scheduler.warmup_steps", "1", *SHORT_RUN[8:10])
    one_rank = (
        "--parallelism.pipeline_parallel_degree", "1", "--parallelism.pipeline_schedule", "1F1B",
        "--parallelism.num_slices", "0", "--parallelism.microbatches", "1",
        "--parallelism.cp", "1", "--parallelism.tp", "1", "--parallelism.ep", "1",
        "--training.gradient_accumulation_steps", "4",
    )  # fmt: skip
    steps = ("--training.steps", "3", "--checkpoint.interval", "2")
    single = train_job(tmp_path / "one", *run, *steps, *one_rank, nproc=1, config=FIVE_D_CONFIG)
    first_two = ("--training.steps", "2", "--checkpoint.interval", "2")
    five_d = train_job(tmp_path / "5d", *run, *first_two, nproc=8, config=FIVE_D_CONFIG)
    resumed = train_job(tmp_path / "5d", *run, *steps, *one_rank, nproc=1, config=FIVE_D_CONFIG)
    assert sorted(five_d) == [1, 2]
    assert five_d == pytest.approx({k: single[k] for k in (1, 2)}, rel=1e-5)
    assert resumed == pytest.approx(single, rel=1e-5)


def test_expert_parallelism_folds_over_the_context_parallel_ranks(tmp_path: Path) -> None:
    """configs/debug_moe.toml (ep = 2) on 2 ranks that are cp ranks of one data rank: the
    experts are split over the ranks that split the sequence (MoE parallel folding), the
    load-balancing statistics are added over them, and the losses equal the one-rank job's
    (experts whole, every token's statistics on one rank)."""
    short = (*SHORT_RUN[:10], "--training.steps", "3", "--checkpoint.enable", "false")
    one_rank = ("--parallelism.dp_shard", "1", "--parallelism.ep", "1")
    single = train_job(tmp_path / "one", *short, *one_rank, nproc=1, config=MOE_CONFIG)
    cp = ("--parallelism.dp_shard", "1", "--parallelism.cp", "2")
    folded = train_job(tmp_path / "cp_ep", *short, *cp, config=MOE_CONFIG)
    assert folded == pytest.approx(single, rel=1e-5)


def test_commutated_context_parallelism_in_the_sliced_pipeline_matches_it(
    tmp_path: Path, sliced_pipeline_losses: dict
) -> None:
    """configs/debug_cp_sliced_pp.toml on 4 ranks (every slice split over 2 cp ranks,
    SlimPipe's commutated attention over the chunked KV cache, context exchange between the
    pipeline ranks), each microbatch's slices cut by its documents and dealt by them, against
    the same pipeline without any of it on 2 ranks: the same losses up to float32 rounding; its
    step-2 checkpoint resumed by the pipeline without cp gives them too."""
    documents = ("--parallelism.slicing", "documents")
    context_parallel = train_job(
        tmp_path / "pp_cp", *LAYOUT_FIRST_HALF, *documents, nproc=4, config=CP_SLICED_PP_CONFIG
    )
    assert sorted(context_parallel) == [1, 2]
    resumed = train_job(tmp_path / "pp_cp", *LAYOUT_RUN, config=SLICED_PP_CONFIG)
    assert resumed == pytest.approx(sliced_pipeline_losses, rel=1e-5)


def test_sliced_pipeline_job_matches_the_data_parallel_job(
    sliced_pipeline_losses: dict, data_parallel_losses: dict
) -> None:
    """configs/debug_sliced_pp.toml (2 pipeline ranks, 4 slices) against debug_model.toml (2
    FSDP ranks) on the same global batches: equal losses step for step (float32 tolerance)."""
    assert sorted(sliced_pipeline_losses) == [1, 2, 3, 4]
    assert sliced_pipeline_losses == pytest.approx(data_parallel_losses, rel=1e-4)


def test_sliced_pipeline_job_resumes_exactly(tmp_path: Path, sliced_pipeline_losses: dict):
    """Each pipeline rank checkpoints its own stages and optimizer state (keyed by parameter
    name); stopping at step 2 and resuming gives the uninterrupted run's losses."""
    train_job(tmp_path, *LAYOUT_FIRST_HALF, config=SLICED_PP_CONFIG)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]
    assert train_job(tmp_path, *LAYOUT_RUN, config=SLICED_PP_CONFIG) == sliced_pipeline_losses


def test_document_cut_pipeline_job_matches_and_resumes_exactly(
    tmp_path: Path, sliced_pipeline_losses: dict
) -> None:
    """slicing = "documents": each step's cuts come from its own batch alone, so a job stopped
    at step 2 and resumed trains the uninterrupted run's losses bit for bit; those equal the
    planned cuts' up to float32 rounding."""
    documents = ("--parallelism.slicing", "documents")
    whole = train_job(
        tmp_path / "whole", *LAYOUT_RUN, *NO_CHECKPOINTS, *documents, config=SLICED_PP_CONFIG
    )
    train_job(tmp_path / "stopped", *LAYOUT_FIRST_HALF, *documents, config=SLICED_PP_CONFIG)
    resumed = train_job(tmp_path / "stopped", *LAYOUT_RUN, *documents, config=SLICED_PP_CONFIG)
    assert resumed == whole
    assert whole == pytest.approx(sliced_pipeline_losses, rel=1e-5)


def test_tied_embeddings_across_pipeline_stages_match_and_resume(tmp_path):
    """The tied debug flavor on 2 pipeline ranks (embedding on one, output on the other, a copy
    each, gradients summed) gives the FSDP job's losses, with gradient clipping counting the
    tied weight once; stopped at step 2 and resumed, it gives the uninterrupted run's losses.
    One process trains the same tied model (one weight, one optimizer state), to 1e-5."""
    short = (*SHORT_RUN[:10], "--model.flavor", "debug_tied", "--training.max_norm", "0.1")
    straight = (*short, "--training.steps", "4", "--checkpoint.interval", "2")
    unsaved = (*short, "--training.steps", "4", "--checkpoint.enable", "false")
    fsdp = train_job(tmp_path / "fsdp", *unsaved)
    assert train_job(tmp_path / "one", *unsaved, nproc=1) == pytest.approx(fsdp, rel=1e-5)
    pipelined = train_job(tmp_path / "straight", *straight, config=SLICED_PP_CONFIG)
    assert pipelined == pytest.approx(fsdp, rel=1e-4)
    resumed = tmp_path / "resumed"
    train_job(
        resumed,
        *short,
        "--training.steps",
        "2",
        "--checkpoint.interval",
        "2",
        config=SLICED_PP_CONFIG,
    )
    assert train_job(resumed, *straight, config=SLICED_PP_CONFIG) == pipelined


def test_interleaved_sliced_pipeline_with_fsdp_and_accumulation_matches(tmp_path):
    """4 ranks: 2 pipeline ranks x 2 FSDP shards, 2 stages per rank (shared rank modules, FSDP
    per stage), 2 accumulation micro-steps; the same losses as the 2-rank FSDP job, with and
    without vocabulary parallelism (its shards FSDP-sharded too). The vocabulary-parallel run's
    step-2 checkpoint (rows split over pipeline and FSDP ranks) loads into the FSDP job, which
    then continues with its own losses."""
    common = (*SHORT_RUN[4:10], "--training.steps", "3", "--checkpoint.interval", "2")
    common += ("--training.global_batch_size", "8", "--training.gradient_accumulation_steps", "2")
    pipelined = ("--parallelism.dp_shard", "2", "--parallelism.stages_per_rank", "2")
    pipelined += ("--parallelism.microbatches", "2")
    runs = {}
    for name, config, nproc, extra in (
        ("fsdp", CONFIG, 2, ()),
        ("pp_fsdp", SLICED_PP_CONFIG, 4, pipelined),
        ("pp_fsdp_vocab", VOCAB_PP_CONFIG, 4, pipelined),
        ("resharded", CONFIG, 2, ()),
    ):
        if name == "resharded":
            source = tmp_path / "pp_fsdp_vocab" / "checkpoints" / "step-2"
            shutil.copytree(source, tmp_path / name / "checkpoints" / "step-2")
        runs[name] = train_job(tmp_path / name, *common, *extra, nproc=nproc, config=config)
    for name in ("pp_fsdp", "pp_fsdp_vocab"):
        assert sorted(runs[name]) == [1, 2, 3]
        assert runs[name] == pytest.approx(runs["fsdp"], rel=1e-4)
    assert runs["resharded"] == pytest.approx({3: runs["fsdp"][3]}, rel=1e-5)


def test_vocab_parallel_pipeline_job_matches_resumes_and_reshards(
    tmp_path: Path, sliced_pipeline_losses: dict
) -> None:
    """configs/debug_vocab_parallel_pp.toml against debug_sliced_pp.toml (the same pipeline with
    the embedding and output layer on one rank each): equal losses step for step, also on 8
    ranks with tp 2 and FSDP2 over 2 data ranks (rows over pp x tp). The 8-rank run's step-2
    checkpoint (vocabulary rows saved as DTensor shards, strided where FSDP2 splits rows that
    tp split first) loads into the pipeline without vocabulary parallelism, which then
    continues with that run's losses."""
    short = (*SHORT_RUN[:10], "--training.steps", "4", "--checkpoint.interval", "2")

    def run(name: str, config: str, *extra: str) -> dict[int, float]:
        return train_job(tmp_path / name, *short, *extra, config=config)

    vocab_parallel = run("vocab_parallel", VOCAB_PP_CONFIG, *NO_CHECKPOINTS)
    plain = sliced_pipeline_losses
    assert sorted(vocab_parallel) == [1, 2, 3, 4]
    assert vocab_parallel == pytest.approx(plain, rel=1e-5)
    # 8 ranks, pp 2 x dp_shard 2 x tp 2: rows split over pp x tp, FSDP2 over dp inside each
    layout = ("--parallelism.tp", "2", "--parallelism.dp_shard", "2",
              "--parallelism.microbatches", "2")  # fmt: skip
    first_two = (*short[:-4], "--training.steps", "2", "--checkpoint.interval", "2")
    tensor_parallel = train_job(
        tmp_path / "tensor_parallel", *first_two, *layout, nproc=8, config=VOCAB_PP_CONFIG
    )
    assert tensor_parallel == pytest.approx({step: plain[step] for step in (1, 2)}, rel=1e-5)
    step_2 = tmp_path / "resharded" / "checkpoints" / "step-2"
    shutil.copytree(tmp_path / "tensor_parallel" / "checkpoints" / "step-2", step_2)
    losses = run("resharded", SLICED_PP_CONFIG)
    assert losses == pytest.approx({step: plain[step] for step in (3, 4)}, rel=1e-5)


def test_pipelines_start_from_hugging_face_weights(tmp_path):
    """`[checkpoint] initial_load_path` into pipeline stages (each loads the modules it holds)
    and into vocabulary shards (each keeps its rows): the same losses as the FSDP job that
    loads the same checkpoint, and not those of a fresh initialisation."""
    write_debug_llama(tmp_path / "hf")
    common = (*SHORT_RUN[2:10], "--training.steps", "2", "--checkpoint.enable", "false")
    load = ("--checkpoint.initial_load_path", str(tmp_path / "hf"))
    runs = {}
    for name, config, extra in (
        ("fsdp", CONFIG, load),
        ("sliced_pp", SLICED_PP_CONFIG, load),
        ("vocab_pp", VOCAB_PP_CONFIG, load),
        ("fresh_pp", SLICED_PP_CONFIG, ()),
    ):
        runs[name] = train_job(tmp_path / name, *common, *extra, config=config)
    assert runs["sliced_pp"] == pytest.approx(runs["fsdp"], rel=1e-4)
    assert runs["vocab_pp"] == pytest.approx(runs["fsdp"], rel=1e-4)
    assert runs["fresh_pp"][1] != pytest.approx(runs["fsdp"][1], rel=1e-3)


def test_context_exchange_job_matches_the_sliced_pipeline(
    tmp_path: Path, sliced_pipeline_losses: dict
) -> None:
    """configs/debug_context_exchange_pp.toml against debug_sliced_pp.toml: equal losses step
    for step, with the embedding and output on their stages and vocabulary-parallel (the output
    passes then sit at lockstep cuts, which never part a lender from its server)."""
    short = (*LAYOUT_RUN, *NO_CHECKPOINTS)
    exchange = train_job(tmp_path / "exchange", *short, config=EXCHANGE_PP_CONFIG)
    vocab = ("--parallelism.vocab_parallel", "true")
    both = train_job(tmp_path / "both", *short, *vocab, config=EXCHANGE_PP_CONFIG)
    assert sorted(exchange) == [1, 2, 3, 4]
    assert exchange == pytest.approx(sliced_pipeline_losses, rel=1e-5)
    assert both == pytest.approx(sliced_pipeline_losses, rel=1e-5)


def test_a_float8_job_trains_near_float32_and_resumes_exactly(
    tmp_path: Path, data_parallel_losses: dict
) -> None:
    """FSDP2 over 2 ranks with float8 = "tensorwise" (torchao, emulated on CPU): within 1% of
    the float32 job's losses at every step, and its step-2 checkpoint resumes to the same steps
    3 and 4."""
    fp8 = ("--training.float8", "tensorwise")
    float8 = train_job(tmp_path / "float8", *LAYOUT_RUN, *fp8)
    assert sorted(float8) == [1, 2, 3, 4]
    for step, loss in data_parallel_losses.items():
        assert abs(float8[step] - loss) <= 0.01 * loss, (step, float8[step], loss)
    assert float8 != data_parallel_losses  # the casts did happen
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "float8" / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2"
    )
    train_job(resumed_dir, *LAYOUT_RUN, *fp8)
    assert logged_losses(resumed_dir) == {step: float8[step] for step in (3, 4)}
