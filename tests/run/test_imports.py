"""Imports point one way (docs/architecture.md, Layout): between the packages
`run -> pipeline -> {sharding -> model, ring} -> ops`, and inside `model/` and
`pipeline/` down the layout's list, each module importing only those listed before it;
and no modules of the package, run/'s included, import each other in a circle. Every
`qwen3_spmd` import counts: at the top, under `if TYPE_CHECKING`, or inside a function
(a function-local import must not dodge a circle). Reads the sources with `ast`;
imports nothing of the package, so it costs milliseconds."""

import ast
import re
from pathlib import Path

import pytest
from reference import ROOT

LAYOUT = ROOT / "docs" / "architecture.md"

# What each package may import of the others (itself included).
ALLOWED = {
    "ops": {"ops"},
    "model": {"ops", "model"},
    "ring": {"ops", "ring"},
    "sharding": {"ops", "model", "sharding"},
    "pipeline": {"ops", "model", "ring", "sharding", "pipeline"},
    "run": {"ops", "model", "ring", "sharding", "pipeline", "run"},
}

# The folders whose modules import only those listed before them in the layout.
ORDERED = {
    "model": ("model/", "model/checkpoint/"),
    "pipeline": (
        "pipeline/",
        "pipeline/programs/",
        "pipeline/runtime/",
        "pipeline/structured/",
        "pipeline/batch/",
        "pipeline/speculative/",
        "pipeline/scheduling/",
    ),
}

# Imports known to point up, each a debt to pay: none left (issue 42's item 3 moved the
# static batch out of the engine). An entry is struck once its import is gone.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def layout_order() -> dict[str, list[str]]:
    """Folder ("model/", "pipeline/", ...) -> its modules as the layout lists them."""
    block = LAYOUT.read_text().split("## Layout", 1)[1].split("```", 2)[1]
    order: dict[str, list[str]] = {}
    folder = None
    for line in block.splitlines():
        if m := re.match(r"^([\w/]+/)\s", line):
            folder = m.group(1)
            order[folder] = []
        elif folder and (m := re.match(r"^  (\w+\.py)\s", line)):
            order[folder].append(folder + m.group(1))
    return order


def imported_modules(source: str, path: str) -> list[tuple[int, str]]:
    """(line, module path such as "pipeline/runtime/engine.py") of every qwen3_spmd import in
    `source`, wherever it stands. `from qwen3_spmd.pipeline import cp_cost` names the
    module cp_cost; `from qwen3_spmd.pipeline.runtime.engine import Engine` names engine."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names = [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # the package imports itself by its one name
                raise AssertionError(f"{path}:{node.lineno}: a relative import")
            base = node.module or ""
            names = [(node.lineno, f"{base}.{a.name}") for a in node.names]
            names = [(line, n if _file(n, package=True) else base) for line, n in names]
        else:
            continue
        out += [(line, _file(n) or _file(n, package=True)) for line, n in names]
    return [(line, f) for line, f in out if f]


def _file(dotted: str, package: bool = False) -> str | None:
    """ "qwen3_spmd.pipeline.runtime.engine" -> "pipeline/runtime/engine.py" (a package: its
    __init__.py, with package=True; "qwen3_spmd" itself: "__init__.py"); None outside
    qwen3_spmd or for a name that is no module."""
    parts = dotted.split(".")
    if parts[0] != "qwen3_spmd":
        return None
    rel = "/".join(parts[1:])
    if rel and (ROOT / f"{rel}.py").is_file():
        return f"{rel}.py"
    init = f"{rel}/__init__.py" if rel else "__init__.py"
    if package and (ROOT / init).is_file():
        return init
    return None


def upward_imports(path: str, source: str, order: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(module, in words) for each import of `source` (the module at `path`) that does
    not point down."""
    package = path.split("/")[0]
    rank = {m: i for folders in ORDERED.values() for i, m in enumerate(_listed(folders, order))}
    bad = []
    for line, target in imported_modules(source, path):
        to = target.split("/")[0]
        if to not in ALLOWED[package]:
            words = f"{path}:{line} imports {target}: {package}/ may import only {ALLOWED[package]}"
            bad.append((target, words))
        elif (
            to == package
            and package in ORDERED
            and "__init__.py" not in (Path(path).name, Path(target).name)
        ):
            if rank[target] >= rank[path]:
                bad.append((target, f"{path}:{line} imports {target}, listed after it (not below)"))
    return bad


