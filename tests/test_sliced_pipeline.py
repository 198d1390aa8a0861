"""The sliced pipeline equals one process running the whole batch unsliced (float64): loss and
every parameter gradient, for p = 2 and 4 ranks, n in {p, 2p, 4p} slices, m in {1, 2, 3}
microbatches and v in {1, 2} stages per rank, on packed documents with ignored labels. torch's own
schedules on the same split match too. The ablation drops the KV-cache gradients and must fail."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import run_on_ranks
from tensordict import TensorDict
from tiny_models import TINY_LLAMA, pp_mesh, tiny_pipeline
from torch import Tensor, nn

from models.llama import Llama
from pipekit.attention.context import CausalAttention
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.layers.loss import IGNORE_INDEX, count_label_tokens, token_sum_cross_entropy
from pipekit.pipelining.runtime.runner import PipelineRunner

BATCH, SEQ_LEN, SEED, TOLERANCE = 6, 32, 3, 1e-10


def _args(num_layers: int, vocab_size: int = TINY_LLAMA.vocab_size):
    return TINY_LLAMA.with_updates(n_layers=num_layers, max_seq_len=SEQ_LEN, vocab_size=vocab_size)


def _batch(vocab_size: int = TINY_LLAMA.vocab_size) -> TensorDict:
    """Two packed documents per row (split at a row-dependent point), some labels ignored."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=generator)
    labels = torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=generator)
    labels[:, ::5] = IGNORE_INDEX
    split_BS = (5 + 3 * torch.arange(BATCH)).unsqueeze(1)
    index_S = torch.arange(SEQ_LEN)
    document_ids = (index_S >= split_BS).long()
    positions = torch.where(index_S >= split_BS, index_S - split_BS, index_S)
    return TensorDict(
        tokens=tokens,
        labels=labels,
        positions=positions,
        document_ids=document_ids,
        batch_size=[BATCH, SEQ_LEN],
    )


def _materialize(module: nn.Module) -> None:
    module.to_empty(device="cpu")
    module.init_weights(seed=SEED)
    module.to(torch.float64)


def _reference(
    num_layers: int, vocab_size: int = TINY_LLAMA.vocab_size
) -> tuple[float, dict[str, Tensor]]:
    with torch.device("meta"):
        model = Llama(_args(num_layers, vocab_size))
    _materialize(model)
    batch = _batch(vocab_size)
    logits = model(
        batch["tokens"], batch["positions"], CausalAttention(batch["document_ids"], "cpu")
    )
    loss = token_sum_cross_entropy(logits, batch["labels"], count_label_tokens(batch["labels"]))
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _run_pipeline(
    rank: int,
    world: int,
    schedule: str,
    v: int,
    m: int,
    n: int,
    drop_kv_grads: bool = False,
    checkpoint_activations: bool = False,
) -> tuple[float | None, dict[str, Tensor]]:
    runner = tiny_pipeline(
        pp_mesh(world),
        schedule=schedule,
        stages_per_rank=v,
        microbatches=m,
        num_slices=n,
        rows=BATCH,
        seq_len=SEQ_LEN,
        seed=SEED,
        checkpoint_activations=checkpoint_activations,
    )
    for stage in runner.stages:
        stage.kv_cache.drop_cached_gradients = drop_kv_grads
    return step_loss_and_grads(runner, _batch())


def step_loss_and_grads(
    runner: PipelineRunner, batch: TensorDict
) -> tuple[float | None, dict[str, Tensor]]:
    """One pipeline step: this rank's loss (None without the last stage) and its gradients."""
    loss = runner.step(batch, count_label_tokens(batch["labels"]))
    grads = {
        name: p.grad.clone()
        for stage in runner.stages
        for name, p in stage.submod.named_parameters()
    }
    dist.barrier()
    return (None if loss is None else loss.item()), grads


def _run_many(rank: int, world: int, configs: list[tuple]) -> list[tuple]:
    return [_run_pipeline(rank, world, *config) for config in configs]


