"""nvrx-report files each event under the run of its SLURM job that its writer recorded
(``slurm_run``, from ``SLURM_RESTART_COUNT``), whenever the event was written: a node cut
off from run 0 that still writes after the requeued job's run 1 started has its events told
under run 0. Events without it (older writers) are filed by the supervisor starts, as before.

The events are written by the real ``EventWriter``, its context read from each process's
environment by ``context_from_env`` as the writers read it (``test_report_fixtures.Proc``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_report_fixtures import T0, Host, Proc

from nvrx.events.failures import NODE_LOST_SIGNATURE, slurm_signature
from nvrx.report import Report, build_report
from nvrx.report.html_lanes import build_lanes
from nvrx.report.render import render

SLURM_JOB = "4242"
REASON = "node lost, no spare: 1 nodes left, below --min-nodes 2"


def _env(run: int | None, slurm_job: str = SLURM_JOB) -> dict[str, str] | None:
    """The SLURM variables of a process of run ``run`` of ``slurm_job`` (SLURM sets no
    ``SLURM_RESTART_COUNT`` on a job's first run); None: an older writer, which records none."""
    if run is None:
        return None
    env = {"SLURM_JOB_ID": slurm_job}
    if run:
        env["SLURM_RESTART_COUNT"] = str(run)
    return env


class Run:
    """One run of a 2-node job of one rank per node: its supervisors by slot, its ranks.
    ``skew``: seconds a slot's host's wall clock is ahead (behind, negative)."""

    def __init__(
        self, log_dir: Path, t: float, hosts: dict[int, str], run: int | None,
        slurm_job: str = SLURM_JOB, skew: dict[int, float] | None = None,
    ) -> None:  # fmt: skip
        self.dir, self.hosts, self.env = log_dir, hosts, _env(run, slurm_job)
        self.machines = {slot: Host(name, slot, (skew or {}).get(slot, 0.0)) for slot, name in hosts.items()}
        self.sup = {
            slot: Proc(log_dir, host, "supervisor", job=SLURM_JOB, env=self.env)
            for slot, host in self.machines.items()
        }
        self.procs: list[Proc] = [*self.sup.values()]
        for sup in self.sup.values():
            sup.at(
                t, "supervisor_start", nnodes=2, nproc_per_node=1, spare_nodes=0,
                slurm_job_id=slurm_job,
            )  # fmt: skip
        self.ranks = {slot: self.start_rank(t + 0.5, slot) for slot in hosts}

    def start_rank(self, t: float, slot: int, attempt: int = 0) -> Proc:
        """The supervisor of ``slot`` starts its rank (rank = slot); its Wrapper's writer."""
        self.sup[slot].at(
            t, "child_start", local_rank=0, child_pid=100 * (attempt + 1) + slot,
            attempt=attempt, global_rank=slot,
        )  # fmt: skip
        proc = Proc(self.dir, self.machines[slot], "wrapper", rank=slot, job=SLURM_JOB, env=self.env)
        self.procs.append(proc)
        return proc

    def round_start(self, t: float, rnd: int, ranks: dict[int, Proc]) -> None:
        for rank, proc in ranks.items():
            proc.round(rnd).at(t, "round_start", world_size=2, initial_rank=rank)
            proc.at(t + 0.01, "call_start", note="enter")

    def node_lost(self, t: float, by: int, lost: int) -> None:
        """Slot ``by`` declares slot ``lost`` lost, and the job stops: no spare."""
        self.sup[by].at(
            t, "node_lost", lost_node=lost, lost_slot=lost, lost_host=self.hosts[lost],
            silent_s=3.0, last_seen_wall=T0 + t - 3.0, seen_by=by, action="stop", ranks=[lost],
        )  # fmt: skip
        self.sup[by].at(t + 0.01, "job_stop", reason=REASON, exit_code=8)

    def complete(self, t: float) -> None:
        for proc in self.ranks.values():
            proc.at(t, "call_end", duration_s=5.0, outcome="completed")
            proc.at(t, "round_end", outcome="completed", duration_s=5.0)
            proc.at(t, "wrapper_end", outcome="completed", rounds=1)
        for sup in self.sup.values():
            sup.at(t + 1.0, "supervisor_end", exit_code=0, reason="all children ended")

    def close(self) -> None:
        for proc in self.procs:
            proc.close()


def _report(log_dir: Path, *runs: Run, output: str | None = None) -> Report:
    """The report of ``log_dir`` once the writers of every run of ``runs`` are closed; with
    ``output``, SLURM's ``slurm-<job>.out`` beside ``log_dir`` holding it."""
    for run in runs:
        run.close()
    if output is None:
        return build_report(log_dir, sacct=False)
    out = log_dir.parent / f"slurm-{SLURM_JOB}.out"
    out.write_text(output)
    return build_report(log_dir, sacct=False, slurm_output=[out])


def _requeued_with_a_late_writer(log_dir: Path, recorded: bool = True) -> dict[str, Any]:
    """Run 0 on node-a and node-b: node-b is cut off at ~11 s, node-a declares it lost at 14 s
    and the job, with no spare, stops and is requeued. Run 1 starts at 40 s on node-a and
    node-c and completes at 60 s. Meanwhile node-b's supervisor of run 0, cut off but alive,
    goes on: at 50 s it declares node-a lost (it cannot see it), and restarts its rank, whose
    new process starts round 1 of run 0. ``recorded``: the writers record their SLURM run
    (else: older writers). The report's JSON."""
    hosts0 = {0: "node-a", 1: "node-b"}
    run0 = Run(log_dir, 0.0, hosts0, 0 if recorded else None)
    run0.round_start(5.0, 0, run0.ranks)
    run0.node_lost(14.4, by=0, lost=1)
    run0.sup[0].at(
        14.9, "requeue", cause="node_failure", count=1, excluded=["node-b"], run=0,
        issued_by="nvrx", slurm_job_id=SLURM_JOB,
    )  # fmt: skip
    run0.sup[0].at(15.0, "supervisor_end", exit_code=8, reason=REASON)
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1 if recorded else None)
    run1.round_start(45.0, 0, run1.ranks)
    run0.node_lost(50.0, by=1, lost=0)  # late: run 1 started 10 s before
    late = run0.start_rank(50.2, 1, attempt=1)
    run0.round_start(51.0, 1, {1: late})
    run1.complete(60.0)
    return _report(log_dir, run0, run1).to_dict()