def _listed(folders, order) -> list[str]:
    return [m for folder in folders for m in order[folder]]


def _modules(package: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py"))


def package_sources() -> dict[str, str]:
    """Every module of the package (the root's __init__.py and each package's) -> its
    source."""
    paths = ["__init__.py", *(m for package in ALLOWED for m in _modules(package))]
    return {path: (ROOT / path).read_text() for path in paths}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports, wherever the import stands."""
    return {path: {t for _, t in imported_modules(s, path)} for path, s in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles a depth-first walk of `graph` meets, each as its modules in
    import order with the first again at the end ([] when there is none: the imports
    form a tree or a DAG). An import of a module still on the walk's path closes one."""
    path: list[str] = []
    done: set[str] = set()
    found = []

    def walk(module: str) -> None:
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                walk(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module)
    return found


def test_the_layout_lists_every_module_of_model_and_pipeline_once():
    order = layout_order()
    for package, folders in ORDERED.items():
        listed = _listed(folders, order)
        assert len(listed) == len(set(listed)), listed
        on_disk = [m for m in _modules(package) if not m.endswith("__init__.py")]
        assert sorted(listed) == on_disk, f"docs/architecture.md's layout of {package}/"


def test_every_package_imports_only_downward():
    order = layout_order()
    found = {}
    for package in ALLOWED:
        for path in _modules(package):
            for target, words in upward_imports(path, (ROOT / path).read_text(), order):
                found.setdefault((path, target), []).append(words)
    new = {k: v for k, v in found.items() if k not in KNOWN_UPWARD}
    assert not new, "\n".join(w for v in new.values() for w in v)
    gone = KNOWN_UPWARD - set(found)
    assert not gone, f"no longer imported upward, strike from KNOWN_UPWARD: {sorted(gone)}"


@pytest.mark.parametrize(
    ("path", "source", "why"),
    [
        ("model/moe.py", "from qwen3_spmd.ring.attention import make_varying\n", "ring"),
        ("model/layers.py", "def f():\n    from qwen3_spmd.sharding import specs\n", "sharding"),
        (
            "pipeline/programs/layout.py",
            "import qwen3_spmd.pipeline.runtime.engine\n",
            "listed after",
        ),
        (
            "pipeline/scheduling/executor.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from qwen3_spmd.pipeline.scheduling.scheduler import Scheduler\n",
            "listed after",
        ),
        (
            "pipeline/programs/prefill.py",
            "from qwen3_spmd.pipeline.scheduling import planner\n",
            "listed after",
        ),
        ("ring/attention.py", "from qwen3_spmd.model import fp8\n", "model"),
    ],
)
def test_an_upward_import_is_caught_wherever_it_stands(path, source, why):
    """The check can fail: an import that points up, at the top, in a function or under
    TYPE_CHECKING, is named with its line."""
    bad = upward_imports(path, source, layout_order())
    assert len(bad) == 1 and why in bad[0][1] and bad[0][1].startswith(path), bad


def test_a_downward_import_passes():
    source = (
        "from qwen3_spmd.pipeline import sampling\nfrom qwen3_spmd.model.config import PRESETS\n"
    )
    assert upward_imports("pipeline/programs/prefill.py", source, layout_order()) == []


def test_no_modules_import_each_other_in_a_circle():
    """Not even through a function-local import: a circle means the two modules are one
    piece cut in two, or that a piece both need belongs below them."""
    found = circles(import_graph(package_sources()))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_circle_is_caught_and_named():
    """The check can fail: a synthetic circle, and one a function-local import would close
    in the package (run.distributed reaching up for the parser of run.cli, which imports
    the commands that import it)."""
    graph = {"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}
    assert circles(graph) == [["a.py", "b.py", "c.py", "a.py"]]
    assert circles({"a.py": {"a.py"}}) == [["a.py", "a.py"]]
    assert circles({"a.py": {"b.py"}, "b.py": set(), "c.py": {"a.py", "b.py"}}) == []
    sources = package_sources()
    sources["run/distributed.py"] += "\ndef f():\n    from qwen3_spmd.run.cli import build_parser\n"
    found = circles(import_graph(sources))
    assert found and all(c[0] == c[-1] for c in found)
    assert any({"run/cli.py", "run/distributed.py"} <= set(c) for c in found), found
