"""`SlicedPipelineSchedule` is the public entry and the one path: the by-hand example that opens
docs/pipelining.md (stages built like torch's, the schedule, `step` in torch's convention) runs
on 2 ranks exactly as written there and gives `build_pipeline`'s losses and gradients; and
`build_pipeline` builds that same class for `pipeline_schedule = "sliced"`."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from pipekit.config.job_config import ParallelismConfig
from pipekit.layers.loss import count_label_tokens
from pipekit.models import get_model_spec
from pipekit.models.materialize import seeded_materializer
from pipekit.pipelining import (
    SlicedPipelineSchedule,
    StageSetup,
    build_pipeline,
    plan_pipeline,
)
from pipekit.testing import parity_batch, run_on_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]


def documented_example() -> dict:
    """The first python block of docs/pipelining.md, executed: it defines `train_step`."""
    text = (REPO_ROOT / "docs" / "pipelining.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/pipelining.md", "exec"), namespace)
    return namespace


def _both(rank: int, world: int) -> dict:
    example = documented_example()
    batch = example["make_batch"]()
    by_hand_losses, by_hand_model = example["train_step"](rank, world, batch)
    args = example["ARGS"]
    llama = get_model_spec("llama")
    parallelism = ParallelismConfig(
        dp_shard=1, pipeline_parallel_degree=world, pipeline_schedule="sliced",
        num_slices=example["SLICES"], microbatches=example["MICROBATCHES"],
    )  # fmt: skip
    rows, length = batch.batch_size
    plan = plan_pipeline(parallelism, llama.structure, llama.shape(args), rows, length)
    setup = StageSetup(
        device=torch.device("cpu"),
        materialize=seeded_materializer("cpu", example["SEED"]),
        parallelize=lambda module: None,
        attention_backend="cpu",
        message_dtype=torch.float32,
    )
    with torch.device("meta"):
        model = llama.build(args)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    runner = build_pipeline(plan, model, mesh, setup)
    loss = runner.step(batch, count_label_tokens(batch["labels"]))
    return {
        "schedule": type(runner.schedule).__name__,
        "by hand": (torch.stack(by_hand_losses).sum() if by_hand_losses else None),
        "built": loss,
        "grads by hand": {n: p.grad for n, p in by_hand_model.named_parameters()},
        "grads built": {n: p.grad for n, p in runner.model.named_parameters()},
    }


def test_the_documented_by_hand_schedule_equals_build_pipeline() -> None:
    first, last = run_on_ranks(_both, 2, timeout=120)
    assert first["schedule"] == last["schedule"] == SlicedPipelineSchedule.__name__
    assert first["by hand"] is None and first["built"] is None
    torch.testing.assert_close(last["by hand"], last["built"], rtol=0, atol=0)
    for rank in (first, last):
        assert rank["grads by hand"].keys() == rank["grads built"].keys()
        for name, grad in rank["grads by hand"].items():
            torch.testing.assert_close(grad, rank["grads built"][name], rtol=0, atol=0)


def test_the_example_batch_is_a_parity_batch() -> None:
    """The example trains on pipekit's parity batch (two packed documents per row)."""
    example = documented_example()
    batch = example["make_batch"]()
    want = parity_batch(example["ARGS"].vocab_size, 4, 32)
    assert torch.equal(batch["tokens"], want["tokens"])
