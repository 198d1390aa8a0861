"""Hugging Face safetensors interop of the Llama: parity with transformers, round trips, errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_reference import LLAMA3_ROPE, TINY_HF_CONFIG, rewrite_weights, save_transformers_model
from safetensors.torch import load_file, save_file

import pipekit.families.decoder.hf_layout as hf_layout
from pipekit.checkpoint import CheckpointError, SafetensorsCheckpoint, TensorRead, save_safetensors
from pipekit.checkpoint.inspect import main as inspect_main
from pipekit.families.decoder.hf_layout import permute_from_hf, permute_to_hf
from pipekit.families.llama.args import LlamaArgs, RopeScaling, llama_flavor
from pipekit.families.llama.hf import (
    LLAMA_HF,
    build_llama_from_hf,
    hf_config_to_args,
    load_hf_llama,
    read_hf_llama_args,
    save_hf_llama,
)
from pipekit.families.llama.model import Llama
from pipekit.layers.rope import RotaryEmbedding, apply_rotary

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = [1, 5, 17, 99, 42, 0, 63, 8, 3, 3, 77, 12, 50, 2, 9, 31]
PARITY_TOLERANCE = 1e-4


def _save_hf_llama(directory: Path, max_shard_size: int | None = None, **overrides: object):
    """A tiny random transformers Llama saved with save_pretrained; returns the HF model."""
    config = transformers.LlamaConfig(**(TINY_HF_CONFIG | overrides))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    return save_transformers_model(transformers.LlamaForCausalLM, config, directory, **kwargs)


def _hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([TOKENS])).logits


def _our_logits(model: Llama) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOKENS]), positions=torch.arange(len(TOKENS)))


def _empty_model(args: LlamaArgs) -> Llama:
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied tiny checkpoint written by transformers, shared by the read-only tests."""
    directory = tmp_path_factory.mktemp("hf") / "untied"
    _save_hf_llama(directory)
    return directory


