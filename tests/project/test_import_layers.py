"""The import graph of `pipekit` stays free of cycles and of upward imports.

Every module under pipekit/ is read as a syntax tree (nothing is imported) and each import of a
pipekit module is classed by when it runs:

- runtime: at the top of the module, or in a class body, `try`, `with` or plain `if` there; it
  runs when the module is imported;
- typing: under `if TYPE_CHECKING:` (never runs);
- deferred: inside a function, or under `if __name__ == "__main__":` (runs after the module has
  finished importing).

`from pipekit.x import y` names the module `pipekit.x.y` when that is a module, else `pipekit.x`;
relative imports are resolved against the importing module. Importing a submodule also runs its
parent packages' `__init__`, but that implicit edge is left out of the graph (Python allows a
package's `__init__` to import its own submodules); explicit imports of a package count.

Two rules hold for imports of every kind (runtime, typing and deferred alike): their module
graph has no cycle, and each top-level component of pipekit (a subpackage such as
`pipekit.moe`, or a top-level module such as `pipekit.upcycle`) imports only itself and
components of lower layers in `LAYERS`. Inside a package listed in `INNER_LAYERS` its
subpackages and modules keep that order too. (`python tests/project/test_import_layers.py` counts
the imports by kind.)
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

PACKAGE = "pipekit"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE
ROOT_COMPONENT = "__init__"
"""The component of `pipekit/__init__.py` itself: every import of any pipekit module runs it."""

LAYERS: tuple[tuple[str, ...], ...] = (
    # Imports nothing from pipekit: the root __init__ runs on every pipekit import (so anything it
    # imported would sit below everything); config is plain dataclasses + TOML, torch-free.
    (ROOT_COMPONENT, "_torch_private", "config", "text_table"),
    ("attention",),  # attention kernels and masks
    ("layers",),  # model building blocks (norms, RoPE, attention layer over pipekit.attention)
    ("moe",),
    ("memory",),  # offload, tracker, per-layer memory formulas (of dense and MoE layers)
    ("models",),  # ModelSpec, registry, stage modules
    ("checkpoint", "distributed"),
    ("pipelining", "upcycle"),
    ("train",),
    ("memory_plan", "testing", "generate"),
    ("layout_search",),  # prices layouts with the memory plan's terms and the simulator
    ("bench", "check"),
    # Model families are plugins found by name through entry points (pipekit.models.registry):
    # nothing else in pipekit imports them at module level.
    ("families", "tools"),
)
"""Top-level components of pipekit, lowest layer first. A module imports (at runtime) modules of
its own component and of lower layers only; components sharing a layer do not import each other.
The order is the one the code keeps: each component sits one layer above the highest it imports,
except that families sits at the top."""

INNER_LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "pipelining": (
        ("_torch_runtime",),  # torch's action type and runtime, reached through one file
        ("actions",),  # the public home of the action vocabulary
        ("schedules",),  # action lists as data, the schedule registry, checker, simulator
        ("model_split",),  # which blocks each stage holds, on which rank
        ("pipeline_plan", "runtime"),  # the plan as a value; the stage, runner and hooks
        ("stage_setup",),  # how a rank's modules become stages (a value)
        ("features",),  # the feature table and pipekit's features
        ("plan",),  # config -> plan
        ("build",),  # plan + model -> runner
        ("tools",),  # timelines, traces, pictures
    ),
    "attention": (
        ("masks", "merge"),  # masks, LSE merging
        ("kernels",),  # kernels returning (out, lse), and the table that picks one
        ("patterns",),  # a layer's attention pattern
        ("chunked", "context_protocol", "work"),  # attention over K/V chunks; what a context
        # is; the attention work of a packed batch's tokens
        ("kv_cache", "document_lengths"),  # the sliced pipeline's chunked KV cache; packed
        # rows drawn from a document-length distribution
        ("across",),  # attention across ranks: context parallelism and context exchange
        ("context",),  # the contexts a model is given
    ),
    "attention.kernels": (
        ("_tiles",),
        ("score_mod",),
        ("cpu_flash",),
        ("flex",),
        ("backends",),
    ),
    "attention.across": (
        ("loan_wire",),  # context exchange's messages
        ("lending",),  # lending attention to a pipeline peer
        ("loan_server", "token_shards"),  # answering loans; KV passing and commutated kernels
        ("exchange_context", "ring", "ulysses"),
        ("hierarchical",),
        ("variant_table",),  # the context-parallel variant table
        ("slice_attention",),  # a slice's attention over token-shard caches
        ("variants",),  # pipekit's entries
    ),
}
"""The order inside a package that keeps one (its subpackages and top modules, lowest first),
held for imports of every kind as `LAYERS` is between packages."""

Kind = Literal["runtime", "typing", "deferred"]


@dataclass(frozen=True)
class Import:
    """One import of a pipekit module by a pipekit module."""

    importer: str
    imported: str
    line: int
    kind: Kind


@dataclass(frozen=True)
class Package:
    """The scanned package: its modules (name -> path) and their imports of its modules."""

    root: Path
    modules: Mapping[str, Path]
    imports: tuple[Import, ...]

    def where(self, imp: Import) -> str:
        """`pipekit/x/y.py:LINE` of an import."""
        path = self.modules[imp.importer].relative_to(self.root)
        return f"{path.as_posix()}:{imp.line}"


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """`pipekit/a/b.py` -> `pipekit.a.b`; `pipekit/a/__init__.py` -> `pipekit.a`."""
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _guard_kind(test: ast.expr) -> Kind | None:
    """The kind of imports under `if test:` at module level (None: an ordinary `if`)."""
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return "typing"
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return "typing"
    if (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    ):
        return "deferred"
    return None


def _in_package(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _targets(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: Collection[str]
) -> list[str]:
    """The pipekit modules an import statement names (unknown names are returned as written)."""
    if isinstance(node, ast.Import):
        found = []
        for alias in node.names:
            if not _in_package(alias.name):
                continue
            name = alias.name
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            found.append(name if name in modules else alias.name)
        return found
    base = node.module or ""
    if node.level:
        anchor = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}" if base else anchor
    if not _in_package(base):
        return []
    named = (f"{base}.{alias.name}" for alias in node.names)
    return [name if name in modules else base for name in named]


def scan_imports(
    importer: str, source: str, is_package: bool, modules: Collection[str]
) -> list[Import]:
    """Every import of a pipekit module in `source` (the module `importer`), with its kind."""
    found: list[Import] = []

    def visit(node: ast.AST, kind: Kind) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, importer, is_package, modules):
                found.append(Import(importer, target, node.lineno, kind))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "deferred" if kind == "runtime" else kind
        elif isinstance(node, ast.If) and kind == "runtime" and (guard := _guard_kind(node.test)):
            for stmt in node.body:
                visit(stmt, guard)
            for stmt in node.orelse:
                visit(stmt, kind)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    visit(ast.parse(source, filename=importer), "runtime")
    return found


@functools.lru_cache(maxsize=1)
def scan_package(package_dir: Path = PACKAGE_DIR) -> Package:
    """Read every module of the package once."""
    modules = {module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    imports: list[Import] = []
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        imports += scan_imports(name, source, path.name == "__init__.py", modules)
    return Package(package_dir.parent, modules, tuple(imports))


def component(module: str) -> str:
    """`pipekit.moe.layer` -> `moe`; `pipekit.upcycle` -> `upcycle`; `pipekit` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_COMPONENT


