"""Documents from Hugging Face `datasets`: a Hub dataset, a local dataset folder, or local
parquet/JSON/CSV/text files read through one of `datasets`' builders.

    [data]
    source = "hf"
    hf_path = "parquet"                 # a builder, a Hub name ("allenai/c4") or a folder
    hf_data_files = "corpus/*.parquet"  # the builder's files (globs allowed)
    hf_name = ""                        # the dataset's configuration, if it has several
    hf_split = "train"
    jsonl_field = "text"                # the column holding the text

Each row's text is one document, in the dataset's order; the loader packs and shuffles them as
it does any source. `datasets` keeps its own Arrow cache of what it read
(`HF_DATASETS_CACHE`), so a second job, or the second rank, reads the cache.
"""

from __future__ import annotations

import contextlib
import glob
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pipekit.config.job_config import DataConfig
from pipekit.train.data.corpus import file_fingerprint, iter_documents

__all__ = ["HF_SOURCE", "check_hf_source", "hf_documents", "hf_source_key", "hf_stream"]

HF_SOURCE = "hf"
"""The `[data] source` value that reads through `datasets`."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "[data] source = 'hf' reads through Hugging Face datasets; "
            "pip install 'pipekit[datasets]'"
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach us as one line
    return datasets


def _data_files(config: DataConfig) -> list[str]:
    return sorted(
        path for pattern in config.hf_data_files.split(",") for path in glob.glob(pattern.strip())
    )


def check_hf_source(config: DataConfig) -> None:
    """What can be checked before reading: the package, the path, local files matching."""
    _datasets()
    if not config.hf_path:
        raise ValueError(
            "source='hf' needs hf_path: a Hub dataset name, a dataset folder, or a builder "
            "(parquet, json, csv, text) with hf_data_files"
        )
    if config.hf_data_files and not _data_files(config):
        raise ValueError(
            f"hf_data_files={config.hf_data_files!r} matches no file; give paths or globs "
            "(comma-separated)"
        )


def hf_source_key(config: DataConfig) -> tuple:
    """What names the documents (a changed local file changes the key)."""
    files = file_fingerprint([Path(name) for name in _data_files(config)])
    return (config.hf_path, config.hf_name, config.hf_split, config.jsonl_field, files)


@contextlib.contextmanager
def _read_errors(config: DataConfig) -> Iterator[None]:
    """`datasets`' and pyarrow's errors while reading as one ValueError: for local JSON lines
    files, the first bad line as `file:line` (found by pipekit's own reader, as for local
    sources); otherwise the dataset and the error's first line."""
    try:
        yield
    except Exception as error:  # DatasetGenerationError, ArrowInvalid, StopIteration, ...
        if type(error) is ValueError:  # pipekit's own, already one line
            raise
        files = [Path(name) for name in _data_files(config)]
        lines = [path for path in files if path.suffix == ".jsonl"]
        for _ in iter_documents(lines, jsonl_field=config.jsonl_field):
            pass  # raises at the first bad line, naming file:line
        empty = [str(path) for path in files if path.is_file() and not path.stat().st_size]
        cause = error.__cause__ or error.__context__ or error
        message = str(cause).strip().splitlines()
        what = f"{type(cause).__name__}: {message[0]}" if message else type(cause).__name__
        if empty:
            what = f"empty files: {', '.join(empty)}"
        raise ValueError(
            f"dataset {config.hf_path!r} could not be read ({what}); check the data files"
        ) from None


def _load(config: DataConfig, streaming: bool) -> Any:
    with _read_errors(config):
        dataset = _datasets().load_dataset(
            config.hf_path,
            name=config.hf_name or None,
            data_files=_data_files(config) or None,
            split=config.hf_split,
            streaming=streaming,
        )
    field = config.jsonl_field
    if dataset.column_names is not None and field not in dataset.column_names:
        raise ValueError(
            f"dataset {config.hf_path!r} has no column {field!r} (its columns: "
            f"{', '.join(dataset.column_names)}); set data.jsonl_field to the text column"
        )
    return dataset


def _texts(config: DataConfig, rows: Iterable[Any]) -> Iterator[str]:
    """Each row's text, checked (empty ones skipped, as in every source)."""
    field = config.jsonl_field
    for index, text in enumerate(rows):
        if not isinstance(text, str):
            raise ValueError(
                f"dataset {config.hf_path!r} row {index}: column {field!r} holds a "
                f"{type(text).__name__}, not text; set data.jsonl_field to the text column"
            )
        if text:
            yield text


def hf_documents(config: DataConfig) -> Iterator[str]:
    """The texts of the dataset's rows, in order."""
    return _texts(config, _load(config, streaming=False)[config.jsonl_field])


def hf_stream(config: DataConfig, seed: int) -> Callable[[int], Iterator[str]]:
    """`epoch -> texts` of the dataset read as a stream (nothing downloaded or converted up
    front); with `data.shuffle`, in an order shuffled by shard and by a buffer of
    `data.shuffle_buffer` rows, the same for a given seed and epoch."""
    dataset = _load(config, streaming=True)
    if config.shuffle:
        dataset = dataset.shuffle(seed=seed, buffer_size=config.shuffle_buffer)

    def documents_of_epoch(epoch: int) -> Iterator[str]:
        dataset.set_epoch(epoch)
        with _read_errors(config):  # a stream reads its files as it goes
            yield from _texts(config, (row[config.jsonl_field] for row in dataset))

    return documents_of_epoch
