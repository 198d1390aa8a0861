"""docs/api.md is what scripts/api_reference.py generates from the code: a public name added,
removed, renamed or re-documented in a listed module fails here until the reference is
regenerated (the failure says the command and shows the first differences)."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE = REPO_ROOT / "docs" / "api.md"
COMMAND = "python scripts/api_reference.py > docs/api.md"
_DIFF_LINES = 60


def test_api_reference_matches_the_code() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "api_reference.py")],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode("utf-8", "replace")[-3000:]
    generated = result.stdout.decode("utf-8")
    current = REFERENCE.read_text(encoding="utf-8") if REFERENCE.is_file() else ""
    if generated != current:
        diff = difflib.unified_diff(
            current.splitlines(), generated.splitlines(), "docs/api.md", "generated", lineterm=""
        )
        shown = "\n".join(list(diff)[:_DIFF_LINES])
        pytest.fail(
            f"docs/api.md is stale: regenerate it with `{COMMAND}` from the repository root.\n"
            f"{shown}",
            pytrace=False,
        )
