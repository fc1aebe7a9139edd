"""Reading damaged event files: the tolerant reader and the report's fast path agree, and skip loudly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nvrx.events import EventWriter, ReadStats, iter_file
from nvrx.report.loading import read_events


def _good_file(tmp_path: Path, n: int = 5) -> Path:
    w = EventWriter(tmp_path, "wrapper", {"job": "1", "node": 0, "rank": 0, "round": 0})
    for i in range(n):
        w.emit(
            "progress", step=i, text="line\nbreak \u00e9"
        )  # newline inside a string stays escaped
    w.close()
    assert w.path is not None
    return w.path


def _both(path: Path) -> tuple[list[dict], ReadStats, list[dict], ReadStats]:
    slow_stats, fast_stats = ReadStats(), ReadStats()
    slow = list(iter_file(path, slow_stats))
    fast = read_events(path, fast_stats)
    return slow, slow_stats, fast, fast_stats


def _same(slow_stats: ReadStats, fast_stats: ReadStats) -> None:
    assert (slow_stats.files, slow_stats.events, slow_stats.unknown_kinds, slow_stats.skipped) == (
        fast_stats.files,
        fast_stats.events,
        fast_stats.unknown_kinds,
        fast_stats.skipped,
    )


def test_well_formed_file_fast_path_equals_reader(tmp_path: Path) -> None:
    path = _good_file(tmp_path)
    slow, slow_stats, fast, fast_stats = _both(path)
    assert fast == slow and [e["step"] for e in fast] == [0, 1, 2, 3, 4]
    assert fast[0]["text"] == "line\nbreak \u00e9"
    _same(slow_stats, fast_stats)


@pytest.mark.parametrize(
    ("tail", "skipped"),
    [
        (b'{"v":1,"kind":"progress","wa', [(6, "torn last line")]),
        (b"\x00\x00\x00\n", [(6, "malformed line")]),
        (b"not json at all\n\n", [(6, "malformed line")]),
        (b'"just a string"\n', [(6, "not an event object")]),
        (b'{"v":1,"no_kind":true}\n', [(6, "not an event object")]),
        (b'{"v":1,"kind":"progress","step":9}{"v":1,"kind":"progress","step":10}\n', []),
        (b'{"v":9,"kind":"from_the_future","x":1}\n', []),
    ],
)
def test_damaged_tail_read_the_same_by_both(
    tmp_path: Path, tail: bytes, skipped: list[tuple[int, str]]
) -> None:
    path = _good_file(tmp_path)
    with open(path, "ab") as fh:
        fh.write(tail)
    before = path.read_bytes()
    slow, slow_stats, fast, fast_stats = _both(path)
    assert path.read_bytes() == before
    assert fast == slow
    assert [(s.line, s.reason) for s in fast_stats.skipped] == skipped
    assert len(fast) >= 5
    _same(slow_stats, fast_stats)


def test_unknown_kinds_counted_and_kept(tmp_path: Path) -> None:
    path = _good_file(tmp_path, n=1)
    with open(path, "a") as fh:
        fh.write(json.dumps({"v": 2, "kind": "gpu_thermal", "wall": 1.0}) + "\n")
    stats = ReadStats()
    events = read_events(path, stats)
    assert stats.unknown_kinds == {"gpu_thermal": 1}
    assert [e["kind"] for e in events] == ["progress", "gpu_thermal"]


def test_unreadable_and_empty_files(tmp_path: Path) -> None:
    stats = ReadStats()
    assert read_events(tmp_path / "missing.jsonl", stats) == []
    assert [(s.line, s.reason.split(":")[0]) for s in stats.skipped] == [(0, "unreadable")]
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    stats = ReadStats()
    assert read_events(empty, stats) == [] and stats.files == 1 and not stats.skipped


def test_entries_that_are_not_regular_files_are_skipped_as_unreadable(tmp_path: Path) -> None:
    from nvrx.events import event_files

    good = _good_file(tmp_path, n=1)
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")  # reading it would block forever
    names = [p.name for p in event_files(tmp_path)]
    assert names == sorted(["dangling.jsonl", "dir.jsonl", "fifo.jsonl", "loop.jsonl", good.name])
    fast, slow = ReadStats(), ReadStats()
    for path in event_files(tmp_path):
        assert read_events(path, fast) == list(iter_file(path, slow))
    assert fast.events == 1 and fast.skipped == slow.skipped
    reasons = {Path(s.path).name: s.reason for s in fast.skipped}
    assert reasons["fifo.jsonl"] == "unreadable: not a regular file"
    assert reasons["dir.jsonl"] == "unreadable: not a regular file"
    assert set(reasons) == {"dangling.jsonl", "dir.jsonl", "fifo.jsonl", "loop.jsonl"}
