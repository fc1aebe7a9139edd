"""``nvrx.atomic_file.replace_file``: a reader sees the old file or the whole new one, never
half of one; a failed write leaves the target as it was and no temporary file behind."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from nvrx.atomic_file import replace_file


def test_text_and_bytes_replace_the_file_and_parents_are_made(tmp_path) -> None:
    target = tmp_path / "a" / "b" / "store.json"
    assert replace_file(target, '{"port": 1}') == target
    assert target.read_text() == '{"port": 1}'
    replace_file(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in target.parent.iterdir()) == ["store.json"]


def test_a_missing_directory_is_an_error_when_parents_are_not_to_be_made(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        replace_file(tmp_path / "gone" / "leader.json", "{}", make_parents=False)
    assert not (tmp_path / "gone").exists()


def test_a_failed_rename_leaves_the_target_and_no_temporary_file(tmp_path) -> None:
    target = tmp_path / "result.pkl"
    target.mkdir()  # a directory in the way: the rename fails
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        replace_file(target, b"new")
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.pkl"]


def _write_many(path: str, writer: int, times: int) -> None:
    for i in range(times):
        replace_file(path, f"{writer}:{i}:" + "x" * 50_000 + ":end")


def test_racing_writers_never_show_a_reader_half_a_file(tmp_path) -> None:
    target = tmp_path / "ledger.json"
    replace_file(target, "0:0:" + "x" * 50_000 + ":end")
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_many, args=(str(target), w, 200)) for w in range(3)]
    for proc in writers:
        proc.start()
    reads = 0
    while any(proc.is_alive() for proc in writers) or reads == 0:
        text = target.read_text()
        assert text.endswith(":end") and len(text.split(":")[2]) == 50_000, text[:40]
        reads += 1
    for proc in writers:
        proc.join()
        assert proc.exitcode == 0
    assert reads > 0
    assert sorted(os.listdir(tmp_path)) == ["ledger.json"]  # every temporary file renamed
