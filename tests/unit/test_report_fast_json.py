"""The report's optional JSON parsers (msgspec, else orjson: ``nvrx[fast]``) read what the
standard library reads: the same events from well-formed files, the same fallback to the tolerant
reader for files they refuse (values outside JSON), and the same report. One difference, orjson's
alone: an integer beyond 64 bits becomes a float; the report takes neither form as a count or a
time."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from test_report_fixtures import write_standard_job

from nvrx.events.reader import ReadStats
from nvrx.report import build_report, loading

PARSERS = {"msgspec": "msgspec.json:decode", "orjson": "orjson:loads"}


@pytest.fixture(params=sorted(PARSERS))
def fast_parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each fast parser in turn, where installed, in place of whichever ``loading`` chose."""
    module, name = PARSERS[request.param].split(":")
    parser = getattr(pytest.importorskip(module, reason=f"{module} is not installed"), name)
    monkeypatch.setattr(loading, "parse_json", parser)
    return request.param


def _read_all(directory: Path) -> tuple[list[list[dict]], ReadStats]:
    stats = ReadStats()
    return [loading.read_events(p, stats) for p in sorted(directory.glob("*.jsonl"))], stats


def test_the_fastest_installed_parser_is_the_one_used() -> None:
    for name in sorted(PARSERS):  # msgspec before orjson
        module, attribute = PARSERS[name].split(":")
        try:
            parser = getattr(importlib.import_module(module), attribute)
        except ImportError:
            continue
        assert loading.parse_json is parser
        return
    assert loading.parse_json is loading.parse_text


def _with_odd_value(directory: Path, odd: str, field: str = "note") -> None:
    """One more event whose own ``field`` holds ``odd`` (JSON text)."""
    first = sorted(directory.glob("*.jsonl"))[0]
    line = json.loads(first.read_text().splitlines()[0])
    line[field] = "__ODD__"
    with first.open("a") as fh:
        fh.write(json.dumps(line).replace('"__ODD__"', odd) + "\n")


@pytest.mark.parametrize("odd", ["NaN", "1e400", '"\\ud800"'])
def test_both_parsers_read_the_same_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, odd: str, fast_parser: str
) -> None:
    write_standard_job(tmp_path)
    _with_odd_value(tmp_path, odd)
    fast, fast_stats = _read_all(tmp_path)
    monkeypatch.setattr(loading, "parse_json", loading.parse_text)
    slow, slow_stats = _read_all(tmp_path)
    assert json.dumps(fast, sort_keys=True, default=repr) == json.dumps(
        slow, sort_keys=True, default=repr
    )
    assert (fast_stats.files, fast_stats.events, fast_stats.skipped) == (
        slow_stats.files,
        slow_stats.events,
        slow_stats.skipped,
    )


@pytest.mark.parametrize("odd", [None, str(2**70)])
def test_the_report_is_the_same_with_either_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, odd: str | None, fast_parser: str
) -> None:
    write_standard_job(tmp_path)
    if odd is not None:  # beyond 64 bits: orjson reads a float, json an int
        _with_odd_value(tmp_path, odd, "exit_code")
    fast = build_report(tmp_path, sacct=False).to_dict()
    monkeypatch.setattr(loading, "parse_json", loading.parse_text)
    slow = build_report(tmp_path, sacct=False).to_dict()
    fast.pop("generated_at", None), slow.pop("generated_at", None)
    assert fast == slow
