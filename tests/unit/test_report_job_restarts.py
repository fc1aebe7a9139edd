"""The report of a job that ran without the Wrapper: ranks, training time, goodput,
and its job-wide restarts as timeline rows, from supervisor events written with the
real ``EventWriter`` (what ``nvrx-supervise`` writes under ``--ft-restart-policy
any-failed``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_report_fixtures import HANG_STACK, T0, Host, Proc

from nvrx.events.failures import UNRESPONSIVE_SIGNATURE
from nvrx.report import build_report

CAUSE = {"rank": 3, "node": 1, "signature": "hang (heartbeat timeout)"}


def _plain_job(log_dir: Path, restart: bool, spares: int = 0) -> None:
    """2 nodes x 2 ranks of a plain script; with ``restart``, rank 3 (node 1) hangs at
    t=20 and every rank restarts together (epoch 1) before the job completes at t=50.
    ``spares``: that many spare nodes more, started by the job as such (their own
    supervisors are the caller's)."""
    for node in (0, 1):
        host = Host(f"n{node}", node)
        sup = Proc(log_dir, host, "supervisor")
        sup.at(0.0, "supervisor_start", nnodes=2 + spares, nproc_per_node=2, spare_nodes=spares,
               command=["train.py"])  # fmt: skip
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


def test_a_spare_node_that_never_took_over_trains_no_rank(tmp_path: Path) -> None:
    """2 training nodes x 2 ranks and 1 spare node: the job has 4 ranks, not 6, and its
    goodput is that of 4."""
    _plain_job(tmp_path, restart=False, spares=1)
    spare = Proc(tmp_path, Host("n2", 2), "supervisor")
    spare.at(0.0, "supervisor_start", nnodes=3, nproc_per_node=2, spare_nodes=1, command=["train.py"])
    spare.at(50.5, "supervisor_end", exit_code=0, reason="all children ended")
    spare.close()
    report = build_report(tmp_path, sacct=False)
    assert report.summary.ranks == 4 and report.summary.training_time_s == 49.0


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


def _job_wide_failures(log_dir: Path, failures: list[str], skew: float = 0.0) -> None:
    """2 nodes x 1 rank of a plain script; rank 1 (node 1, its wall clock ``skew`` s ahead)
    fails once per stretch as ``failures`` say ("exit": exit code 1, "hang": no heartbeat),
    and every rank restarts together after each, as ``any-failed`` does; then it completes."""
    hosts = [Host("n0", 0), Host("n1", 1, skew=skew)]
    sups = [Proc(log_dir, h, "supervisor") for h in hosts]
    for i, sup in enumerate(sups):
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=1, command=["train.py"])
        sup.at(0.5, "child_start", local_rank=0, child_pid=100 + i, global_rank=i, attempt=0)
    for epoch, how in enumerate(failures, start=1):
        t, pid = 30.0 * epoch, 100 * epoch
        signature = "exit code 1" if how == "exit" else "hang (heartbeat timeout)"
        if how == "exit":
            sups[1].at(t, "child_exit", local_rank=0, child_pid=pid + 1, global_rank=1, exit_code=1,
                       signal=None, runtime_s=29.0, attempt=epoch - 1)  # fmt: skip
        else:
            sups[1].at(t, "hang", rank=1, local_rank=0, child_pid=pid + 1, timeout="heartbeat", stack=HANG_STACK)
        sups[1].at(t + 0.05, "restart_decision", local_rank=0, global_rank=1, scope="job", decision="restart",
                   reason="child failed", budget_left=9, signature=signature)  # fmt: skip
        for i, sup in enumerate(sups):
            sup.at(t + 0.1, "job_restart", epoch=epoch, phase="stopping",
                   cause={"rank": 1, "node": 1, "signature": signature})  # fmt: skip
            if i == 0 or how == "hang":
                sup.at(t + 0.3, "child_exit", local_rank=0, child_pid=pid + i, global_rank=i, exit_code=None,
                       signal="SIGTERM", runtime_s=29.0, attempt=epoch - 1)  # fmt: skip
            sup.at(t + 1.0, "job_restart", epoch=epoch, phase="ready", ready=i + 1, nodes=2)
            sup.at(t + 1.5, "child_start", local_rank=0, child_pid=pid + 100 + i, global_rank=i, attempt=epoch)
            sup.at(t + 1.5, "job_restart", epoch=epoch, phase="started")
    end = 30.0 * (len(failures) + 1)
    for i, sup in enumerate(sups):
        sup.at(end, "child_exit", local_rank=0, child_pid=100 * len(failures) + 100 + i, global_rank=i,
               exit_code=0, signal=None, runtime_s=28.0, attempt=len(failures))  # fmt: skip
        sup.at(end + 0.1, "supervisor_end", exit_code=0, reason="all children ended")
        sup.close()


