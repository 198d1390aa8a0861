"""Private torch APIs live in two files only (`pipekit/_torch_private.py` and
`pipekit/pipelining/_torch_runtime.py`), so a torch upgrade touches those two. The scan reads
every other module of the package, the built-in families and train.py as syntax trees: an
import from a private torch module or of a private name, an attribute chain from `torch` (or a
module-level alias of it) through a `_name`, a call of a parent class's private method
(`super()._name`), or a string naming a private torch module (a logger). Its ablation shows the
scan finds each kind when one is added."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
QUARANTINE = {"pipekit/_torch_private.py", "pipekit/pipelining/_torch_runtime.py"}


def _private(segment: str) -> bool:
    return segment.startswith("_") and not segment.startswith("__")


def _chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"] (None for anything but names and attributes)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_torch_uses(source: str) -> list[str]:
    """Every use of a private torch API in `source`, as `line: what`."""
    tree = ast.parse(source)
    torch_names = {"torch"}
    for node in tree.body:  # module-level aliases: `_aten = torch.ops.aten`
        if isinstance(node, ast.Assign) and (chain := _chain(node.value)) and chain[0] == "torch":
            torch_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = [n.name for n in node.names if _private(n.name)]
            if any(_private(part) for part in node.module.split(".")) or private:
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(_private(part) for part in parts):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Del):
            chain = _chain(node)
            if chain and chain[0] in torch_names and any(_private(p) for p in chain[1:]):
                found.append(f"{node.lineno}: {'.'.join(chain)}")
            value = node.value
            if (
                _private(node.attr)
                and isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "super"
            ):
                found.append(f"{node.lineno}: super().{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.startswith("torch.") and " " not in text and "._" in text:
                found.append(f"{node.lineno}: {text!r}")
    return sorted(set(found), key=lambda entry: int(entry.split(":")[0]))


def _scanned() -> list[Path]:
    files = sorted((REPO_ROOT / "pipekit").rglob("*.py"))
    files.append(REPO_ROOT / "train.py")
    return [f for f in files if str(f.relative_to(REPO_ROOT)) not in QUARANTINE]


def test_private_torch_apis_stay_in_their_two_files() -> None:
    leaks = {
        str(path.relative_to(REPO_ROOT)): uses
        for path in _scanned()
        if (uses := private_torch_uses(path.read_text()))
    }
    assert not leaks, f"private torch APIs outside {sorted(QUARANTINE)}: {leaks}"


@pytest.mark.parametrize(
    "leak",
    [
        "from torch.utils._pytree import tree_leaves",
        "from torch.distributed import _functional_collectives",
        "import torch._dynamo",
        "x = torch.cuda.memory._record_memory_history()",
        "_aten = torch.ops.aten\ny = _aten._scaled_dot_product_flash_attention_for_cpu",
        "class S(Base):\n    def f(self):\n        return super()._prepare_forward_infra()",
        "logging.getLogger('torch.distributed.tensor._redistribute')",
    ],
)
def test_the_scan_finds_a_new_private_name(leak: str) -> None:
    """The ablation: each kind of leak, added to a clean module, is found."""
    clean = "import torch\nfrom torch import nn\nx = torch.ops.aten.mm.default\n"
    assert private_torch_uses(clean) == []
    assert private_torch_uses(clean + leak), leak
