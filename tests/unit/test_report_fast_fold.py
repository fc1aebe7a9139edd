"""The report's one-pass reading of huge jobs reads what the tolerant reader reads.

A well-formed file is parsed in one call and its events checked as they are
folded (``FileFolder.fold(parsed=True)``): the writer's usual event inline,
any other in full. A single run's files fold their rounds straight into the
job's (``aggregate_files``). Here each shortcut is compared with the careful
path it stands for: the tolerant reader, and per-file round states merged.
Events that are equal but not of one type (1, 1.0 and true) must not slip
through the check that compares an event with the previous one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_report_fixtures import write_standard_job

from nvrx.events.reader import ReadStats
from nvrx.events.schema import KINDS
from nvrx.events.validation import all_usual, usable_event
from nvrx.report import build, build_report, file_fold, loading, summarize, typed_events
from nvrx.report.file_fold import FileFolder
from nvrx.report.file_summary import FileSummary
from nvrx.report.kind_handlers import DISPATCH
from tests.support.bench_module import load_bench

Mutation = Callable[[dict[str, Any]], str]


def _set(field: str, text: str) -> Mutation:
    """The event with ``field`` set to JSON ``text``."""

    def mutate(event: dict[str, Any]) -> str:
        event = {**event, field: "@@VALUE@@"}
        return json.dumps(event).replace('"@@VALUE@@"', text)

    return mutate


def _as_float(field: str) -> Mutation:
    """The event with integer ``field`` written as the equal float (1234.0)."""
    return lambda event: _set(field, f"{event[field]}.0")(event)


def _without(field: str) -> Mutation:
    return lambda event: json.dumps({k: v for k, v in event.items() if k != field})


# Values the reader skips (several equal to the previous event's value: true == 1 == 1.0).
SKIPPED = {
    "v true": _set("v", "true"),
    "v 1.0": _set("v", "1.0"),
    "pid float": _as_float("pid"),
    "pid 0": _set("pid", "0"),
    "rank true": _set("rank", "true"),
    "rank 1.0": _as_float("rank"),
    "node false": _set("node", "false"),
    "node 0.0": _as_float("node"),
    "round false": _set("round", "false"),
    "round 0.0": _as_float("round"),
    "round -1": _set("round", "-1"),
    "wall 1e308": _set("wall", "1e308"),
    "wall true": _set("wall", "true"),
    "mono -1": _set("mono", "-1.0"),
    "host 5": _set("host", "5"),
    "boot list": _set("boot", "[1]"),
    "component 0": _set("component", "0"),
    "job 1.5": _set("job", "1.5"),
    "kind 3": _set("kind", "3"),
    "not an object": lambda event: "[1, 2]",
}
# Unusual values the reader keeps: the fold takes them the long way.
KEPT = {
    "wall int": lambda event: _set("wall", str(int(event["wall"])))(event),
    "mono int": lambda event: _set("mono", str(int(event["mono"])))(event),
    "host null": _set("host", "null"),
    "boot null": _set("boot", "null"),
    "component null": _set("component", "null"),
    "job int": _set("job", "777"),
    "node null": _set("node", "null"),
    "rank null": _set("rank", "null"),
    "round null": _set("round", "null"),
    "mono missing": _without("mono"),
    "host missing": _without("host"),
    "kind unknown": _set("kind", '"from_a_newer_nvrx"'),
    "kind store_start": _set("kind", '"store_start"'),
}


@pytest.fixture(autouse=True, params=["records", "dicts", "stdlib dicts"])
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test three times: rank files decoded into typed records (``typed_events``, with
    msgspec); every file parsed into dicts by the fastest parser installed and checked as folded;
    the same with the standard library's parser (as without ``nvrx[fast]``)."""
    if request.param == "records" and not typed_events.RECORD_TYPES:
        pytest.skip("msgspec is not installed (pip install 'nvrx[fast]')")
    if request.param != "records":
        monkeypatch.setattr(summarize, "decode_records", lambda data: None)
    if request.param == "stdlib dicts":
        monkeypatch.setattr(loading, "parse_json", loading.parse_text)
    return request.param


def _report(job_dir: Path) -> dict[str, Any]:
    report = build_report(job_dir, sacct=False, workers=1).to_dict()
    report.pop("generated_at")
    return report