def test_a_cut_off_nodes_late_events_are_told_under_the_run_its_writer_recorded(
    tmp_path: Path,
) -> None:
    data = _requeued_with_a_late_writer(tmp_path / "job")
    assert data["summary"]["runs"] == 2
    losses = {(loss["run"], loss["slot"]) for loss in data["node_losses"]}
    assert losses == {(0, 1), (0, 0)}  # node-b's late declaration is of run 0, not run 1
    rows = {(row["run"], row["round"]) for row in data["timeline"]}
    assert rows == {(0, 0), (0, 1), (1, 0)}  # the late process's round 1 too
    assert data["summary"]["outcome"] == "completed"


def test_a_cut_off_nodes_late_events_do_not_shorten_the_wait_for_the_requeue(
    tmp_path: Path,
) -> None:
    """Run 0 ended for the job when node-a's supervisor ended (15 s), run 1 began at 40 s:
    the 25 s between are the requeue's, though node-b, cut off, writes under run 0 until 51 s."""
    ledger = _requeued_with_a_late_writer(tmp_path / "job")["summary"]["time_ledger"]
    assert ledger["requeue_wait_s"] == pytest.approx(25.0)


def test_older_writers_late_events_are_still_filed_by_the_supervisor_starts(
    tmp_path: Path,
) -> None:
    """What docs/report.md says of events without ``slurm_run``: filed under the run of their
    node rank's latest supervisor start, so the late ones land in run 1."""
    data = _requeued_with_a_late_writer(tmp_path / "job", recorded=False)
    losses = {(loss["run"], loss["slot"]) for loss in data["node_losses"]}
    assert losses == {(0, 1), (1, 0)}
    rows = {(row["run"], row["round"]) for row in data["timeline"]}
    assert rows == {(0, 0), (1, 1), (1, 0)}


def test_runs_of_a_job_submitted_again_under_one_job_id_are_told_apart_by_their_starts(
    tmp_path: Path,
) -> None:
    """Each SLURM job counts its runs from 0: two submissions under one ``NVRX_JOB_ID`` both
    record run 0, and the report tells their runs apart by the supervisor starts instead."""
    log_dir = tmp_path / "job"
    first = Run(log_dir, 0.0, {0: "node-a", 1: "node-b"}, 0, slurm_job="100")
    first.round_start(5.0, 0, first.ranks)
    first.complete(10.0)
    second = Run(log_dir, 40.0, {0: "node-a", 1: "node-b"}, 0, slurm_job="200")
    second.round_start(45.0, 0, second.ranks)
    second.complete(60.0)
    data = _report(log_dir, first, second).to_dict()
    assert data["summary"]["runs"] == 2
    assert {(row["run"], row["round"]) for row in data["timeline"]} == {(0, 0), (1, 0)}


def _fault(proc: Proc, t: float, exc_type: str, rank: int, message: str = "x") -> None:
    proc.at(t, "call_end", duration_s=1.0, outcome="fault")
    proc.at(t, "fault", fault_kind="exception", origin_rank=rank, exc_type=exc_type, message=message, detection_s=0.0)


def _late_fault_beside_a_failing_round(log_dir: Path) -> Report:
    """Run 0 as in ``_requeued_with_a_late_writer``: node-b, cut off, is declared lost and
    the job requeued. In run 1, rank 0 raises a ``KeyError`` in round 0 and again in round 1
    (its rounds restart). Meanwhile node-b's supervisor of run 0 restarts its rank, whose new
    process starts round 1 of run 0 at 51 s and raises a ``ValueError`` at 52 s: within run 1's
    round 1 by time, whose cause is rank 0's error."""
    run0 = _slot_1_lost(log_dir)
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1)
    for rnd, t in ((0, 45.0), (1, 49.0)):
        run1.round_start(t, rnd, run1.ranks)
        _fault(run1.ranks[0], t + 3.0, "KeyError", 0)
        for proc in run1.ranks.values():
            proc.at(t + 3.5, "round_end", outcome="restart", duration_s=3.5)
    run1.round_start(55.0, 2, run1.ranks)
    late = run0.start_rank(50.2, 1, attempt=1)
    run0.round_start(51.0, 1, {1: late})
    _fault(late, 52.0, "ValueError", 1)
    run1.complete(60.0)
    return _report(log_dir, run0, run1)


