"""`python -m pipekit.upcycle --dense DIR --out DIR --experts 8 --top-k 2 [--granularity G]`.

Offline upcycling: reads a dense Hugging Face checkpoint tensor block by tensor block and writes
the upcycled mixture of experts in the Hugging Face layout of its family (Llama -> Mixtral,
Qwen3 -> Qwen3-MoE: sharded safetensors, index, config.json), one shard in memory at a time,
with a progress bar. The dense family is the one that reads the checkpoint's config.json.
It asks the same sources as online upcycling (`[model.upcycle]` in a training config), so with
the same seed both give the same weights. Bad input prints one error line and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm

from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint
from pipekit.checkpoint.safetensors_write import DEFAULT_MAX_SHARD_BYTES, save_safetensors
from pipekit.models.registry import get_model_spec, known_models, spec_for_checkpoint
from pipekit.models.upcycling import UpcycleSpec

__all__ = ["main", "upcycle_offline"]

_PROGRAM = "python -m pipekit.upcycle"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def upcycle_offline(
    dense: str | Path,
    out: str | Path,
    spec: UpcycleSpec,
    *,
    model: str | None = None,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write the MoE that `spec` makes of the dense checkpoint `dense` to `out`; returns `out`.
    `model` names the dense family (default: the one that reads its config.json)."""
    dense_spec = spec_for_checkpoint(dense) if model is None else get_model_spec(model)
    model = dense_spec.name
    if dense_spec.upcycler is None or dense_spec.hf is None:
        upcyclable = [name for name in known_models() if get_model_spec(name).upcycler]
        layout = f" (model_type={dense_spec.hf.model_types[0]!r})" if dense_spec.hf else ""
        raise ValueError(
            f"{dense}: model {model!r}{layout} has no upcycler; upcycle a checkpoint of a dense "
            f"family: {upcyclable}"
        )
    upcycler = dense_spec.upcycler
    args = upcycler.moe_args(dense_spec.hf.read_args(str(dense)), spec)
    with SafetensorsCheckpoint(dense) as checkpoint:
        sources = upcycler.sources(checkpoint, args, spec, seed)
        tensors, config = upcycler.hf_layout(sources, args)
        with tqdm(
            total=sum(tensor.nbytes for tensor in tensors.values()),
            unit="B",
            unit_scale=True,
            desc=f"upcycling into {out}",
            disable=not progress,
        ) as bar:
            save_safetensors(
                tensors,
                out,
                max_shard_bytes=max_shard_bytes,
                extra_files={"config.json": json.dumps(config, indent=2) + "\n"},
                overwrite=overwrite,
                on_tensor=lambda _name, nbytes: bar.update(nbytes),
            )
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = _OneLineParser(prog=_PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("--dense", type=Path, required=True, help="dense Hugging Face checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--experts", type=int, required=True, help="copies of each FFN (N)")
    parser.add_argument("--top-k", type=int, required=True, help="copies per token (k)")
    parser.add_argument("--granularity", type=int, default=1, help="pieces per copy (G)")
    parser.add_argument(
        "--every", type=int, default=1, help="upcycle every k-th layer (Mixtral layout: 1)"
    )
    parser.add_argument("--router-init-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0, help="seed of the router init")
    parser.add_argument(
        "--model", default=None, help="dense model family (default: read from config.json)"
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1e9, help="shard size"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    options = parser.parse_args(argv)
    try:
        spec = UpcycleSpec(
            num_experts=options.experts,
            top_k=options.top_k,
            granularity=options.granularity,
            moe_every=options.every,
            router_init_std=options.router_init_std,
        )
        out = upcycle_offline(
            options.dense,
            options.out,
            spec,
            model=options.model,
            seed=options.seed,
            max_shard_bytes=int(options.max_shard_gb * 1e9),
            overwrite=options.overwrite,
        )
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        print(f"{_PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
