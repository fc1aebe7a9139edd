"""The report of a job that ran without the Wrapper: ranks, training time, goodput,
and its job-wide restarts as timeline rows, from supervisor events written with the
real ``EventWriter`` (what ``nvrx-supervise`` writes under ``--ft-restart-policy
any-failed``)."""

from __future__ import annotations

from pathlib import Path

from test_report_fixtures import HANG_STACK, Host, Proc

from nvrx.report import build_report

CAUSE = {"rank": 3, "node": 1, "signature": "hang (heartbeat timeout)"}


def _plain_job(log_dir: Path, restart: bool) -> None:
    """2 nodes x 2 ranks of a plain script; with ``restart``, rank 3 (node 1) hangs at
    t=20 and every rank restarts together (epoch 1) before the job completes at t=50."""
    for node in (0, 1):
        host = Host(f"n{node}", node)
        sup = Proc(log_dir, host, "supervisor")
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2, command=["train.py"])
        for lr in (0, 1):
            sup.at(1.0, "child_start", local_rank=lr, child_pid=100 + lr, global_rank=2 * node + lr, attempt=0)
        if restart:
            if node == 1:
                sup.at(20.0, "hang", rank=3, local_rank=1, child_pid=101, timeout="heartbeat", stack=HANG_STACK)
                sup.at(20.1, "restart_decision", local_rank=1, global_rank=3, scope="job",
                       decision="restart", reason="child failed", budget_left=3, signature=CAUSE["signature"])  # fmt: skip
            sup.at(20.2, "job_restart", epoch=1, phase="stopping", cause=CAUSE)
            for lr in (0, 1):
                sup.at(21.0, "child_exit", local_rank=lr, child_pid=100 + lr, global_rank=2 * node + lr,
                       exit_code=None, signal="SIGTERM", runtime_s=20.0, attempt=0)  # fmt: skip
            sup.at(21.1, "job_restart", epoch=1, phase="ready", ready=node + 1, nodes=2)
            for lr in (0, 1):
                sup.at(21.5, "child_start", local_rank=lr, child_pid=200 + lr, global_rank=2 * node + lr, attempt=1)
            sup.at(21.5, "job_restart", epoch=1, phase="started")
        first_start = 21.5 if restart else 1.0
        for lr in (0, 1):
            sup.at(50.0, "child_exit", local_rank=lr, child_pid=(200 if restart else 100) + lr,
                   global_rank=2 * node + lr, exit_code=0, signal=None, runtime_s=50.0 - first_start,
                   attempt=1 if restart else 0)  # fmt: skip
        sup.at(50.5, "supervisor_end", exit_code=0, reason="all children ended")
        sup.close()


def test_a_job_without_the_wrapper_has_ranks_training_time_and_goodput(tmp_path: Path) -> None:
    _plain_job(tmp_path, restart=False)
    report = build_report(tmp_path, sacct=False)
    s = report.summary
    assert s.ranks == 4
    assert s.training_time_s == 49.0  # each child ran 49 s
    assert s.goodput is not None and 0.9 < s.goodput < 1.0
    assert s.restarts.job_wide == 0 and report.timeline == []
    text = report.to_text("table")
    assert "no Wrapper events, no job-wide restart" in text


def test_a_job_wide_restart_is_one_timeline_row_with_its_cause(tmp_path: Path) -> None:
    _plain_job(tmp_path, restart=True)
    report = build_report(tmp_path, sacct=False)
    s = report.summary
    assert s.ranks == 4 and s.restarts.job_wide == 1
    assert s.restarts.process == 0  # the four relaunches belong to the job-wide restart
    assert s.processes_relaunched == 4
    assert s.training_time_s == (20.0 * 2 + 28.5 * 2) * 2 / 4
    first, last = report.timeline
    assert (first.round, first.outcome, first.cause) == (0, "restart", "hang (heartbeat timeout)")
    assert (first.first_rank, first.first_node, first.first_host) == (3, 1, "n1")
    assert first.ordering == "job_restart" and first.outcome_from == "job_restart"
    assert first.hang_ranks == [3] and first.peer_notified == 3
    assert abs(first.restart_latency_s - 1.3) < 1e-6  # first node stopping -> last node started
    assert (last.round, last.outcome) == (1, "completed")
    text = report.to_text("table")
    assert "job-wide restarts         1" in text
    assert "rank 3 on n1 (node 1)" in text
    assert [h.rank for h in report.hangs] == [3] and "all_reduce_grads" in report.hangs[0].stack
