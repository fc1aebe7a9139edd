"""Every module under nvrx/ stays small and flat: <= 420 lines, control blocks nested <= 4 deep.

Depth counts, inside one function, the nested ``if``/``for``/``while``/
``try``/``with``/``match`` blocks; the body of an ``except`` or ``case``
clause is one level below its ``try`` or ``match``, and an ``elif`` stays at
its ``if``'s level. A nested function or class starts again at 0 (it is
measured on its own). Run as a script it prints every module that breaks a
limit.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nvrx"
MAX_LINES = 420
MAX_DEPTH = 4

_BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.Match)
if sys.version_info >= (3, 11):
    _BLOCKS += (ast.TryStar,)
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


def problems(path: Path) -> list[str]:
    """What in module ``path`` breaks a limit (empty when nothing does)."""
    text = path.read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_LINES:
        found.append(f"{lines} lines (limit {MAX_LINES})")
    for fn in functions(ast.parse(text, str(path))):
        depth = nesting_depth(fn)
        if depth > MAX_DEPTH:
            found.append(f"{fn.name} (line {fn.lineno}) nests {depth} deep (limit {MAX_DEPTH})")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE.parent)) for p in MODULES])
def test_module_is_small_and_flat(path: Path) -> None:
    assert problems(path) == []


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
