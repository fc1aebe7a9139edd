"""The package's layers stand in the order of docs/architecture.md, and no import goes round in a circle.

Every import under ``nvrx/`` is read with ``ast``, the lazy ones inside
functions and those under ``if TYPE_CHECKING:`` too. A module may import its
own layer's modules and the layers below it in the table, never one above;
neither the sub-packages' import graph nor the modules' has a cycle. The table
is read from the document, so the picture and the code agree.

In the modules' graph an import names the module it loads: ``from X import y``
is an edge to ``X.y`` when that is a module, else to ``X`` (a package's
``__init__``). The packages Python loads on the way to a module are not
edges: a package's ``__init__`` may re-export its submodules, and a submodule
then imports its siblings directly, never through the package.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nvrx"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layer_table(text: str) -> list[list[str]]:
    """The module prefixes of each layer, top first, from the ``## Layers`` table."""
    section = text.split("## Layers", 1)[1]
    layers: list[list[str]] = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= {"-", " "}:
            continue
        names = re.findall(r"`(nvrx(?:\.\w+)*)`", cells[1])
        if names:
            layers.append(names)
    return layers


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file, wherever it stands.

    ``from X import y`` imports module ``X.y`` when that is a module, else a name of ``X``.
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                yield node.lineno, child if is_module(child, root) else target


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the layer owning ``module`` (longest matching prefix), None if none does.

    The facade ``nvrx`` (``nvrx/__init__.py``) stands above every layer.
    """
    if module == "nvrx":
        return -1
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    return None if best is None else best[0]


def subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def check(package: Path, layers: list[list[str]]) -> list[str]:
    """Every upward import, unplaced module and sub-package cycle, as readable lines."""
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, package.parent)
        if name == "nvrx":
            continue  # the facade: lazy re-exports of the public names
        own = layer_of(name, layers)
        if own is None:
            problems.append(f"{name} is in no layer of {ARCHITECTURE.name}")
            continue
        for line, target in imports_of(path, package.parent):
            if target != "nvrx" and not target.startswith("nvrx."):
                continue
            if target != "nvrx" and subpackage(target) != subpackage(name):
                graph.setdefault(subpackage(name), set()).add(subpackage(target))
            theirs = layer_of(target, layers)
            if theirs is not None and theirs < own:
                problems.append(
                    f"{path.relative_to(package.parent)}:{line}: {name} ({'/'.join(layers[own])}) "
                    f"imports {target} of a higher layer "
                    f"({'/'.join(layers[theirs]) if theirs >= 0 else 'the nvrx facade'})"
                )
    problems.extend(cycles(graph))
    problems.extend(module_circles(module_graph(package)))
    return problems


def module_graph(package: Path) -> dict[str, set[str]]:
    """Each module under ``package`` and the modules of the package it imports."""
    root = package.parent
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, root)
        targets = graph.setdefault(name, set())
        for _, target in imports_of(path, root):
            inside = target == package.name or target.startswith(package.name + ".")
            if inside and target != name and is_module(target, root):
                targets.add(target)
    return graph


def module_circles(graph: dict[str, set[str]]) -> list[str]:
    """One line per group of modules that import each other, directly or round a circle
    (a strongly connected component of ``graph``, found with Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                found.append("import circle between modules: " + ", ".join(sorted(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cycles(graph: dict[str, set[str]]) -> list[str]:
    found: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append("import cycle: " + " -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_table_names_every_layer_of_the_design() -> None:
    layers = layer_table(ARCHITECTURE.read_text())
    assert len(layers) >= 6, layers
    assert layers[-1][0] == "nvrx.events"  # ground at the bottom


def test_imports_point_down_the_table_only() -> None:
    problems = check(PACKAGE, layer_table(ARCHITECTURE.read_text()))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        (
            "store/late.py",
            "def f():\n    from nvrx.supervisor import config\n",
            "imports nvrx.supervisor.config of a higher layer",
        ),
        ("events/late.py", "from nvrx import store\n", "imports nvrx.store of a higher layer"),
        (
            "report/late.py",
            "from ..supervisor import policy\n",
            "imports nvrx.supervisor.policy of a higher layer",
        ),
        ("slurm/nowhere.py", "import nvrx.report\n", "imports nvrx.report of a higher layer"),
        ("store/facade.py", "from nvrx import submit\n", "imports nvrx of a higher layer"),
        ("inprocess/facade.py", "import nvrx\n", "imports nvrx of a higher layer"),
    ],
)
def test_an_upward_import_is_caught(tmp_path: Path, where: str, source: str, expected: str) -> None:
    copy = tmp_path / "nvrx"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (copy / where).write_text(source)
    layers = layer_table(ARCHITECTURE.read_text())
    problems = check(copy, layers)
    assert any(expected in p for p in problems), problems


def test_a_circle_between_modules_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "nvrx"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (copy / "report" / "hen.py").write_text("from .egg import Egg\n")
    (copy / "report" / "egg.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from nvrx.report.hen import Hen\n"
    )
    problems = check(copy, layer_table(ARCHITECTURE.read_text()))
    assert "import circle between modules: nvrx.report.egg, nvrx.report.hen" in problems, problems


def test_a_package_reexport_is_not_a_circle_but_importing_through_it_is() -> None:
    graph = {
        "nvrx.p": {"nvrx.p.a", "nvrx.p.b"},  # the __init__ re-exports its modules
        "nvrx.p.a": {"nvrx.p.b"},  # a sibling imported directly
        "nvrx.p.b": set(),
    }
    assert module_circles(graph) == []
    graph["nvrx.p.b"] = {"nvrx.p"}  # ``from nvrx.p import name``: through the package
    assert module_circles(graph) == ["import circle between modules: nvrx.p, nvrx.p.a, nvrx.p.b"]


def test_a_cycle_between_subpackages_is_caught() -> None:
    graph = {"nvrx.a": {"nvrx.b"}, "nvrx.b": {"nvrx.c"}, "nvrx.c": {"nvrx.a"}}
    assert cycles(graph) == ["import cycle: nvrx.a -> nvrx.b -> nvrx.c -> nvrx.a"]
