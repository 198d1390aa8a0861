"""What README.md and docs/*.md quote works: every `python -m pipekit.<module>` (and `train.py`)
command in a code span or block names a module that exists, a registered bench for
`python -m pipekit.bench <name>`, and flags that module's `--help` lists; every
`--section.key` override, `[section] key` span and key of a ```toml block is a field of the job
config (`python train.py --help`); every `configs/...` or `examples/...` path exists.

The `--help` texts come from one subprocess that runs each distinct module's `--help` once."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomli

from pipekit.bench.__main__ import _BENCHMARKS
from pipekit.config import help_text
from pipekit.pipelining.schedules.registry import schedule_names

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

# Commands whose flags argparse does not know go to the job config loader (`parse_known_args`
# then `load_job_config`), as train.py's do: `--config` and `--section.key` are theirs.
_TAKES_JOB_CONFIG = {("train.py", ""), ("pipekit.memory_plan", ""), ("pipekit.check", ""),
                     ("pipekit.layout_search", ""), ("pipekit.bench", "step")}  # fmt: skip
_TRAIN_FLAGS = {"--config", "--print-config", "--help"}  # train.py's main, besides the keys
_SUBCOMMANDS = {"pipekit.tools.plot": {"compare"}}  # modules with a subcommand of their own
_NOT_JOB_CONFIG_TABLES = {"project", "tool", "build-system"}  # pyproject.toml snippets

_FENCE = re.compile(r"^[ \t]*```([\w+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"`([^`]+)`")
_COMMAND = re.compile(r"\bpython3? -m (pipekit(?:\.\w+)*)|(?<![\w/.-])train\.py\b")
_COMMAND_END = re.compile(r"&&|;|\s\|\s|(?:^|\s)#|\bpython3? -m |(?<![\w/.-])train\.py\b")
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*(?:\.[\w-]+)*")
_SECTION_KEY = re.compile(r"(?<![\w\[])\[([a-z_]+(?:\.[a-z_]+)*)\][ \t]+([a-z_][a-z0-9_]*\*?)")
_PATH = re.compile(r"(?<![\w/.-])(?:\.\./)?((?:configs|examples)/[\w./-]*[\w/])")
_PLACEHOLDER_KEY = "section.key"  # `[--section.key value ...]` in usage lines


@dataclass(frozen=True)
class Snippet:
    where: str  # "docs/x.md:LINE"
    language: str  # a fence's info string; "" for an inline span
    text: str


@dataclass(frozen=True)
class Command:
    where: str
    module: str  # "train.py" or a dotted module
    subcommand: str  # the bench name, a module's subcommand, or ""
    flags: tuple[str, ...]


def snippets(markdown: str, name: str) -> list[Snippet]:
    """Fenced blocks and inline code spans, in document order."""
    found, blanked = [], markdown
    for fence in _FENCE.finditer(markdown):
        line = markdown.count("\n", 0, fence.start()) + 1
        found.append(Snippet(f"{name}:{line}", fence.group(1), fence.group(2)))
        blank = re.sub(r"[^\n]", " ", fence.group(0))  # same offsets, no spans inside
        blanked = blanked[: fence.start()] + blank + blanked[fence.end() :]
    for span in _SPAN.finditer(blanked):
        line = blanked.count("\n", 0, span.start()) + 1
        found.append(Snippet(f"{name}:{line}", "", " ".join(span.group(1).split())))
    return found


def commands(snippet: Snippet) -> list[Command]:
    text = re.sub(r"\\\n\s*", " ", snippet.text)  # shell line continuations
    found = []
    for line in text.splitlines():
        for start in _COMMAND.finditer(line):
            end = _COMMAND_END.search(line, start.end())
            rest = line[start.end() : end.start() if end else len(line)]
            module = start.group(1) or "train.py"
            words = rest.split()
            first = words[0] if words else ""
            bench_name = module == "pipekit.bench" and re.fullmatch(r"[a-z][\w-]*", first)
            subcommand = first if bench_name or first in _SUBCOMMANDS.get(module, ()) else ""
            flags = tuple(flag for flag in _FLAG.findall(rest) if flag[2:] != _PLACEHOLDER_KEY)
            found.append(Command(snippet.where, module, subcommand, flags))
    return found


@functools.cache
def config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(sections, section.key) of the job config, as `python train.py --help` lists them;
    built once (every snippet of every page asks)."""
    text = help_text()
    sections = frozenset(re.findall(r"^\[(\S+)\]", text, re.M))
    return sections, frozenset(re.findall(r"^  --(\S+) \(", text, re.M))


def _key_problem(key: str, keys: frozenset[str]) -> str | None:
    if key.endswith("*"):  # `mixed_precision_*`: some key starts so
        return None if any(k.startswith(key[:-1]) for k in keys) else f"no key matches {key}"
    return None if key in keys else f"{key} is not a config key"


