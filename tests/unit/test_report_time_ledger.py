"""nvrx-report's training time, goodput and time ledger on cancelled, failed and requeued jobs.

One node, ranks under ``nvrx-supervise``: the supervisor's events name the child
pid, and each rank's events carry that pid (as a real rank's do), so the report can
end a call that never ended when its supervisor saw the process end. Times are
seconds after ``T0``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_report_cli import SCHEMA_PATH, check_schema
from test_report_fixtures import Host, Proc, write_standard_job

from nvrx.report import Report, build_report
from nvrx.report.model import TimeLedger

HOST = Host("node-a", 0)


class Rank:
    """A training process: its events carry its own pid."""

    def __init__(self, log_dir: Path, rank: int, pid: int) -> None:
        self.proc, self.pid = Proc(log_dir, HOST, "wrapper", rank=rank), pid

    def at(self, t: float, kind: str, **fields: Any) -> None:
        self.proc.at(t, kind, pid=self.pid, **fields)


class Node:
    """A supervisor (slot 0) and the processes it starts."""

    def __init__(self, log_dir: Path, t: float = 0.0) -> None:
        self.dir = log_dir
        self.sup = Proc(log_dir, HOST, "supervisor")
        self.sup.at(t, "supervisor_start", nnodes=1, nproc_per_node=1, spare_nodes=0)
        self.procs: list[Proc] = [self.sup]

    def start(self, t: float, pid: int, attempt: int = 0) -> Rank:
        self.sup.at(t, "child_start", local_rank=0, child_pid=pid, attempt=attempt, global_rank=0)
        rank = Rank(self.dir, 0, pid)
        self.procs.append(rank.proc)
        return rank

    def exit(self, t: float, pid: int, runtime: float, code: int | None, sig: str | None) -> None:
        self.sup.at(
            t, "child_exit", local_rank=0, child_pid=pid, exit_code=code, signal=sig,
            runtime_s=runtime, global_rank=0,
        )  # fmt: skip

    def close(self) -> Report:
        for proc in self.procs:
            proc.close()
        return build_report(self.dir, sacct=False)


def _sums_to_the_wall_time(ledger: TimeLedger, wall: float) -> None:
    parts = [
        ledger.startup_s, ledger.training_s, ledger.lost_work_s, ledger.detection_s,
        ledger.restart_s, ledger.rejoin_wait_s, ledger.requeue_wait_s, ledger.other_s,
    ]  # fmt: skip
    assert all(part >= 0 for part in parts), ledger
    assert ledger.wall_s == wall
    assert math.fsum(parts) == pytest.approx(wall, abs=1e-9)


def _cancelled(log_dir: Path, save_at: float | None) -> Report:
    """The Wrapper's call starts at 2.01 s; scancel SIGTERMs the child at 15 s, in the call."""
    node = Node(log_dir)
    rank = node.start(0.5, pid=4242)
    rank.at(2.0, "round_start", round=0, world_size=1, initial_rank=0)
    rank.at(2.01, "call_start", round=0, note="enter")
    if save_at is not None:
        rank.at(save_at, "checkpoint", round=0, path="/ckpt/c.pt", step=100, action="save")
    node.exit(15.0, 4242, runtime=14.5, code=None, sig="SIGTERM")
    node.sup.at(15.2, "supervisor_end", exit_code=143, reason="stopped by SIGTERM")
    return node.close()


def test_a_cancelled_job_trained_until_its_process_ended(tmp_path: Path) -> None:
    """The rank's last event is its call_start: its call lasted until the supervisor saw
    it end, not 0 s."""
    report = _cancelled(tmp_path / "job", save_at=None)
    s = report.summary
    assert s.interrupted_calls == 1
    assert s.training_time_s == pytest.approx(15.0 - 2.01)
    assert s.goodput == pytest.approx((15.0 - 2.01) / 15.2)
    ledger = s.time_ledger
    assert ledger.startup_s == pytest.approx(2.0)
    assert (ledger.lost_work_s, ledger.lost_work_known) == (0.0, False)
    _sums_to_the_wall_time(ledger, s.wall_time_s)


def test_a_cancelled_job_loses_the_work_since_its_last_checkpoint(tmp_path: Path) -> None:
    report = _cancelled(tmp_path / "job", save_at=10.0)
    s = report.summary
    assert s.training_time_s == pytest.approx(15.0 - 2.01)  # time in the function
    ledger = s.time_ledger
    assert (ledger.lost_work_s, ledger.lost_work_known) == (pytest.approx(5.0), True)
    assert ledger.training_s == pytest.approx(15.0 - 2.01 - 5.0)
    assert s.goodput == pytest.approx(ledger.training_s / 15.2)
    _sums_to_the_wall_time(ledger, s.wall_time_s)


