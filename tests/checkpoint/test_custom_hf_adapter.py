"""The example's Hugging Face adapter (examples/custom_model/hf_adapter.py, docs/hf_adapter.md):
a save -> load round trip gives the same weights and logits, tied or not; two ranks that each
hold one pipeline stage and half of the vocabulary rows save one checkpoint together, and each
reads back only its own blocks; `python -m pipekit.checkpoint.inspect` describes and runs it.
Ablation: the same ranks saving without `row_shards` write a checkpoint that does not load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import examples.custom_model.hf_adapter as adapter
from examples.custom_model.model import TinyGPT, TinyGPTArgs
from pipekit.checkpoint.inspect import main as inspect_main
from pipekit.checkpoint.local_shards import RowShard
from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.models import get_model_spec
from pipekit.testing import run_on_ranks

ARGS = TinyGPTArgs(dim=32, n_layers=4, n_heads=2, vocab_size=64, max_seq_len=32)
TOKENS_BS = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def _model(args: TinyGPTArgs, seed: int) -> TinyGPT:
    model = TinyGPT(args)
    model.init_weights(seed=seed)
    return model.eval()


def _assert_same_weights(model: nn.Module, other: nn.Module) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    others = dict(other.named_parameters(remove_duplicate=False))
    assert params.keys() == others.keys()
    for name, param in params.items():
        assert torch.equal(param, others[name]), name


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_load_gives_the_same_weights_and_logits(tmp_path: Path, tied: bool) -> None:
    args = dataclasses.replace(ARGS, tie_embeddings=tied)
    model = _model(args, seed=1)
    adapter.save(model, args, tmp_path / "hf")
    fresh = _model(args, seed=2)
    adapter.load(tmp_path / "hf", fresh, args)
    _assert_same_weights(model, fresh)
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS_BS), model(TOKENS_BS))
    assert adapter.read_args(tmp_path / "hf") == args
    assert ("lm_head.weight" in load_file(tmp_path / "hf" / "model.safetensors")) is not tied


def test_importing_the_adapter_gives_the_family_its_hf_hooks() -> None:
    assert get_model_spec("tiny_gpt").hf is adapter.TINY_GPT_HF


def test_a_checkpoint_of_other_args_is_refused_before_any_weight_is_written(
    tmp_path: Path,
) -> None:
    adapter.save(_model(ARGS, seed=1), ARGS, tmp_path / "hf")
    wider = dataclasses.replace(ARGS, dim=64)
    model = _model(wider, seed=2)
    before = {name: param.clone() for name, param in model.named_parameters()}
    with pytest.raises(CheckpointError, match="dim=32"):
        adapter.load(tmp_path / "hf", model, wider)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


HALF = ARGS.vocab_size // 2


def _rank_part(rank: int) -> tuple[TinyGPT, dict[str, RowShard]]:
    """What rank `rank` of a 2-stage vocabulary-parallel pipeline holds of the seed-1 model:
    its stage's blocks (stage 0 with the positions, stage 1 with the final norm) and its half
    of the embedding and output rows."""
    model = _model(ARGS, seed=1)
    for key in ("2", "3") if rank == 0 else ("0", "1"):
        del model.blocks[key]
    if rank == 0:
        model.ln_f = None
    else:
        model.wpe = None
    rows = slice(rank * HALF, (rank + 1) * HALF)
    embedding, head = nn.Embedding(HALF, ARGS.dim), nn.Linear(ARGS.dim, HALF, bias=False)
    with torch.no_grad():
        embedding.weight.copy_(model.wte.weight[rows])
        head.weight.copy_(model.lm_head.weight[rows])
    model.wte, model.lm_head = embedding, head
    shard = RowShard(start=rows.start, rows=ARGS.vocab_size)
    return model, {"wte.weight": shard, "lm_head.weight": shard}


def _save_and_read_back(rank: int, world: int, folder: str) -> dict:
    part, row_shards = _rank_part(rank)
    adapter.save(part, ARGS, Path(folder) / "hf", row_shards=row_shards)
    adapter.save(part, ARGS, Path(folder) / "ablation_no_row_shards")
    reads = []
    fresh, _ = _rank_part(rank)
    for param in fresh.parameters():
        param.data.zero_()
    adapter.load(Path(folder) / "hf", fresh, ARGS, row_shards=row_shards, read_log=reads)
    _assert_same_weights(part, fresh)
    return {read.name: read.bounds for read in reads}


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("two_ranks")
    return folder, run_on_ranks(_save_and_read_back, 2, str(folder))


def test_two_ranks_save_one_checkpoint_equal_to_the_whole_model(saved_by_two_ranks) -> None:
    folder, _ = saved_by_two_ranks
    whole = _model(ARGS, seed=1)
    loaded, args = adapter.build_from_checkpoint(folder / "hf")
    assert args == ARGS
    _assert_same_weights(whole, loaded.eval())
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS_BS), whole(TOKENS_BS))
    assert len(list((folder / "hf").glob("*.safetensors"))) == 2  # each rank wrote a file


def test_each_rank_reads_only_its_blocks(saved_by_two_ranks) -> None:
    _, reads = saved_by_two_ranks
    whole = {entry.hf_name: entry.hf_shape for entry in adapter.tensors(ARGS)}
    for rank, read in enumerate(reads):
        part, _ = _rank_part(rank)
        held = [
            hf for name, _ in part.named_parameters() for hf in adapter.checkpoint_names(name, ARGS)
        ]
        assert sorted(read) == sorted(held)
        assert not any(f"h.{2 * (1 - rank)}." in name for name in read)  # the other stage's
        rows = (rank * HALF, (rank + 1) * HALF)
        for name, bounds in read.items():
            vocabulary = name in ("transformer.wte.weight", "lm_head.weight")
            expected = (rows, (0, ARGS.dim)) if vocabulary else tuple((0, n) for n in whole[name])
            assert bounds == expected, name


def test_ablation_saving_without_row_shards_writes_a_checkpoint_that_does_not_load(
    saved_by_two_ranks,
) -> None:
    folder, _ = saved_by_two_ranks
    with pytest.raises(CheckpointError, match=r"is \[32, 32\] in the file, \[64, 32\]"):
        adapter.build_from_checkpoint(folder / "ablation_no_row_shards")


def test_inspect_lists_and_runs_the_checkpoint(tmp_path: Path, capsys) -> None:
    model = _model(ARGS, seed=1)
    adapter.save(model, ARGS, tmp_path / "hf")
    tokens = [1, 2, 3, 5, 8]
    out = tmp_path / "logits.safetensors"
    assert inspect_main([str(tmp_path / "hf"), "--tokens", "1,2,3,5,8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "transformer.h.1.mlp.experts.3.w2.weight" in printed
    assert repr(ARGS) in printed
    with torch.no_grad():
        expected = model(torch.tensor([tokens]))
    assert torch.allclose(load_file(out)["logits"], expected, rtol=0, atol=1e-6)
