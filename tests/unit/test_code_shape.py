"""Code under nvrx/ reads in small pieces: short, flat functions, and no mixins.

A function spans at most 60 lines, from its ``def`` to its last line
(decorators not counted; a nested function counts in its parent and is
measured on its own too), and nests its control blocks at most 4 deep. Depth
counts, inside one function, the nested ``if``/``for``/``while``/``try``/
``with``/``match`` blocks; the body of an ``except`` or ``case`` clause is one
level below its ``try`` or ``match``, and an ``elif`` stays at its ``if``'s
level. A nested function or class starts again at 0. A class inherits from at
most one class of nvrx: behaviour is composed from objects it holds, never
mixed in. Run as a script it prints every function and class that breaks a
rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nvrx"
MAX_FUNCTION_LINES = 60
MAX_DEPTH = 4
#: Functions allowed past MAX_FUNCTION_LINES, as "path:qualified name": each goes when it is split.
LONG_FUNCTIONS: set[str] = {
    # The per-event loop, its state in locals: a split costs a call per event for millions
    # of events (bench/report_speed.py).
    "nvrx/report/file_fold.py:FileFolder.fold",
}
#: Classes allowed to inherit from several classes of nvrx, as "module.Class".
MIXIN_COMPOSITIONS: set[str] = {
    # The reference's public types: each step is both a NestedRestarterCallback and the
    # plug-in type of its place in the Wrapper, and callers check both with isinstance.
    "nvrx.inprocess.nested_restarter.NestedRestarterHandlingCompleted",
    "nvrx.inprocess.nested_restarter.NestedRestarterHandlingStarting",
    "nvrx.inprocess.nested_restarter.NestedRestarterFinalized",
    "nvrx.inprocess.nested_restarter.NestedRestarterAborted",
}

_BLOCKS = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.Try,
    ast.TryStar,
    ast.With,
    ast.AsyncWith,
    ast.Match,
)
_CLAUSES = (ast.ExceptHandler, ast.match_case)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _is_elif(node: ast.AST, parent: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(parent, ast.If) and parent.orelse == [node]


def nesting_depth(function: ast.AST) -> int:
    """Deepest nesting of control blocks in ``function`` (nested scopes excluded)."""

    def walk(node: ast.AST, depth: int) -> int:
        deepest = depth
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue
            inner = depth
            if isinstance(child, _CLAUSES) or (
                isinstance(child, _BLOCKS) and not _is_elif(child, node)
            ):
                inner = depth + 1
            deepest = max(deepest, walk(child, inner))
        return deepest

    return walk(function, 0)


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def qualified_functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from qualified_functions(node, name + ".")
        else:
            yield from qualified_functions(node, prefix)


def function_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the ``def`` to the function's last line, decorators not counted."""
    return (function.end_lineno or function.lineno) - function.lineno + 1


def problems(path: Path) -> list[str]:
    """What in module ``path`` breaks a rule (empty when nothing does)."""
    found = []
    where = str(path.relative_to(PACKAGE.parent))
    for name, fn in qualified_functions(ast.parse(path.read_text(), str(path))):
        depth = nesting_depth(fn)
        if depth > MAX_DEPTH:
            found.append(f"{name} (line {fn.lineno}) nests {depth} deep (limit {MAX_DEPTH})")
        lines = function_lines(fn)
        if lines > MAX_FUNCTION_LINES and f"{where}:{name}" not in LONG_FUNCTIONS:
            found.append(
                f"{name} (line {fn.lineno}) spans {lines} lines (limit {MAX_FUNCTION_LINES})"
            )
    return found


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> qualified name of what the module imports (lazy imports included)."""
    names: dict[str, str] = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = (
                package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            )
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{source}.{alias.name}"
    return names


def nvrx_classes() -> dict[str, list[str]]:
    """Each class defined under nvrx/ (``module.Class``) and the bases it names, qualified:
    by the module's imports, else as a class of the module, else as named (a builtin)."""
    classes: dict[str, list[str]] = {}
    for path in MODULES:
        module = module_of(path)
        tree = ast.parse(path.read_text(), str(path))
        names = imported_names(tree, module, path.name == "__init__.py")
        defined = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        own = {node.name for node in defined}
        for node in defined:
            bases = []
            for base in node.bases:
                head, _, rest = ast.unparse(base).partition(".")
                qualified = names.get(head, f"{module}.{head}" if head in own else head)
                bases.append(f"{qualified}.{rest}" if rest else qualified)
            classes[f"{module}.{node.name}"] = bases
    return classes


