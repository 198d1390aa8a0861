"""`python scripts/api_reference.py > docs/api.md`: the API reference of the modules a model
author uses, read from the code itself.

For each module in `MODULES`, every name in its `__all__` with its signature and the first
sentence of its docstring (and, for a class, its own public methods and properties). The output
depends on the code only (no memory addresses, no installed paths), so
`tests/project/test_api_reference.py` can regenerate it and fail when docs/api.md is stale. The
modules documented are those of this checkout, whatever pipekit is installed.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import typing
from pathlib import Path
from types import GenericAlias, ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

MODULES = (
    "pipekit.models.spec",
    "pipekit.models.registry",
    "pipekit.models.stage_module",
    "pipekit.models.forward_order",
    "pipekit.layers",
    "pipekit.layers.init",
    "pipekit.attention.patterns",
    "pipekit.attention.context",
    "pipekit.attention.masks",
    "pipekit.moe",
    "pipekit.distributed.tensor_parallel_styles",
    "pipekit.models.materialize",
    "pipekit.testing",
    "pipekit.generate",
)
"""What a model author imports, in reading order: the contract, then the building blocks."""

COMMAND = "python scripts/api_reference.py > docs/api.md"

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ABBREVIATIONS = ("e.g", "i.e", "etc", "vs", "cf", "Eq", "Fig", "Sec")


class _Annotation:
    """An annotation written as text (`from __future__ import annotations`), shown without
    quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _text_annotation(annotation: Any) -> Any:
    if isinstance(annotation, typing.ForwardRef):  # a NamedTuple's fields, for one
        annotation = annotation.__forward_arg__
    return _Annotation(annotation) if isinstance(annotation, str) else annotation


def signature(obj: Any) -> str | None:
    """`obj`'s call signature as text (a class's without its `-> None`), or None when Python
    cannot tell it (a Protocol's, which is not called)."""
    if inspect.isclass(obj) and getattr(obj, "_is_protocol", False):
        return None
    try:
        found = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parameters = [
        parameter.replace(annotation=_text_annotation(parameter.annotation))
        for parameter in found.parameters.values()
    ]
    returned = _text_annotation(found.return_annotation)
    if inspect.isclass(obj):
        returned = inspect.Signature.empty
    found = found.replace(parameters=parameters, return_annotation=returned)
    return _ADDRESS.sub("", str(found))


def summary(obj: Any) -> str:
    """The first sentence of `obj`'s own docstring (not one inherited, nor a dataclass's
    generated one), on one line; "" when it has none."""
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else None
    name = getattr(obj, "__name__", "")
    if not doc or (inspect.isclass(obj) and doc.startswith(f"{name}(")):
        return ""
    if inspect.isclass(obj) and any(doc is base.__doc__ for base in obj.__mro__[1:]):
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(line.strip() for line in paragraph.splitlines())
    # a sentence ends before a capital (or at the end), not within "e.g. x" or "Eq. 10"
    for end in re.finditer(r"[.!?](?=$|\s+[^a-z0-9\s])", text):
        if not text[: end.start()].endswith(_ABBREVIATIONS):
            return text[: end.end()]
    return text


def _kind(obj: Any) -> str:
    if isinstance(obj, GenericAlias) or typing.get_origin(obj) is not None:
        return "value"  # a type alias such as Callable[[...], Tensor]
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "def"
    return "value"


def _value_text(obj: Any) -> str:
    """A constant or type alias, briefly: a dict or collection by its keys, else its repr."""
    if isinstance(obj, dict):
        shown = ", ".join(repr(key) for key in obj)
        return f"dict with keys {shown}"
    if isinstance(obj, (tuple, list, frozenset, set)):
        items = sorted(obj, key=repr) if isinstance(obj, (frozenset, set)) else obj
        return f"{type(obj).__name__} of {', '.join(repr(item) for item in items)}"
    text = _ADDRESS.sub("", repr(obj))
    return text if len(text) <= 200 else text[:197] + "..."


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties `cls` defines itself, in definition order."""
    members = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property) or inspect.isfunction(member):
            members.append((name, member))
    return members


def _member_lines(cls: type) -> list[str]:
    lines = []
    for name, member in _members(cls):
        if isinstance(member, property):
            text = f"- `{name}` (property)"
            doc = summary(member.fget) if member.fget is not None else ""
        else:
            text = f"- `{name}{signature(member) or '(...)'}`"
            doc = summary(member)
        lines.append(f"{text}: {doc}" if doc else text)
    return lines


def _public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    )


def document_module(module_name: str) -> str:
    """The section of one module."""
    module = importlib.import_module(module_name)
    lines = [f"## `{module_name}`", ""]
    about = summary(module)
    if about:
        lines += [about, ""]
    if not hasattr(module, "__all__"):
        lines += ["(No `__all__`: the public names it defines.)", ""]
    for name in _public_names(module):
        if not hasattr(module, name):
            lines += [f"### `{name}`", "", "Listed in `__all__` but not defined.", ""]
            continue
        obj = getattr(module, name)
        kind = _kind(obj)
        lines += [f"### `{name}`", ""]
        if kind == "value":
            lines += ["```python", f"{name} = {_value_text(obj)}", "```", ""]
            continue
        shown = signature(obj)
        if shown is None:
            shown = "(Protocol)" if getattr(obj, "_is_protocol", False) else "(...)"
        lines += ["```python", f"{kind} {name}{shown}", "```", ""]
        doc = summary(obj)
        if doc:
            lines += [doc, ""]
        if kind == "class":
            members = _member_lines(obj)
            if members:
                lines += [*members, ""]
    return "\n".join(lines)


def render() -> str:
    """The whole reference, as docs/api.md holds it."""
    header = [
        "# API reference for model authors",
        "",
        "The public names of the modules a model of your own uses (docs/custom_models.md): each "
        "with its signature and the first sentence of its docstring, and a class with the "
        "methods and properties it defines. Generated from the code by "
        f"`{COMMAND}`; `tests/project/test_api_reference.py` fails when this file is stale.",
        "",
        *[f"- [`{name}`](#{name.replace('.', '')})" for name in MODULES],
        "",
    ]
    sections = [document_module(name) for name in MODULES]
    return "\n".join(header) + "\n" + "\n".join(sections).rstrip("\n") + "\n"


def main() -> int:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's modules, not an installed pipekit
    sys.stdout.buffer.write(render().encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
