"""A vocabulary-parallel pipeline equals one process running the whole model (float64): loss,
every stage parameter's gradient and every rank's rows of the embedding and output gradients,
for the sliced schedule (p = 2 and 4, v = 1 and 2) and torch's schedules run as action lists,
with packed documents, ignored labels and an uneven last shard. The ablations drop the other
ranks' share of d loss / d hidden, or of the embedding gradient, and must fail."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from tiny_models import (
    PARITY_ROWS,
    PARITY_SEQ_LEN,
    PARITY_TOLERANCE,
    TINY_LLAMA,
    pp_mesh,
    tiny_batch,
    tiny_pipeline,
    tiny_reference,
)

from pipekit.families.llama import Llama
from pipekit.pipelining.features import vocab_parallel
from pipekit.pipelining.features.vocab_parallel import PipelineVocabParallel
from pipekit.testing import max_relative_difference, run_on_ranks, runner_step


def _run(
    rank: int,
    world: int,
    schedule: str,
    v: int,
    m: int,
    n: int,
    ablation: str = "",
    vocab_size: int = TINY_LLAMA.vocab_size,
):
    runner = tiny_pipeline(
        pp_mesh(world),
        schedule=schedule,
        stages_per_rank=v,
        microbatches=m,
        num_slices=n,
        rows=PARITY_ROWS,
        seq_len=PARITY_SEQ_LEN,
        vocab_parallel=True,
        vocab_size=vocab_size,
    )
    vocab = runner.extension("vocab_parallel")
    assert isinstance(vocab, PipelineVocabParallel)
    if ablation == "hidden_grad_last_rank_only" and rank != vocab.last_rank:
        vocab.output.register_full_backward_hook(lambda _, grad_in, __: (grad_in[0] * 0,))
    if ablation == "embedding_grad_first_rank_only":
        _skip_embedding_gradient_broadcast(vocab)
    return runner_step(runner, tiny_batch(vocab_size))


def _skip_embedding_gradient_broadcast(vocab: PipelineVocabParallel) -> None:
    """Ablation: the other ranks never receive the first stage's embedding gradients."""
    end_step = vocab.end_step

    def without_broadcast() -> None:
        with mock.patch.object(vocab_parallel.dist, "broadcast", lambda *_, **__: None):
            end_step()

    vocab.end_step = without_broadcast


def _many(rank: int, world: int, configs: list[tuple]) -> list:
    return [_run(rank, world, *config) for config in configs]


def _differences(world: int, configs: list[tuple]) -> dict[tuple, float]:
    results = run_on_ranks(_many, world, configs, timeout=240)
    return {
        config: max_relative_difference(
            [results[rank][index] for rank in range(world)],
            tiny_reference(world * config[1], *config[5:6]),
        )
        for index, config in enumerate(configs)
    }


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_sliced_pipeline_equals_single_process_fp64(world: int) -> None:
    configs = [
        ("sliced", 1, 2, 2 * world),
        ("sliced", 2, 1, world),
        ("sliced", 1, 3, world),
        ("sliced", 1, 2, world, "", 67),  # uneven: 34/33 or 17/17/17/16 rows
    ]
    differences = _differences(world, configs)
    assert max(differences.values()) < PARITY_TOLERANCE, differences


def test_vocab_parallel_with_torch_schedules() -> None:
    configs = [
        ("1F1B", 1, 3, 1),
        ("GPipe", 1, 2, 1),
        ("Interleaved1F1B", 2, 2, 1),
        ("InterleavedZeroBubble", 2, 2, 1),
        ("ZBVZeroBubble", 2, 2, 1),
        ("DualPipeV", 2, 6, 1),
    ]
    differences = _differences(2, configs)
    assert max(differences.values()) < PARITY_TOLERANCE, differences


@pytest.mark.parametrize(
    "ablation", ["hidden_grad_last_rank_only", "embedding_grad_first_rank_only"]
)
def test_dropping_a_ranks_share_breaks_parity(ablation: str) -> None:
    (difference,) = _differences(2, [("sliced", 1, 2, 4, ablation)]).values()
    assert difference > 1e-3


def _load_hf_into_shards(rank: int, world: int, directory: str) -> tuple[int, int, dict]:
    from pipekit.families.decoder.model import DECODER_STRUCTURE
    from pipekit.families.llama.hf import load_hf_llama
    from pipekit.pipelining.features.vocab_parallel import copy_full_vocab_rows, vocab_shard_modules

    args = TINY_LLAMA.with_updates(vocab_size=TINY_LLAMA.vocab_size + 1)
    embedding, output = vocab_shard_modules(args.vocab_size, args.dim, dist.group.WORLD)

    def materialize(module: torch.nn.Module) -> None:
        module.to_empty(device="cpu")
        load_hf_llama(directory, module, args)

    with torch.device("meta"):
        model = Llama(args)
    copy_full_vocab_rows(embedding, output, materialize, model, DECODER_STRUCTURE)
    rows = {
        "tok_embeddings.weight": embedding.weight.detach().clone(),
        "output.weight": output.weight.detach().clone(),
    }
    return output.vocab_start, output.vocab_end, rows


def test_hugging_face_weights_fill_the_vocabulary_shards(tmp_path) -> None:
    """Each rank keeps its rows of the checkpoint's embedding and head (uneven: 65 rows over 2)."""
    from pipekit.families.llama.hf import save_hf_llama

    args = TINY_LLAMA.with_updates(vocab_size=TINY_LLAMA.vocab_size + 1)
    full = Llama(args)
    full.init_weights(seed=5)
    save_hf_llama(full, args, tmp_path / "hf")
    results = run_on_ranks(_load_hf_into_shards, 2, str(tmp_path / "hf"))
    assert [(start, end) for start, end, _ in results] == [(0, 33), (33, 65)]
    for start, end, rows in results:
        for name, value in rows.items():
            assert torch.equal(value, full.get_parameter(name).detach()[start:end]), name
