"""Rank files decoded into typed records (``nvrx.report.typed_events``, with msgspec) fold into
the summaries their dicts fold into; a record holds what the kind handlers read; any file that
is not all usual rank events is left to the dict path.

``test_report_fast_fold`` runs the careful-path comparisons with records and with dicts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_report_fast_fold import _generator
from test_report_fixtures import write_standard_job

from nvrx.events.reader import ReadStats
from nvrx.events.schema import COMMON_FIELDS, KINDS
from nvrx.report import build_report, summarize
from nvrx.report.file_fold import FileFolder
from nvrx.report.file_summary import FileSummary
from nvrx.report.kind_handlers import DISPATCH
from nvrx.report.loading import parse_lines, read_whole_lines
from nvrx.report.typed_events import RANK_KINDS, RECORD_TYPES, decode_records

REPO = Path(__file__).resolve().parents[2]

needs_msgspec = pytest.mark.skipif(
    not RECORD_TYPES, reason="msgspec is not installed (pip install 'nvrx[fast]')"
)

_USUAL = {
    "v": 1, "kind": "restart_phase", "wall": 1_700_000_000.5, "mono": 100.5, "boot": "b",
    "host": "h", "pid": 4242, "component": "wrapper", "job": "7", "node": 1, "rank": 3, "round": 2,
    "phase": "abort", "duration_s": 0.25, "ok": True,
}  # fmt: skip


def _lines(*events: dict[str, Any]) -> bytes:
    return "".join(json.dumps(e) + "\n" for e in events).encode()


def _fold(path: Path, records: bool) -> FileSummary:
    """One file folded, its events decoded as records or parsed as dicts."""
    data = read_whole_lines(path)
    assert data is not None
    events = decode_records(data) if records else parse_lines(data)
    assert events is not None
    summary = FileSummary(path=str(path), stats=ReadStats(files=1, events=len(events)))
    folder = FileFolder(summary, run_starts=True)
    if records:
        folder.fold_records(events)
    else:
        assert folder.fold(events, parsed=True)
    folder.finish()
    return summary


def _rank_files(job_dir: Path) -> list[Path]:
    return [
        p
        for p in sorted(job_dir.glob("*.jsonl"))
        if not p.name.startswith(("supervisor-", "store-"))
    ]


@needs_msgspec
@pytest.mark.parametrize("job", ["standard", "synthetic"])
def test_each_rank_file_folds_into_the_same_summary_from_records_as_from_dicts(
    tmp_path: Path, job: str
) -> None:
    if job == "standard":
        write_standard_job(tmp_path)
    else:
        _generator().generate(tmp_path, ranks=32, rounds=5, ranks_per_node=8, job="4242", seed=7)
    files = _rank_files(tmp_path)
    assert files
    for path in files:
        assert _fold(path, records=True) == _fold(path, records=False), path.name


@needs_msgspec
def test_the_report_is_the_same_with_and_without_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _generator().generate(tmp_path, ranks=64, rounds=4, ranks_per_node=8, job="4242", seed=11)
    with_records = build_report(tmp_path, sacct=False, workers=1).to_dict()
    monkeypatch.setattr(summarize, "decode_records", lambda data: None)
    without = build_report(tmp_path, sacct=False, workers=1).to_dict()
    with_records.pop("generated_at"), without.pop("generated_at")
    assert with_records == without


@needs_msgspec
def test_every_rank_file_of_the_benchmark_job_decodes_into_records(tmp_path: Path) -> None:
    """What ``bench/report_speed.py`` times goes the fast way: no rank file falls back."""
    _generator().generate(tmp_path, ranks=16, rounds=3, ranks_per_node=8, job="4242", seed=1)
    files = _rank_files(tmp_path)
    assert files and all(decode_records(read_whole_lines(p) or b"") is not None for p in files)


@needs_msgspec
def test_a_usual_event_decodes_with_its_fields_and_kind() -> None:
    assert _lines(_USUAL).count(b"\n") == 1
    [record] = decode_records(_lines(_USUAL)) or [None]
    assert type(record) is RECORD_TYPES["restart_phase"]
    assert (record.get("kind"), record.get("phase"), record.get("ok"), record.wall) == (
        "restart_phase", "abort", True, 1_700_000_000.5,
    )  # fmt: skip
    assert record.get("no_such_field", "default") == "default"


@needs_msgspec
def test_a_whole_second_wall_written_as_an_integer_is_that_float() -> None:
    [record] = decode_records(_lines({**_USUAL, "wall": 1_700_000_000})) or [None]
    assert record.wall == 1_700_000_000.0 and type(record.wall) is float


# Files the decoder leaves to the dict path: each event the reader skips or takes the long way.
_LEFT = {
    "a per-node kind": {"kind": "child_exit"},
    "an unknown kind": {"kind": "from_a_newer_nvrx"},
    "kind not a string": {"kind": 3},
    "v true": {"v": True},
    "v 1.0": {"v": 1.0},
    "pid 0": {"pid": 0},
    "pid float": {"pid": 4242.0},
    "rank true": {"rank": True},
    "rank 3.0": {"rank": 3.0},
    "round -1": {"round": -1},
    "round beyond 2**31": {"round": 2**31},
    "node false": {"node": False},
    "wall 1e308": {"wall": 1e308},
    "wall true": {"wall": True},
    "mono negative": {"mono": -1.0},
    "host null": {"host": None},
    "boot a list": {"boot": [1]},
    "component 0": {"component": 0},
    "job an integer": {"job": 777},
    "job 1.5": {"job": 1.5},
}


@needs_msgspec
@pytest.mark.parametrize("name", sorted(_LEFT))
def test_a_file_with_one_unusual_event_is_left_to_the_dict_path(name: str) -> None:
    odd = {**_USUAL, **_LEFT[name]}
    assert decode_records(_lines(_USUAL, odd, _USUAL)) is None


@needs_msgspec
@pytest.mark.parametrize("field", ["host", "mono", "job", "round"])
def test_a_file_with_an_event_missing_a_common_field_is_left_to_the_dict_path(field: str) -> None:
    odd = {k: v for k, v in _USUAL.items() if k != field}
    assert decode_records(_lines(_USUAL, odd)) is None


@needs_msgspec
@pytest.mark.parametrize(
    "data",
    [
        b"",
        _lines(_USUAL)[:-1],  # its last line torn
        b"[1, 2]\n",
        b"{\n",
        _lines(_USUAL) + b"\n" + _lines(_USUAL),  # a blank line
        _lines(_USUAL).replace(b'"kind": ', b'"kind":\n'),  # an event over two lines
        _lines(_USUAL)[:-1] + _lines(_USUAL),  # two events on one line
        _lines(_USUAL)[:-2] + b', "note": "\xff"}\n',  # not UTF-8, in a field not kept
    ],
)
def test_a_file_whose_lines_are_not_one_usual_event_each_is_left_to_the_dict_path(
    data: bytes,
) -> None:
    assert decode_records(data) is None


def test_without_msgspec_every_file_is_read_as_dicts() -> None:
    code = (
        "import sys; sys.modules['msgspec'] = None\n"
        "from nvrx.report import typed_events as t\n"
        f"assert t.RECORD_TYPES == {{}} and t.decode_records({_lines(_USUAL)!r}) is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


class _Recording(dict):
    """An event that notes every field a handler reads."""

    read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        _Recording.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        _Recording.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        _Recording.read.add(key)
        return super().__contains__(key)


def _variants(kind: str) -> list[dict[str, Any]]:
    """Events of ``kind`` that take each branch of its handler: every documented field set (to
    a value the handler uses), and none set."""
    usable: dict[str, Any] = {
        "fault_kind": "exception", "origin_rank": 5, "exc_type": "ValueError", "message": "m",
        "traceback": "Traceback (most recent call last):\nValueError: m\n", "signature": "s",
        "detected_mono": 101.0, "detection_s": 0.5, "phase": "abort", "duration_s": 0.25,
        "ok": False, "ranks": [1, 2], "world_size": 8, "restart_latency_s": 0.5,
        "outcome": "restart", "timeout": "soft", "stack": "stack", "child_pid": 99,
    }  # fmt: skip
    common = {k: v for k, v in _USUAL.items() if k in COMMON_FIELDS} | {"kind": kind}
    full = common | {name: usable.get(name, 1.0) for name in KINDS[kind]}
    variants = [full, common]
    if kind == "fault":
        variants += [full | {"fault_kind": kind} for kind in ("peer", "dead", "hang_soft")]
    return variants


@pytest.mark.parametrize("kind", sorted(set(RANK_KINDS) & set(DISPATCH)))
def test_a_rank_kind_handler_reads_only_common_and_documented_fields(kind: str) -> None:
    """A record holds only those: a field read beyond them would be None with records."""
    allowed = set(COMMON_FIELDS) | set(KINDS[kind])
    _Recording.read = set()
    start, _ = DISPATCH["call_start"]
    handler, filed = DISPATCH[kind]
    for event in _variants(kind):
        folder = FileFolder(FileSummary(path="x", stats=ReadStats()))
        # A call open first: a call_end without its duration reads the call's start.
        start(folder, _USUAL | {"kind": "call_start"}, None, 3, 1, "h", 1.0)
        part = folder.round_of(2) if filed else None
        handler(folder, _Recording(event), part, 3, 1, "h", 1.0)
    assert _Recording.read and _Recording.read <= allowed, _Recording.read - allowed