@pytest.mark.parametrize("how", ["exit", "hang"])
@pytest.mark.parametrize("skew", [0.0, 0.5], ids=["same-clock", "clock-ahead"])
def test_one_failure_that_restarted_the_job_is_one_fault_and_no_reason_to_exclude(
    tmp_path: Path, how: str, skew: float
) -> None:
    """The failure a job-wide restart announced and the process end or hang report behind it
    are one incident (before: two, and its node was excluded for one crash); two failures of
    the same node in two stretches are two, and exclude it."""
    _job_wide_failures(tmp_path / "one", [how], skew)
    report = build_report(tmp_path / "one", sacct=False)
    [n1] = [n for n in report.suspects if n.host == "n1"]
    assert n1.faults == 1 and not n1.suspect, n1.evidence
    assert report.exclude is None, report.to_text(width=None)
    _job_wide_failures(tmp_path / "two", [how, how], skew)
    report = build_report(tmp_path / "two", sacct=False)
    [n1] = [n for n in report.suspects if n.host == "n1"]
    assert n1.faults == 2 and n1.suspect, n1.evidence
    assert report.exclude == "n1"


def _two_nodes_and_a_spare(log_dir: Path) -> list[Proc]:
    """The supervisors of slots 0 and 1 (n0, n1: a rank each) and of spare slot 2 (n2)."""
    sups = [Proc(log_dir, Host(f"n{slot}", slot), "supervisor") for slot in range(3)]
    for sup in sups:
        sup.at(0.0, "supervisor_start", nnodes=3, spare_nodes=1, nproc_per_node=1, command=["train.py"])
    for i in (0, 1):
        sups[i].at(0.5, "child_start", local_rank=0, child_pid=100 + i, global_rank=i, attempt=0)
    return sups


def _spare_then_failure(log_dir: Path, responding: bool) -> None:
    """Slot 1 (n1) is lost, spare slot 2 (n2) takes node rank 1 and every rank restarts
    (epoch 1, cause "node lost"); later rank 1, now on n2, exits with code 1 (epoch 2)."""
    sups = _two_nodes_and_a_spare(log_dir)
    sups[0].at(20.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=10.0,
               last_seen_wall=T0 + 10.0, seen_by=0, action="spare", replaced_by=2, ranks=[1])  # fmt: skip
    sups[0].at(20.2, "node_probe", lost_slot=1, lost_host="n1", responding=responding, probe_s=0.5)
    sups[2].at(20.5, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.5)
    stretches = [(21.0, "node lost"), (50.0, "exit code 1")]
    for epoch, (t, signature) in enumerate(stretches, start=1):
        if epoch == 2:
            sups[2].at(t - 0.2, "child_exit", local_rank=0, child_pid=300, global_rank=1, exit_code=1,
                       signal=None, runtime_s=28.0, attempt=0)  # fmt: skip
            sups[2].at(t - 0.1, "restart_decision", local_rank=0, global_rank=1, scope="job",
                       decision="restart", reason="child failed", budget_left=5, signature=signature)  # fmt: skip
        for i in (0, 2):
            sups[i].at(t, "job_restart", epoch=epoch, phase="stopping",
                       cause={"rank": 1, "node": 1, "signature": signature})  # fmt: skip
            sups[i].at(t + 0.5, "job_restart", epoch=epoch, phase="ready", ready=2, nodes=2)
            sups[i].at(t + 1.0, "job_restart", epoch=epoch, phase="started")
            sups[i].at(t + 1.0, "child_start", local_rank=0, child_pid=100 * epoch + 100 + i,
                       global_rank=min(i, 1), attempt=epoch)  # fmt: skip
    for i in (0, 2):
        sups[i].at(80.0, "supervisor_end", exit_code=0, reason="all children ended")
    for sup in sups:
        sup.close()


def test_a_hang_a_spares_supervisor_reports_is_the_node_rank_it_took_over(tmp_path: Path) -> None:
    """Spare slot 2 (n2) takes node rank 1 over; later its supervisor reports its rank's hang
    (a plain script's heartbeats): the hang is node rank 1's, as its rank's events are, and n2
    has one suspect row, not one per slot and node rank."""
    sups = _two_nodes_and_a_spare(tmp_path)
    sups[0].at(20.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=10.0,
               last_seen_wall=T0 + 10.0, seen_by=0, action="spare", replaced_by=2, ranks=[1])  # fmt: skip
    sups[2].at(20.5, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.5)
    for i in (0, 2):  # the job-wide restart with the spare: the loss is over once it started
        sups[i].at(21.0, "job_restart", epoch=1, phase="stopping", cause={"rank": 1, "node": 1, "signature": "node lost"})
        sups[i].at(21.5, "job_restart", epoch=1, phase="ready", ready=2, nodes=2)
        sups[i].at(22.0, "job_restart", epoch=1, phase="started")
        sups[i].at(22.0, "child_start", local_rank=0, child_pid=300 + i, global_rank=min(i, 1), attempt=1)
    # past the time a survivor's faults may follow from the loss (``SAME_FAILURE_WINDOW_S``)
    sups[2].at(70.0, "hang", rank=1, local_rank=0, child_pid=302, timeout="heartbeat", stack=HANG_STACK)
    sups[2].at(71.0, "child_exit", local_rank=0, child_pid=302, global_rank=1, exit_code=None,
               signal="SIGKILL", runtime_s=49.0, attempt=1)  # fmt: skip
    for i in (0, 2):
        sups[i].at(90.0, "supervisor_end", exit_code=0, reason="all children ended")
    for sup in sups:
        sup.close()
    report = build_report(tmp_path, sacct=False)
    assert [(h.rank, h.node, h.host) for h in report.hangs] == [(1, 1, "n2")]
    assert {n.node for n in report.suspects if n.host == "n2"} == {1}, report.to_text(width=None)


