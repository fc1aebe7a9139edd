"""The compatibility table of docs/inprocess.md holds: every name it offers exists with its parameters."""

from __future__ import annotations

import datetime
import enum
import importlib
import inspect
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "inprocess.md"
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"
STATUSES = ("same", "fixed", "internal", "missing")
KINDS = ("class", "method", "attribute", "function", "enum", "exception")


def _cells(line: str) -> list[str]:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


def _rows() -> list[dict[str, str]]:
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC}: compatibility table markers missing"
    lines = [ln for ln in text.split(START, 1)[1].split(END, 1)[0].splitlines() if ln.strip()]
    header = _cells(lines[0])
    assert header == ["module", "name", "kind", "parameters", "status"], header
    return [dict(zip(header, _cells(ln), strict=True)) for ln in lines[2:]]


ROWS = _rows()
OFFERED = [r for r in ROWS if r["status"].split(":")[0] in ("same", "fixed")]


def _params(text: str) -> list[tuple[str, str | None]]:
    """``a, b=1, c=<x, y>`` -> [(a, None), (b, '1'), (c, '<x, y>')] (commas inside <> or () kept)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    result = []
    for part in (p.strip().strip("`") for p in parts):
        name, sep, default = part.partition("=")
        result.append((name.strip(), default.strip() if sep else None))
    return result


def _resolve(row: dict[str, str]) -> object:
    module_path = row["module"].replace("inprocess", "nvrx.inprocess", 1)
    obj: object = importlib.import_module(module_path)
    for attr in row["name"].split("."):
        if row["kind"] == "attribute" and isinstance(obj, type) and _declared(obj, attr):
            return None  # an instance attribute, declared on its class
        assert hasattr(obj, attr), f"{module_path}.{row['name']}: {attr!r} is missing"
        obj = getattr(obj, attr) if not isinstance(obj, type) else inspect.getattr_static(obj, attr)
    return obj


def _declared(cls: type, attr: str) -> bool:
    """Whether ``cls`` (or a base) declares the instance attribute ``attr`` in its annotations."""
    return any(attr in inspect.get_annotations(base) for base in cls.__mro__)


def test_table_is_complete_and_well_formed():
    assert len(ROWS) >= 100, "the compatibility table lost rows"
    for row in ROWS:
        assert row["status"].split(":")[0] in STATUSES, row
        assert row["kind"] in KINDS, row
        if row["status"].startswith(("fixed", "internal", "missing")):
            assert ":" in row["status"] and row["status"].split(":", 1)[1].strip(), (
                f"{row['module']}.{row['name']}: a {row['status'].split(':')[0]} row needs its reason"
            )
    names = {(r["module"], r["name"]) for r in ROWS}
    for must in [
        ("inprocess", "Wrapper"),
        ("inprocess.rank_filter", "RankFilter"),
        ("inprocess.tools.inject_fault", "inject_fault"),
        ("inprocess.nested_restarter", "NestedRestarterCallback"),
        ("inprocess.progress_watchdog", "Timestamp"),
        ("inprocess.rank_assignment", "FilterGroupedByKey"),
        ("inprocess.store", "BarrierTimeout"),
        ("inprocess.attribution", "InterruptionRecord"),
    ]:
        assert must in names, f"{must} is not in the compatibility table"


@pytest.mark.parametrize("row", OFFERED, ids=lambda r: f"{r['module']}.{r['name']}")
def test_offered_name_exists_with_reference_parameters(row):
    obj = _resolve(row)
    kind = row["kind"]
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if kind == "enum":
        assert isinstance(obj, type) and issubclass(obj, enum.Enum), obj
        for member, _ in _params(row["parameters"]):
            assert member in obj.__members__, f"{obj.__name__}.{member} is missing"
        return
    if kind == "exception":
        assert isinstance(obj, type) and issubclass(obj, BaseException), obj
    if kind == "class":
        assert isinstance(obj, type), obj
    if kind in ("method", "function"):
        assert callable(obj), obj
    params = _params(row["parameters"])
    if not params:
        return
    signature = inspect.signature(obj)
    for name, default in params:
        assert name in signature.parameters, (
            f"{row['module']}.{row['name']} does not accept {name!r}: {signature}"
        )
        param = signature.parameters[name]
        if default is None:
            continue
        assert param.default is not inspect.Parameter.empty, f"{name} has no default: {signature}"
        if default.startswith("<"):
            continue
        nvrx_state = importlib.import_module("nvrx.inprocess.state")
        expected = eval(default, {"timedelta": datetime.timedelta, "Mode": nvrx_state.Mode})  # noqa: S307
        assert param.default == expected, (
            f"{row['module']}.{row['name']}: {name} defaults to {param.default!r}, "
            f"the reference to {expected!r}"
        )


def test_the_parser_reads_nested_defaults():
    assert _params("a, b=timedelta(seconds=1), c=<Compose(x, y)>") == [
        ("a", None),
        ("b", "timedelta(seconds=1)"),
        ("c", "<Compose(x, y)>"),
    ]
    assert re.fullmatch(r"\w+", "Wrapper")
