"""nvrx-report on corrupted copies of a real job's logs: it reports or says there is nothing to
read (exit 0 or 2), never crashes, and never changes a byte of what it reads.

The logs are the standard job of ``test_report_fixtures`` (written by the real EventWriter).
Each example corrupts a fresh copy: truncation, flipped bytes, common fields of the wrong type
or with absurd values, junk lines, and directories, symlinks or nothing in place of files.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_report_fixtures import JOB, write_standard_job

from nvrx.events import ReadStats, iter_file
from nvrx.report import build_report
from nvrx.report.cli import main
from nvrx.report.loading import read_events
from nvrx.report.output_scan import scan_lines
from nvrx.report.output_triage import Death, EventFacts, triage

COMMON = ["v", "kind", "wall", "mono", "boot", "host", "pid", "component", "job", "node", "rank"]
OWN = ["round", "fault_kind", "exit_code", "signal", "world_size", "duration_s", "local_rank"]
OWN += ["child_pid", "runtime_s", "restart_latency_s", "traceback", "ranks", "outcome", "count"]
OWN += ["signature", "exc_type", "message", "origin_rank", "stack", "timeout", "decision"]
OWN += ["reason", "cause", "attempt", "nproc_per_node", "detected_mono", "phase", "ok"]
#: Text fields whose content the report parses (signatures, tracebacks, the job id it globs).
TEXT_FIELDS = ["signature", "traceback", "job", "exc_type", "message", "fault_kind", "stack"]
TEXT_FIELDS += ["timeout", "signal", "reason", "host", "boot", "outcome", "cause"]
DEEP = "[" * 5000 + "]" * 5000  # deeper than any JSON parser's recursion
BIG_LINE_TB = 'Traceback (most recent call last):\n  File "t.py", line 9999, in f\nValueError: x\n'
# Values as JSON text, so that what json.dumps cannot write (NaN, huge integers) is written too.
ODD_VALUES = [
    "1e308", "-1e308", "NaN", "Infinity", "-Infinity", "-1", "0", "1e400", "-0.0",
    "1" + "0" * 400, "-" + "9" * 30, '"abc"', '""', "true", "false", "null", "[]", "[1,2]",
    '{"a":1}', '"\\u0000"', "2.5", "4294967296", '"1700000000"', '"SIGKILL"',
    DEEP, "[" * 900 + "]" * 900, "9" * 5000, '"exit:\\u00b2"', '"Err@f.py:\\u00b2"',
    '"a**b"', '"["', '"*"', '"../x"', '"exit:' + "9" * 5000 + '"',
    json.dumps(BIG_LINE_TB.replace("9999", "9" * 5000)),
]  # fmt: skip


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    job_dir = tmp_path_factory.mktemp("pristine") / JOB
    write_standard_job(job_dir)
    return job_dir


def _files(job_dir: Path) -> list[Path]:
    return sorted(job_dir.glob("*.jsonl"))


def _truncate(path: Path, data: st.DataObject) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: data.draw(st.integers(0, len(raw)), label="keep bytes")])


def _flip(path: Path, data: st.DataObject) -> None:
    raw = bytearray(path.read_bytes())
    if raw:
        at = data.draw(st.integers(0, len(raw) - 1), label="flip at")
        raw[at] = data.draw(st.integers(0, 255), label="new byte")
    path.write_bytes(bytes(raw))


def _set_field(path: Path, data: st.DataObject) -> None:
    lines = path.read_bytes().split(b"\n")
    at = data.draw(st.integers(0, max(0, len(lines) - 2)), label="line")
    name = data.draw(st.sampled_from(COMMON) | st.sampled_from(OWN), label="field")
    value = data.draw(st.sampled_from(ODD_VALUES), label="value")
    try:
        event = json.loads(lines[at])
    except (ValueError, RecursionError):
        return
    if not isinstance(event, dict):
        return
    event[name] = "@@VALUE@@"
    lines[at] = json.dumps(event).replace('"@@VALUE@@"', value).encode()
    path.write_bytes(b"\n".join(lines))


def _junk(path: Path, data: st.DataObject) -> None:
    junk = data.draw(
        st.sampled_from([b"\x00\xff\xfe", b"{", b"}", b"[]", b'{"kind": 7}', b"NaN", b'"x"'])
        | st.binary(max_size=40),
        label="junk",
    )
    with open(path, "ab") as fh:
        fh.write(b"\n" + junk + b"\n")


def _replace_by_dir(path: Path, data: st.DataObject) -> None:
    path.unlink()
    path.mkdir()
    if data.draw(st.booleans(), label="dir holds an event file"):
        (path / "inner.jsonl").write_bytes(b'{"kind":"progress","wall":"soon"}\n')


def _replace_by_symlink(path: Path, data: st.DataObject) -> None:
    target = data.draw(
        st.sampled_from(["loop", "missing", "dir", "sibling", "devnull"]), label="link to"
    )
    others = [p for p in _files(path.parent) if p != path and p.is_file() and not p.is_symlink()]
    path.unlink()
    destination = {
        "loop": path,
        "missing": path.parent / "gone.jsonl",
        "dir": path.parent,
        "sibling": others[0] if others else path,
        "devnull": Path(os.devnull),
    }[target]
    path.symlink_to(destination)


def _delete(path: Path, data: st.DataObject) -> None:
    path.unlink()


CORRUPTIONS: dict[str, Callable[[Path, st.DataObject], None]] = {
    "truncate": _truncate,
    "flip": _flip,
    "set_field": _set_field,
    "junk": _junk,
    "dir": _replace_by_dir,
    "symlink": _replace_by_symlink,
    "delete": _delete,
}

#: Field changes are the likeliest to reach code that trusts a value: drawn most often.
KINDS_OF_DAMAGE = ["set_field", "set_field", "set_field", *sorted(CORRUPTIONS)]


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root``: file bytes (digest), link targets, directories."""
    seen: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            seen[key] = ("link", os.readlink(path))
        elif path.is_dir():
            seen[key] = ("dir",)
        else:
            seen[key] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return seen


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_corrupted_logs_never_crash_the_report_nor_change(pristine: Path, data: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="nvrx-corrupt-") as tmp:
        job_dir = Path(tmp) / JOB
        shutil.copytree(pristine, job_dir)
        files = _files(job_dir)
        for _ in range(data.draw(st.integers(1, 5), label="corruptions")):
            name = data.draw(st.sampled_from(KINDS_OF_DAMAGE), label="corruption")
            path = data.draw(st.sampled_from(files), label="file")
            if path.is_file() and not path.is_symlink():
                CORRUPTIONS[name](path, data)
        fmt = data.draw(st.sampled_from(["table", "json", "markdown"]), label="format")
        before = _snapshot(Path(tmp))
        code, out, err = _run_cli([str(job_dir), "--no-sacct", "--format", fmt, "--workers", "1"])
        assert _snapshot(Path(tmp)) == before, "the report changed its input"
        assert code in (0, 2), (code, err)
        assert "Traceback (most recent call last)" not in err
        if code == 2:
            assert err.startswith("nvrx-report: ") and out == ""
        elif fmt == "json":
            json.loads(out)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wall", "1e308"),
        ("wall", '"2024-01-01"'),
        ("rank", '"abc"'),
        ("pid", "-5"),
        ("mono", "NaN"),
        ("mono", "Infinity"),
        ("node", "true"),
        ("round", "1" + "0" * 400),
        ("host", "[1]"),
    ],
)
def test_an_event_with_an_impossible_common_field_is_skipped_and_counted(
    pristine: Path, tmp_path: Path, field: str, value: str
) -> None:
    job_dir = tmp_path / JOB
    shutil.copytree(pristine, job_dir)
    victim = next(p for p in _files(job_dir) if p.name.startswith("supervisor-"))
    lines = victim.read_bytes().split(b"\n")
    event = json.loads(lines[1])
    event[field] = "@@VALUE@@"
    lines[1] = json.dumps(event).replace('"@@VALUE@@"', value).encode()
    victim.write_bytes(b"\n".join(lines))
    # The fast path and the tolerant reader agree: one line skipped, naming the field.
    fast, slow = ReadStats(), ReadStats()
    assert read_events(victim, fast) == list(iter_file(victim, slow))
    assert fast.skipped == slow.skipped and len(fast.skipped) == 1
    assert fast.skipped[0].line == 2 and repr(field) in fast.skipped[0].reason
    report = build_report(job_dir, sacct=False)
    assert report.reading.skipped_count == 1
    assert f"bad common field {field!r}" in report.to_text("table", width=None)