@pytest.mark.parametrize("responding", [False, True], ids=["node-dead", "node-responding"])
def test_a_job_wide_restart_for_a_lost_node_is_its_loss_and_a_later_failure_is_the_spares(
    tmp_path: Path, responding: bool
) -> None:
    """The restart a lost node caused is that loss's round, counted once (before: a loss and a
    fault of its own, which excluded a node whose SLURM step answered); a failure of its node
    rank after a spare took it over is the spare's host (before: the lost host's, by slot)."""
    _spare_then_failure(tmp_path, responding)
    report = build_report(tmp_path, sacct=False)
    lost, failed, _ = report.timeline
    assert (lost.cause, lost.ordering, lost.first_host) == ("node lost", "node_lost", "n1")
    assert lost.detection_s == 10.0 and report.node_losses[0].round == 0
    assert (failed.cause, failed.ordering, failed.first_rank, failed.first_host) == ("exit code 1", "job_restart", 1, "n2")
    faults = {n.host: (n.faults, n.suspect) for n in report.suspects}
    assert faults == {"n1": (1, not responding), "n2": (1, False)}, report.to_text(width=None)
    assert report.exclude == (None if responding else "n1")
    first_screen = report.to_text(width=None).split("faults, in time order:")[1].split("exclude next time")[0]
    assert first_screen.count("node lost") == 1, first_screen  # the loss once, as its round


def test_a_plain_scripts_loss_is_over_once_every_node_started_its_children_again(tmp_path: Path) -> None:
    """Without Wrapper rounds, the loss of n1 is recovered when the job-wide restart after its
    declaration started every training node's children (n2 for node rank 1 among them): a
    later failure within the same-failure window is n2's own (before: "not seen in the
    events", and rank 1's exit 29 s later was put down to the loss)."""
    _spare_then_failure(tmp_path, responding=False)
    report = build_report(tmp_path, sacct=False)
    (loss,) = report.node_losses
    assert (loss.recovered_wall, loss.world_size) == (T0 + 22.0, 2)
    assert loss.recovery_s == 12.0  # from its last beat at t=10
    (ended,) = [p for p in report.process_restarts if p.exit_code == 1]
    assert (ended.host, ended.explained_by) == ("n2", None), report.to_text(width=None)


def test_a_restart_one_training_node_did_not_start_is_no_recovery_from_a_loss(tmp_path: Path) -> None:
    """Slot 0 restarts its children after n1 is declared lost, but no spare took node rank 1:
    the job was not whole again, so the loss has no recovery."""
    sups = _two_nodes_and_a_spare(tmp_path)
    sups[0].at(20.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=10.0,
               last_seen_wall=T0 + 10.0, seen_by=0, action="spare", replaced_by=2, ranks=[1])  # fmt: skip
    sups[0].at(21.0, "job_restart", epoch=1, phase="stopping", cause={"rank": 1, "node": 1, "signature": "node lost"})
    sups[0].at(22.0, "job_restart", epoch=1, phase="started")
    for i in (0, 2):
        sups[i].at(60.0, "supervisor_end", exit_code=1, reason="a child failed")
    for sup in sups:
        sup.close()
    (loss,) = build_report(tmp_path, sacct=False).node_losses
    assert loss.recovered_wall is None and loss.recovery_s is None


def test_a_plain_scripts_shrink_is_over_at_the_first_restart_after_its_declaration(tmp_path: Path) -> None:
    """Slot 0 restarts its children for a failure of its own (epoch 1, before the loss), then
    n1 is lost and the job shrinks to slot 0 (epoch 2): the loss is over at epoch 2's start,
    not at epoch 1's, which came before it."""
    sups = [Proc(tmp_path, Host(f"n{slot}", slot), "supervisor") for slot in range(2)]
    for i, sup in enumerate(sups):
        sup.at(0.0, "supervisor_start", nnodes=2, spare_nodes=0, nproc_per_node=1, command=["train.py"])
        sup.at(0.5, "child_start", local_rank=0, child_pid=100 + i, global_rank=i, attempt=0)
    sups[0].at(14.0, "job_restart", epoch=1, phase="stopping", cause={"rank": 0, "node": 0, "signature": "exit code 1"})
    sups[0].at(15.0, "job_restart", epoch=1, phase="started")
    sups[0].at(20.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=3.0,
               last_seen_wall=T0 + 17.0, seen_by=0, action="shrink", ranks=[1])  # fmt: skip
    sups[0].at(21.0, "job_restart", epoch=2, phase="stopping", cause={"rank": 1, "node": 1, "signature": "node lost"})
    sups[0].at(22.0, "job_restart", epoch=2, phase="started")
    sups[0].at(60.0, "supervisor_end", exit_code=0, reason="all children ended")
    for sup in sups:
        sup.close()
    (loss,) = build_report(tmp_path, sacct=False).node_losses
    assert (loss.recovered_wall, loss.recovery_s, loss.world_size) == (T0 + 22.0, 5.0, None)


def test_a_restart_span_that_clock_skew_makes_negative_counts_as_none() -> None:
    """The last node's ``ready`` is stamped by a clock ahead of the one that stamped the last
    ``started``: that phase is 0, not negative."""
    from nvrx.report.job_rounds import _time_restart
    from nvrx.report.model import RoundRow

    row = RoundRow(run=0, round=0, start_wall=0.0, end_wall=10.0, outcome="restart")
    events = [{"phase": "ready", "wall": 12.5}, {"phase": "ready", "wall": 11.0}]
    _time_restart(row, events, 10.0, [12.0, 11.5])
    assert row.restart_latency_s == 2.0
    assert row.phases == {"stop children": 2.5, "start children": 0.0}