def test_a_late_fault_of_a_cut_off_node_is_marked_under_the_run_its_writer_recorded(
    tmp_path: Path,
) -> None:
    """The HTML timeline's mark of the late ``ValueError`` is told under run 0's round 1, where
    the report files it, not under run 1's round 1 that it falls in by time: there it would
    be taken for a consequence of rank 0's ``KeyError`` and drawn nowhere."""
    report = _late_fault_beside_a_failing_round(tmp_path / "job")
    errors = {(row.run, row.round): row.cause for row in report.timeline}
    late = next(m for m in report.activity.faults if m.rank == 1 and "ValueError" in m.signature)
    assert (late.run, late.round, late.wall) == (0, 1, T0 + 52.0)
    assert "ValueError" in (errors[(0, 1)] or "") and "KeyError" in (errors[(1, 1)] or "")
    ids = {f.signature: f"fault-{i}" for i, f in enumerate(report.failures)}
    lanes = {lane.ident: lane for lane in build_lanes(report, ids).lanes if lane.kind == "rank"}
    marks = [(m.wall, m.fault.signature) for m in lanes[1].marks]
    assert marks[1:] == [(T0 + 52.0, late.signature)] and marks[0][1] == NODE_LOST_SIGNATURE
    assert [m.fault.run for m in lanes[0].marks] == [1, 1]  # rank 0's errors, in run 1


#: A fault of the node's own device: evidence against its node, unless a node loss explains it.
ECC = "CUDA error: uncorrectable ECC error encountered"


def _ecc_fault_told(data: dict[str, Any], run: int, rnd: int, host: str) -> None:
    """The report tells the ECC fault on ``host`` as its own: the first failure of round
    ``rnd`` of run ``run``, a failure of ``host`` in the table, and evidence that leaves
    ``host`` out of the next run."""
    rows = {(row["run"], row["round"]): row for row in data["timeline"]}
    assert (rows[(run, rnd)]["cause"], rows[(run, rnd)]["first_host"]) == ("RuntimeError", host)
    assert {f["signature"]: f["hosts"] for f in data["failures"]}["RuntimeError"] == [host]
    suspect = next(s for s in data["suspects"] if s["host"] == host)
    assert "device or driver fault: RuntimeError" in suspect["evidence"]
    assert host in (data["exclude"] or "").split(",")


def _slot_1_lost(log_dir: Path, hosts: dict[int, str] | None = None) -> Run:
    """Run 0 on ``hosts`` (node-a and node-b): slot 0 declares slot 1 lost at 14.4 s (last
    seen 11.4 s) and the job, with no spare, stops (its supervisor ends at 15 s)."""
    run0 = Run(log_dir, 0.0, hosts or {0: "node-a", 1: "node-b"}, 0)
    run0.round_start(5.0, 0, run0.ranks)
    run0.node_lost(14.4, by=0, lost=1)
    run0.sup[0].at(15.0, "supervisor_end", exit_code=8, reason=REASON)
    return run0


def _cut_off_and_requeued(
    log_dir: Path, run1_at: float = 40.0, skew: dict[int, float] | None = None
) -> tuple[Run, Run]:
    """Run 0 on node-a and node-b: node-a declares node-b lost at 14.4 s (last seen 11.4 s)
    and the job, with no spare, stops and is requeued; run 1, on node-a and node-c (the
    clocks of ``skew``), starts at ``run1_at``. node-b is only cut off: its supervisor of
    run 0 may go on writing."""
    return _slot_1_lost(log_dir), Run(log_dir, run1_at, {0: "node-a", 1: "node-c"}, 1, skew=skew)


def _thawed_declares_node_a_lost(run0: Run) -> None:
    """node-b, frozen in run 0 since 11 s, thaws at 50 s (after run 1 began) and declares
    node-a lost as it last saw it, at 11 s."""
    run0.sup[1].at(
        50.0, "node_lost", lost_node=0, lost_slot=0, lost_host="node-a", silent_s=39.0,
        last_seen_wall=T0 + 11.0, seen_by=1, action="stop", ranks=[0],
    )  # fmt: skip


def _late_loss_of_node_a(run0: Run, run1: Run) -> None:
    """Run 1 trains from 45 s and completes at 60 s; node-b, cut off from run 0, declares
    node-a lost at 50 s, after run 1 began."""
    run1.round_start(45.0, 0, run1.ranks)
    run0.node_lost(50.0, by=1, lost=0)
    run1.complete(60.0)


def _ecc_fault_then_completed(run: Run, started: float, t: float, next_at: float) -> None:
    """Rank 1 of ``run``, in round 0 since ``started``, reports an ECC fault at ``t``; every
    rank restarts half a second later, starts round 1 at ``next_at`` and completes at 60 s."""
    _fault(run.ranks[1], t, "RuntimeError", 1, ECC)
    for proc in run.ranks.values():
        proc.at(t + 0.5, "round_end", outcome="restart", duration_s=t + 0.5 - started)
    run.round_start(next_at, 1, run.ranks)
    run.complete(60.0)


