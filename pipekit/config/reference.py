"""`python -m pipekit.config.reference`: the config reference (every key, its type, default and
docstring) as the Markdown of docs/config.md."""

from __future__ import annotations

from pipekit.config.loader import reference_markdown

__all__ = ["main"]


def main() -> None:
    print(reference_markdown(), end="")


if __name__ == "__main__":
    main()