def _copy(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


# (a) parity with transformers' own forward


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"rope_parameters": LLAMA3_ROPE}, {"head_dim": 32}],
    ids=["untied", "tied", "llama3_rope", "head_dim_32"],
)
def test_logits_equal_transformers(tmp_path: Path, overrides: dict) -> None:
    hf_model = _save_hf_llama(tmp_path / "hf", **overrides)
    model, args = build_llama_from_hf(tmp_path / "hf")
    if "head_dim" in overrides:
        assert args.per_head_dim == 32 != args.dim // args.n_heads
    assert (_our_logits(model) - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE


def test_skipping_the_rope_permutation_breaks_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_model = _save_hf_llama(tmp_path / "hf")
    monkeypatch.setattr(hf_layout, "permute_from_hf", lambda w_RD, head_dim: w_RD)
    model, _ = build_llama_from_hf(tmp_path / "hf")
    assert (_our_logits(model) - _hf_logits(hf_model)).abs().max() > 0.1


def test_inspect_cli_runs_sharded_checkpoint_like_transformers(tmp_path: Path) -> None:
    hf_model = _save_hf_llama(tmp_path / "hf", max_shard_size=60_000)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    out = tmp_path / "logits.safetensors"
    tokens = ",".join(map(str, TOKENS))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipekit.checkpoint.inspect",
            str(tmp_path / "hf"),
            "--tokens",
            tokens,
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"model\.layers\.1\.self_attn\.q_proj\.weight +float32 +\[64, 64\]", result.stdout
    )
    assert "LlamaArgs(dim=64, n_layers=2" in result.stdout
    logits = load_file(out)["logits"]
    assert logits.dtype == torch.float32 and logits.shape == (1, len(TOKENS), 100)
    assert (logits - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE


def test_inspect_cli_bad_input_is_one_line_exit_2_from_a_fresh_interpreter() -> None:
    """The command as users start it: nothing but the one line (no import-time warnings)."""
    result = subprocess.run(
        [sys.executable, "-m", "pipekit.checkpoint.inspect", "missing_dir"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], result.stderr


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["{ckpt}", "--tokens", "1,x", "--out", "o.safetensors"], "comma-separated"),
        (["{ckpt}", "--tokens", "1,100", "--out", "o.safetensors"], "vocab_size=100"),
        (["{ckpt}", "--tokens", "1,2"], "go together"),
    ],
)
def test_inspect_cli_bad_input_is_one_line_exit_2(
    hf_checkpoint: Path,
    arguments: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each refusal, through the command's `main` in this process (the parser's exits too)."""
    monkeypatch.chdir(REPO_ROOT)
    arguments = [argument.format(ckpt=hf_checkpoint) for argument in arguments]
    try:
        status = inspect_main(arguments)
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


# (b) round trips


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_save_load_is_bit_exact(tmp_path: Path, tied: bool) -> None:
    hf_model = _save_hf_llama(tmp_path / "hf", tie_word_embeddings=tied)
    model, args = build_llama_from_hf(tmp_path / "hf")
    save_hf_llama(model, args, tmp_path / "ours", max_shard_bytes=40_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()

    with (
        SafetensorsCheckpoint(tmp_path / "hf") as theirs,
        SafetensorsCheckpoint(tmp_path / "ours") as ours,
    ):
        assert ours.names == theirs.names
        for name in theirs.names:
            assert torch.equal(ours.read(name), theirs.read(name)), name
            assert ours.info(name).dtype == theirs.info(name).dtype
    reloaded = _empty_model(args)
    load_hf_llama(tmp_path / "ours", reloaded, args)
    for (name, before), after in zip(
        model.state_dict().items(), reloaded.state_dict().values(), strict=True
    ):
        assert torch.equal(before, after), name
    # transformers reads our config.json and shards as the same model.
    hf_reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert torch.equal(_hf_logits(hf_reloaded), _hf_logits(hf_model))


def test_tensor_list_maps_every_parameter_onto_the_transformers_state_dict(
    tmp_path: Path,
) -> None:
    hf_model = _save_hf_llama(tmp_path / "hf", tie_word_embeddings=True)
    model, args = build_llama_from_hf(tmp_path / "hf")
    theirs = hf_model.state_dict()
    listed = LLAMA_HF.tensors(args)
    assert {entry.hf_name for entry in listed} | {"lm_head.weight"} == set(theirs)
    for entry in listed:
        ours = LLAMA_HF.to_hf(entry.param_name, model.get_parameter(entry.param_name), args)
        assert torch.equal(ours, theirs[entry.hf_name]), entry.hf_name


def test_crash_while_saving_leaves_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {f"t{i}": torch.full((1000,), float(i)) for i in range(4)}
    save_safetensors(tensors, tmp_path / "ckpt", max_shard_bytes=8000)
    written = []

    def save_then_crash(shard: dict, path: str, metadata: dict) -> None:
        if written:
            raise OSError("disk full")
        written.append(path)
        save_file(shard, path, metadata=metadata)

    monkeypatch.setattr("pipekit.checkpoint.safetensors_write.save_file", save_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(tensors, tmp_path / "ckpt", max_shard_bytes=8000, overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(tensors, tmp_path / "new", max_shard_bytes=8000)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        assert torch.equal(checkpoint.read("t3"), tensors["t3"])
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        save_safetensors(tensors, tmp_path / "ckpt")


# (c) errors a user meets


def test_missing_unexpected_and_misshapen_tensors_are_all_listed(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    directory = _copy(hf_checkpoint, tmp_path / "broken")

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # ignored
        tensors["model.norm.weight"] = torch.ones(65)

    rewrite_weights(directory, edit)
    args = read_hf_llama_args(directory)
    model = _empty_model(args)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError) as error:
        load_hf_llama(directory, model, args)
    message = str(error.value)
    assert "missing tensors (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected tensors (1): model.layers.0.self_attn.q_proj.bias" in message
    assert "model.norm.weight expected [64], got [65]" in message
    assert "inv_freq" not in message
    for name, tensor in model.state_dict().items():  # a failed load changes nothing
        assert torch.equal(tensor, before[name]), name


def test_integer_weights_are_refused_not_cast(hf_checkpoint: Path, tmp_path: Path) -> None:
    """An I32 tensor where the model has float weights is refused by name before any load."""
    directory = _copy(hf_checkpoint, tmp_path / "integers")

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)

    rewrite_weights(directory, edit)
    args = read_hf_llama_args(directory)
    with pytest.raises(
        CheckpointError, match=r"integer or bool data .*model\.norm\.weight \(int32\)"
    ):
        load_hf_llama(directory, _empty_model(args), args)


def test_an_index_naming_files_outside_its_folder_is_refused(
    hf_checkpoint: Path, tmp_path: Path
) -> None:
    """A weight_map naming `../outside/...` or an absolute path is refused before any file it
    names is opened (the outside file exists and would parse)."""
    outside = _copy(hf_checkpoint, tmp_path / "outside")
    for target in ("../outside/model.safetensors", str(outside / "model.safetensors")):
        directory = _copy(hf_checkpoint, tmp_path / "escaping")
        weights = load_file(directory / "model.safetensors")
        (directory / "model.safetensors").unlink()
        index = {"metadata": {}, "weight_map": dict.fromkeys(weights, target)}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=r"names shard files outside its folder"):
            SafetensorsCheckpoint(directory)
        shutil.rmtree(directory)


def test_config_that_differs_from_model_lists_fields(hf_checkpoint: Path) -> None:
    args = read_hf_llama_args(hf_checkpoint).with_updates(rope_theta=500000.0, norm_eps=1e-5)
    with pytest.raises(CheckpointError) as error:
        load_hf_llama(hf_checkpoint, _empty_model(args), args)
    assert "norm_eps: checkpoint 1e-06, model 1e-05" in str(error.value)
    assert "rope_theta: checkpoint 10000.0, model 500000.0" in str(error.value)


def test_max_seq_len_may_differ_from_checkpoint(hf_checkpoint: Path) -> None:
    args = read_hf_llama_args(hf_checkpoint).with_updates(max_seq_len=32)
    load_hf_llama(hf_checkpoint, _empty_model(args), args)


def test_model_on_meta_device_is_refused(hf_checkpoint: Path) -> None:
    args = read_hf_llama_args(hf_checkpoint)
    with torch.device("meta"):
        model = Llama(args)
    with pytest.raises(ValueError, match="to_empty"):
        load_hf_llama(hf_checkpoint, model, args)


def test_tied_checkpoint_with_different_lm_head_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "tied"
    _save_hf_llama(directory, tie_word_embeddings=True)
    args = read_hf_llama_args(directory)
    rewrite_weights(directory, lambda t: t.update({"lm_head.weight": torch.zeros(100, 64)}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs"):
        load_hf_llama(directory, _empty_model(args), args)
    rewrite_weights(
        directory, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    )
    load_hf_llama(directory, _empty_model(args), args)  # an identical lm_head is fine


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type='mistral' (need 'llama')"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        (
            {"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope type 'dynamic'",
        ),
        ({"num_attention_heads": 6}, "n_heads=6 must be a multiple of n_kv_heads=4"),
        ({"hidden_size": "64"}, "hidden_size='64' must be an integer"),
    ],
)
def test_unsupported_config_is_refused(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError) as error:
        hf_config_to_args(_published_config() | change)
    assert message in str(error.value)


def test_config_without_required_keys_lists_them() -> None:
    config = _published_config()
    del config["vocab_size"], config["hidden_size"]
    with pytest.raises(CheckpointError, match=r"missing keys \['hidden_size', 'vocab_size'\]"):
        hf_config_to_args(config)


def test_unreadable_checkpoints_name_the_problem(hf_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsCheckpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_hf_llama_args(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        SafetensorsCheckpoint(tmp_path / "empty")

    corrupt = _copy(hf_checkpoint, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match=r"corrupt[/\\]model.safetensors.*corrupt or trunc"):
        SafetensorsCheckpoint(corrupt).names  # noqa: B018 (the listing reads the header)

    sharded = tmp_path / "sharded"
    save_safetensors(
        load_file(hf_checkpoint / "model.safetensors"), sharded, max_shard_bytes=60_000
    )
    (sharded / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"not in .*: \['model-00002-of-00006"):
        SafetensorsCheckpoint(sharded)


# (d) config.json dialects


def _published_config() -> dict:
    """A config.json in the dialect of the published Llama 3.1 files."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 100,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
    }


