"""Document sources: the running Python's standard library, plain-text files and JSONL files.

A source is resolved to a sorted list of files first (cheap, so bad paths fail before any
tokenizing), then read as documents:
- `stdlib`: every `*.py` under `sysconfig.get_paths()["stdlib"]` except `site-packages` and
  `dist-packages`, one document per file, sorted by relative path. Every machine with the same
  Python build sees the same corpus (a distribution that strips e.g. `test/` sees a smaller one).
- `.txt` (and `.py`): one document per file.
- `.jsonl`: one document per line, the text under a configurable field; blank lines are skipped.

Bytes that are not valid UTF-8 are decoded with replacement (U+FFFD), never skipped: a stray
latin-1 byte in one file must neither drop the file silently nor stop a run, and the result is
the same on every machine. Documents whose text is empty are skipped (they would only add a
BOS/EOS pair).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "DOCUMENT_SUFFIXES",
    "STDLIB_SOURCE",
    "file_fingerprint",
    "iter_documents",
    "source_files",
    "stdlib_files",
]

STDLIB_SOURCE = "stdlib"
DOCUMENT_SUFFIXES = (".txt", ".jsonl")
"""Suffixes a path, folder or glob source may name."""
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages"})
_GLOB_CHARS = frozenset("*?[")


def stdlib_files() -> list[Path]:
    """The `.py` files of the running Python's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths = []
    for folder, subfolders, filenames in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _EXCLUDED_STDLIB_DIRS]
        relative_folder = Path(folder).relative_to(root)
        relative_paths += [
            (relative_folder / name).as_posix() for name in filenames if name.endswith(".py")
        ]
    return [root / relative for relative in sorted(relative_paths)]


def _check_suffixes(files: Sequence[Path], source: str) -> None:
    for path in files:
        if path.suffix not in DOCUMENT_SUFFIXES:
            raise ValueError(
                f"data.source={source!r} matches {str(path)!r}, which is not one of "
                f"{', '.join(DOCUMENT_SUFFIXES)}; narrow the glob or convert the file"
            )


def source_files(source: str) -> list[Path]:
    """The files of `source` ("stdlib", a file, a folder searched recursively for .txt/.jsonl,
    or a glob, `**` allowed), in a fixed sorted order."""
    if source == STDLIB_SOURCE:
        files = stdlib_files()
        if not files:
            raise ValueError(
                f"data.source='stdlib': no .py files under {sysconfig.get_paths()['stdlib']!r} "
                "(this Python ships without its library sources); use a .txt/.jsonl source"
            )
        return files
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            (
                file
                for file in path.rglob("*")
                if file.suffix in DOCUMENT_SUFFIXES and file.is_file()
            ),
            key=lambda file: file.relative_to(path).as_posix(),
        )
        if not files:
            raise ValueError(
                f"data.source={source!r} is a folder without {' or '.join(DOCUMENT_SUFFIXES)} "
                "files; point it at the folder holding the data, or a file or glob"
            )
    elif _GLOB_CHARS & set(source):
        pattern = os.path.expanduser(source)
        files = [Path(match) for match in sorted(glob.glob(pattern, recursive=True))]
        files = [file for file in files if file.is_file()]
        if not files:
            raise ValueError(
                f"data.source={source!r}: the glob matches no files; check the pattern (relative "
                f"patterns start at the working folder {os.getcwd()!r})"
            )
    else:
        raise ValueError(
            f"data.source={source!r}: no such file or folder; use 'stdlib', a .txt/.jsonl file, "
            "a folder of them, or a glob such as 'data/**/*.jsonl'"
        )
    _check_suffixes(files, source)
    return files


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _json_type(value: object) -> str:
    """JSON's name for the type of a parsed value, for error messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    """The `field` of every JSON object line; any other line is an error naming file:line."""
    # split on "\n" only: str.splitlines would also split inside strings at U+2028 etc.
    for line_number, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line of a "
                f".jsonl file must be one JSON object"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: a JSON {_json_type(record)}, not an object; each line must be an "
                f"object with the text under {field!r}"
            )
        if field not in record:
            raise ValueError(
                f"{where}: no field {field!r} (fields: {sorted(record)}); set data.jsonl_field "
                "to the field holding the text"
            )
        text = record[field]
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: field {field!r} holds a JSON {_json_type(text)}, not a string; set "
                "data.jsonl_field to the field holding the text"
            )
        if text:
            yield text


def iter_documents(files: Sequence[Path], *, jsonl_field: str = "text") -> Iterator[str]:
    """The documents of `files` in order: one per line of a `.jsonl`, one per other file."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, jsonl_field)
        else:
            text = _read_text(path)
            if text:
                yield text


def file_fingerprint(paths: Sequence[Path]) -> tuple:
    """(path, size, mtime) of each file: a changed file must not hit a stale cache entry."""
    stats = [(str(path), path.stat()) for path in paths]
    return tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)