def config_problems(snippet: Snippet) -> list[str]:
    """Config keys the snippet names that the job config does not have."""
    sections, keys = config_keys()
    problems = []
    for flag in _FLAG.findall(snippet.text):
        if "." in flag and flag[2:] != _PLACEHOLDER_KEY:
            problems.append(_key_problem(flag[2:], keys))
    if snippet.language == "":
        for section, key in _SECTION_KEY.findall(snippet.text):
            if section not in sections:
                problems.append(f"[{section}] is not a config section")
            else:
                problems.append(_key_problem(f"{section}.{key}", keys))
    if snippet.language == "toml":
        try:
            table = tomli.loads(snippet.text)
        except tomli.TOMLDecodeError as error:
            return [f"{snippet.where}: the toml block does not parse: {error}"]
        if not _NOT_JOB_CONFIG_TABLES.isdisjoint(table):
            return []
        problems += _toml_problems(table, "", sections, keys)
    return [f"{snippet.where}: {problem}" for problem in problems if problem]


def _toml_problems(table: dict, section: str, sections: set[str], keys: set[str]) -> list[str]:
    problems = []
    for name, value in table.items():
        dotted = f"{section}.{name}" if section else name
        tables = isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
        if tables and not section:
            continue  # `[[rank]]`: a schedule file, not a job config
        if isinstance(value, dict):
            if dotted not in sections:
                problems.append(f"[{dotted}] is not a config section")
            else:
                problems += _toml_problems(value, dotted, sections, keys)
        elif not section:
            problems.append(f"{name} = ... sits outside a config section")
        else:
            problems.append(_key_problem(dotted, keys))
    return problems


def _module_exists(module: str) -> bool:
    if module == "train.py":
        return (REPO_ROOT / "train.py").is_file()
    path = REPO_ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def command_problems(command: Command, helps: dict[tuple[str, str], str] | None) -> list[str]:
    """What is wrong with the command: its module, its bench, its flags (against `helps`, the
    `--help` text of each (module, subcommand); None checks the names only)."""
    where, module, subcommand = command.where, command.module, command.subcommand
    if not _module_exists(module):
        return [f"{where}: no module {module}"]
    if module == "pipekit.bench" and subcommand and subcommand not in _BENCHMARKS:
        return [f"{where}: {subcommand!r} is not a bench (pipekit/bench/__main__.py)"]
    if helps is None or (module == "pipekit.bench" and not subcommand):
        return []
    takes_config = (module, subcommand) in _TAKES_JOB_CONFIG
    shown = " ".join(part for part in ("python -m", module, subcommand) if part)
    shown = "python train.py" if module == "train.py" else shown
    help_of = helps.get((module, subcommand), "")
    problems = []
    for flag in command.flags:
        if "." in flag:  # a config key: config_problems checks that it exists
            if not takes_config:
                problems.append(f"{where}: `{shown}` takes no config override {flag}")
        elif module == "train.py":
            if flag not in _TRAIN_FLAGS:
                problems.append(f"{where}: train.py takes no {flag}")
        elif not (takes_config and flag == "--config") and not re.search(
            rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_of
        ):
            problems.append(f"{where}: {flag} is not in `{shown} --help`")
    return problems


def path_problems(markdown: str, name: str) -> list[str]:
    problems = []
    for match in _PATH.finditer(markdown):
        if not (REPO_ROOT / match.group(1)).exists():
            line = markdown.count("\n", 0, match.start()) + 1
            problems.append(f"{name}:{line}: {match.group(1)} does not exist")
    return problems


_HELP_DRIVER = r"""
import contextlib, io, json, runpy, sys
results = []
for module, subcommand in json.load(sys.stdin):
    sys.argv = [module, *([subcommand] if subcommand else []), "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if module.endswith(".py"):
                runpy.run_path(module, run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code or 0
    except Exception as error:
        code = f"{type(error).__name__}: {error}"
    results.append([module, subcommand, code, out.getvalue()])
json.dump(results, sys.__stdout__)
"""