def _layer_of(layers: Iterable[Iterable[str]]) -> dict[str, int]:
    return {name: index for index, tier in enumerate(layers) for name in tier}


def _describe(module: str, layer_of: Mapping[str, int]) -> str:
    name = component(module)
    return f"{module} (layer {layer_of.get(name, '?')}: {name})"


def against_layers(imports: Iterable[Import], layers: Iterable[Iterable[str]]) -> list[Import]:
    """The runtime imports of another component that is not in a lower layer."""
    layer_of = _layer_of(layers)
    return [
        imp
        for imp in imports
        if imp.kind == "runtime"
        and component(imp.importer) != component(imp.imported)
        and layer_of[component(imp.imported)] >= layer_of[component(imp.importer)]
    ]


def _runtime_graph(imports: Iterable[Import]) -> dict[str, dict[str, Import]]:
    """importer -> imported -> its first runtime import statement."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in imports:
        if imp.kind == "runtime":
            graph[imp.importer].setdefault(imp.imported, imp)
    return graph


def find_cycles(imports: Iterable[Import]) -> list[list[Import]]:
    """One cycle (as its import statements, in order) per strongly connected component of the
    runtime import graph that has one (Tarjan's algorithm)."""
    graph = _runtime_graph(imports)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            components.append(members)

    for node in sorted(graph):
        if node not in index:
            connect(node)

    cycles = []
    for members in components:
        start = min(members)
        if len(members) == 1 and start not in graph.get(start, {}):
            continue
        inside = set(members)
        # Breadth-first search from `start` back to itself, staying inside the component.
        came_from: dict[str, Import] = {}
        frontier = [start]
        while start not in came_from:
            reached = []
            for node in frontier:
                for succ, imp in sorted(graph.get(node, {}).items()):
                    if succ in inside and succ not in came_from:
                        came_from[succ] = imp
                        reached.append(succ)
            frontier = reached
        cycle = [came_from[start]]
        while cycle[-1].importer != start:
            cycle.append(came_from[cycle[-1].importer])
        cycles.append(cycle[::-1])
    return cycles


def deferred_upward(package: Package) -> list[Import]:
    """Deferred imports of another component that is not in a lower layer (allowed; listed)."""
    runtime_like = [
        Import(imp.importer, imp.imported, imp.line, "runtime")
        for imp in package.imports
        if imp.kind == "deferred"
    ]
    return against_layers(runtime_like, LAYERS)


# --- the rules, on the package ------------------------------------------------------------------


def test_layers_name_every_component_once() -> None:
    listed = [name for tier in LAYERS for name in tier]
    repeated = sorted({name for name in listed if listed.count(name) > 1})
    assert not repeated, f"LAYERS lists {repeated} more than once"
    found = {component(module) for module in scan_package().modules}
    missing = sorted(found - set(listed))
    stale = sorted(set(listed) - found)
    assert not missing, (
        f"pipekit components {missing} have no layer: add each to LAYERS in "
        "tests/project/test_import_layers.py, above everything it imports"
    )
    assert not stale, f"LAYERS names {stale}, which are not in pipekit/ any more: remove them"


def test_every_pipekit_import_names_a_module() -> None:
    package = scan_package()
    unknown = [
        f"{package.where(imp)}: {imp.importer} imports {imp.imported}, which is no module"
        for imp in package.imports
        if imp.imported not in package.modules
    ]
    assert not unknown, "\n".join(unknown)


def test_imports_of_every_kind_form_no_cycle() -> None:
    """Deferred and typing imports included: a typing-only circle still ties two modules into
    one."""
    package = scan_package()
    messages = []
    for cycle in find_cycles(as_runtime(package.imports)):
        modules = " -> ".join([imp.importer for imp in cycle] + [cycle[0].importer])
        steps = "\n".join(
            f"    {package.where(imp)}: {imp.importer} imports {imp.imported}" for imp in cycle
        )
        messages.append(f"import cycle {modules}:\n{steps}")
    assert not messages, (
        "imports between pipekit modules (any kind) form cycles; break each by moving the "
        "shared code down:\n" + "\n".join(messages)
    )


def test_imports_of_every_kind_respect_layers() -> None:
    """Deferred and typing imports included: none goes up or sideways."""
    package = scan_package()
    layer_of = _layer_of(LAYERS)
    messages = []
    for imp in against_layers(as_runtime(package.imports), LAYERS):
        up, down = layer_of[component(imp.importer)], layer_of[component(imp.imported)]
        direction = "upward" if down > up else "sideways (same layer)"
        messages.append(
            f"{package.where(imp)}: {_describe(imp.importer, layer_of)} imports "
            f"{_describe(imp.imported, layer_of)}: {direction}"
        )
    assert not messages, (
        "imports (any kind) against the layer order (LAYERS in "
        "tests/project/test_import_layers.py, lowest first); move the shared code to a lower "
        "layer, or reorder LAYERS if the new dependency is intended:\n" + "\n".join(messages)
    )


def as_runtime(imports: Iterable[Import]) -> list[Import]:
    """Every import counted as if it ran at import time: typing and deferred imports are
    imports too, so the order and the acyclicity rules hold for them as well."""
    return [Import(imp.importer, imp.imported, imp.line, "runtime") for imp in imports]


def inner_imports(imports: Iterable[Import], package: str) -> list[Import]:
    """Imports between two modules of `pipekit.<package>` (its own `__init__` left out),
    renamed so that `component` gives the subpackage or module inside it."""
    prefix = f"{PACKAGE}.{package}."
    return [
        Import(
            f"{PACKAGE}.{imp.importer.removeprefix(prefix)}",
            f"{PACKAGE}.{imp.imported.removeprefix(prefix)}",
            imp.line,
            imp.kind,
        )
        for imp in imports
        if imp.importer.startswith(prefix) and imp.imported.startswith(prefix)
    ]


@pytest.mark.parametrize("package", sorted(INNER_LAYERS))
def test_inner_layers_hold_for_imports_of_every_kind(package: str) -> None:
    layers = INNER_LAYERS[package]
    inside = as_runtime(inner_imports(scan_package().imports, package))
    found = {component(imp.importer) for imp in inside} | {
        component(imp.imported) for imp in inside
    }
    missing = sorted(found - {name for tier in layers for name in tier})
    assert not missing, f"{missing} inside pipekit.{package} have no place in INNER_LAYERS"
    wrong = [f"pipekit.{package}: {imp.importer} imports {imp.imported}" for imp in
             against_layers(inside, layers)]  # fmt: skip
    assert not wrong, "imports against INNER_LAYERS:\n" + "\n".join(wrong)


# --- the scanner and the checks, on made-up code --------------------------------------------------

_MODULES = frozenset(
    {"pipekit", "pipekit.a", "pipekit.a.x", "pipekit.a.y", "pipekit.b", "pipekit.b.z", "pipekit.c"}
)
_SOURCE = """
import os
import pipekit.a.x
from typing import TYPE_CHECKING
from pipekit.a import x, helper
from pipekit.b.z import thing as other
try:
    from pipekit.c import c_name
except ImportError:
    pass
if TYPE_CHECKING:
    from pipekit.b import z
else:
    from pipekit.a import y
class Holder:
    from pipekit.b import z
def later():
    import pipekit.c
    if TYPE_CHECKING:
        import pipekit.b
if __name__ == "__main__":
    from pipekit.c import main
from . import y
from .. import b
from ..b.z import z_name
"""


def test_scanner_classes_and_resolves_imports() -> None:
    found = [
        (imp.imported, imp.kind)
        for imp in scan_imports("pipekit.a.w", _SOURCE, is_package=False, modules=_MODULES)
    ]
    assert found == [
        ("pipekit.a.x", "runtime"),  # import pipekit.a.x
        ("pipekit.a.x", "runtime"),  # from pipekit.a import x: the submodule
        ("pipekit.a", "runtime"),  # from pipekit.a import helper: a name in pipekit.a
        ("pipekit.b.z", "runtime"),
        ("pipekit.c", "runtime"),  # inside try
        ("pipekit.b.z", "typing"),
        ("pipekit.a.y", "runtime"),  # the else of `if TYPE_CHECKING`
        ("pipekit.b.z", "runtime"),  # class body
        ("pipekit.c", "deferred"),
        ("pipekit.b", "deferred"),
        ("pipekit.c", "deferred"),  # __main__ guard
        ("pipekit.a.y", "runtime"),  # from . import y
        ("pipekit.b", "runtime"),  # from .. import b
        ("pipekit.b.z", "runtime"),  # from ..b.z import z_name
    ]


def test_scanner_resolves_relative_imports_in_a_package() -> None:
    found = scan_imports("pipekit.a", "from . import x\nfrom .y import q\n", True, _MODULES)
    assert [imp.imported for imp in found] == ["pipekit.a.x", "pipekit.a.y"]


def _imports(*edges: tuple[str, str]) -> list[Import]:
    return [Import(a, b, line, "runtime") for line, (a, b) in enumerate(edges, start=1)]


def test_cycle_finder_finds_a_cycle_through_a_package_init() -> None:
    imports = _imports(
        ("pipekit.a", "pipekit.a.x"),  # the package imports its submodule: allowed
        ("pipekit.a.x", "pipekit.b.z"),
        ("pipekit.b.z", "pipekit.a"),  # ... but this closes a cycle through it
        ("pipekit.c", "pipekit.a"),
    )
    imports.append(Import("pipekit.c", "pipekit.b", 9, "deferred"))
    imports.append(Import("pipekit.b", "pipekit.c", 9, "runtime"))
    cycles = find_cycles(imports)
    assert [[imp.importer for imp in cycle] for cycle in cycles] == [
        ["pipekit.a", "pipekit.a.x", "pipekit.b.z"]
    ]
    assert find_cycles(_imports(("pipekit.c", "pipekit.c")))  # a module importing itself
    assert not find_cycles(_imports(("pipekit.a", "pipekit.a.x"), ("pipekit.a.x", "pipekit.b")))


def test_inner_layers_see_a_typing_import_from_runtime_into_features() -> None:
    imports = [
        Import("pipekit.p.runtime.runner", "pipekit.p.schedules.sim", 1, "runtime"),  # down
        Import("pipekit.p.runtime.runner", "pipekit.p.features.choice", 2, "typing"),  # up
        Import("pipekit.p.features.x", "pipekit.other", 3, "runtime"),  # leaves the package
    ]
    inside = as_runtime(inner_imports(imports, "p"))
    layers = (("schedules",), ("runtime",), ("features",))
    assert [(imp.importer, imp.imported) for imp in against_layers(inside, layers)] == [
        ("pipekit.runtime.runner", "pipekit.features.choice")
    ]
    assert not against_layers(inner_imports(imports, "p"), layers)  # as typing: exempt there


def test_layer_check_finds_upward_and_sideways_imports() -> None:
    layers = (("a",), ("b", "c"))
    imports = _imports(
        ("pipekit.b.z", "pipekit.a.x"),  # down: allowed
        ("pipekit.a.x", "pipekit.a.y"),  # within a component: allowed
        ("pipekit.a.x", "pipekit.b.z"),  # up
        ("pipekit.b", "pipekit.c"),  # sideways
    )
    imports.append(Import("pipekit.a", "pipekit.c", 9, "deferred"))
    imports.append(Import("pipekit.a", "pipekit.c", 9, "typing"))
    assert [(imp.importer, imp.imported) for imp in against_layers(imports, layers)] == [
        ("pipekit.a.x", "pipekit.b.z"),
        ("pipekit.b", "pipekit.c"),
    ]


if __name__ == "__main__":
    scanned = scan_package()
    kinds: dict[str, int] = defaultdict(int)
    for found_import in scanned.imports:
        kinds[found_import.kind] += 1
    print(f"{len(scanned.modules)} modules; import statements by kind: {dict(kinds)}")
    for found_import in deferred_upward(scanned):
        print(
            f"deferred, against LAYERS: {scanned.where(found_import)}: "
            f"{_describe(found_import.importer, _layer_of(LAYERS))} imports "
            f"{_describe(found_import.imported, _layer_of(LAYERS))}"
        )