@pytest.mark.parametrize("decision_event", [True, False], ids=["decision-read", "slot-at-the-restart"])
def test_a_failure_whose_node_was_lost_during_the_restart_is_its_own_hosts(
    tmp_path: Path, decision_event: bool
) -> None:
    """Rank 1 on n1 exits with code 1 and restarts the job; then n1 falls silent and spare
    n2 takes node rank 1 before the restart ends: the failure is n1's, once (not the spare's,
    which held the node rank only after it)."""
    sups = _two_nodes_and_a_spare(tmp_path)
    sups[1].at(30.0, "child_exit", local_rank=0, child_pid=101, global_rank=1, exit_code=1, signal=None,
               runtime_s=29.0, attempt=0)  # fmt: skip
    if decision_event:
        sups[1].at(30.05, "restart_decision", local_rank=0, global_rank=1, scope="job", decision="restart",
                   reason="child failed", budget_left=5, signature="exit code 1")  # fmt: skip
    for i in (0, 1):
        sups[i].at(30.1, "job_restart", epoch=1, phase="stopping", cause={"rank": 1, "node": 1, "signature": "exit code 1"})
    sups[0].at(30.3, "child_exit", local_rank=0, child_pid=100, global_rank=0, exit_code=None, signal="SIGTERM",
               runtime_s=29.0, attempt=0)  # fmt: skip
    sups[0].at(41.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=10.0,
               last_seen_wall=T0 + 31.0, seen_by=0, action="spare", replaced_by=2, ranks=[1])  # fmt: skip
    sups[2].at(41.5, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.5)
    for i in (0, 2):
        sups[i].at(42.0, "job_restart", epoch=1, phase="ready", ready=2, nodes=2)
        sups[i].at(42.5, "job_restart", epoch=1, phase="started")
        sups[i].at(42.5, "child_start", local_rank=0, child_pid=200 + i, global_rank=min(i, 1), attempt=1)
        sups[i].at(80.0, "supervisor_end", exit_code=0, reason="all children ended")
    for sup in sups:
        sup.close()
    report = build_report(tmp_path, sacct=False)
    failed = report.timeline[0]
    assert (failed.cause, failed.first_rank, failed.first_host) == ("exit code 1", 1, "n1")
    faulted = sorted(n.host for n in report.suspects if n.faults)
    assert faulted == ["n1"], [(n.host, n.faults, n.evidence) for n in report.suspects]


PEER_LOST = "PeerLost at train.py:9 in all_reduce"


def _survivor_failed_near_a_loss(
    log_dir: Path,
    exit_t: float,
    signature: str = PEER_LOST,
    fault: tuple[float, str, str] | None = None,
    hangs: tuple[tuple[int, float, float], ...] = (),
    silent: float | None = None,
) -> None:
    """No Wrapper, 2 nodes x 2 ranks: node 1 is last seen at 20 s and declared lost at 23 s
    (silent 3 s); rank 0 (node 0) ends at ``exit_t`` and its supervisor claims the job-wide
    restart for it (``signature``) before the declaration. ``fault``: (time, exception type,
    message) of the exception rank 0 wrote first; ``hangs``: (rank, time, seconds without
    progress) of the hangs node 0's supervisor told; ``silent``: seconds rank 0 had sent no
    heartbeat when its supervisor declared it unresponsive, just before its end."""
    hosts = {n: Host(f"n{n}", n) for n in (0, 1)}
    sup = {n: Proc(log_dir, h, "supervisor") for n, h in hosts.items()}
    for n, s in sup.items():
        s.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2, command=["train.py"])
        for lr in (0, 1):
            s.at(1.0, "child_start", local_rank=lr, child_pid=100 + lr, global_rank=2 * n + lr, attempt=0)
    if fault is not None:
        app = Proc(log_dir, hosts[0], "app", rank=0)
        app.at(fault[0], "fault", fault_kind="exception", origin_rank=0, exc_type=fault[1], message=fault[2],
               signature=signature)  # fmt: skip
        app.close()
    s0 = sup[0]
    if silent is not None:
        s0.at(exit_t - 0.05, "fault", fault_kind="unresponsive", origin_rank=0, rank=0, local_rank=0,
              child_pid=100, message=f"no heartbeat for {silent:.1f} s", signature=UNRESPONSIVE_SIGNATURE,
              detection_s=silent)  # fmt: skip
    for rank, t, stale in hangs:
        s0.at(t, "hang", rank=rank, local_rank=rank, child_pid=100 + rank, timeout="heartbeat", stale_s=stale,
              stack=HANG_STACK)  # fmt: skip
    s0.at(exit_t, "child_exit", local_rank=0, child_pid=100, global_rank=0, exit_code=1, signal=None,
          runtime_s=exit_t - 1.0)  # fmt: skip
    s0.at(exit_t + 0.01, "restart_decision", local_rank=0, global_rank=0, scope="job", decision="restart",
          reason="child failed (exit code 1)", budget_left=3, signature=signature)  # fmt: skip
    s0.at(exit_t + 0.02, "job_restart", epoch=1, phase="stopping", cause={"rank": 0, "node": 0, "signature": signature})
    s0.at(exit_t + 0.1, "child_exit", local_rank=1, child_pid=101, global_rank=1, exit_code=None, signal="SIGTERM",
          runtime_s=exit_t - 0.9)  # fmt: skip
    s0.at(exit_t + 0.2, "job_restart", epoch=1, phase="ready", ready=1, nodes=2)
    s0.at(23.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=3.0, last_seen_wall=T0 + 20.0,
          seen_by=0, slurm_state=None, action="stop", replaced_by=None, ranks=[2, 3])  # fmt: skip
    s0.at(23.5, "supervisor_end", exit_code=1, reason="node lost")
    for s in sup.values():
        s.close()


