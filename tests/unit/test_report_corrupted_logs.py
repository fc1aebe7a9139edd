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

COMMON = ["v", "kind", "wall", "mono", "boot", "host", "pid", "component", "job", "node", "rank"]
OWN = ["round", "fault_kind", "exit_code", "signal", "world_size", "duration_s", "local_rank"]
OWN += ["child_pid", "runtime_s", "restart_latency_s", "traceback", "ranks", "outcome", "count"]
# Values as JSON text, so that what json.dumps cannot write (NaN, huge integers) is written too.
ODD_VALUES = [
    "1e308", "-1e308", "NaN", "Infinity", "-Infinity", "-1", "0", "1e400", "-0.0",
    "1" + "0" * 400, "-" + "9" * 30, '"abc"', '""', "true", "false", "null", "[]", "[1,2]",
    '{"a":1}', '"\\u0000"', "2.5", "4294967296", '"1700000000"', '"SIGKILL"',
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
    except ValueError:
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
    assert f"bad common field {field!r}" in report.to_text("table")


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
        [sys.executable, "-m", "nvrx.report.cli", str(job_dir), "--no-sacct"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert _snapshot(tmp_path) == before
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "bad common field 'wall'" in done.stdout
