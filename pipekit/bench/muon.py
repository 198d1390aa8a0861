"""`python -m pipekit.bench muon --ranks 2`: what Muon costs under FSDP2 beyond AdamW.

A Llama (`--dim`, `--ffn-dim`, `--layers`, float32) is sharded by FSDP2 over `--ranks` gloo ranks
(fresh interpreters, one thread each); every parameter gets a seeded gradient and the
optimizer steps. For AdamW and Muon (`[optimizer] name`): the median seconds of a step, and the
bytes rank 0 sends in it, counted at torch's functional collectives. Muon gathers each matrix's
update whole before Newton-Schulz, so its step sends (t-1)/t of the matrices' bytes (the
formula); AdamW's sends nothing. Beside them: the seconds of the gathers alone, and FSDP2's own
traffic per training step by its formula (an all-gather in the forward and the backward and a
reduce-scatter of the gradients: 3 (t-1)/t of every parameter's bytes) to size Muon's share.

Timings with more ranks than cores mean nothing: keep `--ranks` at or below the core count and
the machine idle.

RESULT: `muon_bytes_vs_formula` (1 expected), `muon_bytes_over_fsdp_step` (Muon's extra traffic
over FSDP2's per training step), `muon_step_s`, `adamw_step_s`, `gather_s`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from pipekit.bench._collective_bytes import count_collective_bytes
from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench.report import machine_description, print_result, print_table, time_call

__all__ = ["main"]

_MIB = 2**20
_REPEATS = 5


def _worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipekit.config.job_config import OptimizerConfig
    from pipekit.models.registry import get_model_spec
    from pipekit.train.muon import muon_parameter_names
    from pipekit.train.optimizer import build_optimizer

    sent = [0]
    count_collective_bytes(sent, num_ranks)
    llama = get_model_spec("llama")
    args = llama.flavor("debug").with_updates(
        dim=spec["dim"], ffn_dim=spec["ffn_dim"], n_layers=spec["layers"],
        n_heads=spec["dim"] // 64, n_kv_heads=spec["dim"] // 128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = llama.build(args)
    model.init_weights(seed=0)
    names = muon_parameter_names(model, llama.structure.embedding, llama.structure.output)
    numels = {name: param.numel() for name, param in model.named_parameters()}
    mesh = init_device_mesh("cpu", (num_ranks,), mesh_dim_names=("dp_shard",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        local = param.to_local()
        param.grad = param.new_zeros(param.shape)  # a DTensor like the parameter
        param.grad.to_local().copy_(torch.randn(local.shape, generator=generator))
    results: dict[str, Any] = {
        "matrix_bytes": 4 * sum(numels[name] for name in names),
        "param_bytes": 4 * sum(numels.values()),
    }
    for name in ("AdamW", "Muon"):
        optimizer = build_optimizer(model, OptimizerConfig(name=name), llama.structure)
        results[f"{name}_s"] = time_call(optimizer.step, warmup=1, repeats=_REPEATS)
        sent[0] = 0
        optimizer.step()
        results[f"{name}_bytes"] = sent[0]
    matrices = [param for name, param in model.named_parameters() if name in names]
    results["gather_s"] = time_call(
        lambda: [p.grad.full_tensor() for p in matrices], warmup=1, repeats=_REPEATS
    )
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench muon", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 gloo ranks")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn-dim", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    options = parser.parse_args(argv)
    t = options.ranks
    spec = {"dim": options.dim, "ffn_dim": options.ffn_dim, "layers": options.layers}
    print(machine_description(), flush=True)
    print(
        f"Llama, {options.layers} layers, dim {options.dim}, FFN {options.ffn_dim}, float32, "
        f"FSDP2 over {t} gloo ranks (one thread each); rank 0's figures, median of {_REPEATS}"
    )
    result = run_ranks("pipekit.bench.muon:_worker", t, spec)[0]
    formula = (t - 1) / t * result["matrix_bytes"]
    fsdp_step = 3 * (t - 1) / t * result["param_bytes"]
    print_table(
        ["optimizer step", "seconds", "MiB sent", "formula MiB"],
        [
            ["AdamW", result["AdamW_s"], result["AdamW_bytes"] / _MIB, 0.0],
            ["Muon", result["Muon_s"], result["Muon_bytes"] / _MIB, formula / _MIB],
            ["Muon's gathers alone", result["gather_s"], "", ""],
            ["FSDP2 forward + backward (formula)", "", "", fsdp_step / _MIB],
        ],
    )
    print_result(
        muon_bytes_vs_formula=result["Muon_bytes"] / formula,
        muon_bytes_over_fsdp_step=result["Muon_bytes"] / fsdp_step,
        muon_step_s=result["Muon_s"],
        adamw_step_s=result["AdamW_s"],
        gather_s=result["gather_s"],
    )
