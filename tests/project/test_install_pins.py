"""The suite runs on the versions the repository records: README.md's two set-up commands and
CI's script install with constraints.txt, CI into a fresh virtual environment, and the running
environment holds exactly the pinned version of everything `pipekit[test]` pulls in."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO_ROOT / "constraints.txt"


def _pins() -> dict[str, str]:
    """constraints.txt as {canonical name: version}; every line is `name==version`."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, separator, version = line.partition("==")
        assert separator and version, f"constraints.txt: {line!r} is not name==version"
        pins[canonicalize_name(name)] = version.strip()
    return pins


def _installs(text: str) -> list[str]:
    """Every `pip install ...` of a shell text, one string each, in order."""
    return [match.strip() for match in re.findall(r"pip install ([^&\n]+)", text)]


def _closure(root: str, extras: set[str]) -> dict[str, str]:
    """Every distribution `root[extras]` needs in the running environment: {name: version}."""
    seen: dict[str, str] = {}
    walked: set[tuple[str, frozenset[str]]] = set()
    pending = [(root, frozenset(extras))]
    while pending:
        name, wanted = pending.pop()
        if (canonicalize_name(name), wanted) in walked:
            continue
        walked.add((canonicalize_name(name), wanted))
        distribution = metadata.distribution(name)
        seen[canonicalize_name(distribution.metadata["Name"])] = distribution.version
        for text in distribution.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in wanted or {""}):
                pending.append((requirement.name, frozenset(requirement.extras)))
    return seen


def test_readme_and_ci_install_with_the_constraints() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    readme_installs = _installs(readme)
    project_installs = [command for command in readme_installs if "-e " in command]
    assert len(project_installs) == 2, readme_installs  # the main job's and the tests'
    for command in project_installs:
        assert "-c constraints.txt" in command, command
    test_install = next(command for command in project_installs if "[test]" in command)
    assert test_install in [command.removeprefix("--quiet ") for command in _installs(ci)]
    assert "python -m pytest -q tests" in readme and "python -m pytest -q tests" in ci
    assert "python -m venv" in ci, "CI must install into a fresh virtual environment"


def test_constraints_pin_every_test_dependency_at_its_installed_version() -> None:
    pins = _pins()
    installed = _closure("pipekit", {"test"})
    installed.pop("pipekit")
    unpinned = sorted(set(installed) - set(pins))
    assert not unpinned, f"not in constraints.txt: {unpinned}; regenerate it (its header says how)"
    drifted = {
        name: (version, pins[name])
        for name, version in installed.items()
        if version.split("+")[0] != pins[name]
    }
    assert not drifted, (
        f"installed versions differ from constraints.txt (installed, pinned): {drifted}"
    )
