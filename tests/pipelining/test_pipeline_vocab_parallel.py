"""A vocabulary-parallel pipeline equals one process running the whole model (float64): loss,
every stage parameter's gradient and every rank's rows of the embedding and output gradients,
for the sliced schedule (p = 2 and 4, v = 1 and 2) and torch's schedules run as action lists,
with packed documents, ignored labels and an uneven last shard, and for a model whose output
projection has a bias (each rank adds, trains and checkpoints its rows of it, saved under the
bias's own name as one whole tensor). The ablations drop the other ranks' share of d loss /
d hidden, or of the embedding gradient, or the output bias, and must fail."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from tiny_models import (
    BIASED_HEAD,
    PARITY_ROWS,
    PARITY_SEQ_LEN,
    PARITY_TOLERANCE,
    TINY_LLAMA,
    pp_mesh,
    tiny_batch,
    tiny_pipeline,
    tiny_reference,
)
from torch import nn

from pipekit.checkpoint.dcp import CheckpointManager, ModelOptimizerState, load_checkpoint
from pipekit.families.llama import Llama
from pipekit.models import ModelStructure
from pipekit.pipelining import PipelineRunner
from pipekit.pipelining.features import vocab_parallel
from pipekit.pipelining.features.vocab_parallel import PipelineVocabParallel, vocabulary_row_dims
from pipekit.pipelining.features.vocab_rules import check_vocab_parallel_model
from pipekit.testing import Comparison, Result, build_model, compare, run_on_ranks, runner_step


class Case(NamedTuple):
    """One pipeline step: schedule, stages per rank, microbatches, slices, and what differs."""

    schedule: str
    v: int
    m: int
    n: int
    ablation: str = ""
    vocab_size: int = TINY_LLAMA.vocab_size
    head_bias: bool = False
    tied: bool = False
    checkpoint: bool = False
    """Save the step's state into the test's folder as step-1."""


def _run(rank: int, world: int, case: Case, folder: str) -> tuple:
    mesh = pp_mesh(world)
    runner = tiny_pipeline(
        mesh,
        schedule=case.schedule,
        stages_per_rank=case.v,
        microbatches=case.m,
        num_slices=case.n,
        rows=PARITY_ROWS,
        seq_len=PARITY_SEQ_LEN,
        vocab_parallel=True,
        vocab_size=case.vocab_size,
        head_bias=case.head_bias,
        tied=case.tied,
    )
    vocab = runner.extension("vocab_parallel")
    assert isinstance(vocab, PipelineVocabParallel)
    if case.ablation == "hidden_grad_last_rank_only" and rank != vocab.last_rank:
        vocab.output.register_full_backward_hook(lambda _, grad_in, __: (grad_in[0] * 0,))
    if case.ablation == "embedding_grad_first_rank_only":
        _skip_embedding_gradient_broadcast(vocab)
    if case.ablation == "output_bias_dropped":  # on no rank, never applied nor trained
        vocab.output.bias = None
    result = runner_step(runner, tiny_batch(case.vocab_size))
    if case.checkpoint:
        _save_checkpoint(runner, mesh, folder)
    return result


def _skip_embedding_gradient_broadcast(vocab: PipelineVocabParallel) -> None:
    """Ablation: the other ranks never receive the first stage's embedding gradients."""
    end_step = vocab.end_step

    def without_broadcast() -> None:
        with mock.patch.object(vocab_parallel.dist, "broadcast", lambda *_, **__: None):
            end_step()

    vocab.end_step = without_broadcast


def _save_checkpoint(runner: PipelineRunner, mesh, folder: str) -> None:
    """The step's state as the trainer saves it (the vocabulary rows as whole tensors), after an
    AdamW step with lr 0: weights as drawn, first moments 0.1 x the gradients."""
    assert runner.model is not None
    optimizer = torch.optim.AdamW(runner.model.parameters(), lr=0.0)
    optimizer.step()
    rows = {name: shard.rows for name, shard in runner.row_sharded_parameters().items()}
    state = ModelOptimizerState(
        runner.model, optimizer, row_shards=rows, mesh=mesh, row_dims=vocabulary_row_dims(mesh)
    )
    CheckpointManager(folder).save(1, {"model_and_optimizer": state})


def _many(rank: int, world: int, cases: list[Case], folder: str) -> list:
    return [_run(rank, world, case, folder) for case in cases]


def _comparisons(world: int, cases: list[Case], folder: Path) -> dict[Case, Comparison]:
    results = run_on_ranks(_many, world, cases, str(folder), timeout=240)
    return {
        case: compare([results[rank][index] for rank in range(world)], _reference(world, case))
        for index, case in enumerate(cases)
    }


def _reference(world: int, case: Case) -> Result:
    return _tiny_reference(world * case.v, case.vocab_size, case.head_bias, case.tied)


_tiny_reference = functools.cache(tiny_reference)
"""Cases of one model share its reference (it depends on neither schedule nor split)."""


