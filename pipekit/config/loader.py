"""Loading a JobConfig: defaults < TOML file < `--section.key value` command-line overrides.

Every mistake is a `ConfigError` naming the section, key, expected type and offending value, with
the valid names (and a "did you mean") for unknown ones. Field help comes from the docstring
under each dataclass field, read from the source once.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import tomli

from pipekit.config.job_config import JobConfig

__all__ = [
    "ConfigError",
    "field_docs",
    "help_text",
    "load_job_config",
    "parse_cli",
    "reference_markdown",
    "to_dict",
]


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says how to fix it."""


def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; valid names: {', '.join(valid)}"


@functools.cache
def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass section, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(section_cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _type_name(expected: Any) -> str:
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(member) for member in typing.get_args(expected))
    return getattr(expected, "__name__", str(expected))


def _coerce(where: str, expected: Any, value: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (CLI string) one value against the field's type."""
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        # The first member that takes the value wins: `int | str` reads "4" as 4, "auto" as text.
        for member in typing.get_args(expected):
            try:
                return _coerce(where, member, value, from_cli)
            except ConfigError:
                continue
        raise ConfigError(f"{where} expects {_type_name(expected)}, got {value!r}")
    if typing.get_origin(expected) is list:
        (item_type,) = typing.get_args(expected)
        if from_cli:  # `;` separates the items on the command line (items may hold commas)
            return [_coerce(where, item_type, item, True) for item in value.split(";") if item]
        if not isinstance(value, list):
            raise ConfigError(f"{where} expects a list, got {value!r} ({type(value).__name__})")
        return [_coerce(where, item_type, item, False) for item in value]
    if from_cli:
        text = value.strip()
        if expected is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
        elif expected is str:
            return value
        else:
            try:
                return expected(text)
            except ValueError:
                pass
        raise ConfigError(f"{where} expects {_type_name(expected)}, got {value!r}")
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and expected is not bool:
        raise ConfigError(f"{where} expects {_type_name(expected)}, got {value!r}")
    if not isinstance(value, expected):
        raise ConfigError(
            f"{where} expects {_type_name(expected)}, got {value!r} ({type(value).__name__})"
        )
    return value


def _apply(config: JobConfig, section: str, key: str, value: Any, from_cli: bool) -> None:
    """Set `[section] key` (a dotted key reaches into a sub-section such as [model.upcycle])."""
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"unknown config section [{section}]" + _did_you_mean(section, list(sections))
        )
    owner, owner_name = getattr(config, section), section
    *path, leaf = key.split(".")
    for part in path:
        owner, owner_name = _sub_section(owner, owner_name, part), f"{owner_name}.{part}"
    types_by_key = _field_types(type(owner))
    if leaf not in types_by_key:
        raise ConfigError(
            f"unknown key {leaf!r} in [{owner_name}]" + _did_you_mean(leaf, list(types_by_key))
        )
    expected = types_by_key[leaf]
    if dataclasses.is_dataclass(expected):
        if from_cli or not isinstance(value, dict):
            raise ConfigError(
                f"[{owner_name}] {leaf} is a section: write [{owner_name}.{leaf}] in the TOML "
                f"file, or --{owner_name}.{leaf}.KEY VALUE on the command line"
            )
        for sub_key, sub_value in value.items():
            _apply(config, section, f"{key}.{sub_key}", sub_value, from_cli)
        return
    where = f"[{owner_name}] {leaf}" if not from_cli else f"--{owner_name}.{leaf}"
    setattr(owner, leaf, _coerce(where, expected, value, from_cli))


def _sub_section(owner: Any, owner_name: str, part: str) -> Any:
    types_by_key = _field_types(type(owner))
    sections = [key for key, kind in types_by_key.items() if dataclasses.is_dataclass(kind)]
    if part not in sections:
        raise ConfigError(
            f"[{owner_name}] has no sub-section {part!r}"
            + (_did_you_mean(part, sections) if sections else "")
        )
    return getattr(owner, part)


