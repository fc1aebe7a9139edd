"""The text report's first screen gives the answer (outcome, each fault in time order, the
exclusion advice with its evidence), every line fits a terminal, and each stack is printed
once, the user's stuck thread first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from test_report_fixtures import HANG_STACK, JOB, write_standard_job
from test_report_html import _evil_job, _requeued_job
from test_report_job_restarts import _plain_job
from test_report_node_loss import _faults_in_turn, _spare_job
from test_report_vocabulary import _demo_like_job

from nvrx.report import Report, build_report
from nvrx.report.cli import main
from nvrx.report.failure_order import causes_first
from nvrx.report.model import Failure
from nvrx.report.render_answer import FAILED, OK, UNFINISHED, fault_lines, verdict
from nvrx.report.stacks import stuck_first
from nvrx.report.text_doc import TEXT_WIDTH, when

#: Lines of a terminal's first screen.
SCREEN_LINES = 25


def _standard(log_dir: Path) -> Report:
    write_standard_job(log_dir)
    return build_report(log_dir, job=JOB, sacct=False)


def _built(write: Callable[[Path], None]) -> Callable[[Path], Report]:
    def build(log_dir: Path) -> Report:
        write(log_dir)
        return build_report(log_dir, sacct=False)

    return build


JOBS: dict[str, Callable[[Path], Report]] = {
    "standard": _standard,
    "demo_like": _built(_demo_like_job),
    "evil": _built(_evil_job),
    "requeued": _built(_requeued_job),
    "plain_restart": _built(lambda d: _plain_job(d, True)),
    "spare": lambda d: _spare_job(d, {0: "node-a", 1: "node-b", 2: "node-c"}),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_line_of_the_table_report_fits_120_columns(name: str, tmp_path: Path) -> None:
    report = JOBS[name](tmp_path / "job")
    text = report.to_text("table")
    wide = [line for line in text.splitlines() if len(line) > TEXT_WIDTH]
    assert wide == [], "\n".join(wide)
    # unfitted, some of these reports are wider: the fitting is what keeps them in
    assert report.to_text("table", width=None).count("\n") <= text.count("\n")


def test_the_cli_fits_its_lines_and_width_0_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_standard_job(tmp_path)
    assert main([str(tmp_path), "--no-sacct"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= TEXT_WIDTH
    assert main([str(tmp_path), "--no-sacct", "--width", "0"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) > TEXT_WIDTH
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--no-sacct", "--width", "7"])
    assert "--width must be 0 (no limit) or at least" in capsys.readouterr().err


def _first_screen(report: Report) -> list[str]:
    lines = report.to_text("table").splitlines()
    return lines[: lines.index("Summary")]


def test_the_first_screen_says_the_outcome_each_fault_in_time_order_and_what_to_exclude(
    tmp_path: Path,
) -> None:
    screen = _first_screen(_standard(tmp_path))
    assert len(screen) <= SCREEN_LINES, "\n".join(screen)
    text = "\n".join(screen)
    assert screen[3].startswith("outcome: completed (training completed); 4 ranks on 2 node(s)")
    # one row per fault, in time order: kind, cause, first rank and node, round, recovered, cost
    rows = [line.split() for line in screen if line[:1].isdigit()]
    assert [row[:3] for row in rows] == [
        ["1", "22:13:30.000", "exception"],
        ["2", "22:13:37.100", "signal"],  # the SIGKILL came at 17.1 s (node-a 3 s behind)
        ["3", "22:14:05.000", "hang"],
    ]
    assert "ValueError at" in next(x for x in screen if x.startswith("1  "))
    assert all("yes" in row for row in rows)  # each was recovered from
    assert "rank 2 on node-b" in text and "rank 1 on node-a" in text and "rank 3 on node-b" in text
    assert "exclude next time: --exclude=node-b" in text
    evidence = next(line for line in screen if line.startswith("  node-b (node 1): "))
    assert "ValueError at train.py:12 in step" in evidence


def test_the_first_screen_lists_at_most_12_faults_and_the_sections_below_have_them_all(
    tmp_path: Path,
) -> None:
    """docs/report.md: "At most 12 rows; the sections below have them all": 14 rounds, each
    ended by a fault of its own, give the first 12 rows in time order and say 2 more are
    below, where the restart timeline has all 14."""
    report = _faults_in_turn(tmp_path / "job", [f"bad value {i}" for i in range(14)])
    lines = report.to_text("table", width=None).splitlines()
    screen = lines[: lines.index("Summary")]
    assert "faults, in time order (first 12; 2 more below):" in screen
    rows = [line.split() for line in screen if line[:1].isdigit()]
    assert [row[0] for row in rows] == [str(i) for i in range(1, 13)]
    rounds = [row[row.index("(node") + 2] for row in rows]  # the column after the node
    assert rounds == [str(rnd) for rnd in range(12)]  # the first 12, in time order
    timeline = lines[lines.index("Restart timeline") : lines.index("Failures by signature")]
    told = [line.split()[0] for line in timeline if "RuntimeError at train.py:40" in line]
    assert told == [str(rnd) for rnd in range(14)]
    # 12 faults fit with nothing said of more
    few = _faults_in_turn(tmp_path / "few", [f"bad value {i}" for i in range(12)])
    text = few.to_text("table", width=None)
    assert "faults, in time order:" in text and "more below" not in text
    assert "\n12  " in text


def test_each_fault_row_gives_the_time_its_fault_was_told_in_its_round(tmp_path: Path) -> None:
    """The same error in three rounds: each row of the first screen has the time of that
    round's fault (3 s into it), not only the first one's, nor the round's end."""
    report = _faults_in_turn(tmp_path / "job", ["bad value"] * 3)
    rows = [t for t in report.timeline if t.cause]
    assert len(rows) == 3
    assert [t.first_wall - t.start_wall for t in rows] == pytest.approx([3.0] * 3)
    text = report.to_text("table", width=None)
    screen = text[: text.index("\nSummary")]
    clock = [when(t.first_wall).split()[-1] for t in rows]  # the screen gives the time of day
    ends = [when(t.end_wall).split()[-1] for t in rows]
    assert all(c in screen for c in clock) and not any(e in screen for e in ends), screen


