"""Hugging Face export and load from sharded layouts, against one process.

Each case builds a layout on 4 ranks (FSDP2, FSDP2 + expert parallelism, a sliced pipeline x
FSDP2 with vocabulary shards and tied embeddings, a sliced pipeline x FSDP2 x expert
parallelism), materialised shard by shard from one seed; every rank exports its part. The
checkpoint must equal, tensor for tensor, the export of the same model built whole in one
process. Then a second, differently seeded build of the layout loads that checkpoint: every
rank's shards must equal its blocks of the whole model, and it must read no more bytes than it
owns (plus the whole heads around a RoPE-reordered block). Ablations: a vocabulary shard
exported without its row offset is refused (its rows overlap another rank's), and a stage
without its row offset loads the wrong rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tiny_models import TINY_LLAMA
from torch import nn
from torch.distributed.tensor import DTensor

from pipekit.checkpoint import CheckpointError, SafetensorsCheckpoint, TensorRead
from pipekit.checkpoint.local_shards import local_nbytes
from pipekit.families.llama.hf import LLAMA_HF
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.models import get_model_spec
from pipekit.models.materialize import local_block
from pipekit.moe import MoEArgs
from pipekit.testing import build_model, data_parallel_model, pipeline_layout, run_on_ranks

WORLD, SEED, OTHER_SEED = 4, 3, 11
MOE = MoEArgs(num_experts=4, top_k=2)
LLAMA_TIED = dataclasses.replace(TINY_LLAMA, n_layers=4, tie_embeddings=True)
LLAMA_MOE = LlamaMoEArgs(**{**vars(TINY_LLAMA), "n_layers": 4}, moe=MOE, moe_every=1)
SLICED = {"pipeline_schedule": "sliced", "num_slices": 2, "microbatches": 2, "dp_shard": 2}
CASES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "fsdp": ("llama", LLAMA_TIED, {}),
    "fsdp+ep": ("llama_moe", LLAMA_MOE, {"ep": 2}),
    "sliced x fsdp, tied vocabulary shards": (
        "llama",
        LLAMA_TIED,
        SLICED | {"pipeline": True, "vocab_parallel": True},
    ),
    "sliced x fsdp x ep": ("llama_moe", LLAMA_MOE, SLICED | {"pipeline": True, "ep": 2}),
}


def _layout(rank: int, case: str, seed: int) -> tuple[nn.Module, dict]:
    """This rank's part of the case's layout, and its row-sharded parameters."""
    family, args, options = CASES[case]
    spec = get_model_spec(family)
    options = dict(options)
    if options.pop("pipeline", False):
        runner, _, _ = pipeline_layout(
            WORLD, spec, args, (8, 16), seed=seed, dtype=torch.float32, **options
        )
        return runner.model, runner.row_sharded_parameters()
    model, _, _ = data_parallel_model(WORLD, spec, args, seed=seed, dtype=torch.float32, **options)
    return model, {}


def _export_and_load(rank: int, world: int, folder: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for number, case in enumerate(CASES):
        family, args, _ = CASES[case]
        hf = get_model_spec(family).hf
        directory = Path(folder, f"case{number}")
        model, rows = _layout(rank, case, SEED)
        hf.save(model, args, str(directory), row_shards=rows)
        if number == 0:  # rank 0's refusal to replace a checkpoint reaches every rank
            report["refused_overwrite"] = _refused_overwrite(model, args, directory)
        reference = build_model(get_model_spec(family), args, SEED, torch.float32)
        reads: list[TensorRead] = []
        loaded, rows = _layout(rank, case, OTHER_SEED)
        hf.load(str(directory), loaded, args, row_shards=rows, read_log=reads)
        wrong = [
            name
            for name, param in loaded.named_parameters()
            if not torch.equal(_local(param), _block_of(reference, name, param, rows))
        ]
        report[case] = {
            "wrong": wrong,
            "read": sum(read.nbytes for read in reads),
            "owned": local_nbytes(loaded),
        }
        if case.startswith("sliced x fsdp, tied"):
            report["unshifted_export"] = _refused(
                hf, model, args, _unshifted(rows), Path(folder, "unshifted")
            )
            loaded_again, _ = _layout(rank, case, OTHER_SEED)
            hf.load(str(directory), loaded_again, args, row_shards=_unshifted(rows))
            report["unshifted_load_wrong"] = sorted(
                name
                for name, param in loaded_again.named_parameters()
                if not torch.equal(_local(param), _block_of(reference, name, param, rows))
            )
        dist.barrier()
    return report


def _refused_overwrite(model: nn.Module, args: Any, directory: Path) -> str:
    try:
        LLAMA_HF.save(model, args, directory, overwrite=False)
    except CheckpointError as error:
        return str(error)
    return ""


def _refused(hf: Any, model: nn.Module, args: Any, rows: dict, directory: Path) -> str:
    try:
        hf.save(model, args, str(directory), row_shards=rows)
    except ValueError as error:
        return str(error)
    return ""


def _unshifted(rows: dict) -> dict:
    return {name: dataclasses.replace(shard, start=0) for name, shard in rows.items()}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _block_of(reference: nn.Module, name: str, param: torch.Tensor, rows: dict) -> torch.Tensor:
    index = local_block(param)
    if name in rows:
        start = rows[name].start
        index = (slice(index[0].start + start, index[0].stop + start), *index[1:])
    whole = dict(reference.named_parameters(remove_duplicate=False))[name]
    return whole.detach()[index]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("sharded_hf")
    reports = run_on_ranks(_export_and_load, WORLD, str(folder), timeout=300)
    return folder, reports


@pytest.mark.parametrize("number", range(len(CASES)), ids=list(CASES))
def test_sharded_export_equals_the_whole_model_export(exported, tmp_path, number: int) -> None:
    folder, _ = exported
    family, args, _ = list(CASES.values())[number]
    spec = get_model_spec(family)
    spec.hf.save(build_model(spec, args, SEED, torch.float32), args, str(tmp_path / "whole"))
    whole, sharded = _tensors(tmp_path / "whole"), _tensors(folder / f"case{number}")
    assert sharded.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(sharded[name], tensor), name
    files = sorted(path.name for path in (folder / f"case{number}").iterdir())
    assert "config.json" in files
    assert (folder / f"case{number}" / "config.json").read_text() == (
        tmp_path / "whole" / "config.json"
    ).read_text()


@pytest.mark.parametrize("number", range(len(CASES)), ids=list(CASES))
def test_sharded_load_reads_only_the_local_blocks(exported, number: int) -> None:
    _, reports = exported
    case = list(CASES)[number]
    for rank, report in enumerate(reports):
        figures = report[case]
        assert figures["wrong"] == [], (rank, figures["wrong"])
        # RoPE-reordered rows are read as whole heads: a shard cutting a head reads it all.
        assert figures["read"] <= 1.1 * figures["owned"], (rank, figures)


def test_every_rank_writes_a_share_of_the_files(exported) -> None:
    """Writers are chosen by bytes: each of the 4 ranks writes one file of whole tensors."""
    folder, _ = exported
    for number in range(len(CASES)):
        files = sorted((folder / f"case{number}").glob("*.safetensors"))
        assert [path.name for path in files] == [
            f"model-{i:05d}-of-{WORLD:05d}.safetensors" for i in range(1, WORLD + 1)
        ]
        assert (folder / f"case{number}" / "model.safetensors.index.json").exists()


def test_an_existing_checkpoint_is_not_replaced_unless_asked(exported) -> None:
    _, reports = exported
    assert all("already exists" in report["refused_overwrite"] for report in reports)


def test_ablation_vocabulary_shards_without_their_row_offsets(exported) -> None:
    _, reports = exported
    assert all("overlap or one is missing" in report["unshifted_export"] for report in reports)
    wrong = {name for report in reports for name in report["unshifted_load_wrong"]}
    assert wrong == {"tok_embeddings.weight", "output.weight"}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with SafetensorsCheckpoint(directory) as checkpoint:
        files = checkpoint.files
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors |= load_file(str(path))
    return tensors
