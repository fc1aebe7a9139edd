"""The event writer and reader: schema fields, one file per process, crash safety, tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from nvrx import events
from nvrx.events import EventWriter, iter_file, job_log_dir, read_dir
from nvrx.events.reader import event_files


def test_event_has_common_fields_and_context(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path, "wrapper", {"job": "42", "node": 1, "rank": 3, "round": 0})
    writer.emit("round_start", world_size=4)
    writer.update(round=1, rank=2)
    writer.emit("fault", fault_kind="exception", exc_type="ValueError")
    got, stats = read_dir(tmp_path)
    assert stats.skipped == [] and stats.events == 2
    first, second = got
    for field in events.COMMON_FIELDS:
        assert field in first, field
    assert first["kind"] == "round_start" and first["world_size"] == 4
    assert (first["job"], first["node"], first["rank"], first["round"]) == ("42", 1, 3, 0)
    assert (second["rank"], second["round"]) == (2, 1)
    assert second["mono"] >= first["mono"]
    assert first["pid"] == os.getpid() and first["v"] == events.SCHEMA_VERSION


def test_events_are_written_whatever_logging_is_set_to(tmp_path: Path) -> None:
    """Events are not log records: with every log level off, and a handler on the root logger
    that fails on any record, each event is written, and nothing reaches the handler."""
    import logging

    class Refuse(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise AssertionError(f"an event went through logging: {record.getMessage()}")

    refuse = Refuse(level=logging.NOTSET)
    root = logging.getLogger()
    root.addHandler(refuse)
    logging.disable(logging.CRITICAL)
    try:
        writer = EventWriter(tmp_path, "wrapper", {"job": "7"})
        writer.emit("round_start", world_size=2)
        writer.emit("fault", fault_kind="exception")
    finally:
        logging.disable(logging.NOTSET)
        root.removeHandler(refuse)
    got, _ = read_dir(tmp_path)
    assert [e["kind"] for e in got] == ["round_start", "fault"]
    writer = EventWriter(tmp_path / "loud", "wrapper", {"job": "7"})
    level = root.level
    root.addHandler(refuse)
    root.setLevel(logging.DEBUG)
    try:
        writer.emit("round_start", world_size=2)  # every level on: still not a record
    finally:
        root.setLevel(level)
        root.removeHandler(refuse)


def test_unserializable_field_is_written_as_text(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path, "app", {"job": "j"})
    writer.emit("progress", step=object.__new__(object), path=tmp_path)
    (event,), _ = read_dir(tmp_path)
    assert event["path"] == str(tmp_path)
    assert event["step"].startswith("<object")


def test_event_written_right_before_a_crash_is_kept(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os
        from nvrx.events import EventWriter
        w = EventWriter({str(tmp_path)!r}, "app", {{"job": "crash"}})
        for i in range(50):
            w.emit("progress", step=i)
        os._exit(9)  # no flush, no atexit: only what each emit wrote survives
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 9
    got, stats = read_dir(tmp_path)
    assert [e["step"] for e in got] == list(range(50))


def test_forked_child_writes_its_own_file(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path, "supervisor", {"job": "f"})
    writer.emit("process_start")
    pid = os.fork()
    if pid == 0:
        try:
            writer.emit("child_start", local_rank=0)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) == 2
    pids = {json.loads(f.read_text().splitlines()[0])["pid"] for f in files}
    assert pids == {os.getpid(), pid}


def test_concurrent_emits_never_interleave(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path, "app", {"job": "t"})

    def work(n: int) -> None:
        for i in range(200):
            writer.emit("progress", step=i, thread=n, pad="x" * 500)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got, stats = read_dir(tmp_path)
    assert stats.skipped == [] and len(got) == 800


def test_reader_tolerates_torn_garbage_merged_and_unknown(tmp_path: Path) -> None:
    good = {"v": 1, "kind": "progress", "wall": 1.0, "mono": 1.0, "step": 1}
    newer = {"v": 2, "kind": "from_the_future", "wall": 2.0}
    lines = [
        json.dumps(good),
        "not json at all",
        json.dumps(good) + json.dumps(newer),  # two writers ran together on one line
        json.dumps([1, 2, 3]),
        '{"kind": "progress", "wall": 3.0, "st',  # torn last line, no newline
    ]
    path = tmp_path / "app-n0-p1-x.jsonl"
    path.write_text("\n".join(lines))
    before = path.read_bytes()
    stats = events.ReadStats()
    got = list(iter_file(path, stats))
    assert [e["kind"] for e in got] == ["progress", "progress", "from_the_future"]
    reasons = sorted((s.line, s.reason) for s in stats.skipped)
    assert reasons == [(2, "malformed line"), (4, "not an event object"), (5, "torn last line")]
    assert stats.unknown_kinds == {"from_the_future": 1}
    assert path.read_bytes() == before  # reading never modifies logs


def test_reader_reports_unreadable_file(tmp_path: Path) -> None:
    stats = events.ReadStats()
    assert list(iter_file(tmp_path / "missing.jsonl", stats)) == []
    assert stats.skipped[0].reason.startswith("unreadable")


def test_log_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "77"}
    assert job_log_dir(env=env) == Path("nvrx_logs").absolute() / "77"
    env = {"SLURM_JOB_ID": "77", "NVRX_JOB_ID": "local-1", "NVRX_LOG_DIR": str(tmp_path)}
    assert job_log_dir(env=env) == tmp_path / "local-1"


def test_write_failure_is_counted_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    writer = EventWriter(blocker / "sub", "app", {"job": "j"})  # parent is a file
    event = writer.emit("progress", step=1)
    assert event["kind"] == "progress" and writer.dropped == 1


def test_an_event_after_a_write_that_failed_part_way_starts_a_line_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills after 20 bytes of an event: that event is lost, torn; the next one
    is read back whole, not joined to the torn line."""
    real_write, calls = os.write, []

    def full_after_20_bytes(fd: int, data) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:20]))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    writer = EventWriter(tmp_path, "supervisor", {"job": "j"})
    writer.emit("supervisor_start", nnodes=1)  # opens the file: the failing write is the next
    monkeypatch.setattr(os, "write", full_after_20_bytes)
    writer.emit("child_exit", exit_code=1)
    writer.emit("supervisor_end", exit_code=1, reason="failed")
    monkeypatch.undo()
    writer.close()
    events, skipped = read_dir(tmp_path)
    assert [e["kind"] for e in events] == ["supervisor_start", "supervisor_end"]
    assert writer.dropped == 1 and len(skipped.skipped) == 1  # the torn line