def test_cli_on_a_corrupted_copy_in_a_subprocess(pristine: Path, tmp_path: Path) -> None:
    """The installed entry point, as CI runs it: exit 0, no traceback, logs untouched."""
    job_dir = tmp_path / JOB
    shutil.copytree(pristine, job_dir)
    files = _files(job_dir)
    with open(files[0], "ab") as fh:
        fh.write(b'{"v":1,"kind":"fault","wall":1e308,"mono":1.0,"pid":1,"rank":"abc"}\n')
        fh.write(b'{"v":1,"kind":"round_start","wall":"x","round":2}\n')
    files[1].unlink()
    files[1].symlink_to(files[1])
    before = _snapshot(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.report.cli", str(job_dir), "--no-sacct", "--width", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert _snapshot(tmp_path) == before
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "bad common field 'wall'" in done.stdout


def _event(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    event = {"v": 1, "kind": kind, "wall": 1_700_000_000.0 + t, "mono": 100.0 + t, "boot": "b"}
    event.update(host="h1", pid=42, component="wrapper", job=JOB, node=0, rank=0, round=0)
    event.update(fields)
    return event


def _small_job(job_dir: Path, fields: dict[str, Any]) -> None:
    """A supervised rank that faults, hangs and is killed, with ``fields`` on each of its events."""
    job_dir.mkdir(parents=True)
    sup = dict(component="supervisor", pid=7, rank=None, round=None)
    rank = [
        _event("round_start", 1.0, world_size=1),
        _event("call_start", 1.1),
        _event("fault", 5.0, fault_kind="exception", exc_type="ValueError"),
        _event("hang", 6.0, timeout="soft", component="monitor"),
        _event("fault", 7.0, fault_kind="dead", component="monitor"),
    ]
    node = [
        _event("supervisor_start", 0.0, nproc_per_node=1, **sup),
        _event("child_exit", 8.0, local_rank=0, child_pid=42, signal="SIGKILL", **sup),
        _event("restart_decision", 8.1, local_rank=0, decision="restart", **sup),
        _event("supervisor_end", 9.0, exit_code=1, reason="x", **sup),
    ]
    for name, events in (("wrapper-n0-p42-a.jsonl", rank), ("supervisor-n0-p7-a.jsonl", node)):
        lines = [json.dumps({**e, **fields}, ensure_ascii=False) for e in events]
        (job_dir / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fields=st.dictionaries(
        st.sampled_from(TEXT_FIELDS),
        st.text(max_size=60)
        | st.sampled_from(["exit:\u00b2", "a**b", "[", "Err@f.py:\u00b2", BIG_LINE_TB, "*"]),
        max_size=4,
    )
)
def test_fuzzed_text_fields_never_crash_the_report(fields: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="nvrx-text-") as tmp:
        job_dir = Path(tmp) / JOB
        _small_job(job_dir, fields)
        (Path(tmp) / f"slurm-{JOB}.out").write_text("srun: error: h1: task 0: Killed\n")
        for fmt in ("table", "json", "markdown"):
            code, out, err = _run_cli([str(job_dir), "--no-sacct", "--format", fmt])
            assert code in (0, 2), (code, err)
            if code == 0 and fmt == "json":
                json.loads(out)


def test_a_line_nested_too_deep_is_skipped_like_malformed_json(tmp_path: Path) -> None:
    job_dir = tmp_path / JOB
    _small_job(job_dir, {})
    victim = job_dir / "wrapper-n0-p42-a.jsonl"
    with open(victim, "a") as fh:
        fh.write('{"v":1,"kind":"progress","wall":1.0,"mono":1.0,"pid":1,"a":' + DEEP + "}\n")
        fh.write(DEEP + "\n")
    fast, slow = ReadStats(), ReadStats()
    assert read_events(victim, fast) == list(iter_file(victim, slow)) != []
    assert (
        [s.reason for s in fast.skipped]
        == ["malformed line"] * 2
        == [s.reason for s in slow.skipped]
    )
    with open(victim, "a") as fh:
        fh.write(DEEP[:7000])  # and torn
    report = build_report(job_dir, sacct=False, workers=1)
    assert report.reading.skipped_count == 3
    assert "torn last line" in {s["reason"] for s in report.reading.skipped}


@pytest.mark.parametrize("job", ["a**b", "[", "*", "7*", "a/b"])
def test_a_job_id_that_looks_like_a_glob_matches_only_its_own_output_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: str
) -> None:
    monkeypatch.chdir(tmp_path)
    job_dir = tmp_path / "logs" / "j"
    _small_job(job_dir, {"job": job})
    (tmp_path / f"slurm-{JOB}.out").write_text("srun: error: h9: task 3: Killed\n")  # job 777
    report = build_report(job_dir, sacct=False, workers=1)
    assert report.summary.job == job
    assert report.slurm.output_files == []
    assert report.log_findings == []


#: Pieces of what output files hold, for the scanner's fuzzing to combine with any text.
OUTPUT_PIECES = [
    "Traceback (most recent call last):",
    '  File "/home/u/train.py", line 3, in f',
    '  File "/home/u/train.py", line ' + "9" * 5000 + ", in f",
    "ValueError: boom",
    "Epoch: 3 loss 0.5",
    "During handling of the above exception, another exception occurred:",
    "Thread 0x00007f1c2a5fe700 (most recent call first):",
    "Timeout (0:01:00)!",
    "srun: error: n1: tasks 0-999999999999: Killed",
    "srun: error: n1: task 3: Exited with exit code " + "9" * 5000,
    "srun: error: n1: task 1: Out Of Memory",
    "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=7.0",
    "*** JOB 7 ON n1 CANCELLED AT 2024-01-01T00:00:00 DUE TO TIME LIMIT ***",
    "Fatal Python error: Segmentation fault",
    "9" * 5000 + ": hello",
    "[rank" + "9" * 5000 + "]: hello",
    "3: ",
    "[rank2]:",
]
_OUTPUT_LINE = st.text() | st.sampled_from(OUTPUT_PIECES)


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(
        st.tuples(st.sampled_from(["", "0: ", "12: ", "[rank1]:", "  "]), _OUTPUT_LINE), max_size=40
    ),
    task=st.none() | st.integers(0, 8),
)
def test_the_output_scanner_reads_any_text(lines: list[tuple[str, str]], task: int | None) -> None:
    """Any output file: items come out, and judging them against some events never fails."""
    text = [prefix + line + "\n" for prefix, line in lines]
    items = list(scan_lines(text, "slurm-7.out", task))
    for item in items:
        assert 0 < item.line <= len(text) + 1 and len(item.srun_tasks) <= 4096
    facts = EventFacts(
        deaths=[Death(1, 0, "n1", "exit code 1"), Death(None, None, None, "vanished")],
        killed=[Death(3, 1, "n2", "signal SIGKILL")],
        supervised=task is None,
        node_hosts={0: "n1", 1: "n2"},
        supervisor_exits={0: {0: {1}}},
        lost_slots={1: {0}},
        slot_hosts={(0, 1): {"n2"}},
        fault_ended_ranks={2},
        slurm_causes={"time_limit"},
    )
    triage(items, facts)
