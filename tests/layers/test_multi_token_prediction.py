"""Multi-token prediction: the loss and every gradient of a model with MTP modules equal a
reference written out document by document (float64), for DeepSeek-V3 (MLA and MoE blocks) and a
Llama with tied embeddings; the same under FSDP2, expert parallelism and the sliced pipeline
(with EP, and for the tied Llama) against one process; ablations (no shift; slices that do not
look into the next one); what the extra modules leave alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from pipekit.attention.context import CausalAttention
from pipekit.layers import multi_token_prediction as mtp_module
from pipekit.layers.loss import IGNORE_INDEX, count_label_tokens, token_sum_cross_entropy
from pipekit.layers.multi_token_prediction import depth_targets, sequence_targets
from pipekit.models import get_model_spec
from pipekit.pipelining.features.multi_token_units import MultiTokenUnits
from pipekit.testing import (
    build_model,
    compare,
    data_parallel_step,
    parity_batch,
    pipeline_step,
    reference_step,
    run_on_ranks,
)

ROWS, SEQ = 4, 24


def _deepseek(depth: int = 2):
    spec = get_model_spec("deepseek_v3")
    args = spec.flavor("debug")
    # no balance loss: its statistics are per row, and the reference runs documents alone
    moe = dataclasses.replace(args.moe, load_balance_weight=0.0)
    return spec, args.with_updates(n_layers=2, mtp_depth=depth, mtp_loss_weight=0.3, moe=moe)


def _tied_llama():
    spec = get_model_spec("llama")
    return spec, spec.flavor("debug").with_updates(
        n_layers=2, tie_embeddings=True, mtp_depth=1, mtp_loss_weight=0.5
    )


def _written_out(spec, args, batch: TensorDict) -> tuple[float, dict[str, torch.Tensor]]:
    """(Main loss, gradients of main loss + lambda / D x sum_k CE^k / N), each depth run on
    each document's tokens alone (a document of L tokens gives depth k its first L - k
    positions), the embeddings of the tokens k on, the labels k on as targets; N the batch's
    label count."""
    model = build_model(spec, args, seed=3, dtype=torch.float64)
    normaliser = count_label_tokens(batch["labels"])
    final_hidden = []
    handle = model.output.register_forward_pre_hook(lambda _, args: final_hidden.append(args[0]))
    context = CausalAttention(batch["document_ids"])
    logits = model(batch["tokens"], batch["positions"], context)
    handle.remove()
    total = token_sum_cross_entropy(logits, batch["labels"], normaliser)
    extra = torch.zeros((), dtype=torch.float64)
    for row in range(ROWS):
        documents = batch["document_ids"][row]
        for document in documents.unique():
            where = (documents == document).nonzero().flatten()
            start, end = int(where[0]), int(where[-1]) + 1
            hidden = final_hidden[0][row : row + 1, start:end]
            for k, depth in enumerate(model.mtp.values(), start=1):
                length = end - start - k
                if length <= 0:
                    break
                tokens = batch["tokens"][row : row + 1, start + k : end]
                merged = depth.eh_proj(
                    torch.cat([depth.enorm(model.tok_embeddings(tokens)),
                               depth.hnorm(hidden[:, :length])], -1)
                )  # fmt: skip
                rope = model.rope(batch["positions"][row, start : start + length])
                hidden = depth.block(merged, rope)
                depth_logits = model.output(depth.norm(hidden))
                targets = batch["labels"][row : row + 1, start + k : end]
                extra = extra + token_sum_cross_entropy(depth_logits, targets, 1.0)
    (total + extra * args.mtp_loss_weight / args.mtp_depth / normaliser).backward()
    # the step reports the main loss; the extra one is in the gradients and its own metric
    return total.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model", ["deepseek_v3", "tied_llama"])
def test_mtp_loss_and_every_gradient_equal_the_written_out_reference_fp64(model):
    spec, args = _deepseek() if model == "deepseek_v3" else _tied_llama()
    batch = parity_batch(args.vocab_size, ROWS, SEQ)
    reference = _written_out(spec, args, batch)
    mtp_gradients = [name for name, grad in reference[1].items() if name.startswith("mtp.")]
    assert mtp_gradients and all(reference[1][name].abs().sum() > 0 for name in mtp_gradients)
    assert compare([reference_step(spec, args, batch)], reference).within(1e-12)


def test_mtp_without_its_shift_is_caught(monkeypatch):
    """The ablation: depth k fed the embeddings of the tokens it stands on (no shift) fails the
    same comparison."""
    spec, args = _deepseek(depth=1)
    batch = parity_batch(args.vocab_size, ROWS, SEQ)
    reference = _written_out(spec, args, batch)
    monkeypatch.setattr(mtp_module, "_ahead", lambda x_BT, k, length: x_BT[:, :length])
    assert not compare([reference_step(spec, args, batch)], reference).within(1e-3)


def test_depth_targets_stop_at_the_row_and_the_document():
    tokens_BS = torch.zeros(1, 6, dtype=torch.long)
    labels_BS = torch.tensor([[10, 11, 12, 13, 14, IGNORE_INDEX]])
    documents_BS = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with sequence_targets(tokens_BS, labels_BS, documents_BS, 2, 1.0) as targets:
        labels_BT, documents_BT = targets.labels_BT, targets.document_ids_BT
    assert depth_targets(labels_BT, documents_BT, 1, 6).tolist() == [
        [11, 12, IGNORE_INDEX, 14, IGNORE_INDEX, IGNORE_INDEX]
    ]
    assert depth_targets(labels_BT, None, 2, 6).tolist() == [
        [12, 13, 14, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    ]


def test_generation_and_evaluation_never_run_the_extra_modules():
    """Outside `multi_token_targets` the logits are the model's without MTP and the extra
    modules get no gradient."""
    spec, args = _deepseek(depth=1)
    plain = build_model(spec, args.with_updates(mtp_depth=0), seed=3, dtype=torch.float64)
    with_mtp = build_model(spec, args, seed=3, dtype=torch.float64)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = with_mtp(tokens)
    assert torch.equal(logits, plain(tokens))
    logits.sum().backward()
    assert all(p.grad is None for p in with_mtp.mtp.parameters())


def _layouts(rank: int, world: int, spec, args, batch):
    return [
        data_parallel_step(rank, world, spec, args, batch),
        data_parallel_step(rank, world, spec, args, batch, ep=2),
    ]


def test_mtp_under_fsdp_and_expert_parallelism_equals_one_process_fp64():
    spec, args = _deepseek(depth=2)
    args = args.with_updates(moe=dataclasses.replace(args.moe, load_balance_weight=1e-2))
    batch = parity_batch(args.vocab_size, ROWS, SEQ)
    reference = reference_step(spec, args, batch)
    per_rank = run_on_ranks(_layouts, 2, spec, args, batch, timeout=180)
    for index in range(2):
        assert compare([steps[index] for steps in per_rank], reference).within(1e-10)


SLICED = {"pipeline_schedule": "sliced", "num_slices": 4, "microbatches": 2}


def _slices_blind_to_the_next(runner) -> None:
    """The ablation: each slice's depth targets padded at its own end, as if it were a row."""
    units = runner.extension(MultiTokenUnits.name)

    def begin_step(units_, normaliser):
        MultiTokenUnits.begin_step(units, units_, normaliser)
        units._columns = [slice(c.start, c.stop - units.depth) for c in units._columns]

    def unit_targets(unit):
        batch = mtp_module.current_targets()
        index = unit  # units run in (microbatch, slice) order
        rows, columns = units._rows[index], units._columns[index]
        documents = batch.document_ids_BT[rows, columns]
        return sequence_targets(batch.tokens_BT[rows, columns], batch.labels_BT[rows, columns],
                                documents, units.depth, batch.loss_scale)  # fmt: skip

    units.begin_step = begin_step
    units._unit_targets = unit_targets


