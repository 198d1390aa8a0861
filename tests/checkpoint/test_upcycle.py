"""Online upcycling of a dense Llama checkpoint: first forward equals the dense model's, reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_reference import rewrite_weights
from safetensors.torch import save_file
from tiny_models import TINY_LLAMA
from torch import nn

from pipekit.attention.kernels.backends import use_backend
from pipekit.checkpoint import CheckpointError, SafetensorsCheckpoint, TensorRead
from pipekit.checkpoint import upcycle as upcycle_module
from pipekit.checkpoint.block_sources import BlockSource, CheckpointBlock, fill_from_sources
from pipekit.checkpoint.file_reads import DirectReader, evict, resident_fraction
from pipekit.families.llama import Llama, LlamaArgs
from pipekit.families.llama.hf import build_llama_from_hf, load_hf_llama, save_hf_llama
from pipekit.families.llama_moe import LlamaMoE
from pipekit.families.llama_moe.upcycle import LLAMA_UPCYCLER, upcycle_llama, upcycled_args
from pipekit.models.upcycling import UpcycleSpec

DENSE = TINY_LLAMA
TOKENS = torch.tensor(
    [[1, 5, 17, 60, 42, 0, 63, 8, 3, 3, 33, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2]]
)


def write_dense(
    directory: Path, dtype: torch.dtype, args: LlamaArgs = DENSE, seed: int = 0
) -> Path:
    """A randomly initialised dense Llama in Hugging Face layout, in `dtype`."""
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    save_hf_llama(model.to(dtype), args, directory)
    return directory


def dense_logits(directory: Path, dtype: torch.dtype) -> torch.Tensor:
    model, args = build_llama_from_hf(directory)
    if dtype != torch.float32:  # reload in dtype: the checkpoint's values, not a cast of float32
        with torch.device("meta"):
            model = Llama(args).to(dtype)
        model.to_empty(device="cpu")
        model.tie_weights()
        load_hf_llama(directory, model, args)
    return logits(model)


def logits(model: nn.Module) -> torch.Tensor:
    """Eval-mode logits of TOKENS with the CPU kernel (it takes float64; flex on CPU does not)."""
    with torch.no_grad(), use_backend("cpu"):
        return model.eval()(TOKENS)


@pytest.mark.parametrize(
    ("dtype", "granularity", "moe_every", "tolerance"),
    [
        (torch.float32, 1, 1, 1e-5),
        (torch.float64, 1, 1, 1e-10),
        (torch.float64, 2, 1, 1e-10),
        (torch.float32, 4, 2, 1e-5),
        (torch.float64, 3, 2, 1e-10),
    ],
)
def test_mixtral_router_keeps_the_dense_logits(
    tmp_path: Path, dtype: torch.dtype, granularity: int, moe_every: int, tolerance: float
) -> None:
    directory = write_dense(tmp_path / "dense", dtype)
    spec = UpcycleSpec(num_experts=4, top_k=2, granularity=granularity, moe_every=moe_every)
    model, args = upcycle_llama(directory, spec, seed=3, dtype=dtype)
    assert args.moe.num_experts == 4 * granularity and args.moe.top_k == 2 * granularity
    torch.testing.assert_close(
        logits(model), dense_logits(directory, dtype), rtol=0, atol=tolerance
    )


def test_softmax_then_topk_router_departs_from_dense(tmp_path: Path) -> None:
    """The ST router's weights sum to the kept probability mass p < 1, so each MoE layer outputs
    p x the dense FFN: exactly, per token, and the logits move far beyond rounding."""
    directory = write_dense(tmp_path / "dense", torch.float64)
    spec = UpcycleSpec(num_experts=4, top_k=2, router="softmax_topk")
    model, _ = upcycle_llama(directory, spec, seed=3, dtype=torch.float64)
    dense, _ = build_llama_from_hf(directory)
    x_TD = torch.randn(
        10, DENSE.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    moe = model.layers["0"].feed_forward
    with torch.no_grad():
        probs_TE = torch.softmax(moe.router.logits(x_TD), dim=-1)
        kept_T1 = probs_TE.topk(2, dim=-1).values.sum(-1, keepdim=True)
        ffn_TD = dense.layers["0"].feed_forward.double()(x_TD)
        torch.testing.assert_close(
            moe.eval()(x_TD[None])[0], kept_T1 * ffn_TD, rtol=1e-12, atol=1e-15
        )
    assert float(kept_T1.min()) > 0.45 and float(kept_T1.max()) < 0.6  # ~k/N: a near-flat router
    gap = (logits(model) - dense_logits(directory, torch.float64)).abs().max()
    assert gap > 1e-3, f"softmax-then-top-k moved the logits by only {gap:.2e}"


def test_granular_experts_are_pieces_and_router_rows_repeat(tmp_path: Path) -> None:
    directory = write_dense(tmp_path / "dense", torch.float32)
    spec = UpcycleSpec(num_experts=2, top_k=1, granularity=3)
    model, _ = upcycle_llama(directory, spec)
    dense, _ = build_llama_from_hf(directory)
    moe, ffn = model.layers["1"].feed_forward, dense.layers["1"].feed_forward
    piece = DENSE.ffn_dim // 3
    for expert in range(6):
        rows = slice(expert % 3 * piece, (expert % 3 + 1) * piece)
        assert torch.equal(moe.experts.w1_EFD[expert], ffn.w1.weight[rows])
        assert torch.equal(moe.experts.w3_EFD[expert], ffn.w3.weight[rows])
        assert torch.equal(moe.experts.w2_EDF[expert], 3 * ffn.w2.weight[:, rows])
        assert torch.equal(moe.router.gate.weight[expert], moe.router.gate.weight[expert // 3 * 3])
    assert not torch.equal(moe.router.gate.weight[0], moe.router.gate.weight[3])


def test_router_depends_on_seed_and_layer_only(tmp_path: Path) -> None:
    directory = write_dense(tmp_path / "dense", torch.float32)
    spec = UpcycleSpec(num_experts=4, top_k=2, router_init_std=0.5)
    first, _ = upcycle_llama(directory, spec, seed=7)
    again, _ = upcycle_llama(directory, spec, seed=7)
    other, _ = upcycle_llama(directory, spec, seed=8)
    gates = [m.layers["0"].feed_forward.router.gate.weight for m in (first, again, other)]
    assert torch.equal(gates[0], gates[1]) and not torch.equal(gates[0], gates[2])
    assert not torch.equal(gates[0], first.layers["1"].feed_forward.router.gate.weight)
    assert 0.3 < float(gates[0].detach().std()) < 0.6


def test_single_rank_reads_each_dense_tensor_once(tmp_path: Path) -> None:
    """One rank owns everything: every dense tensor is read whole, once; the experts' bytes are
    read once per layer, not once per expert."""
    directory = write_dense(tmp_path / "dense", torch.float32)
    reads: list[TensorRead] = []
    model, _ = upcycle_llama(directory, UpcycleSpec(num_experts=8, top_k=2), read_log=reads)
    names = [read.name for read in reads]
    assert (
        len(names) == len(set(names)) == len(list(build_llama_from_hf(directory)[0].parameters()))
    )
    owned = sum(param.numel() * 4 for param in model.parameters())
    router = sum(m.router.gate.weight.numel() * 4 for m in _moe_layers(model))
    ffn = 3 * DENSE.dim * DENSE.ffn_dim * 4 * DENSE.n_layers
    assert sum(read.nbytes for read in reads) == owned - router - 7 * ffn


def _upcycle_counting_temporaries(directory, monkeypatch, direct):
    """(model, bytes of block-sized temporaries, bytes read) of a bfloat16 upcycle; without
    `direct`, every source reads, then copies (the default `BlockSource.read_into`)."""
    temporary_bytes = []
    real_read_block = SafetensorsCheckpoint.read_block

    def counting_read_block(self, name, index):
        block = real_read_block(self, name, index)
        temporary_bytes.append(block.nbytes)
        return block

    with monkeypatch.context() as patch:
        patch.setattr(SafetensorsCheckpoint, "read_block", counting_read_block)
        if not direct:
            patch.setattr(CheckpointBlock, "read_into", BlockSource.read_into)
            patch.setattr(upcycle_module.ExpertCopies, "read_into", BlockSource.read_into)
        reads: list[TensorRead] = []
        spec = UpcycleSpec(num_experts=4, top_k=2)
        model, _ = upcycle_llama(directory, spec, dtype=torch.bfloat16, read_log=reads)
    return model, sum(temporary_bytes), sum(read.nbytes for read in reads)


def test_blocks_are_read_straight_into_the_model_storage(tmp_path: Path, monkeypatch) -> None:
    """Every block of whole rows, experts and the RoPE-reordered query and key projections
    included, is read with pread into its final storage: no block-sized temporary
    (`read_block` allocates one), the same weights. Ablation: reading, then copying, allocates
    a temporary for every byte read."""
    directory = write_dense(tmp_path / "dense", torch.bfloat16)
    model, temporaries, read = _upcycle_counting_temporaries(directory, monkeypatch, True)
    copied, copy_temporaries, _ = _upcycle_counting_temporaries(directory, monkeypatch, False)
    assert temporaries == 0 < read
    assert copy_temporaries == read
    for name, values in copied.state_dict().items():
        assert torch.equal(model.state_dict()[name], values), name


@pytest.mark.parametrize(
    ("shape", "rows"), [((12, 5), slice(3, 11)), ((12, 5), slice(0, 12)), ((8,), slice(2, 7))]
)
def test_reordered_rows_are_scattered_straight_into_the_storage(
    tmp_path: Path, shape: tuple[int, ...], rows: slice
) -> None:
    """A row order within groups (RoPE's per-head reorder) read straight into a block that
    cuts groups at both ends, a 1-D tensor's elements being its rows, equals reordering the
    whole tensor, then cutting; its read log names the whole groups it read."""
    order = [2, 0, 3, 1]
    values = torch.randn(shape, dtype=torch.float64)
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    expected = values.unflatten(0, (-1, 4))[:, order].flatten(0, 1)[rows]
    reads: list[TensorRead] = []
    with SafetensorsCheckpoint(tmp_path, read_log=reads) as checkpoint:
        source = CheckpointBlock(checkpoint, "w", row_order=order)
        out = torch.full_like(expected, float("nan"))
        source.read_into((rows,), out)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(source.read((rows,)), expected, rtol=0, atol=0)
        first, last = rows.start // 4 * 4, -(-rows.stop // 4) * 4
        assert reads[0].bounds[0] == (first, last)
        with pytest.raises(ValueError, match="not a permutation"):
            CheckpointBlock(checkpoint, "w", row_order=[0, 0, 1, 2])


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    return [
        block.feed_forward
        for block in model.layers.values()
        if hasattr(block.feed_forward, "router")
    ]


def test_bad_input_is_named(tmp_path: Path) -> None:
    directory = write_dense(tmp_path / "dense", torch.float32)
    with pytest.raises(ValueError, match="granularity=5 must divide the dense FFN hidden dim 48"):
        upcycled_args(DENSE, UpcycleSpec(num_experts=2, top_k=1, granularity=5))
    with pytest.raises(ValueError, match="use topk_softmax"):
        upcycled_args(DENSE, UpcycleSpec(num_experts=2, top_k=1, router="expert_choice"))
    with pytest.raises(ValueError, match="1 <= top_k <= num_experts"):
        UpcycleSpec(num_experts=2, top_k=3)
    # not a Llama checkpoint
    config = directory / "config.json"
    config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "gpt2"'))
    with pytest.raises(CheckpointError, match="model_type='gpt2'"):
        upcycle_llama(directory, UpcycleSpec(num_experts=2, top_k=1))
    # a dense FFN tensor missing
    directory = write_dense(tmp_path / "dense2", torch.float32)
    rewrite_weights(directory, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model.layers.1.mlp.up_proj"):
        upcycle_llama(directory, UpcycleSpec(num_experts=2, top_k=1))


def test_experts_other_than_swiglu_are_refused_before_any_read(tmp_path: Path) -> None:
    """A dense SwiGLU FFN copied into gelu experts would compute another function."""
    directory = write_dense(tmp_path / "dense", torch.float32)
    spec = UpcycleSpec(num_experts=2, top_k=1)
    args = upcycled_args(DENSE, spec)
    args = args.with_updates(moe=dataclasses.replace(args.moe, activation="gelu"))
    with torch.device("meta"):
        model = LlamaMoE(args)
    reads: list[TensorRead] = []
    with pytest.raises(
        ValueError, match=r"moe.activation='gelu' experts: .* use activation='swiglu'"
    ):
        upcycle_module.materialize_upcycled(
            model, "cpu", directory, LLAMA_UPCYCLER, args, spec, seed=0, read_log=reads
        )
    assert reads == []


@pytest.mark.parametrize("broken", ["independent router rows", "unscaled down projections"])
def test_granular_upcycling_needs_virtual_groups_and_scaling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """Ablation: without the repeated router rows, top-(k·G) picks pieces of different copies;
    without the x G down projections, the output is the dense FFN / G."""
    directory = write_dense(tmp_path / "dense", torch.float64)
    if broken == "independent router rows":
        monkeypatch.setattr(upcycle_module.RouterInit, "__init__", _router_without_groups)
    else:
        original = upcycle_module.ExpertCopies.__init__

        def unscaled(self, source, copies, granularity, split_dim, scale):  # type: ignore[no-untyped-def]
            original(self, source, copies, granularity, split_dim, 1)

        monkeypatch.setattr(upcycle_module.ExpertCopies, "__init__", unscaled)
    spec = UpcycleSpec(num_experts=4, top_k=2, granularity=2, router_init_std=0.5)
    model, _ = upcycle_llama(directory, spec, seed=3, dtype=torch.float64)
    gap = (logits(model) - dense_logits(directory, torch.float64)).abs().max()
    assert gap > 1e-3, f"{broken}: the logits moved by only {gap:.2e}"


_router_init = upcycle_module.RouterInit.__init__


def _router_without_groups(self, name, copies, granularity, dim, std, seed, dtype):  # type: ignore[no-untyped-def]
    _router_init(self, name, copies * granularity, 1, dim, std, seed, dtype)


def test_storage_of_the_wrong_shape_is_named_before_anything_is_written(tmp_path: Path) -> None:
    directory = write_dense(tmp_path / "dense", torch.float32)
    with SafetensorsCheckpoint(directory) as checkpoint:
        dense = CheckpointBlock(checkpoint, "model.layers.0.mlp.gate_proj.weight")
        experts = upcycle_module.ExpertCopies(dense, copies=4, granularity=1, split_dim=0, scale=1)
        index = tuple(slice(0, size) for size in experts.shape)
        too_many = torch.full((5, *experts.shape[1:]), 7.0)
        fill = fill_from_sources({"layers.0.feed_forward.experts.w1": experts})
        with pytest.raises(ValueError, match=r"experts.w1: block rows 0:4 do not fit storage"):
            fill("layers.0.feed_forward.experts.w1", index, too_many)
        assert bool((too_many == 7).all())
        narrow = torch.empty(dense.shape[0], dense.shape[1] - 1)
        with pytest.raises(ValueError, match=r"gate_proj.weight.*storage to fill has shape"):
            dense.read_into(tuple(slice(0, size) for size in dense.shape), narrow)


def test_an_uncached_checkpoint_is_upcycled_past_the_page_cache(
    direct_read_dir: Path, monkeypatch
) -> None:
    """Upcycling an evicted checkpoint reads its rows with O_DIRECT: the same weights as a
    buffered upcycle, and the checkpoint's pages are not cached afterwards (the bytes saved).
    Ablation: with direct reads off, the upcycle fills the page cache with the checkpoint. The
    FFN weights are 16 MB each, so that what the kernel reads ahead while the files' headers are
    checked (a few MB) leaves most of the file uncached."""
    args = dataclasses.replace(DENSE, dim=64, ffn_dim=65536)
    directory = write_dense(direct_read_dir / "dense", torch.float32, args)
    files = SafetensorsCheckpoint(directory).files

    def upcycle_evicted() -> tuple[nn.Module, float]:
        for path in files:
            evict(path)
        model, _ = upcycle_llama(directory, UpcycleSpec(num_experts=2, top_k=1))
        pages = sum(path.stat().st_size for path in files)
        cached = sum(resident_fraction(path) * path.stat().st_size for path in files) / pages
        return model, cached

    direct, direct_cached = upcycle_evicted()
    monkeypatch.setattr(DirectReader, "read", lambda self, path, offset, buffers: False)
    buffered, buffered_cached = upcycle_evicted()
    assert direct_cached < 0.25 < 0.9 < buffered_cached
    for name, values in buffered.state_dict().items():
        assert torch.equal(direct.state_dict()[name], values), name
