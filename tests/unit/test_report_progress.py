"""``nvrx-report`` tells a terminal how far it has read, and nothing else."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from nvrx.events.writer import EventWriter
from nvrx.report import build_report
from nvrx.report import progress as progress_module
from nvrx.report.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _job(tmp_path: Path, files: int) -> Path:
    job = tmp_path / "j"
    for rank in range(files):
        writer = EventWriter(job, "app", {"job": "j", "node": 0, "rank": rank, "round": 0})
        writer.emit("call_start")
        writer.emit("call_end", duration_s=1.0, outcome="completed")
        writer.close()
    return job


def test_a_terminal_sees_the_files_read_and_a_cleared_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_module, "EVERY_S", 0.0)  # every piece read is shown
    job = _job(tmp_path, 150)
    screen = _Terminal()
    report = build_report(job, sacct=False, workers=1, progress=screen)
    assert report.reading.files == 150
    lines = screen.getvalue().split("\r")
    assert "nvrx-report: read 64/150 event files" in lines
    assert "nvrx-report: read 150/150 event files" in lines
    assert screen.getvalue().endswith("\r\033[K")  # cleared before the report is printed


def test_progress_lines_count_up_to_the_total() -> None:
    screen = _Terminal()
    progress = Progress(10, screen, every_s=0.0)
    for _ in range(10):
        progress.advance(1)
    progress.finish()
    lines = screen.getvalue().split("\r")
    assert "nvrx-report: read 1/10 event files" in lines
    assert "nvrx-report: read 10/10 event files" in lines
    assert screen.getvalue().endswith("\r\033[K")


def test_nothing_is_written_where_no_terminal_reads(tmp_path: Path) -> None:
    pipe = io.StringIO()
    progress = Progress(10, pipe, every_s=0.0)
    progress.advance(10)
    progress.finish()
    assert pipe.getvalue() == ""
    build_report(_job(tmp_path, 3), sacct=False, workers=1, progress=pipe)
    assert pipe.getvalue() == ""