def _flat_sections() -> list[tuple[str, type]]:
    """Every section and sub-section, as (dotted name, dataclass), parents first."""
    flat: list[tuple[str, type]] = []

    def visit(name: str, section_cls: type) -> None:
        flat.append((name, section_cls))
        for key, kind in _field_types(section_cls).items():
            if dataclasses.is_dataclass(kind):
                visit(f"{name}.{key}", kind)

    for name, section_cls in _sections().items():
        visit(name, section_cls)
    return flat


def _plain_fields(section_cls: type) -> dict[str, Any]:
    """A section's own keys (its sub-sections are listed separately)."""
    return {
        key: kind
        for key, kind in _field_types(section_cls).items()
        if not dataclasses.is_dataclass(kind)
    }


def parse_cli(argv: list[str]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """`--config PATH` and `--section.key value` (or `=value`) pairs from the command line."""
    config_path: str | None = None
    overrides: list[tuple[str, str, str]] = []
    index = 0
    while index < len(argv):
        argument = argv[index]
        if not argument.startswith("--"):
            raise ConfigError(
                f"unexpected argument {argument!r}; options look like --section.key value"
            )
        name, has_value, value = argument[2:].partition("=")
        if not has_value:
            if index + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            index += 1
            value = argv[index]
        if name == "config":
            config_path = value
        elif "." in name:
            section, _, key = name.partition(".")
            overrides.append((section, key, value))
        else:
            raise ConfigError(f"option --{name} is not --config or --section.key")
        index += 1
    return config_path, overrides


def load_job_config(argv: list[str]) -> JobConfig:
    """The resolved config: dataclass defaults, then the TOML file, then CLI overrides."""
    config_path, overrides = parse_cli(argv)
    config = JobConfig()
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file {config_path} does not exist; pass --config PATH.toml")
        try:
            document = tomli.loads(path.read_text())
        except tomli.TOMLDecodeError as error:
            raise ConfigError(f"{config_path} is not valid TOML: {error}") from None
        for section, table in document.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{config_path}: top-level key {section!r} must be a [section]")
            for key, value in table.items():
                _apply(config, section, key, value, from_cli=False)
    for section, key, value in overrides:
        _apply(config, section, key, value, from_cli=True)
    return config


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts (for dumps, metrics and checkpoints)."""
    return dataclasses.asdict(config)


def help_text() -> str:
    """Every section and key with its type, default and doc: `train.py --help`."""
    lines = [
        "usage: torchrun --nproc-per-node N train.py --config CONFIG.toml "
        "[--section.key value ...]",
        "",
        "Precedence: command line > TOML file > defaults. Keys:",
    ]
    for section, section_cls in _flat_sections():
        lines.append("")
        lines.append(f"[{section}]  {inspect.getdoc(section_cls)}")
        defaults = section_cls()
        docs = field_docs(section_cls)
        for key, expected in _plain_fields(section_cls).items():
            default = getattr(defaults, key)
            lines.append(f"  --{section}.{key} ({_type_name(expected)}, default {default!r})")
            lines.append(f"      {docs.get(key, '')}")
    return "\n".join(lines)


def reference_markdown() -> str:
    """docs/config.md: every section and key (regenerate with `python -m pipekit.config.reference
    > docs/config.md`)."""
    lines = [
        "# Config reference",
        "",
        "Generated from the dataclasses in `pipekit/config/job_config.py` by",
        "`python -m pipekit.config.reference`. Precedence: command line",
        "(`--section.key value`) > TOML file > these defaults.",
    ]
    for section, section_cls in _flat_sections():
        lines += ["", f"## [{section}]", "", inspect.getdoc(section_cls) or "", ""]
        lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        defaults, docs = section_cls(), field_docs(section_cls)
        for key, expected in _plain_fields(section_cls).items():
            default = getattr(defaults, key)
            lines.append(
                f"| `{key}` | {_type_name(expected)} | `{default!r}` | {docs.get(key, '')} |"
            )
    return "\n".join(lines) + "\n"