def _assert_parity(comparisons: dict[Case, Comparison]) -> None:
    failed = {case: comparison for case, comparison in comparisons.items()
              if not comparison.within(PARITY_TOLERANCE)}  # fmt: skip
    assert not failed, failed


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_sliced_pipeline_equals_single_process_fp64(
    world: int, tmp_path: Path
) -> None:
    """Also (p = 2): the biased head's checkpoint loads into one process, every entry as the
    ranks held it, the bias and its optimizer state among them."""
    cases = [
        Case("sliced", 1, 2, 2 * world),
        Case("sliced", 2, 1, world),
        Case("sliced", 1, 3, world),
        Case("sliced", 1, 2, world, vocab_size=67),  # uneven: 34/33 or 17/17/17/16 rows
        Case("sliced", 1, 2, world, head_bias=True, checkpoint=world == 2),
        Case("sliced", 1, 2, world, head_bias=True, tied=True),  # the bias is the head's own
    ]
    _assert_parity(_comparisons(world, cases, tmp_path))
    if world == 2:
        (saved,) = [case for case in cases if case.checkpoint]
        _assert_checkpoint_holds_the_bias(tmp_path / "step-1", world, _reference(world, saved))


def _assert_checkpoint_holds_the_bias(step: Path, world: int, reference: Result) -> None:
    args = TINY_LLAMA.with_updates(n_layers=world)
    drawn = build_model(BIASED_HEAD, args, seed=3, dtype=torch.float64)
    _, reference_grads = reference
    loaded = build_model(BIASED_HEAD, args, seed=5, dtype=torch.float64).state_dict()
    exp_avg = {"state.output.bias.exp_avg": torch.zeros(args.vocab_size, dtype=torch.float64)}
    load_checkpoint(step, {"model_and_optimizer": {"model": loaded, "optimizer": exp_avg}})
    for name, tensor in drawn.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    want = 0.1 * reference_grads["output.bias"]
    torch.testing.assert_close(exp_avg["state.output.bias.exp_avg"], want, rtol=1e-9, atol=0)


def test_vocab_parallel_with_torch_schedules(tmp_path: Path) -> None:
    cases = [
        Case("1F1B", 1, 3, 1),
        Case("GPipe", 1, 2, 1),
        Case("Interleaved1F1B", 2, 2, 1),
        Case("InterleavedZeroBubble", 2, 2, 1),
        Case("ZBVZeroBubble", 2, 2, 1),
        Case("DualPipeV", 2, 6, 1),
    ]
    _assert_parity(_comparisons(2, cases, tmp_path))


def test_dropping_a_ranks_share_or_the_output_bias_breaks_parity(tmp_path: Path) -> None:
    ablations = ["hidden_grad_last_rank_only", "embedding_grad_first_rank_only"]
    cases = [Case("sliced", 1, 2, 4, ablation) for ablation in ablations]
    dropped_bias = Case("sliced", 1, 2, 4, "output_bias_dropped", head_bias=True)
    comparisons = _comparisons(2, [*cases, dropped_bias], tmp_path)
    for case in cases:
        assert comparisons[case].worst > 1e-3 and not comparisons[case].missing, case
    assert comparisons[dropped_bias].loss > 1e-3  # the loss of the model without its bias
    assert comparisons[dropped_bias].missing == ("output.bias",)  # and no rank trains it


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


class _ScaledEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(ids)


def _with(**modules: nn.Module) -> nn.Module:
    """A tiny model whose embedding and output are the given modules (defaults: plain ones)."""
    model = nn.Module()
    model.embed, model.head = nn.Embedding(8, 4), nn.Linear(4, 8)
    for name, module in modules.items():
        setattr(model, name, module)
    return model


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        ({"embed": _ScaledEmbedding(8, 4)}, "'embed' is a _ScaledEmbedding, which .* own forward"),
        ({"head": nn.Bilinear(4, 4, 8)}, "'head' is a Bilinear"),
        ({"embed": nn.Embedding(8, 4, padding_idx=0)}, r"with \{'padding_idx': 0\}"),
        ({"embed": nn.Embedding(8, 4, sparse=True)}, r"with \{'sparse': True\}"),
    ],
)
def test_vocabulary_modules_the_shards_cannot_compute_are_refused(modules, message) -> None:
    structure = ModelStructure("blocks", "embed", "head")
    check_vocab_parallel_model(_with(), structure)  # a biased nn.Linear head is kept
    with pytest.raises(ValueError, match=message):
        check_vocab_parallel_model(_with(**modules), structure)


def test_parameters_and_buffers_the_shards_would_drop_are_refused() -> None:
    structure = ModelStructure("blocks", "embed", "head")
    embedding = nn.Embedding(8, 4)
    embedding.scale = nn.Parameter(torch.ones(()))
    head = nn.Linear(4, 8)
    head.register_buffer("temperature", torch.ones(()))
    with pytest.raises(ValueError, match=r"'embed' holds \['scale'\], .* \(of weight only\)"):
        check_vocab_parallel_model(_with(embed=embedding), structure)
    with pytest.raises(ValueError, match=r"'head' holds \['temperature'\], .* weight and bias"):
        check_vocab_parallel_model(_with(head=head), structure)