def test_fsync_after_each_event_only_where_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NVRX_EVENTS_FSYNC=1`` flushes each event to the disk (to survive a crash of the
    host, not only of the process); by default the kernel's page cache holds it."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    monkeypatch.delenv("NVRX_EVENTS_FSYNC", raising=False)
    EventWriter(tmp_path / "plain", "test").emit("job_start")
    assert synced == []
    monkeypatch.setenv("NVRX_EVENTS_FSYNC", "1")
    writer = EventWriter(tmp_path / "synced", "test")
    writer.emit("job_start")
    writer.emit("job_end")
    assert len(synced) == 2
    assert [e["kind"] for e in read_dir(tmp_path / "synced")[0]] == ["job_start", "job_end"]


def test_a_folder_that_vanished_while_listed_is_not_taken_for_one_this_user_may_not_read(
    tmp_path: Path,
) -> None:
    """A rank's empty attempt folder is removed while a report lists the job: nothing was
    in it, and no permission is missing."""
    unlisted: list[Path] = []
    assert event_files(tmp_path / "gone", unlisted) == [] and unlisted == []


@pytest.mark.parametrize(
    ("env", "run"),
    [
        ({"SLURM_JOB_ID": "9"}, 0),  # SLURM sets no SLURM_RESTART_COUNT on the first run
        ({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "0"}, 0),
        ({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "2"}, 2),
        ({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "two"}, None),
        ({"SLURM_RESTART_COUNT": "2"}, None),  # not in a SLURM job: no run of one
        ({}, None),
    ],
)
def test_the_event_context_records_the_run_of_the_slurm_job(env: dict[str, str], run: int | None) -> None:
    assert events.context_from_env(env)["slurm_run"] == run


def test_supervisors_and_their_ranks_record_the_slurm_run_they_run_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor's writer (``configure``, as ``Supervisor.run`` sets it up) and a rank's
    (its context read from the environment its supervisor gives it, as the Wrapper, its
    monitor and the node agent read theirs) stamp ``slurm_run`` on every event."""
    from nvrx.events import writer as writer_module
    from nvrx.jobenv import JobEnv

    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    monkeypatch.setattr(writer_module, "_default", None)  # this process's writer is restored after
    supervisor = events.configure("supervisor", tmp_path / "s", job="9", node=0, rank=None, round=None)
    supervisor.emit("supervisor_start", nnodes=1)
    supervisor.emit("supervisor_end", exit_code=0)
    supervisor.close()
    child_env = JobEnv(job_id="9", log_dir=str(tmp_path)).child_env(0, restart_count=0)
    rank = EventWriter(tmp_path / "r", "wrapper", dict(events.context_from_env(child_env), rank=0))
    rank.emit("round_start", world_size=1)
    rank.close()
    written = [e for d in ("s", "r") for e in read_dir(tmp_path / d)[0]]
    assert [(e["kind"], e["slurm_run"]) for e in written] == [
        ("supervisor_start", 3), ("supervisor_end", 3), ("round_start", 3),
    ]  # fmt: skip