def test_a_cut_off_nodes_late_node_loss_explains_no_fault_of_the_next_run(tmp_path: Path) -> None:
    """node-b, cut off from run 0, declares node-a lost at 50 s (last seen 47 s), after run 1
    began (40 s): that loss is run 0's, and node-c's own ECC fault in run 1 (52 s) is told as
    node-c's, not taken for a consequence of it."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    run1.round_start(45.0, 0, run1.ranks)
    run0.node_lost(50.0, by=1, lost=0)  # late: run 1 started 10 s before
    _ecc_fault_then_completed(run1, 45.0, 52.0, 55.0)
    data = _report(log_dir, run0, run1).to_dict()
    assert {(loss["run"], loss["slot"]) for loss in data["node_losses"]} == {(0, 1), (0, 0)}
    _ecc_fault_told(data, 1, 0, "node-c")


@pytest.mark.parametrize("recorded", [True, False])
def test_a_node_loss_at_a_runs_very_end_explains_no_fault_of_the_next_run(
    tmp_path: Path, recorded: bool
) -> None:
    """Run 0 loses node-b at 30 s (last seen 27 s) and goes on without it, but is ended and
    requeued at 32 s: the loss's window (until a smaller round, else 30 s past the loss) ends
    with the run. Run 1 begins at 40 s; node-c's ECC fault at 45 s is its own, whether its
    writer recorded its run or the report infers it (older writers)."""
    log_dir = tmp_path / "job"
    run0 = Run(log_dir, 0.0, {0: "node-a", 1: "node-b"}, 0 if recorded else None)
    run0.round_start(5.0, 0, run0.ranks)
    run0.sup[0].at(
        30.0, "node_lost", lost_node=1, lost_slot=1, lost_host="node-b", silent_s=3.0,
        last_seen_wall=T0 + 27.0, seen_by=0, action="shrink", ranks=[1],
    )  # fmt: skip
    run0.sup[0].at(32.0, "supervisor_end", exit_code=143, reason="terminated by SIGTERM")
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1 if recorded else None)
    run1.round_start(41.0, 0, run1.ranks)
    _ecc_fault_then_completed(run1, 41.0, 45.0, 47.0)
    data = _report(log_dir, run0, run1).to_dict()
    assert [(loss["run"], loss["node"]) for loss in data["node_losses"]] == [(0, 1)]
    _ecc_fault_told(data, 1, 0, "node-c")


def test_a_node_loss_of_the_next_run_explains_no_late_fault_of_a_cut_off_node(tmp_path: Path) -> None:
    """The reverse: node-b, cut off from run 0, restarts its rank (round 1 of run 0), which
    reports an ECC fault at 48 s; run 1 loses node-c at 50 s (last seen 47 s). The fault is
    filed under run 0 and told as node-b's own, not taken for a consequence of run 1's loss."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    run1.round_start(45.0, 0, run1.ranks)
    late = run0.start_rank(45.2, 1, attempt=1)
    run0.round_start(46.0, 1, {1: late})
    _fault(late, 48.0, "RuntimeError", 1, ECC)
    run1.node_lost(50.0, by=0, lost=1)
    data = _report(log_dir, run0, run1).to_dict()
    assert {(loss["run"], loss["host"]) for loss in data["node_losses"]} == {(0, "node-b"), (1, "node-c")}
    _ecc_fault_told(data, 0, 1, "node-b")


def test_a_node_loss_declared_after_its_run_ended_explains_nothing(tmp_path: Path) -> None:
    """node-b, cut off from run 0, declares node-a lost at 50 s, after run 1 began (40 s): the
    job was not getting over a loss of run 0 then, so the ECC fault node-b's restarted rank
    reports under run 0 at 52 s is node-b's own, not a consequence of that loss."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    run1.round_start(45.0, 0, run1.ranks)
    run0.node_lost(50.0, by=1, lost=0)
    late = run0.start_rank(50.2, 1, attempt=1)
    run0.round_start(51.0, 1, {1: late})
    _fault(late, 52.0, "RuntimeError", 1, ECC)
    run1.complete(60.0)
    data = _report(log_dir, run0, run1).to_dict()
    assert {(loss["run"], loss["slot"]) for loss in data["node_losses"]} == {(0, 1), (0, 0)}
    _ecc_fault_told(data, 0, 1, "node-b")


def test_a_cut_off_nodes_late_node_loss_explains_no_process_end_of_the_next_run(
    tmp_path: Path,
) -> None:
    """node-c's rank of run 1 is killed at 52 s, after node-b, cut off from run 0, declared
    node-a lost (50 s): its end is node-c's, not one the job got over that loss with."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    run1.round_start(45.0, 0, run1.ranks)
    run0.node_lost(50.0, by=1, lost=0)
    run1.sup[1].at(52.0, "child_exit", local_rank=0, child_pid=101, global_rank=1, signal="SIGKILL", runtime_s=11.5)
    report = _report(log_dir, run0, run1)
    ended = next(p for p in report.process_restarts if p.host == "node-c")
    assert (ended.run, ended.signal, ended.explained_by) == (1, "SIGKILL", None)
    killed = next(f for f in report.failures if f.category == "signal")
    assert killed.hosts == ["node-c"]


