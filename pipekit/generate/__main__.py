"""`python -m pipekit.generate --checkpoint DIR --prompt TEXT`: what a trained model writes.

DIR is a pipekit checkpoint step (`outputs/<job>/checkpoints/step-N`, any training layout; the
job's `config.toml` beside it says the model and tokenizer, or give `--config`) or a Hugging
Face folder of a registered family. The prompt is tokenized as training frames a document
(BOS first), decoded with the KV cache greedily or by sampling, and the text is printed, then
the tokens/s on stderr. Bad input is one error line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from pipekit.generate.decode import Sampling, decode_tokens
from pipekit.generate.load import load_for_generation

_PROGRAM = "python -m pipekit.generate"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=_PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="step or HF folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--config", type=Path, help="the job's config (default: beside it)")
    parser.add_argument("--tokenizer", help="tokenizer.json or 'bytes' (default: the job's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: every token")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop", type=int, action="append", default=None, help="token id that ends (EOS)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    options = _parser().parse_args(argv)
    try:
        sampling = Sampling(options.temperature, options.top_k, options.top_p, options.seed)
        if options.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {options.max_new_tokens} must be at least 1")
        model, tokenizer, max_seq_len = load_for_generation(
            options.checkpoint, options.config, options.tokenizer
        )
        prompt = [tokenizer.bos_id, *[int(t) for t in tokenizer.encode(options.prompt)]]
        stop = options.stop if options.stop is not None else [tokenizer.eos_id]
        model = model.to(options.device)
        tokens = decode_tokens(model, prompt, options.max_new_tokens, sampling, stop, max_seq_len)
    except (ValueError, OSError, ImportError) as error:  # CheckpointError is a ValueError
        print(f"{_PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    written = list(tokens)
    seconds = time.perf_counter() - started
    print(options.prompt + tokenizer.decode([t for t in written if t not in stop]))
    print(f"{len(written)} tokens in {seconds:.2f} s: {len(written) / seconds:.1f} tokens/s",
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
