"""Per-rank output files, tee'd console lines and ``@record`` error files with a real supervisor,
and the report that points at them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from nvrx.report import build_report
from nvrx.supervisor.rank_logs import RankLogs, Std
from nvrx.supervisor.standby import Standbys
from tests.multiproc.test_supervisor_local import Job

pytestmark = pytest.mark.timeout(180)

RECORDED = textwrap.dedent(
    """
    import os, sys
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        rank, restart = os.environ["RANK"], os.environ["NVRX_RESTART_COUNT"]
        print(f"out of rank {rank} start {restart}", flush=True)
        print(f"err of rank {rank} start {restart}", file=sys.stderr, flush=True)
        if rank == "1" and restart == "0":
            raise ValueError("rank 1 gives up")

    main()
    """
)


def test_redirects_tee_filter_and_the_error_file_in_the_report(tmp_path: Path) -> None:
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    # ranks 0 and 1: stderr to files only, stdout to files and (rank 0 only) the console;
    # rank 2: nothing routed, and filtered out of the console: its output goes nowhere
    job = Job(
        tmp_path, 1, 3, [sys.executable, str(script)],
        "--redirects", "0:2,1:2", "--tee", "0:1,1:1", "--local-ranks-filter", "0",
        "--ft-restart-policy", "min-healthy",  # rank 1 restarts alone
    )  # fmt: skip
    assert job.wait(150) == [0], job.output()
    console = job.outputs[0].read_text()
    # tee'd stdout of local rank 0 on the console, prefixed; ranks 1 and 2 are filtered out
    assert "[default0]:out of rank 0 start 0" in console
    assert "err of rank 0" not in console  # stderr: file only
    assert "rank 1" not in console and "rank 2" not in console
    ranks = job.log_dir / job.job_id / "ranks"
    (first,) = (ranks / "rank1").glob("attempt0-*")
    (second,) = (ranks / "rank1").glob("attempt1-*")
    assert (first / "stdout.log").read_text() == "out of rank 1 start 0\n"  # files: no prefix
    stderr = (first / "stderr.log").read_text()
    assert stderr.startswith("err of rank 1 start 0\n") and "ValueError: rank 1 gives up" in stderr
    assert (second / "stdout.log").read_text() == "out of rank 1 start 1\n"
    assert not (second / "error.json").exists()
    message = json.loads((first / "error.json").read_text())["message"]["message"]
    assert message == "ValueError: rank 1 gives up"
    assert not (ranks / "rank2").exists() or not list((ranks / "rank2").iterdir())  # no files
    exits = {(e["global_rank"], e["attempt"]): e.get("error_file") for e in job.events("child_exit")}
    assert exits == {
        (0, 0): None,
        (1, 0): str((first / "error.json").relative_to(job.log_dir / job.job_id)),
        (1, 1): None,
        (2, 0): None,
    }

    report = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job.log_dir / job.job_id), "--no-sacct",
         "--format", "json"], capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = json.loads(report.stdout)
    (failure,) = data["failures"]
    assert failure["signature"] == "ValueError at recorded.py:11 in main"
    assert failure["ranks"] == [1] and "raise ValueError" in failure["traceback"]
    (row,) = data["process_restarts"]
    assert row["error"]["signature"] == failure["signature"]
    assert sorted(row["files"]) == [
        f"ranks/rank1/{first.name}/stderr.log",
        f"ranks/rank1/{first.name}/stdout.log",
    ]
    text = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job.log_dir / job.job_id), "--no-sacct"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "rank 1, ended" in text and f"ranks/rank1/{first.name}/error.json" in text


def test_a_warm_standby_routes_its_output_to_the_rank_it_becomes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\nprint('bye')\n")
    command = [sys.executable, str(script)]
    pool = Standbys(logs=RankLogs(redirects=Std.ERR, tee=Std.OUT))
    assert pool.start(command, [0], dict(os.environ)) == 1
    directory = tmp_path / "rank7"
    directory.mkdir()
    child = pool.spawn(command, 0, 1, {**os.environ, "RANK": "7"}, directory)
    try:
        assert child.warm
        assert child.wait(150) is not None and child.status is not None and child.status.ok
        pool.close_outputs()
        assert not [t for t in threading.enumerate() if t.name.startswith("nvrx-std")]
        assert (directory / "stdout.log").read_text() == "hello from 7\nbye\n"
        assert (directory / "stderr.log").exists()
        out = capfd.readouterr().out
        assert "[default0]:hello from 7\n[default0]:bye\n" in out
    finally:
        child.kill_group()
        pool.discard()


def test_a_cold_child_whose_command_cannot_start_leaves_no_pump(tmp_path: Path) -> None:
    pool = Standbys(enabled=False, logs=RankLogs(tee=Std.ALL))
    with pytest.raises(OSError):
        pool.spawn([str(tmp_path / "missing")], 0, 0, {"RANK": "0"}, tmp_path)
    pool.close_outputs()
    assert not [t for t in threading.enumerate() if t.name.startswith("nvrx-std")]


def test_a_discarded_standby_leaves_no_process_and_no_thread() -> None:
    pool = Standbys(logs=RankLogs(tee=Std.ALL))
    assert pool.start([sys.executable, "train.py"], [0, 1], dict(os.environ)) == 2
    pids = pool.pids()
    pool.discard()
    assert not [t for t in threading.enumerate() if t.name.startswith("nvrx-std")]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_closing_waits_a_bounded_time_for_a_pipe_a_leftover_holds_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child starts a process of its own session (out of reach of its group's kill) that
    keeps its stdout, and exits: the supervisor's wait for that stream's last lines ends at
    ``DRAIN_TIMEOUT_S`` while the leftover still runs, with what the child wrote kept."""
    from nvrx.supervisor import standby

    monkeypatch.setattr(standby, "DRAIN_TIMEOUT_S", 1.0)
    leftover = tmp_path / "leftover.pid"
    script = (
        "import subprocess, sys\n"
        "p = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
        f"open({str(leftover)!r}, 'w').write(str(p.pid))\n"
        "print('last line', flush=True)\n"
    )
    pool = Standbys(enabled=False, logs=RankLogs(redirects=Std.ALL))
    child = pool.spawn([sys.executable, "-c", script], 0, 0, {**os.environ, "RANK": "0"}, tmp_path)
    try:
        assert child.proc.wait(timeout=60) == 0
        pool.close_outputs()
        os.kill(int(leftover.read_text()), 0)  # still there, holding the pipe: not waited for
        assert (tmp_path / "stdout.log").read_text() == "last line\n"
    finally:
        if leftover.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(leftover.read_text()), 9)
    pump = child.output.pumps["stdout"]
    pump._thread.join(60)  # the leftover's end closes the pipe
    assert pump.done()


