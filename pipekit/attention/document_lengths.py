"""Document-length distributions: what the planners assume about the documents packed into rows.

The memory plan, the layout search and the schedule simulator price a step from its rows'
document ids (`pipekit.attention.work`); without real data in hand, they draw those rows from a
distribution named by `[data] document_lengths`:
- "" (the default): one causal document per row, as if every row were a single sequence;
- "lognormal" or "lognormal:median=1024,sigma=1.6,minimum=16": lengths in tokens drawn from a
  log-normal (web and book corpora are close to one: most documents short, a thin long tail);
- the path of a `.json` histogram (`{"lengths": [...], "counts": [...]}`), measured from a
  corpus by `python -m pipekit.train.data.corpus_lengths --config job.toml --out lengths.json`.

Drawn documents are packed back to back as the loader packs them: a document that crosses a row
edge continues in the next row, whose ids restart at 0. A histogram keeps the corpus's lengths
in bins of an eighth of an octave, each at its documents' mean length (framed: BOS and EOS
counted, as the loader's rows count them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pipekit.attention.work import document_spans

__all__ = [
    "DocumentLengths",
    "HistogramLengths",
    "LogNormalLengths",
    "corpus_histogram",
    "packed_document_ids",
    "parse_document_lengths",
    "positions_in_documents",
]

_BINS_PER_OCTAVE = 8


@dataclass(frozen=True)
class LogNormalLengths:
    """Lengths drawn from a log-normal with median `median` tokens and log-spread `sigma`,
    clipped below at `minimum`."""

    median: int = 1024
    sigma: float = 1.6
    minimum: int = 16

    def __post_init__(self) -> None:
        if self.median < 1 or self.minimum < 1 or self.sigma < 0:
            raise ValueError(
                f"lognormal document lengths need median >= 1, minimum >= 1 and sigma >= 0, not "
                f"median={self.median}, minimum={self.minimum}, sigma={self.sigma}; write e.g. "
                '"lognormal:median=1024,sigma=1.6"'
            )

    def draw(self, generator: torch.Generator) -> int:
        normal = float(torch.randn(1, generator=generator))
        return max(int(math.exp(math.log(self.median) + self.sigma * normal)), self.minimum)

    @property
    def label(self) -> str:
        return f"log-normal document lengths, median {self.median} tokens, sigma {self.sigma}"


@dataclass(frozen=True)
class HistogramLengths:
    """Lengths drawn from a histogram: `lengths[i]` with probability `counts[i] / sum`."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    source: str = "a histogram"

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.counts):
            raise ValueError(
                f"{self.source}: a document-length histogram needs as many counts as lengths, "
                f"one at least; got {len(self.lengths)} lengths and {len(self.counts)} counts"
            )
        if min(self.lengths) < 1 or min(self.counts) < 0 or sum(self.counts) == 0:
            raise ValueError(
                f"{self.source}: document lengths must be >= 1 and counts >= 0, their total "
                "positive; write it again with python -m pipekit.train.data.corpus_lengths"
            )

    def draw(self, generator: torch.Generator) -> int:
        weights = torch.tensor(self.counts, dtype=torch.double)
        return self.lengths[int(torch.multinomial(weights, 1, generator=generator))]

    @property
    def label(self) -> str:
        total = sum(self.counts)
        mean = sum(n * c for n, c in zip(self.lengths, self.counts, strict=True)) / total
        return f"document lengths of {self.source} ({total} documents, mean {mean:.0f} tokens)"


DocumentLengths = LogNormalLengths | HistogramLengths


def packed_document_ids(lengths: DocumentLengths, rows: int, seq_len: int, seed: int) -> Tensor:
    """Document ids `[rows, seq_len]` of documents drawn from `lengths` (seeded by `seed`) and
    packed in order, as the loader packs a corpus: per row 0, 1, 2, ... (0 is the document the
    row starts in)."""
    generator = torch.Generator().manual_seed(seed)
    total = rows * seq_len
    drawn: list[int] = []
    while sum(drawn) < total:
        drawn.append(min(lengths.draw(generator), total))
    stream_T = torch.repeat_interleave(torch.arange(len(drawn)), torch.tensor(drawn))[:total]
    document_ids_BS = stream_T.view(rows, seq_len)
    return document_ids_BS - document_ids_BS[:, :1]


def positions_in_documents(document_ids_BS: Tensor) -> Tensor:
    """Each token's index within its document's part of the row: what packing gives RoPE
    (0 at each document's first token, and at a row's first token)."""
    first_BS, _ = document_spans(document_ids_BS)
    return torch.arange(document_ids_BS.shape[1], device=first_BS.device) - first_BS


def parse_document_lengths(text: str) -> DocumentLengths | None:
    """The distribution `[data] document_lengths` names (None: one document per row).
    ValueError, naming the fix, for anything else."""
    text = text.strip()
    if not text:
        return None
    name, _, arguments = text.partition(":")
    if name == "lognormal":
        return LogNormalLengths(**_lognormal_arguments(arguments))
    if text.endswith(".json"):
        return _read_histogram(Path(text))
    raise ValueError(
        f'[data] document_lengths={text!r} is not a distribution; write "" (one document per '
        'row), "lognormal:median=1024,sigma=1.6", or the path of a .json histogram written by '
        "python -m pipekit.train.data.corpus_lengths"
    )


def _lognormal_arguments(arguments: str) -> dict[str, float | int]:
    kinds: dict[str, type] = {"median": int, "sigma": float, "minimum": int}
    values: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in arguments.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in kinds:
            raise ValueError(
                f"[data] document_lengths: lognormal takes {', '.join(kinds)}, not {key!r}; "
                'write e.g. "lognormal:median=1024,sigma=1.6"'
            )
        try:
            values[key] = kinds[key](value)
        except ValueError:
            raise ValueError(
                f"[data] document_lengths: lognormal {key}={value!r} is not a number; "
                'write e.g. "lognormal:median=1024,sigma=1.6"'
            ) from None
    return values


def _read_histogram(path: Path) -> HistogramLengths:
    try:
        record = json.loads(path.read_text())
        return HistogramLengths(
            tuple(int(n) for n in record["lengths"]),
            tuple(int(c) for c in record["counts"]),
            source=str(path),
        )
    except FileNotFoundError:
        raise ValueError(
            f"[data] document_lengths: no file {path}; measure a corpus with python -m "
            "pipekit.train.data.corpus_lengths --config job.toml --out lengths.json"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"[data] document_lengths: {path} is not a document-length histogram ({error}); "
            "write it with python -m pipekit.train.data.corpus_lengths"
        ) from None


def corpus_histogram(document_lengths_D: Tensor, source: str) -> HistogramLengths:
    """The histogram of a corpus's document lengths, in bins of an eighth of an octave, each
    at its documents' mean length."""
    lengths_D = document_lengths_D.double()
    bins_D = torch.floor(torch.log2(lengths_D) * _BINS_PER_OCTAVE).long()
    bins, inverse_D, counts = torch.unique(bins_D, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(bins), dtype=torch.double).index_add_(0, inverse_D, lengths_D)
    means = torch.round(sums / counts).long()
    return HistogramLengths(tuple(means.tolist()), tuple(counts.tolist()), source=source)