def test_a_cut_off_nodes_late_node_loss_is_no_evidence_against_the_node_it_names(
    tmp_path: Path,
) -> None:
    """node-b, cut off from run 0, declares node-a lost at 50 s, after the job went on to run 1
    (40 s), where node-a trained on: node-a is no suspect, not in ``--exclude``, and not a lost
    node in the failures, the answer, the HTML timeline, the counts or the time ledger. The lost-node table says who
    declared it and when, and node-b's own loss says it was cut off, not dead."""
    log_dir = tmp_path / "job"
    data = _requeued_with_a_late_writer(log_dir)
    losses = {(loss["run"], loss["host"]): loss for loss in data["node_losses"]}
    late, own = losses[(0, "node-a")], losses[(0, "node-b")]
    assert (late["after_run_end"], own["after_run_end"]) == (True, False)
    assert late["outcome"] == (
        "declared by slot 1 (node-b) after run 0 ended: its declarer was cut off from the job, "
        "which had gone on without it; no evidence against this node"
    )
    assert (late["round"], late["recovered_wall"]) == (None, None)
    assert data["exclude"] == "node-b"
    assert [s["host"] for s in data["suspects"]] == ["node-b"]
    assert data["suspects"][0]["evidence"] == [  # its own loss, which it was declared for
        "lost: silent 3.0 s to the job, cut off, not dead: it declared node-a lost after run 0 "
        "ended, SLURM not asked"
    ]
    assert {f["signature"]: f["hosts"] for f in data["failures"]}["node lost"] == ["node-b"]
    assert data["summary"]["restarts"]["node_loss"] == 1
    assert data["summary"]["time_ledger"]["detection_s"] == pytest.approx(3.0)  # node-b's silence
    report = build_report(log_dir, sacct=False)
    marks = [m for m in report.activity.faults if m.signature == NODE_LOST_SIGNATURE]
    assert [m.host for m in marks] == ["node-b"]  # no node-lost mark on the HTML timeline
    ended = [p.ended for p in report.activity.processes if (p.run, p.host) == (0, "node-a")]
    assert ended == [None]  # its end is not in the events: not one with the late loss
    text = render(report, width=None)
    assert "lost node node-a" not in text  # nor a fault in the answer's list
    row = next(line for line in text.splitlines() if "node-a" in line and "declared by" in line)
    assert "- (declared after its run ended)" in row
    assert "its declarer was cut off from the job" in row


