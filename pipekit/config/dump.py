"""`python -m pipekit.config.dump CONFIG.toml [--section.key value ...]`: the resolved config.

`python -m pipekit.config.dump --reference` prints the config reference (docs/config.md).
"""

from __future__ import annotations

import sys

from pipekit.config.loader import ConfigError, load_job_config, reference_markdown, to_dict
from pipekit.config.validate import validate_job_config

__all__ = ["dump_toml", "main"]


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--reference"]:
        print(reference_markdown(), end="")
        return 0
    if argv and not argv[0].startswith("--"):
        argv = ["--config", argv[0], *argv[1:]]
    try:
        config = load_job_config(argv)
        validate_job_config(config, world_size=None)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    print(dump_toml(to_dict(config)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
