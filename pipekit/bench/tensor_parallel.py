"""`python -m pipekit.bench tensor-parallel`: activation memory per rank with and without
sequence parallelism, and the bytes tensor parallelism moves, against Megatron's formulas.

A run of Llama blocks (`--layers`, at `--dim` with `--heads`/`--kv-heads` and `--ffn-dim`) is
split over `--tp` gloo ranks by the Llama plan, as a pipeline stage between two others is: it
takes and gives hidden states (a rank's tokens of them under sequence parallelism). For each
mode, one forward and backward of `--rows` x `--seq` tokens in float32:
- activations: the bytes autograd saves on rank 0 (`ActivationMemoryTracker`), split by where
  they are saved: the norms, attention (with the projections), the FFN;
- communication: the bytes rank 0 sends in the collectives tensor parallelism issues, forward
  and backward, counted at torch's functional collectives (ring algorithms: an all-gather or a
  reduce-scatter of N bytes sends (t-1)/t N per rank, an all-reduce twice that).

Megatron's figures ("Reducing Activation Recomputation in Large Transformer Models"): sequence
parallelism divides the activations tensor parallelism leaves whole (the norms' inputs) by t,
and per layer forward and backward move 4 all-reduces of b s h elements without it, or 4
all-gathers and 4 reduce-scatters with it: the same 8 (t-1)/t b s h elements per rank.

RESULT: sp_activation_ratio (the norms' saved bytes with over without sequence parallelism;
1/t expected), tp_bytes_vs_formula (measured over Megatron's bytes with sequence parallelism),
and the same for the blocks' whole activations and without sequence parallelism.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from pipekit.bench._collective_bytes import count_collective_bytes
from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench.report import machine_description, print_result, print_table

__all__ = ["main"]

_MIB = 2**20
_PARTS = ("norms", "attention", "feed_forward")


def _worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from pipekit.distributed.tensor_parallel import apply_tensor_parallel
    from pipekit.memory.tracker import SAVED, ActivationMemoryTracker
    from pipekit.models.materialize import materialize_sharded
    from pipekit.models.registry import get_model_spec
    from pipekit.models.stage_module import build_stage_module

    sent = [0]
    count_collective_bytes(sent, num_ranks)
    mesh = init_device_mesh("cpu", (num_ranks,), mesh_dim_names=("tp",))
    llama = get_model_spec("llama")
    args = llama.flavor("debug").with_updates(
        dim=spec["dim"], n_layers=spec["layers"], n_heads=spec["heads"],
        n_kv_heads=spec["kv_heads"], ffn_dim=spec["ffn_dim"], max_seq_len=spec["seq"],
    )  # fmt: skip
    results: dict[str, Any] = {}
    for sequence_parallel in (False, True):
        with torch.device("meta"):
            model = llama.build(args)
        blocks = build_stage_module(
            model, [*llama.structure.shared, *(f"layers.{i}" for i in range(spec["layers"]))]
        )
        apply_tensor_parallel(blocks, mesh, llama, sequence_parallel=sequence_parallel)
        materialize_sharded(blocks, "cpu", lambda unit: unit.init_weights(seed=0))
        local_tokens = spec["seq"] // (num_ranks if sequence_parallel else 1)
        size = (spec["rows"], local_tokens, spec["dim"])
        hidden_BSD = torch.randn(size, generator=torch.Generator().manual_seed(0))
        saved = dict.fromkeys(_PARTS, 0)
        with ActivationMemoryTracker(exclude=list(blocks.parameters())) as tracker:
            _attribute_saved_bytes(blocks, tracker, saved)
            sent[0] = 0
            out_BSD = blocks(hidden_BSD.requires_grad_())
        forward_bytes = sent[0]
        out_BSD.backward(torch.ones_like(out_BSD))
        results[f"sp={sequence_parallel}"] = {
            "saved": saved,
            "total_saved": tracker.peak_bytes(SAVED),
            "forward_bytes": forward_bytes,
            "bytes": sent[0],
        }
    return results


def _attribute_saved_bytes(blocks: torch.nn.Module, tracker, saved: dict[str, int]) -> None:
    """Hooks that add to `saved[part]` what autograd saves during each part's forward."""
    from pipekit.memory.tracker import SAVED

    parts = {"attention_norm": "norms", "ffn_norm": "norms", "attention": "attention"}
    parts["feed_forward"] = "feed_forward"
    for block in blocks.layers.values():
        for name, part in parts.items():
            module = block.get_submodule(name)
            before: list[int] = []
            module.register_forward_pre_hook(
                lambda *_, before=before: before.append(tracker.live_bytes(SAVED))
            )
            module.register_forward_hook(
                lambda *_, before=before, part=part: saved.__setitem__(
                    part, saved[part] + tracker.live_bytes(SAVED) - before.pop()
                )
            )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench tensor-parallel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel gloo ranks")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    options = parser.parse_args(argv)
    t = options.tp
    spec = {name: getattr(options, name) for name in
            ("dim", "heads", "kv_heads", "ffn_dim", "layers", "rows", "seq")}  # fmt: skip
    print(machine_description(), flush=True)
    print(
        f"{options.layers} Llama blocks (dim {options.dim}, {options.heads} query heads, "
        f"{options.kv_heads} kv heads, FFN {options.ffn_dim}) over tp {t} gloo ranks, "
        f"{options.rows} x {options.seq} tokens, float32; rank 0's figures"
    )
    result = run_ranks("pipekit.bench.tensor_parallel:_worker", t, spec)[0]
    plain, split = result["sp=False"], result["sp=True"]
    print_table(
        ["saved for backward (MiB)", "tp", "tp + sp", "ratio"],
        [
            *([part, plain["saved"][part] / _MIB, split["saved"][part] / _MIB,
               split["saved"][part] / plain["saved"][part]] for part in _PARTS),
            ["all (blocks)", plain["total_saved"] / _MIB, split["total_saved"] / _MIB,
             split["total_saved"] / plain["total_saved"]],
        ],
    )  # fmt: skip
    element = 4  # float32
    formula = 8 * (t - 1) / t * options.rows * options.seq * options.dim * element
    formula *= options.layers
    print(
        f"\nMegatron's bytes per rank, forward and backward: 8 (t-1)/t b s h e x layers = "
        f"{formula / _MIB:.3f} MiB (both modes)"
    )
    print_table(
        ["mode", "forward MiB", "forward + backward MiB", "vs formula"],
        [
            ["tp", plain["forward_bytes"] / _MIB, plain["bytes"] / _MIB, plain["bytes"] / formula],
            ["tp + sp", split["forward_bytes"] / _MIB, split["bytes"] / _MIB,
             split["bytes"] / formula],
        ],
    )  # fmt: skip
    print_result(
        sp_activation_ratio=split["saved"]["norms"] / plain["saved"]["norms"],
        tp_bytes_vs_formula=split["bytes"] / formula,
        sp_block_activation_ratio=split["total_saved"] / plain["total_saved"],
        tp_without_sp_bytes_vs_formula=plain["bytes"] / formula,
    )