def _blamed(report: Any) -> dict[str, int]:
    return {s.host: s.first_failures for s in report.suspects}


def test_a_survivors_failure_after_a_nodes_last_heartbeat_is_the_loss_not_its_own(tmp_path: Path) -> None:
    """No Wrapper: node 1 falls silent at 20 s; rank 0 (node 0) then fails talking to it
    (PeerLost, 20.5 s) and its supervisor claims the job-wide restart before the loss is
    declared (23 s). The stretch's first failure is the lost node: the survivor is not
    blamed, and the lost ranks are not counted as peers."""
    _survivor_failed_near_a_loss(tmp_path, 20.5)
    report = build_report(tmp_path, sacct=False)
    first = report.timeline[0]
    assert (first.cause, first.first_node, first.first_host, first.ordering) == ("node lost", 1, "n1", "node_lost")
    assert first.peer_notified == 2 and first.also_failed == []
    assert report.node_losses[0].round == first.round
    blamed = _blamed(report)
    assert blamed.get("n0", 0) == 0 and blamed["n1"] == 1, blamed


ZERO_DIVISION = "ZeroDivisionError at train.py:9 in step"


@pytest.mark.parametrize(
    ("raised", "lost"),
    [(19.8, False), (20.3, True)],
    ids=["raised-before-the-last-heartbeat", "raised-after-it"],
)
def test_a_survivors_own_exception_counts_from_when_it_was_raised_not_from_its_process_end(
    tmp_path: Path, raised: float, lost: bool
) -> None:
    """No Wrapper: rank 0 raises a ZeroDivisionError and its process ends at 20.5 s, after
    node 1's last heartbeat (20 s). Raised at 19.8 s, before that heartbeat, it is a fault
    of its own (not a follow-on one): the stretch's first failure, its node blamed. Raised
    after the heartbeat, the loss explains it."""
    _survivor_failed_near_a_loss(
        tmp_path, 20.5, ZERO_DIVISION, fault=(raised, "ZeroDivisionError", "division by zero")
    )
    report = build_report(tmp_path, sacct=False)
    first = report.timeline[0]
    blamed = _blamed(report)
    if lost:
        assert (first.cause, first.first_host, first.ordering) == ("node lost", "n1", "node_lost")
        assert blamed.get("n0", 0) == 0 and blamed["n1"] == 1, blamed
        return
    assert (first.cause, first.first_rank, first.first_host, first.ordering) == (
        ZERO_DIVISION, 0, "n0", "job_restart",
    )  # fmt: skip
    assert report.node_losses[0].round != first.round
    assert blamed["n0"] == 1 and blamed.get("n1", 0) == 0, blamed


@pytest.mark.parametrize(
    ("exc_type", "message", "lost"),
    [("ConnectionResetError", "Connection reset by peer", True), ("ZeroDivisionError", "division by zero", False)],
    ids=["follow-on", "own"],
)
def test_a_survivors_follow_on_fault_just_before_a_nodes_last_heartbeat_is_the_loss(
    tmp_path: Path, exc_type: str, message: str, lost: bool
) -> None:
    """No Wrapper: rank 0 fails at 19.9 s, 0.1 s before node 1's last heartbeat (its silence
    before the declaration was 3 s), and its process ends at 19.95 s. A follow-on fault (a
    connection reset by the peer) follows from the loss; a fault of another shape is the
    survivor's own."""
    signature = f"{exc_type} at train.py:9 in step"
    _survivor_failed_near_a_loss(tmp_path, 19.95, signature, fault=(19.9, exc_type, message))
    first = build_report(tmp_path, sacct=False).timeline[0]
    expected = ("node lost", "n1", "node_lost") if lost else (signature, "n0", "job_restart")
    assert (first.cause, first.first_host, first.ordering) == expected