def test_a_node_loss_declared_after_its_run_ended_explains_nothing_from_before_that_end(
    tmp_path: Path,
) -> None:
    """node-b, frozen at 11 s (node-a declares it lost at 14.4 s), thaws at 50 s, after run 1
    began (40 s), and declares node-a lost as it last saw it: at 11 s. That loss explains
    nothing, not even node-a's own ECC fault at 11.2 s in run 0: node-a is a suspect for its
    device, not for a loss."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    _fault(run0.ranks[0], 11.2, "RuntimeError", 0, ECC)
    run1.round_start(45.0, 0, run1.ranks)
    _thawed_declares_node_a_lost(run0)
    run1.complete(60.0)
    data = _report(log_dir, run0, run1).to_dict()
    late = next(loss for loss in data["node_losses"] if loss["host"] == "node-a")
    assert late["after_run_end"] is True
    assert {f["signature"]: f["hosts"] for f in data["failures"]}["RuntimeError"] == ["node-a"]
    suspect = next(s for s in data["suspects"] if s["host"] == "node-a")
    assert suspect["evidence"] == [  # nothing of a loss
        "device or driver fault: RuntimeError",
        "one fault of its own (RuntimeError): not enough to exclude",
    ]


@pytest.mark.parametrize("declarer_lost", [True, False])
def test_a_job_wide_restart_a_cut_off_node_announces_for_its_late_loss_blames_no_one_for_it(
    tmp_path: Path, declarer_lost: bool
) -> None:
    """Without the Wrapper: run 0 on node-a and node-b ends at 15 s, either with node-a
    declaring node-b lost (``declarer_lost``) or with node-a's own stop, and is requeued; run 1
    trains on node-a and node-c from 40 s. node-b's supervisor of run 0, cut off, declares
    node-a lost at 50 s and announces a job-wide restart for it. That restart ends run 0's
    stretch 0, but the loss it announces is no loss the job had: the stretch is node-b's own
    loss, where the job declared one, else names no failure; node-a is no suspect and not in
    the answer's list."""
    log_dir = tmp_path / "job"
    run0 = Run(log_dir, 0.0, {0: "node-a", 1: "node-b"}, 0)
    if declarer_lost:
        run0.node_lost(14.4, by=0, lost=1)
    else:
        run0.sup[0].at(14.4, "job_stop", reason="operator asked", exit_code=1)
    run0.sup[0].at(15.0, "supervisor_end", exit_code=8 if declarer_lost else 1, reason=REASON)
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1)
    cut_off = run0.sup[1]
    cut_off.at(
        50.0, "node_lost", lost_node=0, lost_slot=0, lost_host="node-a", silent_s=3.0,
        last_seen_wall=T0 + 47.0, seen_by=1, action="shrink", ranks=[0],
    )  # fmt: skip
    cause = {"rank": 0, "node": 0, "signature": NODE_LOST_SIGNATURE}
    cut_off.at(50.1, "job_restart", epoch=1, phase="stopping", cause=cause)
    cut_off.at(50.3, "job_restart", epoch=1, phase="ready", ready=1, nodes=1)
    cut_off.at(50.4, "child_start", local_rank=0, child_pid=201, attempt=1, global_rank=1)
    cut_off.at(50.5, "job_restart", epoch=1, phase="started")
    cut_off.at(55.0, "supervisor_end", exit_code=0, reason="all children ended")
    for sup in run1.sup.values():
        sup.at(60.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = _report(log_dir, run0, run1)
    data = report.to_dict()
    late = next(loss for loss in data["node_losses"] if loss["host"] == "node-a")
    assert (late["after_run_end"], late["round"]) == (True, None)
    row = next(row for row in data["timeline"] if (row["run"], row["round"]) == (0, 0))
    told = (row["cause"], row["first_host"], row["first_node"], row["ordering"])
    if declarer_lost:
        assert told == (NODE_LOST_SIGNATURE, "node-b", 1, "node_lost")
        assert next(loss for loss in data["node_losses"] if loss["host"] == "node-b")["round"] == 0
    else:
        assert told == (None, None, None, "none")
    assert "node-a" not in {s["host"] for s in data["suspects"]}
    assert "node-a" not in (data["exclude"] or "")
    answer = render(report, width=None).partition("\nSummary\n")[0]
    faults = [line for line in answer.splitlines() if line[:1].isdigit()]  # the list of faults
    assert [line for line in faults if "node-a" in line] == []
    assert [("lost node node-b (node 1)" in line) for line in faults] == ([True] if declarer_lost else [])


def test_a_loss_declared_just_before_the_requeue_counts_whatever_the_next_runs_clocks(
    tmp_path: Path,
) -> None:
    """node-a declares node-b lost at 14.4 s and the job is requeued; run 1 starts 10 s after
    node-a's supervisor ended, on node-a and node-c, whose clock is 12 s behind: its start
    reads 13 s, before the declaration. node-a's own clock, which started run 1 at 25 s,
    orders its declaration before that run: the loss is one the job had, and node-b a
    suspect for it."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir, run1_at=25.0, skew={1: -12.0})
    data = _report(log_dir, run0, run1).to_dict()
    assert [(loss["host"], loss["after_run_end"]) for loss in data["node_losses"]] == [("node-b", False)]
    assert data["exclude"] == "node-b"
    assert {f["signature"]: f["hosts"] for f in data["failures"]}["node lost"] == ["node-b"]


def test_a_node_loss_declared_after_its_run_ended_explains_no_process_end_of_the_node_it_names(
    tmp_path: Path,
) -> None:
    """node-a's rank of run 0 dies of SIGSEGV at 11.2 s, before node-b's last heartbeat
    (11.4 s); node-b, frozen then, thaws after run 1 began and declares node-a lost as it last
    saw it (11 s). That end is node-a's own, a failure of node-a, not its node's loss."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    run0.sup[0].at(11.2, "child_exit", local_rank=0, child_pid=100, global_rank=0, signal="SIGSEGV", runtime_s=10.7)
    run1.round_start(45.0, 0, run1.ranks)
    _thawed_declares_node_a_lost(run0)
    run1.complete(60.0)
    report = _report(log_dir, run0, run1)
    ended = next(p for p in report.process_restarts if p.host == "node-a")
    assert (ended.run, ended.signal, ended.explained_by) == (0, "SIGSEGV", None)
    assert next(f for f in report.failures if f.category == "signal").hosts == ["node-a"]


def test_a_late_loss_of_a_node_on_the_lost_nodes_host_leaves_that_host_healthy(
    tmp_path: Path,
) -> None:
    """Every slot on one host (a local job): slot 1, frozen, is declared lost by slot 0 and the
    job is run again. A node lost while a node that stayed healthy ran on its host is no
    evidence against that host; slot 1, thawed after run 1 began, declares slot 0 lost, which
    leaves slot 0 as healthy as it was: the host is still not excluded."""
    log_dir = tmp_path / "job"
    run0 = _slot_1_lost(log_dir, {0: "vm", 1: "vm"})
    run1 = Run(log_dir, 40.0, {0: "vm", 1: "vm"}, 1)
    _late_loss_of_node_a(run0, run1)
    data = _report(log_dir, run0, run1).to_dict()
    assert [(x["slot"], x["after_run_end"]) for x in data["node_losses"]] == [(1, False), (0, True)]
    assert data["exclude"] is None
    assert [(s["host"], s["evidence"]) for s in data["suspects"]] == [
        ("vm", ["lost, but nodes that stayed healthy ran on its host: not excluded"])
    ]


def test_srun_killing_the_task_of_a_node_declared_lost_after_its_run_ended_is_a_finding(
    tmp_path: Path,
) -> None:
    """srun's line for a lost node's task is told by the loss; node-a's (task 0) is not by
    the loss node-b, cut off, declared of it after run 1 began: no event says how it was
    killed, and it is a finding. node-b's own (task 1) is told by its loss."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    _late_loss_of_node_a(run0, run1)
    report = _report(
        log_dir, run0, run1, output="srun: error: node-b: task 1: Killed\nsrun: error: node-a: task 0: Killed\n"
    )
    assert [loss.after_run_end for loss in report.node_losses] == [False, True]
    assert [(f.signature, f.nodes, f.hosts) for f in report.log_findings] == [
        ("signal SIGKILL", [0], ["node-a"])
    ]


def test_slurms_node_failure_is_a_finding_when_the_jobs_only_loss_was_declared_after_its_run(
    tmp_path: Path,
) -> None:
    """SLURM's ``DUE TO NODE FAILURE`` is told by a node the job lost; node-b, cut off from
    run 0 after that run ended on node-a, declares node-a lost after run 1 began: the job lost
    no node, and SLURM's line is a finding."""
    log_dir = tmp_path / "job"
    run0 = Run(log_dir, 0.0, {0: "node-a", 1: "node-b"}, 0)
    run0.round_start(5.0, 0, run0.ranks)
    run0.sup[0].at(15.0, "supervisor_end", exit_code=8, reason=REASON)
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1)
    _late_loss_of_node_a(run0, run1)
    report = _report(
        log_dir, run0, run1,
        output=f"slurmstepd: error: *** STEP {SLURM_JOB}.0 ON node-b CANCELLED AT 2024-01-01T00:00:15 "
        "DUE TO NODE FAILURE ***\n",
    )  # fmt: skip
    assert [loss.after_run_end for loss in report.node_losses] == [True]
    assert [(f.signature, f.printed_by) for f in report.log_findings] == [
        (slurm_signature("node failure"), "SLURM (the whole job)")
    ]


