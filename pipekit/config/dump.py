"""A loaded config written back as TOML (`train.py --print-config` prints it); the loader reads
the text back to the same config."""

from __future__ import annotations

import os
from pathlib import Path

from pipekit.config.job_config import JobConfig
from pipekit.config.loader import to_dict

__all__ = ["JOB_CONFIG_FILE", "dump_toml", "write_job_config"]

JOB_CONFIG_FILE = "config.toml"
"""The resolved config a job writes into its output folder and into each of its checkpoints:
what built the model of those checkpoints (`python -m pipekit.generate` reads it; a job about to
load a checkpoint names the `[model]` keys that changed since)."""


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def dump_toml(sections: dict[str, dict[str, object]]) -> str:
    """TOML text of nested section dicts (the loader reads it back to the same config); a dict
    value is a sub-section, written as its own [section.key] table."""
    blocks: list[str] = []

    def add(name: str, values: dict[str, object]) -> None:
        plain = {key: value for key, value in values.items() if not isinstance(value, dict)}
        body = "\n".join(f"{key} = {_toml_value(value)}" for key, value in plain.items())
        blocks.append(f"[{name}]\n{body}")
        for key, value in values.items():
            if isinstance(value, dict):
                add(f"{name}.{key}", value)

    for section, values in sections.items():
        add(section, values)
    return "\n\n".join(blocks) + "\n"


def write_job_config(config: JobConfig, folder: Path) -> None:
    """`config` as `folder/JOB_CONFIG_FILE`, replaced atomically and flushed to disk."""
    path = folder / JOB_CONFIG_FILE
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    temporary.write_text(dump_toml(to_dict(config)))
    descriptor = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.replace(temporary, path)
