"""Offline upcycling (`python -m pipekit.upcycle`): a transformers-written Llama becomes a Mixtral
that transformers runs with the dense logits, and the weights equal online upcycling's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import LLAMA3_ROPE, TINY_HF_CONFIG, rewrite_weights, save_transformers_model
from test_upcycle import write_dense

from pipekit.families.llama_moe.hf_mixtral import load_hf_mixtral, read_hf_mixtral_args
from pipekit.families.llama_moe.model import LlamaMoE
from pipekit.families.llama_moe.upcycle import upcycle_llama
from pipekit.models.upcycling import UpcycleSpec
from pipekit.upcycle import main, upcycle_offline

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 5, 17, 99, 42, 0, 63, 8, 3, 3, 77, 12, 50, 2, 9, 31]])


def _transformers_dense(directory: Path, dtype: torch.dtype, **overrides: object) -> None:
    """A random Llama written by transformers' save_pretrained (sharded), in `dtype`."""
    config = transformers.LlamaConfig(**(TINY_HF_CONFIG | overrides))
    model_class = transformers.LlamaForCausalLM
    save_transformers_model(model_class, config, directory, dtype, max_shard_size="40KB")


def _logits(model_class, directory: Path) -> torch.Tensor:
    model = model_class.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize(
    ("dtype", "overrides", "granularity"),
    [
        (torch.float32, {}, 1),
        (torch.bfloat16, {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}, 1),
        (torch.float32, {"rope_scaling": LLAMA3_ROPE}, 2),
        (torch.bfloat16, {}, 3),  # x3 is not exact in bf16: those down projections stay fp32
    ],
    ids=["float32", "bf16_tied_llama3_rope", "granularity2", "bf16_granularity3"],
)
def test_transformers_mixtral_gives_the_dense_logits(
    tmp_path: Path, dtype: torch.dtype, overrides: dict, granularity: int
) -> None:
    _transformers_dense(tmp_path / "dense", dtype, **overrides)
    command = ["--dense", str(tmp_path / "dense"), "--out", str(tmp_path / "moe")]
    command += ["--experts", "4", "--top-k", "2", "--granularity", str(granularity)]
    assert main([*command, "--max-shard-gb", "0.00005"]) == 0
    assert (tmp_path / "moe" / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["num_local_experts"] == 4 * granularity
    assert config["num_experts_per_tok"] == 2 * granularity
    dense = _logits(transformers.LlamaForCausalLM, tmp_path / "dense")
    moe = _logits(transformers.MixtralForCausalLM, tmp_path / "moe")
    torch.testing.assert_close(moe, dense, rtol=0, atol=1e-4)


@pytest.mark.parametrize("granularity", [1, 2])
def test_offline_and_online_give_the_same_weights(tmp_path: Path, granularity: int) -> None:
    directory = write_dense(tmp_path / "dense", torch.float32)
    spec = UpcycleSpec(num_experts=4, top_k=2, granularity=granularity)
    upcycle_offline(directory, tmp_path / "moe", spec, seed=11, progress=False)
    args = read_hf_mixtral_args(tmp_path / "moe")
    with torch.device("meta"):
        offline = LlamaMoE(args)
    offline.to_empty(device="cpu")
    load_hf_mixtral(tmp_path / "moe", offline, args)
    online, online_args = upcycle_llama(directory, spec, seed=11)
    assert online_args.moe.num_experts == args.moe.num_experts
    online_params = dict(online.named_parameters())
    for name, param in offline.named_parameters():
        assert torch.equal(param, online_params[name]), name


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().err


def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = write_dense(tmp_path / "dense", torch.float32)
    out = tmp_path / "moe"
    base = ["--dense", str(dense), "--out", str(out), "--experts", "4", "--top-k", "2"]

    status, error = _run([*base, "--every", "2"], capsys)
    assert status == 2 and "moe_every=2" in error and not out.exists()
    status, error = _run([*base[:-1], "5"], capsys)
    assert status == 2 and "1 <= top_k <= num_experts" in error and not out.exists()
    status, error = _run([*base, "--granularity", "5"], capsys)
    assert status == 2 and "granularity=5 must divide" in error and not out.exists()

    rewrite_weights(dense, lambda tensors: tensors.pop("model.layers.0.mlp.gate_proj.weight"))
    status, error = _run(base, capsys)
    assert status == 2 and "model.layers.0.mlp.gate_proj.weight" in error and not out.exists()

    upcycle_offline(  # a Mixtral is not a dense Llama
        write_dense(tmp_path / "dense2", torch.float32),
        out,
        UpcycleSpec(num_experts=2, top_k=1),
        progress=False,
    )
    status, error = _run(
        ["--dense", str(out), *base[2:4], "--experts", "2", "--top-k", "1"], capsys
    )
    assert status == 2 and "model_type='mixtral'" in error
    assert len(error.strip().splitlines()) == 1