def help_texts(targets: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """`--help` of every (module, subcommand), each run once, in one interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", _HELP_DRIVER],
        input=json.dumps(sorted(targets)),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    helps = {}
    for module, subcommand, code, text in json.loads(result.stdout):
        assert code == 0, f"`{module} {subcommand} --help` failed ({code}): {text[-2000:]}"
        helps[(module, subcommand)] = text
    return helps


def _documents() -> list[tuple[str, str]]:
    return [(str(path.relative_to(REPO_ROOT)), path.read_text()) for path in DOCUMENTS]


def test_documented_commands_name_real_modules_benches_and_flags() -> None:
    found = [
        command
        for name, markdown in _documents()
        for snippet in snippets(markdown, name)
        for command in commands(snippet)
    ]
    assert len(found) > 50  # the extractor finds the docs' commands
    problems = [problem for command in found for problem in command_problems(command, None)]
    assert not problems, "\n".join(problems)
    targets = {
        (c.module, c.subcommand) for c in found if c.module != "pipekit.bench" or c.subcommand
    }
    helps = help_texts(targets)
    problems = [problem for command in found for problem in command_problems(command, helps)]
    assert not problems, "\n".join(problems)


def test_documented_config_keys_are_fields_of_the_job_config() -> None:
    problems = [
        problem
        for name, markdown in _documents()
        for snippet in snippets(markdown, name)
        for problem in config_problems(snippet)
    ]
    assert not problems, "\n".join(problems)


def test_documented_config_paths_exist() -> None:
    problems = [
        problem for name, markdown in _documents() for problem in path_problems(markdown, name)
    ]
    assert not problems, "\n".join(problems)


_WRONG = """
Run `python -m pipekit.bench no-such-bench --pp 2` or `python -m pipekit.nowhere`, then
`torchrun --nproc-per-node 2 train.py --config configs/missing.toml --parallelism.no_such 2`
with `[compile] enabled` and

```toml
[parallelism]
pipeline_parallel_degree = 2
slices = 4

[paralelism]
tp = 2
```

and `python -m pipekit.memory_plan --config configs/debug_model.toml --world-sise 8`.
"""
_RIGHT = """
Run `python -m pipekit.bench schedules` or `python -m pipekit.memory_plan --help`, then
`torchrun --nproc-per-node 2 train.py --config configs/debug_model.toml --parallelism.tp 2`
with `[compile] enable` and

```toml
[parallelism]
pipeline_parallel_degree = 2
num_slices = 4

[model.upcycle]
top_k = 2
```

and `python -m pipekit.memory_plan --config configs/debug_model.toml --world-size 8`.
"""


def _all_problems(markdown: str) -> list[str]:
    plan_help = "usage: python -m pipekit.memory_plan [-h] --world-size WORLD_SIZE\n  -h, --help"
    found = snippets(markdown, "x.md")
    problems = path_problems(markdown, "x.md")
    for snippet in found:
        problems += config_problems(snippet)
        for command in commands(snippet):
            problems += command_problems(command, {("pipekit.memory_plan", ""): plan_help})
    return problems


def test_the_checks_catch_a_wrong_bench_module_key_flag_and_path() -> None:
    problems = "\n".join(_all_problems(_WRONG))
    for expected in [
        "'no-such-bench' is not a bench",
        "no module pipekit.nowhere",
        "configs/missing.toml does not exist",
        "parallelism.no_such is not a config key",
        "compile.enabled is not a config key",
        "parallelism.slices is not a config key",
        "[paralelism] is not a config section",
        "--world-sise is not in `python -m pipekit.memory_plan --help`",
    ]:
        assert expected in problems, f"{expected!r} not reported in:\n{problems}"
    assert len(problems.splitlines()) == 8
    assert _all_problems(_RIGHT) == []  # the same text made right passes


def test_documented_schedule_names_are_the_registry() -> None:
    """The `pipeline_schedule` row of docs/pipelining.md lists exactly the registered
    schedules a config can name (the registry is the one list; "user" is a file's)."""
    row = next(
        line
        for line in (REPO_ROOT / "docs" / "pipelining.md").read_text().splitlines()
        if line.startswith("| `pipeline_schedule` |")
    )
    documented = _SPAN.findall(row.split("|")[2])
    assert documented == [name for name in schedule_names() if name != "user"]


def test_documented_context_parallel_variants_are_the_table() -> None:
    """The variant table of docs/context_parallel.md has one row per variant pipekit
    registers, and its sliced-pipeline column says "no" exactly where the entry has no
    per-slice attention."""
    from pipekit.attention.across import context_parallel_variant_entry, variants

    lines = (REPO_ROOT / "docs" / "context_parallel.md").read_text().splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| variant |")))
    rows = {}
    for line in lines[header + 2 :]:
        if not line.startswith("| `"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    assert sorted(rows) == sorted(getattr(variants, entry).name for entry in variants.__all__)
    for name, cells in rows.items():
        assert (cells[1] != "no") == context_parallel_variant_entry(name).in_pipelines, name


_GENERATED_DOCS = {"api.md", "config.md"}
"""Written by scripts/api_reference.py and `python -m pipekit.config.reference`, whole."""
_RESULTS_LINES, _FEATURE_DOC_LINES = 300, 250


def test_docs_stay_reference_sized() -> None:
    """docs/results.md holds current figures (history lives in git) within 300 lines, and
    every other hand-written doc within 250."""
    lengths = {
        path.name: len(path.read_text().splitlines())
        for path in sorted((REPO_ROOT / "docs").glob("*.md"))
        if path.name not in _GENERATED_DOCS
    }
    limits = {
        name: _RESULTS_LINES if name == "results.md" else _FEATURE_DOC_LINES for name in lengths
    }
    over = [f"docs/{name}: {lines} lines > {limits[name]}" for name, lines in lengths.items()
            if lines > limits[name]]  # fmt: skip
    assert not over, "docs over their size; cut history and repetition:\n" + "\n".join(over)