def _max_relative_difference(results: list[tuple], reference: tuple) -> float:
    ref_loss, ref_grads = reference
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == 1
    worst = abs(losses[0] - ref_loss) / abs(ref_loss)
    seen: set[str] = set()
    for _, grads in results:
        for name, grad in grads.items():
            seen.add(name)
            scale = ref_grads[name].abs().max().clamp_min(1e-30)
            worst = max(worst, ((grad - ref_grads[name]).abs().max() / scale).item())
    assert seen == set(ref_grads), "the stages must hold every parameter exactly once"
    return worst


def _differences(world: int, configs: list[tuple], timeout: float) -> dict[tuple, float]:
    """Run every config on `world` ranks in one group; max relative difference to the reference."""
    results = run_on_ranks(_run_many, world, configs, timeout=timeout)
    references = {v: _reference(world * v) for v in {config[1] for config in configs}}
    return {
        config: _max_relative_difference(
            [results[rank][index] for rank in range(world)], references[config[1]]
        )
        for index, config in enumerate(configs)
    }


@pytest.mark.parametrize("world", [2, 4])
def test_sliced_pipeline_equals_unsliced_single_process_fp64(world: int) -> None:
    configs = [
        ("sliced", v, m, n)
        for v, m, n in itertools.product((1, 2), (1, 2, 3), (world, 2 * world, 4 * world))
    ]
    for config, difference in _differences(world, configs, timeout=300).items():
        assert difference <= TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_torch_schedules_match_on_the_same_split() -> None:
    configs = [("1F1B", 1, 6, 1), ("GPipe", 1, 3, 1), ("Interleaved1F1B", 2, 6, 1)]
    configs += [("ZBVZeroBubble", 2, 6, 1), ("sliced", 2, 3, 4)]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_activation_checkpointing_recomputes_slices_against_the_cache() -> None:
    """A checkpointed block recomputes its slice inside the slice's backward, against the
    cached earlier slices; the gradients stay exact (sliced, v = 1 and 2; and 1F1B)."""
    configs = [("sliced", 1, 2, 4, False, True), ("sliced", 2, 3, 4, False, True)]
    configs.append(("1F1B", 1, 6, 1, False, True))
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_dropping_kv_cache_gradients_breaks_parity() -> None:
    configs = [("sliced", 1, 2, 4, True), ("sliced", 2, 1, 2, True)]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference > 1e-3, config


def _run_pipeline_with_fsdp(rank: int, world: int, m: int, n: int) -> tuple[float | None, dict]:
    """pp=2 x dp_shard=2: each data-parallel rank runs half the batch through a 2-stage sliced
    pipeline whose stages are FSDP2-sharded; gradients are summed over data-parallel ranks."""
    dims = ParallelDims.from_config(
        ParallelismConfig(dp_shard=2, pipeline_parallel_degree=2), world
    )
    mesh = dims.build_mesh("cpu")
    rows = BATCH // 2

    def parallelize(stage_module: nn.Module) -> None:
        apply_data_parallel(
            stage_module,
            mesh,
            dims,
            blocks=list(stage_module.layers.values()),
            param_dtype=torch.float64,
            reduce_dtype=torch.float64,
        )

    runner = tiny_pipeline(
        mesh,
        microbatches=m,
        num_slices=n,
        rows=rows,
        seq_len=SEQ_LEN,
        seed=SEED,
        parallelize=parallelize,
    )
    stages = runner.stages
    batch = _batch()
    dp_rank = dims.dp_rank(mesh)
    loss = runner.step(
        batch[dp_rank * rows : (dp_rank + 1) * rows], count_label_tokens(batch["labels"])
    )
    if loss is not None:
        dist.all_reduce(loss, group=dims.mesh("dp_shard").get_group())
    grads = {
        name: p.grad.full_tensor()
        for stage in stages
        for name, p in stage.submod.named_parameters()
    }
    dist.barrier()
    return (None if loss is None or dp_rank else loss.item()), grads


def test_sliced_pipeline_composes_with_fsdp_on_the_data_parallel_dim() -> None:
    results = run_on_ranks(_run_pipeline_with_fsdp, 4, 3, 4, timeout=120)
    difference = _max_relative_difference(results, _reference(2))
    assert difference <= TOLERANCE, f"max relative difference {difference:.2e}"