def _rounds(job_dir: Path) -> dict[Any, Any]:
    """The round states of the job's rank files aggregated as a worker process does."""
    files = sorted(job_dir.glob("*.jsonl"))
    node_files = [p for p in files if p.name.startswith(("supervisor-", "store-"))]
    starts = build.run_starts_of(summarize.summarize_file(p) for p in node_files)
    rank_files = [p for p in files if p not in node_files]
    return build.aggregate_files(rank_files, None, starts).rounds


def _careful(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file through the tolerant reader, every event the fold's long way (no usual
    event), and the files' own round states merged."""
    monkeypatch.setattr(loading, "parse_file", lambda path: None)
    monkeypatch.setattr(summarize, "read_whole_lines", lambda path: None)
    monkeypatch.setattr(file_fold, "EVENT_FIELDS", itemgetter("no such field"))
    monkeypatch.setattr(build, "fold_file", lambda *args, **kwargs: None)


def _mutate_second_event_of_round_0(job_dir: Path, mutation: Mutation) -> None:
    """Rank 1 (node 0, version 1): its second event of round 0, so that the one before it has
    the same round, node, rank and version, which true, false and 1.0 equal."""
    for victim in sorted(job_dir.glob("wrapper-*.jsonl")):
        lines = victim.read_text().splitlines()
        events = [json.loads(line) for line in lines]
        in_round_0 = [i for i, e in enumerate(events) if e["rank"] == 1 and e["round"] == 0]
        if len(in_round_0) >= 2:
            lines[in_round_0[1]] = mutation(events[in_round_0[1]])
            victim.write_text("\n".join(lines) + "\n")
            return
    raise AssertionError("no file of rank 1 with two events of round 0")


@pytest.mark.parametrize("name", sorted(SKIPPED))
def test_an_event_the_reader_skips_makes_the_file_take_the_careful_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    write_standard_job(tmp_path)
    _mutate_second_event_of_round_0(tmp_path, SKIPPED[name])
    fast, fast_rounds = _report(tmp_path), _rounds(tmp_path)
    assert fast["reading"]["skipped_count"] == 1
    _careful(monkeypatch)
    assert fast == _report(tmp_path)
    assert fast_rounds == _rounds(tmp_path)  # none of the file's events folded twice


@pytest.mark.parametrize("name", sorted(KEPT))
def test_an_unusual_event_the_reader_keeps_is_folded_like_any_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    write_standard_job(tmp_path)
    _mutate_second_event_of_round_0(tmp_path, KEPT[name])
    fast, fast_rounds = _report(tmp_path), _rounds(tmp_path)
    assert fast["reading"]["skipped_count"] == 0
    _careful(monkeypatch)
    assert fast == _report(tmp_path)
    assert fast_rounds == _rounds(tmp_path)


def _split_second_event(line: str) -> str:
    """An event torn over two lines after its ``kind`` (as a hand-split or pretty-printed one)."""
    return line.replace('"kind":', '"kind":\n', 1)


def _comma_split_second_event(line: str) -> str:
    """An event torn over two lines between two fields, its comma lost: joined with a comma the
    two lines would read as one event."""
    head, tail = line.split(',"wall"', 1)
    return head + '\n"wall"' + tail