def test_a_round_no_event_started_claims_no_earlier_process_end(tmp_path: Path) -> None:
    """A job-wide restart still under way when the events end is a round without a start:
    it holds no time, so the processes that failed in the rounds before it are not its."""
    report = _standard(tmp_path / JOB)
    (killed,) = [p for p in report.process_restarts if p.signal == "SIGKILL"]
    last = report.timeline[-1]
    report.timeline.append(
        dataclasses.replace(last, round=last.round + 1, start_wall=None, end_wall=None, cause=None,
                            outcome="unfinished", first_rank=None, first_wall=None)
    )  # fmt: skip
    lines = [x for x in fault_lines(report) if x.wall == killed.wall]
    assert [(x.cause, x.round) for x in lines] == [("signal SIGKILL", "1")], lines


def test_a_failed_job_says_so_first(tmp_path: Path) -> None:
    report = _standard(tmp_path)
    report.summary = dataclasses.replace(
        report.summary, outcome="failed (exit code 4)", reason="restart budget exhausted"
    )
    screen = _first_screen(report)
    assert screen[3].startswith("outcome: FAILED: failed (exit code 4) (restart budget exhausted)")
    summary = report.summary
    assert verdict(summary) == FAILED
    assert verdict(dataclasses.replace(summary, outcome="COMPLETED (sacct, exit 0:0)")) == OK
    assert verdict(dataclasses.replace(summary, outcome="unknown")) == UNFINISHED