def test_a_failed_job_counts_only_the_work_its_checkpoints_kept(tmp_path: Path) -> None:
    """No Wrapper: the child fails twice (exit 1) and the restart budget ends the job
    (exit 4). Each failure throws away what it trained since the last save."""
    node = Node(tmp_path / "job")
    for attempt, (start, save, end) in enumerate(((0.5, 5.0, 10.0), (10.5, 15.0, 20.0))):
        rank = node.start(start, pid=500 + attempt, attempt=attempt)
        rank.at(save, "checkpoint", path="/ckpt/c.pt", step=10 * (attempt + 1), action="save")
        node.exit(end, 500 + attempt, runtime=end - start, code=1, sig=None)
        decision = "restart" if attempt == 0 else "stop"
        node.sup.at(end + 0.1, "restart_decision", local_rank=0, decision=decision, reason="exit 1")
    node.sup.at(20.2, "job_stop", reason="restart budget exhausted", exit_code=4)
    node.sup.at(20.5, "supervisor_end", exit_code=4, reason="restart budget exhausted")
    report = node.close()
    s = report.summary
    assert s.outcome == "failed (exit code 4)"
    assert s.training_time_s == pytest.approx(9.5 + 9.5)  # the processes' run time
    ledger = s.time_ledger
    assert ledger.lost_work_s == pytest.approx(5.0 + 5.0)
    assert s.goodput == pytest.approx((19.0 - 10.0) / 20.5)
    _sums_to_the_wall_time(ledger, s.wall_time_s)