# Damage to rank 1's file that only the reader reads right: lines that are not one event each.
LINE_DAMAGE = {
    "an event torn over two lines": lambda lines, i: [
        *lines[:i], _split_second_event(lines[i]), *lines[i + 1 :]
    ],
    "an event torn over two lines where a comma would join them": lambda lines, i: [
        *lines[:i], _comma_split_second_event(lines[i]), *lines[i + 1 :]
    ],
    "a torn event and two events merged on one line": lambda lines, i: [
        *lines[:i], _split_second_event(lines[i]), lines[i + 1] + lines[i + 2], *lines[i + 3 :]
    ],
    "a blank line": lambda lines, i: [*lines[:i], "", *lines[i:]],
    "bytes that are not UTF-8 in a field the report does not read": lambda lines, i: [
        *lines[:i], lines[i][:-1] + ', "note": "\udcff"}', *lines[i + 1 :]
    ],
    "values nested 1,000 deep in a field the report does not read": lambda lines, i: [
        *lines[:i], lines[i][:-1] + ', "note": ' + "[" * 1000 + "]" * 1000 + "}", *lines[i + 1 :]
    ],
    "values nested 600 deep in a field the report does not read": lambda lines, i: [
        *lines[:i], lines[i][:-1] + ', "note": ' + "[" * 600 + "]" * 600 + "}", *lines[i + 1 :]
    ],
    "an integer of 5,000 digits in a field the report does not read": lambda lines, i: [
        *lines[:i], lines[i][:-1] + ', "note": ' + "9" * 5000 + "}", *lines[i + 1 :]
    ],
    "a line that starts with a byte order mark": lambda lines, i: [
        *lines[:i], "\ufeff" + lines[i], *lines[i + 1 :]
    ],
    "a surrogate written as raw bytes in a field the report does not read": lambda lines, i: [
        *lines[:i], lines[i][:-1] + ', "note": "\udced\udca0\udc80"}', *lines[i + 1 :]
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LINE_DAMAGE))
def test_a_file_whose_lines_are_not_one_event_each_is_read_as_the_reader_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    write_standard_job(tmp_path)
    victim = next(
        p for p in sorted(tmp_path.glob("wrapper-*.jsonl")) if '"rank":1,' in p.read_text()
    )
    lines = victim.read_text().splitlines()
    damaged = "\n".join(LINE_DAMAGE[name](lines, 1)) + "\n"
    victim.write_bytes(damaged.encode("utf-8", "surrogateescape"))
    fast, fast_rounds = _report(tmp_path), _rounds(tmp_path)
    skipped = {  # lines, as the reader counts them
        "a blank line": 0,
        "values nested 600 deep in a field the report does not read": 0,
        "a line that starts with a byte order mark": 1,
        **dict.fromkeys(
            [name for name in LINE_DAMAGE if "does not read" in name and "600" not in name], 1
        ),
    }
    assert fast["reading"]["skipped_count"] == skipped.get(name, 2)
    _careful(monkeypatch)
    assert fast == _report(tmp_path)
    assert fast_rounds == _rounds(tmp_path)


@pytest.mark.skipif(
    not hasattr(sys, "set_int_max_str_digits"), reason="Python before 3.10.7 has no digit limit"
)
def test_an_integer_longer_than_a_lowered_digit_limit_is_judged_by_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python reads integers of at most ``sys.get_int_max_str_digits()`` digits, which may be set
    as low as 640: a shorter line than any nested one can then hold one the reader refuses."""
    write_standard_job(tmp_path)
    victim = next(
        p for p in sorted(tmp_path.glob("wrapper-*.jsonl")) if '"rank":1,' in p.read_text()
    )
    lines = victim.read_text().splitlines()
    lines[1] = lines[1][:-1] + ', "note": ' + "9" * 700 + "}"
    assert len(lines[1]) < 2 * loading.NESTING_BOUND
    victim.write_text("\n".join(lines) + "\n")
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        fast, fast_rounds = _report(tmp_path), _rounds(tmp_path)
        assert fast["reading"]["skipped_count"] == 1
        _careful(monkeypatch)
        assert fast == _report(tmp_path)
        assert fast_rounds == _rounds(tmp_path)
    finally:
        sys.set_int_max_str_digits(limit)


def test_a_file_damaged_at_its_end_is_not_folded_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its events up to the damage went into the job's rounds before the damage was seen:
    the files are folded again, each into rounds of its own."""
    write_standard_job(tmp_path)
    for victim in sorted(tmp_path.glob("wrapper-*.jsonl")):
        lines = victim.read_text().splitlines()
        lines[-1] = _set("wall", "1e308")(json.loads(lines[-1]))
        victim.write_text("\n".join(lines) + "\n")
    fast, fast_rounds = _report(tmp_path), _rounds(tmp_path)
    assert fast["reading"]["skipped_count"] == len(list(tmp_path.glob("wrapper-*.jsonl")))
    _careful(monkeypatch)
    assert fast == _report(tmp_path)
    assert fast_rounds == _rounds(tmp_path)


@pytest.mark.parametrize("field", ["wall", "mono"])
def test_nan_is_refused_with_the_standard_library_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    monkeypatch.setattr(loading, "parse_json", json.loads)  # reads NaN (orjson refuses it)
    write_standard_job(tmp_path)
    _mutate_second_event_of_round_0(tmp_path, _set(field, "NaN"))
    fast = _report(tmp_path)
    assert fast["reading"]["skipped_count"] == 1
    _careful(monkeypatch)
    assert fast == _report(tmp_path)