@pytest.mark.parametrize(
    ("told", "stale", "lost"),
    [(20.5, 10.0, False), (20.5, 0.6, True), (20.5, 1.5, True), (20.5, 2.9, True), (22.5, 2.0, True),
     (19.8, 1.5, True)],
    ids=[
        "hung-long-before-the-last-heartbeat",
        "hung-just-before-it",
        "hung-in-the-detection-window",
        "hung-near-the-windows-start",
        "hung-after-it",
        "told-before-the-heartbeat",
    ],
)  # fmt: skip
def test_a_survivors_hang_counts_from_its_last_progress_not_from_when_it_was_told(
    tmp_path: Path, told: float, stale: float, lost: bool
) -> None:
    """No Wrapper: node 0's supervisor tells, after node 1's last heartbeat (20 s, silent
    3 s before its declaration), that rank 0 hung, and restarts the job for it. Without
    progress for 10 s, the hang began long before the heartbeat: rank 0's own failure.
    Begun less than the node's silence before the heartbeat (a rank waiting in a collective
    for the lost node stops progressing before that node's last beat), or after it: the
    loss's. The failure table, the activity marks and the suspect table say the same: the
    hang is rank 0's own failure only when the timeline says so."""
    hang = "hang (heartbeat timeout)"
    _survivor_failed_near_a_loss(tmp_path, told + 0.05, hang, hangs=((0, told, stale),))
    report = build_report(tmp_path, sacct=False)
    first = report.timeline[0]
    expected = ("node lost", "n1", "node_lost") if lost else (hang, "n0", "job_restart")
    assert (first.cause, first.first_host, first.ordering) == expected
    own = 0 if lost else 1
    assert [f.count for f in report.failures if f.signature == hang] == ([1] if own else [])
    assert sum(m.signature == hang for m in report.activity.faults) == own
    assert {s.host: s.hangs for s in report.suspects}.get("n0", 0) == own


def test_a_stretchs_failure_is_read_from_the_fault_its_restart_announced(tmp_path: Path) -> None:
    """No Wrapper: rank 0 raises PeerLost at 20.3 s, after node 1's last heartbeat (20 s),
    and its supervisor restarts the job for that signature; it also tells, later, that the
    rank had made no progress for 10 s. The stretch is read from the announced fault, begun
    after the heartbeat: the loss's, not the hang's, begun long before it."""
    _survivor_failed_near_a_loss(
        tmp_path, 20.5, PEER_LOST, fault=(20.3, "PeerLost", "peer went away"), hangs=((0, 20.45, 10.0),)
    )
    first = build_report(tmp_path, sacct=False).timeline[0]
    assert (first.cause, first.first_host, first.ordering) == ("node lost", "n1", "node_lost")


@pytest.mark.parametrize(
    ("silent", "lost"),
    [(12.0, False), (2.0, False), (0.3, True)],
    ids=["silent-long-before", "silent-in-the-detection-window", "silent-after-the-beat"],
)
def test_an_unresponsive_survivor_counts_from_when_it_fell_silent(tmp_path: Path, silent: float, lost: bool) -> None:
    """No Wrapper: node 0's supervisor declares rank 0 unresponsive at 20.5 s, after node 1's
    last heartbeat (20 s, silent 3 s before its declaration), and restarts the job for it.
    Silent for 12 s, the rank stopped long before the heartbeat: its own failure. Silent for
    2 s, in the loss's detection window: still its own, for an unresponsive monitor is no
    follow-on fault (a rank blocked on a lost peer hangs while its monitor beats). Silent
    for 0.3 s, it fell silent after the heartbeat: the loss's."""
    _survivor_failed_near_a_loss(tmp_path, 20.55, UNRESPONSIVE_SIGNATURE, silent=silent)
    first = build_report(tmp_path, sacct=False).timeline[0]
    expected = ("node lost", "n1", "node_lost") if lost else (UNRESPONSIVE_SIGNATURE, "n0", "job_restart")
    assert (first.cause, first.first_host, first.ordering) == expected


def test_a_restart_announced_for_a_lost_node_keeps_its_loss_from_an_earlier_stretch(tmp_path: Path) -> None:
    """No Wrapper, 2 nodes and a spare: rank 0 (node 0) fails on a reset connection at 19.9 s
    and restarts the job (claimed 19.95 s, started again 20.3 s); node 1, last seen at
    20 s, is declared lost at 23 s, the spare takes its node rank, and a second restart is
    announced for the lost node. The loss's window would explain rank 0's follow-on fault,
    but the restart announced for the loss has it: the first stretch is rank 0's."""
    sups = _two_nodes_and_a_spare(tmp_path)
    s0 = sups[0]
    app = Proc(tmp_path, Host("n0", 0), "app", rank=0)
    signature = "ConnectionResetError at train.py:9 in step"
    app.at(19.9, "fault", fault_kind="exception", origin_rank=0, exc_type="ConnectionResetError",
           message="Connection reset by peer", signature=signature)  # fmt: skip
    app.close()
    s0.at(19.92, "child_exit", local_rank=0, child_pid=100, global_rank=0, exit_code=1, signal=None, runtime_s=18.9)
    s0.at(19.93, "restart_decision", local_rank=0, global_rank=0, scope="job", decision="restart",
          reason="child failed (exit code 1)", budget_left=3, signature=signature)  # fmt: skip
    s0.at(19.95, "job_restart", epoch=1, phase="stopping", cause={"rank": 0, "node": 0, "signature": signature})
    s0.at(20.2, "job_restart", epoch=1, phase="ready", ready=1, nodes=2)
    s0.at(20.3, "child_start", local_rank=0, child_pid=200, global_rank=0, attempt=1)
    s0.at(20.3, "job_restart", epoch=1, phase="started")
    s0.at(23.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=3.0, last_seen_wall=T0 + 20.0,
          seen_by=0, action="spare", replaced_by=2, ranks=[1])  # fmt: skip
    sups[2].at(23.2, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.2)
    lost = {"rank": None, "node": 1, "signature": "node lost"}
    for i in (0, 2):
        sups[i].at(23.3, "job_restart", epoch=2, phase="stopping", cause=lost)
        sups[i].at(23.8, "job_restart", epoch=2, phase="ready", ready=2, nodes=2)
        sups[i].at(24.0, "child_start", local_rank=0, child_pid=300 + i, global_rank=min(i, 1), attempt=2)
        sups[i].at(24.0, "job_restart", epoch=2, phase="started")
        sups[i].at(50.0, "supervisor_end", exit_code=0, reason="all children ended")
    for sup in sups:
        sup.close()
    report = build_report(tmp_path, sacct=False)
    first, second = report.timeline[:2]
    assert (first.cause, first.first_rank, first.first_host, first.ordering) == (signature, 0, "n0", "job_restart")
    assert (second.cause, second.first_node, second.first_host, second.ordering) == (
        "node lost", 1, "n1", "node_lost",
    )  # fmt: skip
    assert report.node_losses[0].round == second.round


