"""`python -m pipekit.train.data.corpus_lengths --config job.toml --out lengths.json`: the
histogram of a job's corpus's document lengths, for `[data] document_lengths`.

The corpus is read and tokenized as the job's loader does, and each document's length counted
as its rows hold it (framed: BOS and EOS included); the histogram
(`pipekit.attention.document_lengths.corpus_histogram`) is written atomically, with a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from pipekit.attention.document_lengths import corpus_histogram
from pipekit.config.loader import ConfigError, load_job_config
from pipekit.text_table import format_table
from pipekit.train.data.loader import load_token_stream

__all__ = ["main"]


def _summary(lengths_D: Tensor) -> str:
    quantiles = torch.quantile(
        lengths_D.double(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.double)
    )
    headers = ["documents", "tokens", "median", "p90", "p99", "max"]
    values = [
        lengths_D.numel(),
        int(lengths_D.sum()),
        *map(int, quantiles.tolist()),
        int(lengths_D.max()),
    ]
    return format_table(headers, [[str(value) for value in values]])


def main(argv: list[str]) -> int:
    """Measure the document lengths of a job's corpus and write their histogram."""
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.train.data.corpus_lengths",
        description="Write the histogram of a job's corpus's document lengths, for "
        "[data] document_lengths; the rest of the arguments are the job's (--config, overrides).",
    )
    parser.add_argument("--out", required=True, help="the .json histogram to write")
    options, config_argv = parser.parse_known_args(argv)
    if not options.out.endswith(".json"):
        parser.error(f"--out {options.out} must end in .json (what [data] document_lengths reads)")
    try:
        config = load_job_config(config_argv)
        stream = load_token_stream(config.data)
    except (ConfigError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ends_D = torch.cat([stream.document_starts_D[1:], torch.tensor([stream.num_tokens])])
    lengths_D = ends_D - stream.document_starts_D
    histogram = corpus_histogram(lengths_D, source=config.data.source)
    record = {"lengths": list(histogram.lengths), "counts": list(histogram.counts)}
    temporary = f"{options.out}.tmp"
    Path(temporary).write_text(json.dumps(record) + "\n")
    os.replace(temporary, options.out)
    print(_summary(lengths_D))
    print(f"wrote {options.out}: {len(histogram.lengths)} bins; set [data] document_lengths = "
          f'"{options.out}"')  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