def _srun_findings(log_dir: Path, lines: str) -> list[tuple[str, list[int], list[str]]]:
    """(signature, nodes, hosts) of the findings of srun's ``lines`` in ``slurm-<job>.out``."""
    report = _report(log_dir, output=lines)
    return [(f.signature, f.nodes, f.hosts) for f in report.log_findings]


def test_srun_killing_a_task_of_the_next_run_is_a_finding_though_its_slot_was_lost_before(
    tmp_path: Path,
) -> None:
    """A requeued job's runs append to one ``slurm-<job>.out``: srun's line names the task's
    host, which tells its run. Slot 1 was lost in run 0 on node-b; in run 1 slot 1 runs on
    node-c, whose task srun kills with no event saying why: a finding, not told by run 0's
    loss. node-b's own line is told by its loss, node-a's exit 8 of run 0 by its
    supervisor's end."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    run1.round_start(45.0, 0, run1.ranks)
    run0.close()
    run1.close()
    found = _srun_findings(
        log_dir,
        "srun: error: node-b: task 1: Killed\n"
        "srun: error: node-a: task 0: Exited with exit code 8\n"
        "srun: error: node-c: task 1: Killed\n",
    )  # fmt: skip
    assert found == [("signal SIGKILL", [1], ["node-c"])]


def test_srun_ending_a_task_of_the_next_run_is_a_finding_though_its_slot_ended_so_before(
    tmp_path: Path,
) -> None:
    """Run 0 on node-a and node-b stops: both supervisors end with exit code 1. In run 1 on
    node-a and node-c, node-a's supervisor ends so again, node-c's writes no end: srun's
    exit 1 of node-c's task 1 is a finding, not told by node-b's end in run 0."""
    log_dir = tmp_path / "job"
    run0 = Run(log_dir, 0.0, {0: "node-a", 1: "node-b"}, 0)
    run0.round_start(5.0, 0, run0.ranks)
    for sup in run0.sup.values():
        sup.at(15.0, "supervisor_end", exit_code=1, reason="a rank failed")
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1)
    run1.round_start(45.0, 0, run1.ranks)
    run1.sup[0].at(55.0, "supervisor_end", exit_code=1, reason="a rank failed")
    run0.close()
    run1.close()
    found = _srun_findings(
        log_dir,
        "srun: error: node-b: task 1: Exited with exit code 1\n"
        "srun: error: node-a: task 0: Exited with exit code 1\n"
        "srun: error: node-c: task 1: Exited with exit code 1\n",
    )  # fmt: skip
    assert found == [("exit code 1", [1], ["node-c"])]


def test_srun_line_of_a_task_that_ran_on_one_host_in_both_runs_is_told_by_either_runs_end(
    tmp_path: Path,
) -> None:
    """Slot 1 runs on node-b in run 0, where it is lost, and again in run 1: srun's line
    names no run, and the host cannot tell which, so the loss of run 0 still tells it."""
    log_dir = tmp_path / "job"
    run0 = _slot_1_lost(log_dir)
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-b"}, 1)
    run1.round_start(45.0, 0, run1.ranks)
    run0.close()
    run1.close()
    assert _srun_findings(log_dir, "srun: error: node-b: task 1: Killed\n") == []


ZERO_DIVISION = "ZeroDivisionError at train.py:9 in step"


def _raise(run: Run, slot: int, t: float) -> None:
    """Rank ``slot`` of ``run``, without the Wrapper, raises a ZeroDivisionError at ``t``."""
    app = Proc(run.dir, run.machines[slot], "app", rank=slot, job=SLURM_JOB, env=run.env)
    app.at(t, "fault", fault_kind="exception", origin_rank=slot, exc_type="ZeroDivisionError",
           message="division by zero", signature=ZERO_DIVISION)  # fmt: skip
    app.close()


def test_a_late_fault_of_a_cut_off_node_sets_no_onset_of_the_next_runs_job_wide_restart(
    tmp_path: Path,
) -> None:
    """Without the Wrapper. Run 0 on node-a and node-b: node-b is declared lost and the job
    requeued. In run 1 on node-a and node-c, rank 1 (node-c) raises a ZeroDivisionError at
    49.8 s, before node-a's last heartbeat (50 s; node-c declares it lost at 53 s), and its
    supervisor restarts the job for it: its own failure. Meanwhile node-b's rank 1 of run 0,
    cut off, raises the same error at 50.3 s, after that heartbeat: a fault of run 0, which
    says nothing of when run 1's failure began."""
    log_dir = tmp_path / "job"
    run0, run1 = _cut_off_and_requeued(log_dir)
    _raise(run1, 1, 49.8)
    _raise(run0, 1, 50.3)
    sup = run1.sup[1]
    sup.at(50.5, "child_exit", local_rank=0, child_pid=101, global_rank=1, exit_code=1, runtime_s=10.0)
    sup.at(50.51, "restart_decision", local_rank=0, global_rank=1, scope="job", decision="restart",
           reason="child failed (exit code 1)", budget_left=3, signature=ZERO_DIVISION)  # fmt: skip
    sup.at(50.52, "job_restart", epoch=1, phase="stopping", cause={"rank": 1, "node": 1, "signature": ZERO_DIVISION})
    sup.at(50.7, "job_restart", epoch=1, phase="ready", ready=1, nodes=2)
    sup.at(
        53.0, "node_lost", lost_node=0, lost_slot=0, lost_host="node-a", silent_s=3.0,
        last_seen_wall=T0 + 50.0, seen_by=1, action="stop", ranks=[0],
    )  # fmt: skip
    sup.at(53.5, "supervisor_end", exit_code=8, reason=REASON)
    report = _report(log_dir, run0, run1)
    first = next(row for row in report.timeline if (row.run, row.round) == (1, 0))
    assert (first.cause, first.first_rank, first.first_host, first.ordering) == (
        ZERO_DIVISION, 1, "node-c", "job_restart",
    )  # fmt: skip