@pytest.mark.parametrize(
    ("hung_at", "stale", "own"),
    [(20.45, 2.0, False), (19.0, 5.0, True), (20.45, 10.0, True)],
    ids=["in-the-loss-window", "before-the-loss", "told-in-the-window-begun-long-before"],
)
def test_a_stretch_the_loss_explains_leaves_out_the_hangs_of_its_window(
    tmp_path: Path, hung_at: float, stale: float, own: bool
) -> None:
    """No Wrapper: the stretch is node 1's loss's (rank 0 failed after its last heartbeat).
    Rank 1's hang, begun in the loss's detection window before that heartbeat (without
    progress for 2 s, told just after it), follows from the loss: not a failure of its own,
    and rank 1 counts with the peers. A hang begun long before the heartbeat stays its own,
    whether told before it or after it: a hang counts from its onset, as the stretch's first
    failure does."""
    _survivor_failed_near_a_loss(tmp_path, 20.5, hangs=((1, hung_at, stale),))
    first = build_report(tmp_path, sacct=False).timeline[0]
    assert (first.cause, first.ordering, first.hang_ranks) == ("node lost", "node_lost", [1])
    assert (first.also_failed, first.peer_notified) == (([1], 1) if own else ([], 2))


def test_a_stretchs_loss_is_found_past_an_earlier_loss_whose_window_is_still_open(tmp_path: Path) -> None:
    """No Wrapper, 3 nodes x 2 ranks: node 2 is lost (last seen 10 s, declared 13 s), the
    spare never comes, so its window stays open; the job restarts without it (14 s). Node 1
    is then lost too (last seen 20 s, declared 23 s), and rank 0 fails after that (20.5 s).
    Both windows hold rank 0's failure: the second stretch is node 1's loss's, not rank 0's
    own failure, though the first loss began in the first stretch. Rank 1's hang, begun in
    the second stretch before node 1's detection window, is its own: only the first loss's
    window, not the stretch's loss's, holds it."""
    hosts = {n: Host(f"n{n}", n) for n in (0, 1, 2)}
    sup = {n: Proc(tmp_path, h, "supervisor") for n, h in hosts.items()}
    for n, s in sup.items():
        s.at(0.0, "supervisor_start", nnodes=3, nproc_per_node=2, command=["train.py"])
        for lr in (0, 1):
            s.at(1.0, "child_start", local_rank=lr, child_pid=100 + lr, global_rank=2 * n + lr, attempt=0)
    s0 = sup[0]
    s0.at(13.0, "node_lost", lost_node=2, lost_slot=2, lost_host="n2", silent_s=3.0, last_seen_wall=T0 + 10.0,
          seen_by=0, slurm_state=None, action="spare", replaced_by=3, ranks=[4, 5])  # fmt: skip
    for n in (0, 1):
        s = sup[n]
        s.at(13.1, "job_restart", epoch=1, phase="stopping", cause={"rank": None, "node": 2, "signature": "node lost"})
        for lr in (0, 1):
            s.at(13.5, "child_exit", local_rank=lr, child_pid=100 + lr, global_rank=2 * n + lr, exit_code=None,
                 signal="SIGTERM", runtime_s=12.5)  # fmt: skip
            s.at(14.0, "child_start", local_rank=lr, child_pid=200 + lr, global_rank=2 * n + lr, attempt=1)
        s.at(14.0, "job_restart", epoch=1, phase="started")
    s0.at(19.0, "hang", rank=1, local_rank=1, child_pid=201, timeout="heartbeat", stale_s=4.0, stack=HANG_STACK)
    s0.at(20.5, "child_exit", local_rank=0, child_pid=200, global_rank=0, exit_code=1, signal=None, runtime_s=6.5)
    s0.at(20.51, "restart_decision", local_rank=0, global_rank=0, scope="job", decision="restart",
          reason="child failed (exit code 1)", budget_left=3, signature=PEER_LOST)  # fmt: skip
    s0.at(20.52, "job_restart", epoch=2, phase="stopping", cause={"rank": 0, "node": 0, "signature": PEER_LOST})
    s0.at(23.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=3.0, last_seen_wall=T0 + 20.0,
          seen_by=0, slurm_state=None, action="stop", replaced_by=None, ranks=[2, 3])  # fmt: skip
    s0.at(23.5, "supervisor_end", exit_code=1, reason="node lost")
    for s in sup.values():
        s.close()
    report = build_report(tmp_path, sacct=False)
    first, second = report.timeline[:2]
    assert (first.cause, first.first_host, first.ordering) == ("node lost", "n2", "node_lost")
    assert (second.cause, second.first_node, second.first_host, second.ordering) == (
        "node lost", 1, "n1", "node_lost",
    )  # fmt: skip
    assert (second.hang_ranks, second.also_failed) == ([1], [1])
    rounds = {x.host: x.round for x in report.node_losses}
    assert rounds == {"n2": first.round, "n1": second.round}, rounds