@pytest.mark.parametrize("code", [75, 144], ids=["slurm", "submitit-local"])
def test_a_run_that_ended_requeued_is_not_finished_not_failed(tmp_path: Path, code: int) -> None:
    """SLURM warned, the ranks checkpointed and the job was requeued (every supervisor exits
    75; 144 under submitit's local executor): read from the events alone (no sacct), the job
    has not ended, nor failed."""
    from test_report_fixtures import Host, Proc

    reason = "SLURM sent SIGUSR1 (time limit): checkpointed and requeued"
    for node in (0, 1):
        sup = Proc(tmp_path / "job", Host(f"n{node}", node), "supervisor")
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=1, command=["train.py"])
        sup.at(1.0, "child_start", local_rank=0, child_pid=100, global_rank=node, attempt=0)
        sup.at(30.0, "job_stop", reason=reason, exit_code=code)
        sup.at(31.0, "child_exit", local_rank=0, child_pid=100, global_rank=node, exit_code=0,
               signal=None, runtime_s=30.0, attempt=0)  # fmt: skip
        sup.at(32.0, "supervisor_end", exit_code=code, reason=reason)
        sup.close()
    report = build_report(tmp_path / "job", sacct=False)
    assert report.summary.outcome == f"requeued (exit code {code})"
    assert verdict(report.summary) == UNFINISHED
    assert _first_screen(report)[3].startswith(f"outcome: NOT FINISHED: requeued (exit code {code}) ({reason})")


def test_a_follow_on_fault_comes_after_its_cause_even_when_written_before_it(
    tmp_path: Path,
) -> None:
    report = _standard(tmp_path)
    root = next(f for f in report.failures if f.signature.startswith("ValueError"))
    assert root.first_wall is not None
    peer = Failure(
        signature="torch.distributed.DistBackendError at train.py:40 in sync",
        category="exception", count=1, ranks=[0], nodes=[0], hosts=["node-a"], rounds=[0],
        first_wall=root.first_wall - 0.5, exc_type="torch.distributed.DistBackendError",
        message="Connection reset by peer", traceback=None, source="events",
    )  # fmt: skip
    report.failures.insert(0, peer)
    ordered = [f.signature for f in causes_first(report)]
    assert ordered.index(root.signature) < ordered.index(peer.signature)
    assert ordered[0] == root.signature  # the round's cause is the first row
    section = report.to_text("table", width=None).split("Failures by signature")[1]
    line = next(x for x in section.splitlines() if x.startswith(peer.signature))
    assert "exception (follow-on)" in line


def test_a_hangs_stack_is_printed_once(tmp_path: Path) -> None:
    text = _standard(tmp_path).to_text("table")
    assert text.count("line 55 in all_reduce_grads") == 1
    assert "[hang (soft timeout)]: its stack is under Hangs" in text


NVRX_FIRST = (
    "Thread 0x0001 (most recent call first):\n"
    '  File "/venv/lib/python3.11/site-packages/nvrx/inprocess/monitor_thread.py", line 80 in run\n'
    '  File "/usr/lib/python3.11/threading.py", line 1010 in _bootstrap_inner\n'
    "\n"
    "Thread 0x0002 (most recent call first):\n"
    '  File "/venv/lib/python3.11/site-packages/nvrx/fault_tolerance/heartbeat.py", line 9 in beat\n'
    "\n"
    "Current thread 0x0003 (most recent call first):\n"
    '  File "/venv/lib/python3.11/site-packages/nvrx/inprocess/wrap.py", line 120 in run\n'
    '  File "/home/u/train.py", line 55 in all_reduce_grads\n'
)


def test_the_stuck_user_thread_comes_before_nvrxs_own_threads() -> None:
    lines = stuck_first(NVRX_FIRST).splitlines()
    assert lines[0] == "Current thread 0x0003 (most recent call first):"
    assert [x for x in lines if x.startswith(("Thread", "Current"))] == [
        "Current thread 0x0003 (most recent call first):",
        "Thread 0x0001 (most recent call first):",
        "Thread 0x0002 (most recent call first):",
    ]
    assert sorted(lines) == sorted(NVRX_FIRST.splitlines())  # nothing lost, nothing added
    assert stuck_first(HANG_STACK) == HANG_STACK  # one thread: as it was