def test_srun_line_of_a_lost_slot_whose_supervisor_wrote_nothing_is_told_by_its_loss(
    tmp_path: Path,
) -> None:
    """node-a declares slot 1 lost; slot 1's supervisor wrote no event, so no event names
    its host: srun's line for task 1 may be of that run, and the loss tells it."""
    log_dir = tmp_path / "job"
    run0 = Run(log_dir, 0.0, {0: "node-a"}, 0)
    run0.round_start(5.0, 0, run0.ranks)
    run0.hosts[1] = "node-x"
    run0.node_lost(14.4, by=0, lost=1)
    run0.sup[0].at(15.0, "supervisor_end", exit_code=8, reason=REASON)
    run0.close()
    assert _srun_findings(log_dir, "srun: error: node-x: task 1: Killed\n") == []
    assert _srun_findings(log_dir, "srun: error: node-a: task 0: Killed\n") == [
        ("signal SIGKILL", [0], ["node-a"])
    ]


def test_srun_line_of_the_next_run_is_a_finding_though_the_lost_slots_supervisor_wrote_nothing(
    tmp_path: Path,
) -> None:
    """Slot 1's supervisor on node-b wrote no event in run 0, where node-a declares it lost:
    the ``node_lost`` event names node-b as the slot's host. In run 1 slot 1 runs on node-c,
    whose task srun kills with no event saying why: a finding, not told by run 0's loss;
    node-b's own line is told by it."""
    log_dir = tmp_path / "job"
    run0 = Run(log_dir, 0.0, {0: "node-a"}, 0)
    run0.round_start(5.0, 0, run0.ranks)
    run0.hosts[1] = "node-b"
    run0.node_lost(14.4, by=0, lost=1)
    run0.sup[0].at(15.0, "supervisor_end", exit_code=8, reason=REASON)
    run1 = Run(log_dir, 40.0, {0: "node-a", 1: "node-c"}, 1)
    run1.round_start(45.0, 0, run1.ranks)
    run0.close()
    run1.close()
    found = _srun_findings(
        log_dir,
        "srun: error: node-b: task 1: Killed\n"
        "srun: error: node-c: task 1: Killed\n",
    )  # fmt: skip
    assert found == [("signal SIGKILL", [1], ["node-c"])]


def test_srun_line_naming_the_short_name_of_a_host_the_events_name_in_full_is_of_its_run(
    tmp_path: Path,
) -> None:
    """Events of an older writer name a host as the machine calls itself, here its full
    domain name; srun's line names the SLURM node, here the short name: the same host. One
    run, slot 1 lost on node-b: srun's line for task 1 is told by the loss."""
    log_dir = tmp_path / "job"
    run0 = _slot_1_lost(log_dir, {0: "node-a.cluster.example", 1: "node-b.cluster.example"})
    run0.close()
    assert _srun_findings(log_dir, "srun: error: node-b: task 1: Killed\n") == []