def test_a_requeued_job_waits_in_the_queue_and_trains_again(tmp_path: Path) -> None:
    """Run 0 checkpoints at 50 s and is requeued (its child ends at 50.6 s, in its call);
    run 1 starts at 100 s, trains from 103 s and completes at 150 s."""
    log_dir = tmp_path / "job"
    node = Node(log_dir)
    rank = node.start(0.5, pid=700)
    rank.at(2.0, "round_start", round=0, world_size=1, initial_rank=0)
    rank.at(2.01, "call_start", round=0, note="enter")
    rank.at(50.0, "checkpoint", round=0, path="/ckpt/c.pt", step=500, action="save")
    node.sup.at(50.2, "requeue", cause="time_limit", count=1, run=0, issued_by="nvrx")
    node.exit(50.6, 700, runtime=50.1, code=None, sig="SIGTERM")
    node.sup.at(51.0, "supervisor_end", exit_code=75, reason="requeued")
    node.sup.at(100.0, "supervisor_start", nnodes=1, nproc_per_node=1, spare_nodes=0)
    rank = node.start(100.5, pid=800)
    rank.at(103.0, "round_start", round=0, world_size=1, initial_rank=0)
    rank.at(103.01, "call_start", round=0, note="enter")
    rank.at(150.0, "call_end", round=0, duration_s=46.99, outcome="completed")
    rank.at(150.0, "round_end", round=0, outcome="completed", duration_s=47.0)
    rank.at(150.1, "wrapper_end", outcome="completed", rounds=1)
    node.exit(150.5, 800, runtime=50.0, code=0, sig=None)
    node.sup.at(151.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = node.close()
    s = report.summary
    assert (s.runs, s.restarts.requeue, s.outcome) == (2, 1, "completed")
    trained = (50.6 - 2.01) + 46.99
    assert s.training_time_s == pytest.approx(trained)
    ledger = s.time_ledger
    assert ledger.requeue_wait_s == pytest.approx(100.0 - 51.0)
    assert ledger.startup_s == pytest.approx(2.0 + 3.0)
    assert ledger.lost_work_s == pytest.approx(0.6)  # the SIGTERM came 0.6 s after the save
    assert s.goodput == pytest.approx((trained - 0.6) / 151.0)
    _sums_to_the_wall_time(ledger, s.wall_time_s)
    data = report.to_dict()
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["summary"]["time_ledger"]["requeue_wait_s"] == pytest.approx(49.0)


def test_restarts_of_the_wrapper_are_detection_restart_and_rejoin_time(tmp_path: Path) -> None:
    """The standard job's three restarts: each round's detection and restart latency."""
    write_standard_job(tmp_path / "job")
    report = build_report(tmp_path / "job", sacct=False)
    s = report.summary
    ledger = s.time_ledger
    restarts = [row for row in report.timeline if row.outcome == "restart"]
    latency = sum(row.restart_latency_s or 0.0 for row in restarts)
    rejoin = sum(row.phases.get("rejoin_wait", 0.0) for row in restarts)
    assert ledger.restart_s + ledger.rejoin_wait_s == pytest.approx(latency)
    assert ledger.rejoin_wait_s == pytest.approx(rejoin)
    assert ledger.detection_s == pytest.approx(sum(row.detection_s or 0.0 for row in restarts))
    # no checkpoint events; the ranks waited in the function while faults went undetected
    assert ledger.training_s == pytest.approx(s.training_time_s - ledger.detection_s)
    _sums_to_the_wall_time(ledger, s.wall_time_s)


def test_a_wrapper_that_gave_up_is_not_a_completed_job(tmp_path: Path) -> None:
    """RestartAbort: the Wrapper gives up after 2 rounds; its child exits 130 (a clean stop
    to the supervisor, which ends with 0): the job gave up, it did not complete."""
    node = Node(tmp_path / "job")
    rank = node.start(0.5, pid=900)
    for rnd in (0, 1):
        rank.at(2.0 + 5 * rnd, "round_start", round=rnd, world_size=1, initial_rank=0)
        rank.at(2.01 + 5 * rnd, "call_start", round=rnd, note="enter")
        rank.at(4.0 + 5 * rnd, "call_end", round=rnd, duration_s=1.99, outcome="fault")
        rank.at(4.0 + 5 * rnd, "fault", round=rnd, fault_kind="exception", exc_type="ValueError")
        outcome = "restart" if rnd == 0 else "abort"
        rank.at(4.5 + 5 * rnd, "round_end", round=rnd, outcome=outcome, duration_s=2.5)
    rank.at(9.6, "wrapper_end", outcome="restart_abort", rounds=2)
    node.exit(9.8, 900, runtime=9.3, code=130, sig=None)
    node.sup.at(10.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = node.close()
    assert report.summary.outcome == "gave up: restart_abort after 2 rounds"


def test_a_job_whose_wrapper_gave_up_then_completed_in_its_next_run_completed(tmp_path: Path) -> None:
    """Run 0's Wrapper gives up (its supervisor stops the job, exit 12); the job is submitted
    again and run 1 completes: the job completed. Run 0's ``restart_abort`` is no end of it."""
    node = Node(tmp_path / "job")
    rank = node.start(0.5, pid=900)
    rank.at(2.0, "round_start", round=0, world_size=1, initial_rank=0)
    rank.at(4.0, "fault", round=0, fault_kind="exception", exc_type="ValueError")
    rank.at(4.5, "round_end", round=0, outcome="abort", duration_s=2.5)
    rank.at(4.6, "wrapper_end", outcome="restart_abort", rounds=1)
    node.exit(4.8, 900, runtime=4.3, code=130, sig=None)
    node.sup.at(4.9, "job_stop", reason="a rank stopped the job", exit_code=12)
    node.sup.at(5.0, "supervisor_end", exit_code=12, reason="a rank stopped the job")
    node.sup.at(100.0, "supervisor_start", nnodes=1, nproc_per_node=1, spare_nodes=0)
    rank = node.start(100.5, pid=901)
    rank.at(102.0, "round_start", round=0, world_size=1, initial_rank=0)
    rank.at(150.0, "round_end", round=0, outcome="completed", duration_s=48.0)
    rank.at(150.1, "wrapper_end", outcome="completed", rounds=1)
    node.exit(150.5, 901, runtime=50.0, code=0, sig=None)
    node.sup.at(151.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = node.close()
    assert (report.summary.runs, report.summary.outcome) == (2, "completed")


def test_the_text_report_shows_the_ledger_that_sums_to_the_wall_time(tmp_path: Path) -> None:
    """The failed job's ledger, as the text report prints it: each part with its seconds and
    share of the wall time, and the sum."""
    node = Node(tmp_path / "job")
    rank = node.start(0.5, pid=500, attempt=0)
    rank.at(5.0, "checkpoint", path="/ckpt/c.pt", step=10, action="save")
    node.exit(10.0, 500, runtime=9.5, code=1, sig=None)
    node.sup.at(10.2, "job_stop", reason="restart budget exhausted", exit_code=4)
    node.sup.at(10.5, "supervisor_end", exit_code=4, reason="restart budget exhausted")
    report = node.close()
    ledger = report.summary.time_ledger
    text = report.to_text(width=None)
    section = text[text.index("Where the time went") :].split("\n\n\n")[0]
    rows = {line.split("  ")[0]: line.split() for line in section.splitlines()}
    assert rows["training kept"][-3:] == [f"{ledger.training_s:.3f}", "s", "42.9%"], section
    lost = rows["work lost since the state was last saved"]
    assert lost[-3:] == [f"{ledger.lost_work_s:.3f}", "s", "47.6%"], section
    assert f"sum: {ledger.wall_s:.1f} s wall" in section, section


def _hung_then_restored(log_dir: Path, committed: float) -> Report:
    """Round 0: the rank hangs after its last progress at 7 s; the soft timeout fires at
    12 s (5 s without progress). Round 1 restores the kept step,
    committed at ``committed`` s, and completes at 20 s."""
    from test_report_fixtures import T0

    node = Node(log_dir)
    rank = node.start(0.5, pid=900)
    rank.at(2.0, "round_start", round=0, world_size=1, initial_rank=0)
    rank.at(2.01, "call_start", round=0, note="enter")
    rank.at(12.0, "fault", round=0, fault_kind="hang_soft", origin_rank=0, signature="hang_soft",
            message="no progress for 5.0 s (soft timeout 5 s)", detection_s=5.0)  # fmt: skip
    rank.at(12.1, "call_end", round=0, duration_s=10.09, outcome="restart")
    rank.at(12.1, "round_end", round=0, outcome="restart", duration_s=10.1)
    rank.at(12.5, "round_start", round=1, world_size=1, initial_rank=0)
    rank.at(12.51, "call_start", round=1, note="enter")
    rank.at(12.6, "state_restored", round=1, source="memory", step=70, newest_step=70,
            committed_wall=T0 + committed, duration_s=0.01)  # fmt: skip
    rank.at(20.0, "call_end", round=1, duration_s=7.49, outcome="completed")
    rank.at(20.0, "round_end", round=1, outcome="completed", duration_s=7.5)
    rank.at(20.1, "wrapper_end", outcome="completed", rounds=2)
    node.exit(20.5, 900, runtime=20.0, code=0, sig=None)
    node.sup.at(21.0, "supervisor_end", exit_code=0, reason="all children ended")
    return node.close()


def test_a_hang_counts_as_detection_and_a_kept_state_restore_as_a_save(tmp_path: Path) -> None:
    """The hang's 5 s without progress are detection, not lost work; the work lost ends
    where the fault began (7 s) and starts at the restored step's commit (6.9 s)."""
    s = _hung_then_restored(tmp_path / "job", committed=6.9).summary
    ledger = s.time_ledger
    assert ledger.lost_work_known
    assert ledger.lost_work_s == pytest.approx(0.1)
    assert ledger.detection_s == pytest.approx(5.0)
    assert ledger.training_s == pytest.approx(10.09 + 7.49 - 0.1 - 5.0)
    _sums_to_the_wall_time(ledger, s.wall_time_s)


def test_a_job_without_the_wrapper_counts_every_supervised_rank_though_one_writes_events(
    tmp_path: Path,
) -> None:
    """2 nodes x 2 children under ``nvrx-supervise``, no Wrapper; only rank 0 writes events
    of its own (progress): the job has 4 ranks, each trained 100 s of the 102 s."""
    log_dir = tmp_path / "job"
    procs = []
    for node in (0, 1):
        host = Host(f"node-{'ab'[node]}", node)
        sup = Proc(log_dir, host, "supervisor")
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2, spare_nodes=0)
        for local in (0, 1):
            sup.at(1.0, "child_start", local_rank=local, child_pid=100 + 2 * node + local,
                   attempt=0, global_rank=2 * node + local)  # fmt: skip
        for local in (0, 1):
            sup.at(101.0, "child_exit", local_rank=local, child_pid=100 + 2 * node + local,
                   exit_code=0, signal=None, runtime_s=100.0, global_rank=2 * node + local)  # fmt: skip
        sup.at(102.0, "supervisor_end", exit_code=0, reason="all children ended")
        procs.append(sup)
    app = Proc(log_dir, Host("node-a", 0), "app", rank=0)
    for step in range(5):
        app.at(10.0 + 10 * step, "progress", pid=100, step=step)
    procs.append(app)
    for proc in procs:
        proc.close()
    s = build_report(log_dir, sacct=False).summary
    assert (s.outcome, s.ranks) == ("completed", 4)
    assert s.training_time_s == pytest.approx(100.0)
    assert s.goodput == pytest.approx(100.0 / 102.0)


def test_a_wrappers_spare_rank_counts_in_goodput(tmp_path: Path) -> None:
    """2 ranks, rank 1 a spare of the Wrapper that never runs the function: goodput is
    rank 0's 100 s over 2 ranks of the 100 s wall, as docs/report.md says."""
    log_dir = tmp_path / "job"
    host = Host("node-a", 0)
    procs = []
    for rank in (0, 1):
        proc = Proc(log_dir, host, "wrapper", rank=rank).round(0)
        proc.at(0.0, "round_start", world_size=2, active_world_size=1,
                active_rank=0 if rank == 0 else None, initial_rank=rank)  # fmt: skip
        if rank == 0:
            proc.at(0.0, "call_start", note="enter")
            proc.at(100.0, "call_end", duration_s=100.0, outcome="completed")
        proc.at(100.0, "round_end", outcome="completed", duration_s=100.0)
        proc.at(100.0, "wrapper_end", outcome="completed", rounds=1)
        procs.append(proc)
    for proc in procs:
        proc.close()
    s = build_report(log_dir, sacct=False).summary
    assert (s.outcome, s.ranks) == ("completed", 2)
    assert s.goodput == pytest.approx(0.5)