PLAIN = textwrap.dedent(
    """
    import os

    def step(rank):
        raise RuntimeError(f"rank {rank} cannot go on")

    if os.environ["RANK"] == "1" and os.environ["NVRX_RESTART_COUNT"] == "0":
        step(os.environ["RANK"])
    """
)


def test_a_plain_scripts_traceback_in_its_stderr_log_is_the_cause_in_the_report(
    tmp_path: Path,
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    job = Job(
        tmp_path, 1, 2, [sys.executable, str(script)], "--redirects", "2"
    )  # any rank's failure restarts both: one round of the timeline ends with it
    assert job.wait(150) == [0], job.output()
    job_dir = job.log_dir / job.job_id
    (first,) = (job_dir / "ranks" / "rank1").glob("attempt0-*")
    assert not (first / "error.json").exists()  # no @record: the traceback is only in stderr.log
    signature = "RuntimeError at plain.py:5 in step"
    report = build_report(job_dir, sacct=False)
    (row,) = [p for p in report.process_restarts if p.explained_by is None]
    assert row.error is not None and row.error.source == "stderr"
    assert row.error.path == f"ranks/rank1/{first.name}/stderr.log"
    assert (row.error.signature, row.error.message) == (signature, "rank 1 cannot go on")
    (failure,) = report.failures
    assert failure.signature == signature and failure.ranks == [1]
    assert failure.traceback is not None and 'raise RuntimeError(f"rank {rank}' in failure.traceback
    causes = [(t.cause, t.first_rank, t.fault_kind) for t in report.timeline if t.cause]
    assert causes == [(signature, 1, "exception")], report.to_text("table")
    print(report.to_text("table"))