def _pipelines(rank: int, world: int, spec, args, batch, ablate: bool = False):
    adjust = _slices_blind_to_the_next if ablate else None
    return [pipeline_step(rank, world, spec, args, batch, adjust=adjust, **SLICED)]


@pytest.mark.parametrize("model", ["deepseek_v3", "tied_llama"])
def test_mtp_under_the_sliced_pipeline_equals_one_process_fp64(model):
    spec, args = _deepseek(depth=2) if model == "deepseek_v3" else _tied_llama()
    batch = parity_batch(args.vocab_size, ROWS, SEQ)
    reference = reference_step(spec, args, batch, microbatches=2)
    per_rank = run_on_ranks(_pipelines, 2, spec, args, batch, timeout=180)
    assert compare([steps[0] for steps in per_rank], reference).within(1e-10)


def test_mtp_slices_that_do_not_look_into_the_next_are_caught():
    spec, args = _deepseek(depth=2)
    batch = parity_batch(args.vocab_size, ROWS, SEQ)
    reference = reference_step(spec, args, batch, microbatches=2)
    per_rank = run_on_ranks(_pipelines, 2, spec, args, batch, True, timeout=180)
    assert not compare([steps[0] for steps in per_rank], reference).within(1e-3)


def _pipeline_with_experts(rank: int, world: int, spec, args, batch):
    return pipeline_step(rank, world, spec, args, batch, dp_shard=2, ep=2, **SLICED)


def test_mtp_under_the_sliced_pipeline_and_expert_parallelism_equals_one_process_fp64():
    spec, args = _deepseek(depth=1)
    batch = parity_batch(args.vocab_size, ROWS, SEQ)
    reference = reference_step(spec, args, batch, microbatches=2)
    per_rank = run_on_ranks(_pipeline_with_experts, 4, spec, args, batch, timeout=300)
    assert compare(per_rank, reference).within(1e-10)