def mixin_compositions(classes: dict[str, list[str]]) -> set[str]:
    """Classes that inherit from two or more classes of nvrx.

    A base named through a package that re-exports it counts by its name: a
    qualified name under ``nvrx.`` whose last part names a class of nvrx.
    """
    names = {qualified.rpartition(".")[2] for qualified in classes}

    def of_nvrx(base: str) -> bool:
        return base in classes or (base.startswith("nvrx.") and base.rpartition(".")[2] in names)

    return {cls for cls, bases in classes.items() if sum(map(of_nvrx, bases)) >= 2}


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE.parent)) for p in MODULES])
def test_functions_are_short_and_flat(path: Path) -> None:
    assert problems(path) == []


def test_the_long_functions_allowed_are_still_long() -> None:
    # An entry that no longer names a long function goes, so the list cannot hide a new one.
    long = set()
    for path in MODULES:
        where = str(path.relative_to(PACKAGE.parent))
        for name, fn in qualified_functions(ast.parse(path.read_text(), str(path))):
            if function_lines(fn) > MAX_FUNCTION_LINES:
                long.add(f"{where}:{name}")
    assert LONG_FUNCTIONS - long == set()


def test_no_class_mixes_in_classes_of_nvrx() -> None:
    found = mixin_compositions(nvrx_classes())
    assert found - MIXIN_COMPOSITIONS == set(), "compose these of objects they hold"
    # An allowed class that is no longer a composition of mixins leaves the list.
    assert MIXIN_COMPOSITIONS - found == set()


def test_a_mixin_composition_is_found() -> None:
    classes = {
        "nvrx.a.Part": [],
        "nvrx.b.Other": ["Exception"],
        "nvrx.c.Mixed": ["nvrx.a.Part", "nvrx.b.Other"],
        "nvrx.c.Through": ["nvrx.a.Part", "nvrx.pkg.Other"],  # re-exported by a package
        "nvrx.c.Single": ["nvrx.a.Part", "torch.distributed.TCPStore"],
    }
    assert mixin_compositions(classes) == {"nvrx.c.Mixed", "nvrx.c.Through"}


def test_function_length_counts_from_the_def() -> None:
    tree = ast.parse(
        "@decorator\n@another\ndef f(\n    x,\n):\n    def g():\n        pass\n    return g\n"
    )
    measured = {name: function_lines(fn) for name, fn in qualified_functions(tree)}
    assert measured == {"f": 6, "f.g": 2}


def test_depth_measure() -> None:
    tree = ast.parse(
        "def f(x):\n"
        "    if x:\n"
        "        pass\n"
        "    elif x:\n"
        "        for i in x:\n"
        "            try:\n"
        "                pass\n"
        "            except E:\n"
        "                with x:\n"
        "                    pass\n"
        "    def g():\n"
        "        while x:\n"
        "            pass\n"
    )
    outer, inner = list(functions(tree))
    assert nesting_depth(outer) == 5  # if/elif, for, try, except, with
    assert nesting_depth(inner) == 1


def test_test_files_have_unique_names() -> None:
    # The tiers import their test files by basename (rootdir-relative sys.path, no packages):
    # two files of one name in two tiers stop the whole session at collection.
    tests = PACKAGE.parent / "tests"
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


if __name__ == "__main__":
    for module in MODULES:
        for problem in problems(module):
            print(f"{module.relative_to(PACKAGE.parent)}: {problem}")
    for cls in sorted(mixin_compositions(nvrx_classes()) - MIXIN_COMPOSITIONS):
        print(f"{cls}: inherits from several classes of nvrx")