def test_a_restart_for_a_lost_node_is_the_losss_round_under_the_apps_own_round_counter(
    tmp_path: Path,
) -> None:
    """No Wrapper, but the app writes its own round (as the demo does): node 1 is lost (last
    seen 20 s, declared 23 s) and the job-wide restart is announced for it. The loss was
    first placed in the app's round 3; the stretch (round 0) is the loss's round."""
    hosts = {n: Host(f"n{n}", n) for n in (0, 1)}
    sup = {n: Proc(tmp_path, h, "supervisor") for n, h in hosts.items()}
    apps = []
    for n, s in sup.items():
        s.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2, command=["train.py"])
        for lr in (0, 1):
            s.at(1.0, "child_start", local_rank=lr, child_pid=100 + lr, global_rank=2 * n + lr, attempt=0)
            app = Proc(tmp_path, hosts[n], "app", rank=2 * n + lr)
            app.round(3).at(2.0, "progress", step=1)  # the app's count, not the stretch's
            app.at(15.0, "progress", step=10)
            apps.append(app)
    s0 = sup[0]
    s0.at(23.0, "node_lost", lost_node=1, lost_slot=1, lost_host="n1", silent_s=3.0, last_seen_wall=T0 + 20.0,
          seen_by=0, slurm_state=None, action="stop", replaced_by=None, ranks=[2, 3])  # fmt: skip
    s0.at(23.1, "job_restart", epoch=1, phase="stopping", cause={"rank": None, "node": 1, "signature": "node lost"})
    for lr in (0, 1):
        s0.at(23.6, "child_exit", local_rank=lr, child_pid=100 + lr, global_rank=lr, exit_code=None,
              signal="SIGTERM", runtime_s=22.6)  # fmt: skip
    s0.at(24.0, "supervisor_end", exit_code=1, reason="node lost")
    for p in [*sup.values(), *apps]:
        p.close()
    report = build_report(tmp_path, sacct=False)
    first = report.timeline[0]
    assert (first.cause, first.first_host, first.ordering, first.detection_s) == ("node lost", "n1", "node_lost", 3.0)
    assert first.peer_notified == 2
    assert (first.round, report.node_losses[0].round) == (0, 0)


def test_a_job_wide_restart_that_timed_out_is_where_the_job_stopped_not_a_recovery(tmp_path: Path) -> None:
    """3 monitors of one rank each (``fork_and_monitor``, no node liveness); monitor 2 is gone
    when rank 1 fails at t=20: monitors 0 and 1 count themselves ready, wait for slot 2, then
    stop the job (``job_restart`` phase ``timed_out``, exit 6). The failure's stretch ends the
    job: it is not recovered, and no stretch follows it, as no rank started again."""
    sups = [Proc(tmp_path, Host(f"n{i}", i), "supervisor") for i in range(3)]
    for i, sup in enumerate(sups):
        sup.at(0.0, "supervisor_start", nnodes=3, nproc_per_node=1, command=["train.py"])
        sup.at(0.5, "child_start", local_rank=0, child_pid=100 + i, global_rank=i, attempt=0)
    cause = {"rank": 1, "node": 1, "signature": "exit code 1"}
    sups[1].at(20.0, "child_exit", local_rank=0, child_pid=101, global_rank=1, exit_code=1, signal=None,
               runtime_s=19.5, attempt=0)  # fmt: skip
    sups[1].at(20.05, "restart_decision", local_rank=0, global_rank=1, scope="job", decision="restart",
               reason="child failed", budget_left=3, signature=cause["signature"])  # fmt: skip
    for i, sup in enumerate(sups[:2]):
        sup.at(20.1, "job_restart", epoch=1, phase="stopping", cause=cause)
        if i == 0:
            sup.at(20.3, "child_exit", local_rank=0, child_pid=100, global_rank=0, exit_code=None,
                   signal="SIGTERM", runtime_s=19.8, attempt=0)  # fmt: skip
        sup.at(20.4, "job_restart", epoch=1, phase="ready", ready=i + 1, nodes=3)
        sup.at(31.4, "job_restart", epoch=1, phase="timed_out", missing=[2], limit_s=11.0)
        sup.at(31.4, "job_stop", reason="job-wide restart 1: node slot(s) 2 never became ready", exit_code=6)
        sup.at(31.5, "supervisor_end", exit_code=6, reason="job-wide restart 1: node slot(s) 2 never became ready")
    for sup in sups:
        sup.close()
    report = build_report(tmp_path, sacct=False)
    assert report.summary.restarts.job_wide == 0
    [row] = report.timeline
    assert (row.round, row.outcome, row.cause, row.first_rank) == (0, "stopped", "exit code 1", 1)
    fault = next(line for line in report.to_text("table").splitlines() if line.startswith("1 "))
    assert fault.split()[-2:] == ["no", "-"], fault  # recovered: no