def test_both_config_dialects_give_the_same_args() -> None:
    published = _published_config()
    transformers5 = {key: value for key, value in published.items() if not key.startswith("rope")}
    transformers5 |= {
        "rope_parameters": {**published["rope_scaling"], "rope_theta": 500000.0},
        "head_dim": 16,
        "dtype": "bfloat16",
    }
    expected = LlamaArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=100,
        ffn_dim=96,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=256,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64),
    )
    assert hf_config_to_args(published) == expected
    assert hf_config_to_args(transformers5) == expected
    legacy = published | {"rope_scaling": {**published["rope_scaling"], "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    assert hf_config_to_args(legacy) == expected


def test_absent_keys_take_transformers_defaults() -> None:
    config = _published_config() | {"rope_scaling": None}
    for key in ("num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        del config[key]
    args = hf_config_to_args(config | {"head_dim": None})
    assert (args.num_kv_heads, args.per_head_dim) == (4, 16)
    assert (args.rope_theta, args.norm_eps, args.rope_scaling) == (10000.0, 1e-6, None)
    assert not args.tie_embeddings
    default_type = hf_config_to_args(config | {"rope_parameters": {"rope_type": "default"}})
    assert default_type.rope_scaling is None


def test_published_llama31_8b_config_is_the_8b_flavor() -> None:
    config = _published_config() | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    config["rope_scaling"] = config["rope_scaling"] | {"original_max_position_embeddings": 8192}
    assert hf_config_to_args(config) == llama_flavor("8B")


# (e) permutation and head-aligned slices


def test_permuted_projection_rotates_like_rotate_half() -> None:
    """Interleaved RoPE on our rows == Hugging Face's rotate_half RoPE on the permuted rows."""
    head_dim, heads, seq_len = 8, 3, 5
    torch.manual_seed(0)
    wq_RD, x_SD = torch.randn(heads * head_dim, 16), torch.randn(seq_len, 16)
    rope = RotaryEmbedding(head_dim, theta=10000.0)
    cos_SF, sin_SF = rope(torch.arange(seq_len))
    ours_HSK = apply_rotary(
        (x_SD @ wq_RD.T).view(seq_len, heads, head_dim), cos_SF, sin_SF
    ).transpose(0, 1)
    theirs_HSK = (x_SD @ permute_to_hf(wq_RD, head_dim).T).view(seq_len, heads, head_dim)
    theirs_HSK = theirs_HSK.transpose(0, 1)
    cos_SK, sin_SK = torch.cat([cos_SF, cos_SF], -1), torch.cat([sin_SF, sin_SF], -1)
    first, second = theirs_HSK.chunk(2, dim=-1)
    rotated_HSK = theirs_HSK * cos_SK + torch.cat([-second, first], -1) * sin_SK
    # Same rotation, reported in each layout's own channel order.
    assert torch.allclose(
        permute_to_hf(ours_HSK.reshape(-1, head_dim).T, head_dim).T,
        rotated_HSK.reshape(-1, head_dim),
        atol=1e-6,
    )
    assert torch.equal(permute_from_hf(permute_to_hf(wq_RD, head_dim), head_dim), wq_RD)


@pytest.mark.parametrize("name", ["layers.1.attention.wq.weight", "layers.0.attention.wk.weight"])
def test_any_row_block_of_a_permuted_weight_equals_that_block_of_the_whole(
    hf_checkpoint: Path, name: str
) -> None:
    """A shard's rows are read as the whole heads covering them, reordered, then cut."""
    args = read_hf_llama_args(hf_checkpoint)
    head_dim = args.per_head_dim
    reads: list[TensorRead] = []
    with SafetensorsCheckpoint(hf_checkpoint, read_log=reads) as checkpoint:
        source = LLAMA_HF.source(checkpoint, name, args)
        full = source.read_all()
        hf_name = LLAMA_HF.source_name(name, args)
        assert torch.equal(full, permute_from_hf(checkpoint.read(hf_name), head_dim))
        for start, stop in [(head_dim, 2 * head_dim), (0, head_dim), (4, head_dim + 4)]:
            reads.clear()
            block = source.read((slice(start, stop), slice(0, args.dim)))
            assert torch.equal(block, full[start:stop])
            (read,) = reads
            assert read.bounds[0] == (start // head_dim * head_dim, -(-stop // head_dim) * head_dim)


def test_listing_reads_headers_only(hf_checkpoint: Path) -> None:
    with SafetensorsCheckpoint(hf_checkpoint) as checkpoint:
        infos = checkpoint.infos()
    assert infos["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert infos["model.embed_tokens.weight"].nbytes == 100 * 64 * 4
    assert {info.dtype for info in infos.values()} == {torch.float32}
    assert len(infos) == 2 * 9 + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_row_blocks_are_read_from_the_file_and_other_blocks_through_the_map(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """A block of whole rows is one byte range (`pread`, no memory map); a narrower block goes
    through safetensors' slicing. Both equal the block of the whole tensor, in several files."""
    tensors = {
        "a": torch.arange(7 * 5 * 3).reshape(7, 5, 3).to(dtype),
        "b": torch.arange(11 * 4).reshape(11, 4).to(dtype),
        "scalar": torch.tensor(3).to(dtype),
    }
    save_safetensors(tensors, tmp_path / "ckpt", max_shard_bytes=200)
    with SafetensorsCheckpoint(tmp_path / "ckpt") as checkpoint:
        assert len(checkpoint.files) > 1
        for name, whole in tensors.items():
            assert torch.equal(checkpoint.read(name), whole), name
        assert torch.equal(checkpoint.read("a", slice(2, 6)), tensors["a"][2:6])
        assert torch.equal(checkpoint.read("b", slice(10, 11)), tensors["b"][10:11])
        columns = checkpoint.read_block("a", (slice(1, 4), slice(2, 5), slice(0, 2)))
        assert torch.equal(columns, tensors["a"][1:4, 2:5, 0:2])
        # the row path hands back memory of its own, not a view of the file
        rows = checkpoint.read("b", slice(0, 5))
        rows.add_(1)
        assert torch.equal(checkpoint.read("b", slice(0, 5)), tensors["b"][0:5])
