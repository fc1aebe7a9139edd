"""The event schema is the contract between the writers and the reader.

Every ``emit``/``_emit`` call under ``nvrx/`` is read with ``ast``: a kind given as
a string must be declared in ``nvrx.events.schema.KINDS``, and every field it passes
by name must be a common or stamped field or one of that kind's documented fields. A
kind that is not a string literal is allowed only where a function forwards its own
``kind`` parameter (the writers' ``emit`` helpers), and the fields such a helper adds
by name must be common or stamped ones. On the reading side, ``nvrx-report``
summarizes each declared kind (``kind_handlers.DISPATCH``) or names it, with the
reason, as not summarized (``kind_handlers.NOT_SUMMARIZED``): a kind that is neither
fails here, so a new writer cannot go unread unnoticed.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nvrx.events.schema import COMMON_FIELDS, KINDS, STAMPED_FIELDS
from nvrx.report.kind_handlers import DISPATCH, NOT_SUMMARIZED

PACKAGE = Path(__file__).resolve().parents[2] / "nvrx"
EMITTERS = ("emit", "_emit")


@dataclass(frozen=True)
class EmitCall:
    """One call of an event writer, where it stands and what it passes."""

    where: str
    kind: str | None  # None: not a string literal
    forwarded: bool  # the kind is the enclosing function's own ``kind`` parameter
    fields: tuple[str, ...]  # by name, and the keys of a ``**name`` the function set to a dict literal


def _is_super_call(node: ast.expr) -> bool:
    """``super().emit(...)``: a base class's method (a logging handler's), not a writer."""
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _calls_in(function: ast.AST | None, tree: ast.AST) -> Iterator[tuple[ast.Call, ast.AST | None]]:
    """Every call under ``tree`` with the function that encloses it most closely."""
    for node in ast.iter_child_nodes(tree):
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        if isinstance(node, ast.Call):
            yield node, function
        yield from _calls_in(inner, node)


def _parameters(function: ast.AST | None) -> set[str]:
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def _splat_keys(function: ast.AST | None, name: str) -> list[str]:
    """The string keys of every dict literal that ``function`` assigns to ``name`` (a
    ``**name`` passed to a writer); none where it is built otherwise."""
    if function is None:
        return []
    keys = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                keys += [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return keys


def _fields(call: ast.Call, function: ast.AST | None) -> tuple[str, ...]:
    named = [k.arg for k in call.keywords if k.arg not in (None, "kind")]
    for k in call.keywords:
        if k.arg is None and isinstance(k.value, ast.Name):
            named += _splat_keys(function, k.value.id)
    return tuple(named)


def emit_calls(package: Path) -> Iterator[EmitCall]:
    """Every writer call under ``package``."""
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for call, function in _calls_in(None, tree):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            keyword = next((k.value for k in call.keywords if k.arg == "kind"), None)
            if name not in EMITTERS or not (call.args or keyword is not None):
                continue
            if isinstance(func, ast.Attribute) and _is_super_call(func.value):
                continue
            first = call.args[0] if call.args else keyword
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            forwarded = isinstance(first, ast.Name) and first.id == "kind"
            yield EmitCall(
                where=f"{path.relative_to(package.parent)}:{call.lineno}",
                kind=first.value if literal else None,
                forwarded=forwarded and "kind" in _parameters(function),
                fields=_fields(call, function),
            )


def contract_problems(package: Path) -> list[str]:
    """What the writers under ``package`` emit that the schema does not declare."""
    problems = []
    every = {**COMMON_FIELDS, **STAMPED_FIELDS}
    for call in emit_calls(package):
        if call.kind is None:
            if not call.forwarded:
                problems.append(f"{call.where}: the kind is not a string literal")
            problems += [f"{call.where}: {n} is not a common or stamped field" for n in call.fields if n not in every]
            continue
        declared = KINDS.get(call.kind)
        if declared is None:
            problems.append(f"{call.where}: kind {call.kind!r} is not declared in events.schema")
            continue
        for name in call.fields:
            if name not in declared and name not in every:
                problems.append(f"{call.where}: {call.kind}.{name} is not documented")
    return problems


def test_every_emitted_kind_and_field_is_declared() -> None:
    calls = list(emit_calls(PACKAGE))
    assert len({c.kind for c in calls if c.kind}) >= 30  # the scan sees the writers
    assert contract_problems(PACKAGE) == []


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('emit("no_such_kind", x=1)', "kind 'no_such_kind' is not declared"),
        ('writer.emit("fault", no_such_field=1)', "fault.no_such_field is not documented"),
        ('self._emit("store_failover", epoch=1, planet="mars")', "store_failover.planet"),
        ("emit(some_kind)", "the kind is not a string literal"),
        ('emit(kind="no_such_kind")', "kind 'no_such_kind' is not declared"),
        ('emit(kind="fault", planet="mars")', "fault.planet is not documented"),
        ("writer.emit(kind, planet=1)", "planet is not a common or stamped field"),
        ('ids = {"child_pid": 1, "planet": 2}\n    emit("child_start", **ids)', "child_start.planet"),
    ],
)
def test_an_undeclared_emit_is_caught(tmp_path: Path, line: str, expected: str) -> None:
    copy = tmp_path / "nvrx"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    writer = copy / "supervisor" / "job_end.py"
    writer.write_text(writer.read_text() + f"\n\ndef _added(emit, writer, self, some_kind, kind):\n    {line}\n")
    problems = contract_problems(copy)
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith("nvrx/supervisor/job_end.py:")


def test_a_forwarded_kind_needs_the_forwarders_own_parameter(tmp_path: Path) -> None:
    module = tmp_path / "nvrx" / "m.py"
    module.parent.mkdir()
    module.write_text(
        "def ok(kind, **fields):\n    writer.emit(kind, **fields)\n\n"
        "def not_ok(other):\n    kind = other\n    writer.emit(kind)\n\n"
        "class H(Handler):\n    def emit(self, record):\n        super().emit(record)\n"
    )
    assert contract_problems(module.parent) == ["nvrx/m.py:6: the kind is not a string literal"]


def test_the_report_reads_each_declared_kind_or_says_why_not() -> None:
    read = set(DISPATCH)
    assert set(KINDS) - read - set(NOT_SUMMARIZED) == set()  # neither read nor excused
    assert read & set(NOT_SUMMARIZED) == set()  # both: one of them is wrong
    assert set(NOT_SUMMARIZED) - set(KINDS) == set()  # excuses for kinds nobody declares
    assert set(DISPATCH) - set(KINDS) == set()  # handlers of kinds nobody may write
    assert all(reason.strip() for reason in NOT_SUMMARIZED.values())


def test_the_supervisors_start_fields_are_declared(tmp_path: Path) -> None:
    """``supervisor_start`` takes the configuration's fields as ``**start_fields()`` and the
    SLURM job's as ``**slurm_job_ids()``, which the scan of emit calls cannot read: each of
    them is declared all the same."""
    from nvrx.events.schema import KINDS
    from nvrx.slurm.job_ids import slurm_job_ids
    from nvrx.supervisor.config import SupervisorConfig, local_job

    config = SupervisorConfig(command=["train"], job=local_job(nproc_per_node=1, log_dir=str(tmp_path)))
    assert set(config.start_fields()) - set(KINDS["supervisor_start"]) == set()
    assert set(slurm_job_ids({})) - set(KINDS["supervisor_start"]) == set()