def test_every_kind_the_fold_handles_is_a_known_kind() -> None:
    """The fold counts unknown kinds only among those it has no handler for."""
    assert set(DISPATCH) <= set(KINDS)


def _generator() -> Any:
    return load_bench("gen_synthetic_logs", "gen_synthetic_logs")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank_file_starts_a_run", [False, True])
def test_rounds_folded_into_the_job_equal_the_files_rounds_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank_file_starts_a_run: bool
) -> None:
    job_dir = tmp_path / "job"
    _generator().generate(job_dir, ranks=96, rounds=6, ranks_per_node=8, job="4242", seed=5)
    if rank_file_starts_a_run:  # node 3's runs start again just before this file: run 1
        victim = sorted(job_dir.glob("wrapper-n3-*.jsonl"))[0]
        first = json.loads(victim.read_text().splitlines()[0])
        start = {**first, "kind": "supervisor_start", "wall": first["wall"] - 0.25}
        with victim.open("a") as fh:
            fh.write(json.dumps(start) + "\n")
    fast, fast_rounds = _report(job_dir), _rounds(job_dir)
    assert fast["summary"]["runs"] == (2 if rank_file_starts_a_run else 1)
    assert any(run == 1 for run, _ in fast_rounds) == rank_file_starts_a_run
    monkeypatch.setattr(build, "fold_file", lambda *args, **kwargs: None)
    assert fast == _report(job_dir)
    assert fast_rounds == _rounds(job_dir)


def test_each_round_spans_the_walls_of_its_events(tmp_path: Path) -> None:
    """The fold widens a round's span when its events end (lazily): every round's first and
    last wall are those of the events filed under it, whichever file they are in."""
    job_dir = tmp_path / "job"
    _generator().generate(job_dir, ranks=16, rounds=4, ranks_per_node=4, job="4242", seed=3)
    walls: dict[Any, list[float]] = {}
    for path in job_dir.glob("*.jsonl"):
        if path.name.startswith(("supervisor-", "store-")):
            continue
        for event in map(json.loads, path.read_text().splitlines()):
            filed = DISPATCH.get(event["kind"], (None, True))[1]
            if filed and event["round"] is not None:
                walls.setdefault((0, event["round"]), []).append(event["wall"])
    rounds = _rounds(job_dir)
    assert len(walls) == 4
    assert {key: (min(w), max(w)) for key, w in walls.items()} == {
        key: (rounds[key].first_wall, rounds[key].last_wall) for key in walls
    }


_BASE = {
    "v": 1, "kind": "round_start", "wall": 1_700_000_000.5, "mono": 100.5, "boot": "b",
    "host": "h", "pid": 4242, "component": "wrapper", "job": "7", "node": 1, "rank": 1, "round": 1,
}  # fmt: skip
_ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(_BASE)), value=_ODD, drop=st.booleans())
def test_the_inline_check_never_keeps_what_the_full_check_refuses(
    field: str, value: Any, drop: bool
) -> None:
    odd = {k: v for k, v in _BASE.items() if k != field}
    if not drop:
        odd[field] = value
    events = [dict(_BASE), odd, {**_BASE, "wall": _BASE["wall"] + 1.0}]
    usable = all(map(usable_event, events))
    assert not all_usual(events) or usable
    folder = FileFolder(FileSummary(path="x", stats=ReadStats()))
    assert folder.fold(events, parsed=True) == usable


def test_an_unusual_event_does_not_hand_its_writer_to_the_next_usual_one() -> None:
    """After an event the fold took the long way (a whole-second wall, no host), an event
    equal in its common fields to the one before is its writer's again (host "h")."""
    fault = {**_BASE, "kind": "fault", "fault_kind": "exception", "exc_type": "ValueError"}
    events = [dict(_BASE), {**_BASE, "wall": 1_700_000_000, "host": None}, fault]
    summary = FileSummary(path="x", stats=ReadStats())
    assert FileFolder(summary).fold(events, parsed=True)
    assert [group.hosts for group in summary.signatures.values()] == [{"h"}]
