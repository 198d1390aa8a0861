"""`python -m pipekit.checkpoint.inspect DIR [--tokens 1,2,3 --out FILE]`: what a checkpoint holds.

Lists every tensor (name, dtype, shape) from the file headers alone, the total size, and the
model args its config.json describes, read by the registered family whose Hugging Face adapter
reads that `model_type` (Llama, Mixtral, Qwen3, Qwen3-MoE, or a family of your own). With
--tokens it also runs pipekit's model on those token ids (CPU, float32) and writes the logits,
so our numbers can be compared with any other implementation's. Bad input prints one error line
and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import NoReturn

import torch
from safetensors.torch import save_file

from pipekit.attention.kernels.backends import use_backend
from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint
from pipekit.models.registry import spec_for_checkpoint

__all__ = ["main"]

_PROGRAM = "python -m pipekit.checkpoint.inspect"


class _OneLineParser(argparse.ArgumentParser):
    """Reports usage errors as one line, like every other error of this command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = _OneLineParser(prog=_PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="checkpoint directory")
    parser.add_argument("--tokens", type=_token_ids, help="comma-separated token ids to run")
    parser.add_argument("--out", type=Path, help="safetensors file for the logits [1, S, vocab]")
    parser.add_argument(
        "--attention-backend",
        choices=("cpu", "flex"),
        default="cpu",
        help="kernel for --tokens: the CPU flash kernel (default) or compiled FlexAttention",
    )
    options = parser.parse_args(argv)
    if (options.tokens is None) != (options.out is None):
        parser.error("--tokens and --out go together")
    try:
        _describe(options.directory, running=options.tokens is not None)
        if options.tokens is not None:
            _write_logits(options.directory, options.tokens, options.out, options.attention_backend)
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        print(f"{_PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        tokens = [int(token) for token in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 1,2,3)"
        ) from None
    if any(token < 0 for token in tokens):
        raise argparse.ArgumentTypeError(f"token ids must be non-negative, got {text!r}")
    return tokens


def _describe(directory: Path, *, running: bool) -> None:
    with SafetensorsCheckpoint(directory) as checkpoint:
        infos = checkpoint.infos()
        file_count = len(checkpoint.files)
    width = max((len(name) for name in infos), default=0)
    for info in sorted(infos.values(), key=lambda info: _natural_order(info.name)):
        dtype = str(info.dtype).removeprefix("torch.")
        print(f"{info.name:<{width}}  {dtype:<8}  {list(info.shape)}")
    total_bytes = sum(info.nbytes for info in infos.values())
    print(
        f"{len(infos)} tensors in {file_count} file(s): {total_bytes:,} bytes "
        f"({total_bytes / 2**30:.3f} GiB)"
    )
    try:
        family = spec_for_checkpoint(directory)
        assert family.hf is not None
        print(family.hf.read_args(str(directory)))
    except ValueError as error:
        if running:
            raise
        print(f"not a checkpoint pipekit can load: {error}")


def _natural_order(name: str) -> list[str | int]:
    """Sort key that puts layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _write_logits(directory: Path, tokens: list[int], out: Path, attention_backend: str) -> None:
    family = spec_for_checkpoint(directory)
    assert family.hf is not None
    vocab_size = family.shape(family.hf.read_args(str(directory))).vocab_size
    too_large = [token for token in tokens if token >= vocab_size]
    if too_large:
        raise ValueError(f"token ids {too_large} are not below vocab_size={vocab_size}")
    model, _ = family.hf.build_from_checkpoint(str(directory))
    model.eval()
    tokens_BS = torch.tensor([tokens], dtype=torch.long)
    positions_BS = torch.arange(len(tokens)).unsqueeze(0)
    with torch.no_grad(), use_backend(attention_backend):
        logits_BSV = model(tokens_BS, positions=positions_BS)
    save_file({"logits": logits_BSV.float().contiguous()}, str(out))
    print(f"wrote logits {list(logits_BSV.shape)} to {out}")


if __name__ == "__main__":
    sys.exit(main())
