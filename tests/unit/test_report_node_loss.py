"""nvrx-report on lost nodes: the *Lost nodes* section, the counts, who is blamed, --exclude.

The event logs are shaped like those of ``tests/multiproc/test_node_loss.py`` (3 local
supervisors x 2 ranks of the demo under the Wrapper, slot 1's whole process tree killed),
trimmed to what the report reads: supervisor events name their writer's *slot* as
``node``; the lost node's ranks write nothing after their last step; the spare's
children write as node rank 1, the one it took over. Times are seconds after ``T0``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_report_cli import SCHEMA_PATH, check_schema
from test_report_fixtures import T0, Host, Proc

from nvrx.report import Report, build_report

LAST_SEEN = 11.4  # slot 1's last heartbeat
DECLARED = 14.4  # slot 0 declares it lost, 3 s later
DIST_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/train.py", line 40, in train\n'
    "    dist.all_reduce(grad)\n"
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 9, in all_reduce\n'
    "    work.wait()\n"
    "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0\n"
)


class Job:
    """A job's simulated processes: supervisors by slot, training ranks by global rank."""

    def __init__(self, log_dir: Path, hosts: dict[int, str], nnodes: int, spares: int) -> None:
        self.dir, self.hosts = log_dir, hosts
        self.sup = {
            slot: Proc(log_dir, Host(name, slot), "supervisor") for slot, name in hosts.items()
        }
        self.ranks: dict[int, Proc] = {}
        for sup in self.sup.values():
            sup.at(0.0, "supervisor_start", nnodes=nnodes, nproc_per_node=2, spare_nodes=spares)
        self.others: list[Proc] = []

    def start_rank(self, t: float, rank: int, slot: int, node: int, attempt: int = 0) -> Proc:
        """The supervisor of ``slot`` starts ``rank`` as node rank ``node``."""
        self.sup[slot].at(
            t, "child_start", local_rank=rank % 2, child_pid=100 * (attempt + 1) + rank,
            attempt=attempt, global_rank=rank,
        )  # fmt: skip
        proc = Proc(self.dir, Host(self.hosts[slot], node), "wrapper", rank=rank)
        self.ranks[rank] = proc
        return proc

    def monitor(self, rank: int, node: int, slot: int) -> Proc:
        proc = Proc(self.dir, Host(self.hosts[slot], node), "monitor", rank=rank)
        self.others.append(proc)
        return proc

    def round_start(self, t: float, rnd: int, ranks: list[int]) -> None:
        for r in ranks:
            self.ranks[r].round(rnd).at(t, "round_start", world_size=len(ranks), initial_rank=r)
            self.ranks[r].at(t + 0.01, "call_start", note="enter")

    def round_restart(self, t: float, ranks: list[int]) -> None:
        for r in ranks:
            self.ranks[r].at(t, "call_end", duration_s=5.0, outcome="restart")
            self.ranks[r].at(t + 0.2, "round_end", outcome="restart", duration_s=10.0)

    def complete(self, t: float, ranks: list[int]) -> None:
        for r in ranks:
            self.ranks[r].at(t, "call_end", duration_s=5.0, outcome="completed")
            self.ranks[r].at(t, "round_end", outcome="completed", duration_s=5.0)
            self.ranks[r].at(t, "wrapper_end", outcome="completed", rounds=2)

    def node_lost(self, action: str, replaced_by: int | None = None, **more: Any) -> None:
        fields = {
            "lost_node": 1, "lost_slot": 1, "lost_host": self.hosts[1], "silent_s": 3.003,
            "last_seen_wall": T0 + LAST_SEEN, "seen_by": 0, "slurm_state": None,
            "action": action, "replaced_by": replaced_by, "ranks": [2, 3],
        }  # fmt: skip
        fields.update(more)
        self.sup[0].at(DECLARED, "node_lost", **fields)

    def close(self, **build: Any) -> Report:
        for proc in [*self.sup.values(), *self.ranks.values(), *self.others]:
            proc.close()
        return build_report(self.dir, sacct=False, **build)


def _raises(job: Job, rank: int, t: float, exc_type: str, message: str) -> None:
    """``rank`` raises ``exc_type`` at ``t`` in its current round, from the training code."""
    job.ranks[rank].at(
        t, "fault", fault_kind="exception", origin_rank=rank, exc_type=exc_type, message=message,
        traceback=DIST_TRACEBACK.replace(
            "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0",
            f"{exc_type}: {message}",
        ),
    )  # fmt: skip


def _spare_takes_over(job: Job) -> None:
    """Spare slot 2 takes node rank 1 just before slot 0 declares slot 1 lost; its
    children start as ranks 2 and 3."""
    job.sup[2].at(DECLARED - 0.05, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.004)
    for rank in (2, 3):
        job.start_rank(DECLARED - 0.04, rank, slot=2, node=1, attempt=1)
    job.node_lost("spare", replaced_by=2)


def _before_the_loss(job: Job) -> None:
    """Round 0 at world size 4: ranks 0-1 on slot 0, ranks 2-3 on slot 1; slot 1 dies at ~12 s."""
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(5.0, 0, [0, 1, 2, 3])
    for rank in (2, 3):  # their last step, then nothing: the node is gone
        job.ranks[rank].at(LAST_SEEN + 0.3, "progress", step=15)


def _spare_job(log_dir: Path, hosts: dict[int, str]) -> Report:
    """Spare slot 2 takes over node rank 1; its children rejoin; round 1 at world size 4."""
    job = Job(log_dir, hosts, nnodes=3, spares=1)
    _before_the_loss(job)
    return _recovered_by_the_spare(job)


def _recovered_by_the_spare(job: Job) -> Report:
    """Spare slot 2 takes over node rank 1; its children rejoin; round 1 at world size 4."""
    _spare_takes_over(job)
    job.round_restart(DECLARED + 0.01, [0, 1])
    job.round_start(17.6, 1, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    for slot in (0, 2):
        job.sup[slot].at(28.0, "supervisor_end", exit_code=0, reason="all children ended")
    return job.close()


@pytest.fixture
def spare(tmp_path: Path) -> Report:
    """The local spare takeover: every node on one host, as in the multiproc test."""
    return _spare_job(tmp_path / "job", {0: "vm", 1: "vm", 2: "vm"})


def test_spare_takeover_is_listed_with_detection_recovery_and_action(spare: Report) -> None:
    (loss,) = spare.node_losses
    assert (loss.node, loss.slot, loss.host, loss.ranks) == (1, 1, "vm", [2, 3])
    assert (loss.action, loss.replaced_by, loss.seen_by, loss.silent_s) == ("spare", 2, 0, 3.003)
    assert loss.last_seen_wall == pytest.approx(T0 + LAST_SEEN)
    assert loss.outcome == "spare slot 2 took over node rank 1"
    assert loss.takeover_s == 0.004 and loss.round == 0 and not loss.fenced
    # from its last heartbeat to round 1, the first round back at world size 4
    assert loss.recovered_wall == pytest.approx(T0 + 17.6)
    assert loss.recovery_s == pytest.approx(17.6 - LAST_SEEN)
    assert loss.world_size == 4
    text = spare.to_text(width=None)  # cells unwrapped
    assert "Lost nodes" in text
    assert "silent 3.003 s, seen by slot 0" in text
    assert "6.200 s (" in text and "world size 4)" in text
    assert "spare slot 2 took over node rank 1 (0.004 s after)" in text


def test_a_round_begun_before_the_declaration_is_no_recovery(tmp_path: Path) -> None:
    """The survivors restart at world size 4 between the node's last beat and its
    declaration (they still count the lost ranks): the recovery is the round after the
    spare took over, not that one."""
    job = Job(tmp_path / "job", {0: "vm", 1: "vm", 2: "vm"}, nnodes=3, spares=1)
    _before_the_loss(job)
    job.round_restart(LAST_SEEN + 0.01, [0, 1])
    job.round_start(LAST_SEEN + 0.03, 1, [0, 1])
    for rank in (0, 1):  # round 1 is at world size 4: ranks 2 and 3 are not known lost yet
        job.ranks[rank].round(1).at(LAST_SEEN + 0.04, "round_start", world_size=4)
    _spare_takes_over(job)
    job.round_restart(DECLARED + 0.01, [0, 1])
    job.round_start(17.6, 2, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    (loss,) = job.close().node_losses
    assert loss.recovered_wall == pytest.approx(T0 + 17.6)
    assert loss.recovery_s == pytest.approx(17.6 - LAST_SEEN)


def _lost_in_round_1_and_trained_again(job: Job) -> Report:
    """Round 1 runs when the spare takes over; round 2, at full size, trains to the end."""
    _spare_takes_over(job)
    job.round_restart(DECLARED + 0.01, [0, 1])
    job.round_start(17.6, 2, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    return job.close()


def test_a_node_that_beat_last_in_a_round_another_fault_ended_is_lost_in_the_next(
    tmp_path: Path,
) -> None:
    """Rank 0 raises in round 0; round 1 begins just after the lost node's last beat (its
    ranks start it, then die): the loss interrupted round 1, not round 0, whose cause stays
    rank 0's exception."""
    job = Job(tmp_path / "job", {0: "vm", 1: "vm", 2: "vm"}, nnodes=3, spares=1)
    _before_the_loss(job)
    _raises(job, 0, 9.0, "RuntimeError", "bad value")
    for rank in (1, 2, 3):
        job.ranks[rank].at(9.1, "fault", fault_kind="peer", origin_rank=0)
    job.round_restart(9.5, [0, 1, 2, 3])
    job.round_start(LAST_SEEN + 0.03, 1, [0, 1, 2, 3])
    report = _lost_in_round_1_and_trained_again(job)
    (loss,) = report.node_losses
    assert loss.round == 1 and loss.recovered_wall == pytest.approx(T0 + 17.6)
    causes = {row.round: row.cause for row in report.timeline}
    assert causes[0] == "RuntimeError at train.py:40 in train"
    assert causes[1] == "node lost"


def test_a_hang_detected_after_the_last_beat_but_begun_before_keeps_its_round(
    tmp_path: Path,
) -> None:
    """Rank 3 stops making progress at 5.9 s; its monitor tells the hang at 11.5 s, just
    after the node's last beat (11.4 s), and round 1 begins; the node dies in round 1. The
    hang began long before the node fell silent: round 0's cause stays the hang, and the
    loss interrupted round 1."""
    job = Job(tmp_path / "job", {0: "vm", 1: "vm", 2: "vm"}, nnodes=3, spares=1)
    _before_the_loss(job)
    monitor = job.monitor(3, node=1, slot=1)
    monitor.round(0).at(LAST_SEEN + 0.1, "hang", timeout="soft", stale_s=5.6)
    monitor.at(LAST_SEEN + 0.1, "fault", fault_kind="hang_soft", origin_rank=3,
               signature="hang_soft", detection_s=5.6)  # fmt: skip
    job.round_restart(LAST_SEEN + 0.12, [0, 1, 2, 3])
    job.round_start(LAST_SEEN + 0.35, 1, [0, 1, 2, 3])
    report = _lost_in_round_1_and_trained_again(job)
    (loss,) = report.node_losses
    assert loss.round == 1
    causes = {row.round: row.cause for row in report.timeline}
    assert causes[0] == "hang (soft timeout)" and causes[1] == "node lost", causes
    # the hang is a fault of its own, not one the loss explains: its own mark on the page
    hangs = [m for m in report.activity.faults if m.signature == "hang (soft timeout)"]
    assert [(m.rank, m.round) for m in hangs] == [(3, 0)]
    assert "hang (soft timeout)" in {f.signature for f in report.failures}


HANG = "hang (soft timeout)"


@pytest.mark.parametrize(
    ("told", "stale", "lost"),
    [(LAST_SEEN - 0.2, 1.8, True), (LAST_SEEN + 0.5, 6.0, False)],
    ids=["told-before-the-beat-begun-in-the-detection-window", "told-after-the-beat-begun-long-before"],
)
def test_a_survivors_hang_under_the_wrapper_counts_from_its_last_progress(
    tmp_path: Path, told: float, stale: float, lost: bool
) -> None:
    """Survivor rank 0's monitor tells a hang at ``told``, ``stale`` seconds after the rank's
    last progress; slot 1 beats last at 11.4 s (silent 3 s before its declaration). Begun
    in the loss's detection window, though told before the beat: the loss's, as a rank
    blocked on the lost peer is. Begun long before the beat, though told after it: rank
    0's own. As without the Wrapper; and the failure table, the activity marks and the
    suspect table say what the timeline says."""
    job = Job(tmp_path / "job", {0: "vm0", 1: "vm1", 2: "vm2"}, nnodes=3, spares=1)
    _before_the_loss(job)
    monitor = job.monitor(0, node=0, slot=0)
    monitor.round(0).at(told, "hang", timeout="soft", stale_s=stale)
    monitor.at(told, "fault", fault_kind="hang_soft", origin_rank=0, signature="hang_soft", detection_s=stale)
    report = _recovered_by_the_spare(job)
    first = report.timeline[0]
    assert (first.round, first.cause) == (0, "node lost" if lost else HANG)
    assert first.first_host == ("vm1" if lost else "vm0")
    own = 0 if lost else 1
    assert [f.count for f in report.failures if f.signature == HANG] == ([1] if own else [])
    assert [(m.rank, m.round) for m in report.activity.faults if m.signature == HANG] == [(0, 0)] * own
    assert {s.host: s.hangs for s in report.suspects}.get("vm0", 0) == own


def test_node_losses_are_counted_beside_the_restarts(spare: Report) -> None:
    restarts = spare.summary.restarts
    # The Wrapper's round ended in a restart (in-process); the spare's two children are
    # the lost node's replacements, not process restarts.
    assert (restarts.node_loss, restarts.in_process, restarts.process) == (1, 1, 0)
    assert spare.summary.processes_relaunched == 0
    assert "node losses               1" in spare.to_text()


def test_the_lost_node_is_the_first_failure_of_the_round_it_interrupted(spare: Report) -> None:
    first = spare.timeline[0]
    assert (first.cause, first.fault_kind, first.ordering) == (
        "node lost",
        "node_lost",
        "node_lost",
    )
    assert (first.first_rank, first.first_node, first.first_host) == (2, 1, "vm")
    assert first.detection_s == 3.003 and first.peer_notified == 2
    (loss,) = spare.node_losses
    assert first.first_wall == loss.last_seen_wall == loss.start  # its row's time: its last beat
    assert [(f.signature, f.category, f.ranks, f.nodes) for f in spare.failures] == [
        ("node lost", "node", [2, 3], [1])
    ]
    assert "lost node vm (node 1)" in spare.to_text()


def test_ranks_of_the_lost_node_are_not_counted_as_waiting_for_its_detection(
    spare: Report,
) -> None:
    # 4 ranks; the lost node's 2 were gone, the other 2 waited in the function 3.003 s
    ledger = spare.summary.time_ledger
    assert ledger.detection_s == pytest.approx(3.003) and ledger.lost_work_s == 0.0
    assert ledger.training_s == pytest.approx(spare.summary.training_time_s - 3.003 * 2 / 4)


def test_json_of_a_node_loss_follows_the_schema(spare: Report) -> None:
    data = spare.to_dict()
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["summary"]["restarts"]["node_loss"] == 1
    assert data["node_losses"][0]["outcome"] == "spare slot 2 took over node rank 1"


def test_local_losses_exclude_no_host_shared_with_healthy_nodes(spare: Report) -> None:
    rows = {(n.host, n.node): (n.lost, n.first_failures, n.suspect) for n in spare.suspects}
    assert rows == {("vm", 1): (1, 1, False)}
    assert spare.exclude is None


def _three_slurm_nodes(log_dir: Path, **build: Any) -> Report:
    """Three SLURM nodes: node-b (slot 1) is lost, spare node-c (slot 2) takes over; the
    survivors on node-a raise DistBackendError, one's monitor finds it unresponsive, one
    process exits 1 and is restarted, all while the job gets over the loss."""
    job = Job(log_dir, {0: "node-a", 1: "node-b", 2: "node-c"}, nnodes=3, spares=1)
    _before_the_loss(job)
    mon = job.monitor(0, node=0, slot=0).round(0)
    for t, rank in ((12.5, 0), (12.6, 1)):
        job.ranks[rank].at(
            t, "fault", fault_kind="exception", origin_rank=rank,
            exc_type="torch.distributed.DistBackendError", message="NCCL aborted",
            traceback=DIST_TRACEBACK,
        )  # fmt: skip
    job.ranks[1].at(12.7, "fault", fault_kind="peer", origin_rank=2, message="rank 2 left")
    mon.at(13.0, "fault", fault_kind="unresponsive", origin_rank=0, message="no heartbeat")
    job.sup[0].at(13.5, "child_exit", local_rank=1, child_pid=101, exit_code=1, runtime_s=13.0)
    job.sup[0].at(13.6, "restart_decision", local_rank=1, decision="restart", reason="exit 1")
    job.start_rank(14.0, 1, slot=0, node=0, attempt=1)
    job.sup[2].at(DECLARED + 0.1, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.1)
    for rank in (2, 3):
        job.start_rank(DECLARED + 0.11, rank, slot=2, node=1, attempt=1)
    state = {"State": "DOWN+NOT_RESPONDING", "Reason": "Not responding"}
    job.node_lost("spare", replaced_by=2, slurm_state=state)
    job.round_restart(DECLARED + 0.2, [0])
    job.round_start(18.0, 1, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    return job.close(**build)


def test_survivors_are_not_blamed_and_the_lost_host_is_excluded(tmp_path: Path) -> None:
    report = _three_slurm_nodes(tmp_path / "job")
    assert [(f.signature, f.hosts) for f in report.failures] == [("node lost", ["node-b"])]
    first = report.timeline[0]
    assert (first.cause, first.first_node, first.first_host) == ("node lost", 1, "node-b")
    assert first.also_failed == []  # the survivors' faults follow from the loss
    (death,) = report.process_restarts
    assert (death.rank, death.explained_by) == (1, "node_lost")
    assert report.summary.restarts.process == 0
    suspects = {(n.host, n.node): (n.lost, n.suspect) for n in report.suspects}
    assert suspects == {("node-b", 1): (1, True)}
    assert report.exclude == "node-b"
    text = report.to_text(width=None)  # cells unwrapped
    assert "next submission: --exclude=node-b\n" in text
    assert "SLURM: DOWN+NOT_RESPONDING (Not responding)" in text


def test_output_lines_of_the_lost_node_are_told_by_its_loss(tmp_path: Path) -> None:
    """srun's line for the lost node's task (slot 1), SLURM's NODE FAILURE, and a traceback
    of a rank of the lost node: the node_lost event tells them. A healthy node's killed
    task that no event explains is still a finding."""
    out = tmp_path / "slurm-777.out"
    out.write_text(
        "[rank2]: Traceback (most recent call last):\n"
        '[rank2]:   File "/home/u/train.py", line 40, in train\n'
        "[rank2]: RuntimeError: CUDA error: unspecified launch failure\n"
        "srun: error: node-b: task 1: Killed\n"
        "slurmstepd: error: *** STEP 777.0 ON node-b CANCELLED AT 2024-01-01T00:00:01 "
        "DUE TO NODE FAILURE ***\n"
        "srun: error: node-a: task 0: Killed\n"
    )
    report = _three_slurm_nodes(tmp_path / "job", slurm_output=[out])
    assert [(f.signature, f.nodes) for f in report.log_findings] == [("signal SIGKILL", [0])]


def test_a_fault_before_the_loss_is_still_its_own_failure(tmp_path: Path) -> None:
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    _raises(job, 0, 8.0, "ValueError", "bad batch")
    job.node_lost("shrink")
    job.round_restart(DECLARED + 0.2, [0, 1])
    report = job.close()
    first = report.timeline[0]
    assert first.first_rank == 0 and first.cause == "ValueError at train.py:40 in train"
    assert {f.signature for f in report.failures} == {first.cause, "node lost"}


@pytest.mark.parametrize(("after", "explained"), [(29.0, True), (31.0, False)])
def test_without_a_recovery_the_loss_window_ends_30_s_after_the_declaration(
    tmp_path: Path, after: float, explained: bool
) -> None:
    """docs/report.md: the loss window runs, "without a recovery in the events, to 30 s after
    the declaration": a survivor's error 29 s after it follows from the loss (no failure of
    its own, not in the round's ``also failed``); one 31 s after it is a failure again."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    job.node_lost("shrink")  # and no round after it: no recovery
    _raises(job, 0, DECLARED + after, "ValueError", "bad batch")
    report = job.close()
    (loss,) = report.node_losses
    assert loss.recovered_wall is None and loss.declared_wall == pytest.approx(T0 + DECLARED)
    own = "ValueError at train.py:40 in train"
    assert [f.signature for f in report.failures] == ["node lost"] + ([] if explained else [own])
    first = report.timeline[0]
    assert (first.cause, first.also_failed) == ("node lost", [] if explained else [0])


def test_shrink_recovers_at_the_next_round_of_any_size(tmp_path: Path) -> None:
    job = Job(tmp_path / "job", {0: "vm", 1: "vm"}, nnodes=2, spares=0)
    _before_the_loss(job)
    job.node_lost("shrink")
    for rank in (0, 1):
        job.ranks[rank].at(DECLARED + 0.3, "ranks_terminated", ranks=[2, 3])
    job.round_restart(DECLARED + 0.3, [0, 1])
    job.round_start(DECLARED + 0.5, 1, [0, 1])
    job.complete(22.0, [0, 1])
    job.sup[0].at(23.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = job.close()
    (loss,) = report.node_losses
    assert loss.outcome == "job shrank to 1 node"
    assert loss.recovery_s == pytest.approx(DECLARED + 0.5 - LAST_SEEN)
    assert loss.world_size == 2
    assert report.summary.outcome == "completed"
    assert "job shrank to 1 node" in report.to_text()


def test_stop_without_a_spare_blames_the_lost_node_not_the_stopped_survivors(
    tmp_path: Path,
) -> None:
    """No spare, no --min-nodes: node 0 stops the job (exit 8); its ranks' monitors then
    find their processes dead (the stop's SIGTERM): consequences of the loss, not failures."""
    job = Job(tmp_path / "job", {0: "vm", 1: "vm"}, nnodes=2, spares=0)
    _before_the_loss(job)
    for rank in (0, 1):
        job.ranks[rank].at(DECLARED, "call_end", duration_s=7.2, outcome="restart")
    reason = "node lost, no spare: 1 nodes left, below --min-nodes 2"
    job.node_lost("stop")
    job.sup[0].at(DECLARED + 0.001, "job_stop", reason=reason, exit_code=8)
    for rank in (1, 0):
        mon = job.monitor(rank, node=0, slot=0).round(0)
        mon.at(DECLARED + 0.04, "fault", fault_kind="dead", origin_rank=rank, signature="dead")
        job.sup[0].at(
            DECLARED + 0.05, "child_exit", local_rank=rank, child_pid=100 + rank,
            exit_code=None, signal="SIGTERM", runtime_s=12.0,
        )  # fmt: skip
    job.sup[0].at(DECLARED + 1.0, "supervisor_end", exit_code=8, reason=reason)
    report = job.close()
    (loss,) = report.node_losses
    assert loss.outcome == f"job stopped: {reason}"
    assert loss.recovery_s is None
    assert [f.signature for f in report.failures] == ["node lost"]
    assert (report.timeline[0].cause, report.timeline[0].first_node) == ("node lost", 1)
    assert report.summary.outcome == "failed (exit code 8)"
    assert report.summary.reason == reason
    text = report.to_text()
    assert "never (job stopped)" in text and "job stopped: node lost, no spare" in text


def test_the_round_running_when_the_node_fell_silent_is_blamed_though_the_next_began(
    tmp_path: Path,
) -> None:
    """The survivors find the lost peers at once (a closed connection) and begin round 1
    before the node is declared lost: round 0 is still the one the loss interrupted."""
    job = Job(tmp_path / "job", {0: "vm", 1: "vm"}, nnodes=2, spares=0)
    _before_the_loss(job)
    for rank in (0, 1):
        job.ranks[rank].at(
            LAST_SEEN + 0.5, "fault", fault_kind="exception", origin_rank=rank,
            exc_type="DistBackendError", message="Connection closed by peer",
            traceback=DIST_TRACEBACK,
        )  # fmt: skip
    job.round_restart(LAST_SEEN + 0.6, [0, 1])
    job.round_start(LAST_SEEN + 1.0, 1, [0, 1, 2, 3])
    reason = "node lost, no spare: 1 nodes left, below --min-nodes 2"
    job.node_lost("stop")
    job.sup[0].at(DECLARED + 0.001, "job_stop", reason=reason, exit_code=8)
    job.sup[0].at(DECLARED + 1.0, "supervisor_end", exit_code=8, reason=reason)
    report = job.close()
    (loss,) = report.node_losses
    assert loss.round == 0
    first = report.timeline[0]
    assert (first.round, first.cause, first.first_node) == (0, "node lost", 1)
    assert [f.signature for f in report.failures] == ["node lost"]


def test_a_fenced_node_that_comes_back_does_not_end_the_job(tmp_path: Path) -> None:
    """Slot 0 stalls, slot 1 declares it lost and the job shrinks; slot 0 wakes up, finds
    itself fenced off and ends its children (exit 9). The job's end is slot 1's."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(5.0, 0, [0, 1, 2, 3])
    job.sup[1].at(
        DECLARED, "node_lost", lost_node=0, lost_slot=0, lost_host="node-a", silent_s=3.0,
        last_seen_wall=T0 + LAST_SEEN, seen_by=1, slurm_state=None, action="shrink",
        replaced_by=None, ranks=[0, 1],
    )  # fmt: skip
    job.round_restart(DECLARED + 0.2, [2, 3])
    job.round_start(DECLARED + 0.4, 1, [2, 3])
    fenced = "this node was declared lost by the others; the job goes on without it"
    job.sup[0].at(40.0, "job_stop", reason=fenced, exit_code=9)
    job.sup[0].at(40.1, "child_exit", local_rank=0, child_pid=100, signal="SIGKILL", runtime_s=39)
    job.sup[0].at(40.2, "supervisor_end", exit_code=9, reason=fenced)
    job.complete(45.0, [2, 3])
    job.sup[1].at(46.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = job.close()
    (loss,) = report.node_losses
    assert loss.fenced and loss.outcome.endswith("fenced off (exit 9)")
    assert report.summary.outcome == "completed"
    assert [f.signature for f in report.failures] == ["node lost"]
    assert report.exclude == "node-a"


def test_a_lost_spare_is_counted_and_excluded_but_interrupts_no_round(tmp_path: Path) -> None:
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b", 2: "node-c"}, nnodes=3, spares=1)
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(5.0, 0, [0, 1, 2, 3])
    job.sup[0].at(
        DECLARED, "node_lost", lost_node=None, lost_slot=2, lost_host="node-c", silent_s=3.0,
        last_seen_wall=T0 + LAST_SEEN, seen_by=0, slurm_state=None, action="none",
        replaced_by=None, ranks=[],
    )  # fmt: skip
    job.complete(26.0, [0, 1, 2, 3])
    report = job.close()
    (loss,) = report.node_losses
    assert (loss.node, loss.slot, loss.outcome) == (
        None,
        2,
        "a spare node was lost; training went on",
    )
    assert report.summary.restarts.node_loss == 1
    assert report.timeline[0].cause is None and report.timeline[0].outcome == "completed"
    assert report.exclude == "node-c"
    text = report.to_text()
    assert "spare (slot 2)" in text and "- (no ranks lost)" in text


def _trains(job: Job) -> None:
    """Four ranks on the job's first two nodes start and begin round 0."""
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(5.0, 0, [0, 1, 2, 3])


def test_losses_recorded_by_a_survivor_without_a_store_say_the_store_stopped_the_job(
    tmp_path: Path,
) -> None:
    # node-a (slot 0, the store's host) and the spare node-c are lost with the store; slot 1
    # alone cannot elect a successor: it stops (exit 3), then records both as SLURM answers
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b", 2: "node-c"}, nnodes=3, spares=1)
    _trains(job)
    reason = "store at node-a:29500 lost: the store did not answer a heartbeat for 3.1 s"
    job.sup[1].at(DECLARED, "job_stop", reason=reason, exit_code=3)
    for slot, node_rank, action in ((0, 0, "stop"), (2, None, "none")):
        job.sup[1].at(
            DECLARED + 30.0, "node_lost", lost_node=node_rank, lost_slot=slot,
            lost_host=job.hosts[slot], silent_s=None, last_seen_wall=T0 + DECLARED - 0.5,
            seen_by=1, slurm_state=None, action=action, replaced_by=None,
            ranks=[] if node_rank is None else [0, 1],
        )  # fmt: skip
    job.sup[1].at(DECLARED + 31.0, "job_stop", reason="received SIGTERM", exit_code=143)
    report = job.close()
    assert [(loss.slot, loss.outcome) for loss in report.node_losses] == [
        (0, f"job stopped: {reason}"),
        (2, "a spare node was lost"),
    ]


def test_a_spare_lost_while_training_goes_on_is_said_so_whatever_stops_later(
    tmp_path: Path,
) -> None:
    # the spare node-c is lost while the job trains; node-b is fenced later (the job goes
    # on without it) and the job is cancelled much later still: neither stopped it then
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b", 2: "node-c"}, nnodes=3, spares=1)
    _trains(job)
    job.sup[0].at(
        DECLARED, "node_lost", lost_node=None, lost_slot=2, lost_host="node-c", silent_s=3.0,
        last_seen_wall=T0 + LAST_SEEN, seen_by=0, slurm_state=None, action="none",
        replaced_by=None, ranks=[],
    )  # fmt: skip
    job.sup[1].at(DECLARED + 20.0, "job_stop", reason="this node was declared lost", exit_code=9)
    job.sup[0].at(DECLARED + 7000.0, "job_stop", reason="received SIGTERM", exit_code=143)
    (loss,) = job.close().node_losses
    assert loss.outcome == "a spare node was lost; training went on"


def test_a_node_lost_after_its_training_ended_is_said_to_cost_nothing(tmp_path: Path) -> None:
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _trains(job)
    job.node_lost("none")
    job.complete(26.0, [0, 1, 2, 3])
    (loss,) = job.close().node_losses
    assert loss.outcome == "node rank 1 had ended its training: nothing to replace"


def test_a_ranks_death_is_filed_under_the_node_that_ran_it_on_a_shared_host(
    tmp_path: Path,
) -> None:
    """The demo's faults on one host: rank 2 (node 1) raises in round 0; rank 1 (node 0,
    local rank 1) is SIGKILLed in round 1. Each is its own node's, not the host's first."""
    job = Job(tmp_path / "job", {0: "vm", 1: "vm"}, nnodes=2, spares=0)
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(2.0, 0, [0, 1, 2, 3])
    job.ranks[2].at(5.0, "fault", fault_kind="exception", origin_rank=2, exc_type="ValueError")
    job.round_restart(5.5, [0, 1, 2, 3])
    job.round_start(7.0, 1, [0, 1, 2, 3])
    job.monitor(1, node=0, slot=0).round(1).at(
        10.0, "fault", fault_kind="dead", origin_rank=1, signature="dead"
    )
    job.sup[0].at(10.05, "child_exit", local_rank=1, child_pid=101, signal="SIGKILL", runtime_s=9)
    job.sup[0].at(10.1, "restart_decision", local_rank=1, decision="restart", reason="SIGKILL")
    report = job.close()
    (death,) = report.process_restarts
    assert (death.rank, death.node, death.host) == (1, 0, "vm")
    rows = {(n.host, n.node): (n.first_failures, n.deaths, n.signatures) for n in report.suspects}
    assert rows == {
        ("vm", 0): (1, 1, ["signal SIGKILL"]),
        ("vm", 1): (1, 0, ["ValueError"]),
    }
    assert report.node_losses == [] and report.summary.restarts.node_loss == 0


def test_a_last_seen_wall_beyond_any_clock_is_shown_not_fatal(tmp_path: Path) -> None:
    """A writer's garbage time (1e17 s) reaches every format as text, never as a crash."""
    job = Job(tmp_path / "job", {0: "a", 1: "b", 2: "c"}, nnodes=3, spares=1)
    _before_the_loss(job)
    job.node_lost("spare", replaced_by=2, last_seen_wall=1e17)
    report = job.close()
    for fmt in ("table", "markdown", "json", "html"):
        assert report.to_text(fmt)
    assert "? (wall 1e+17)" in report.to_text("table")


def test_a_store_failover_is_told_with_the_loss_of_its_host(tmp_path: Path) -> None:
    """Slot 1 held the store when it was lost: both survivors write ``store_failover`` (each
    with its own duration); the successor's (slot 0 here, the lowest survivor) is told."""
    job = Job(tmp_path / "job", {0: "a", 1: "b", 2: "c"}, nnodes=3, spares=1)
    _before_the_loss(job)
    _spare_takes_over(job)
    for slot, took in ((2, 1.9), (0, 1.25)):
        job.sup[slot].at(
            DECLARED + 0.5, "store_failover", epoch=1, old_store="b:29501",
            new_store="a:29511", successor=0, lost_slot=1, duration_s=took,
        )  # fmt: skip
    job.round_restart(DECLARED + 0.01, [0, 1])
    job.round_start(17.6, 1, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    report = job.close()
    (loss,) = report.node_losses
    move = loss.store_failover
    assert move is not None
    assert (move.successor, move.old_store, move.new_store, move.epoch, move.duration_s) == (
        0, "b:29501", "a:29511", 1, 1.25,
    )  # fmt: skip
    expected = "spare slot 2 took over node rank 1; the job's store moved to slot 0 (a:29511) in 1.2 s"
    assert loss.outcome == expected
    text = report.to_text()
    assert "the job's store moved to slot 0 (a:29511)" in text, text
    assert "unknown to this nvrx" not in text, text
    data = report.to_dict()
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["node_losses"][0]["store_failover"]["new_store"] == "a:29511"


def test_a_loss_without_a_store_failover_has_none(spare: Report) -> None:
    assert spare.node_losses[0].store_failover is None
    assert spare.to_dict()["node_losses"][0]["store_failover"] is None


GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer"


def _survivor_error(job: Job, t: float, exc_type: str, message: str) -> None:
    """Rank 0 (node-a, a survivor) raises ``exc_type`` at ``t``, in round 0."""
    _raises(job, 0, t, exc_type, message)


def _store_host_loss(log_dir: Path, collateral_at: float) -> Report:
    """node-b is lost; spare node-c takes over; node-a's rank 0 logs gloo's "Connection
    reset by peer" at ``collateral_at`` (seconds after T0; node-b's last beat is LAST_SEEN)."""
    job = Job(log_dir, {0: "node-a", 1: "node-b", 2: "node-c"}, nnodes=3, spares=1)
    _before_the_loss(job)
    _survivor_error(job, collateral_at, "RuntimeError", GLOO_RESET)
    job.sup[2].at(DECLARED + 0.1, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.1)
    for rank in (2, 3):
        job.start_rank(DECLARED + 0.11, rank, slot=2, node=1, attempt=1)
    state = {"State": "DOWN+NOT_RESPONDING", "Reason": "Not responding"}
    job.node_lost("spare", replaced_by=2, slurm_state=state)
    job.round_restart(DECLARED + 0.2, [0, 1])
    job.round_start(18.0, 1, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    return job.close()


@pytest.mark.parametrize("offset", [-0.033, 0.2], ids=["just_before", "just_after"])
def test_a_survivors_collateral_error_near_the_last_beat_follows_from_the_loss(
    tmp_path: Path, offset: float
) -> None:
    """A broken connection seen 33 ms before the lost node's last beat reached its peers
    (or just after) is the loss's consequence: the lost node alone is blamed and excluded."""
    report = _store_host_loss(tmp_path / "job", LAST_SEEN + offset)
    first = report.timeline[0]
    assert (first.cause, first.first_host, first.also_failed) == ("node lost", "node-b", [])
    assert [f.signature for f in report.failures] == ["node lost"]
    rows = {n.host: (n.first_failures, n.suspect) for n in report.suspects}
    assert rows == {"node-b": (1, True)}
    (lost,) = report.suspects
    assert lost.evidence == ["lost: silent 3.0 s to the job, SLURM DOWN+NOT_RESPONDING"]
    assert report.exclude == "node-b"


def test_a_survivors_own_error_before_the_loss_stays_its_own_fault(tmp_path: Path) -> None:
    """A ZeroDivisionError on a survivor 0.5 s before the node's last beat is no broken
    connection: it is the round's cause, and one fault is not enough to exclude its node."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    _survivor_error(job, LAST_SEEN - 0.5, "ZeroDivisionError", "division by zero")
    job.node_lost("shrink")
    job.round_restart(DECLARED + 0.2, [0, 1])
    report = job.close()
    first = report.timeline[0]
    assert (first.first_rank, first.cause) == (0, "ZeroDivisionError at train.py:40 in train")
    assert {f.signature for f in report.failures} == {first.cause, "node lost"}
    by_host = {n.host: n for n in report.suspects}
    assert not by_host["node-a"].suspect
    assert by_host["node-a"].evidence == [
        "one fault of its own (ZeroDivisionError at train.py:40 in train): not enough to exclude"
    ]
    assert report.exclude == "node-b"  # lost, SLURM not asked: as before


@pytest.mark.parametrize("requeued", [True, False], ids=["requeued", "not-requeued"])
def test_a_killed_supervisor_on_a_responding_node_is_not_excluded(tmp_path: Path, requeued: bool) -> None:
    """node-b's supervisor is SIGKILLed: its peers declare it lost and requeue the job, but
    node-b still runs the SLURM step the requeue tried on it (``answered``), so nothing tells
    against the node. A job that may not be requeued records the same answer as a
    ``node_probe`` of no slot (``node_requeue.requeue_without``)."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    reason = "node lost, no spare: 1 nodes left, below --min-nodes 2"
    job.node_lost("stop", slurm_state={"State": "MIXED", "Reason": "none"})
    job.sup[0].at(DECLARED + 0.001, "job_stop", reason=reason, exit_code=8)
    if requeued:
        job.sup[0].at(DECLARED + 0.5, "requeue", cause="node_failure", count=1, excluded=[], answered=["node-b"])
    else:
        job.sup[0].at(DECLARED + 0.5, "node_probe", lost_slot=None, lost_host="node-b", responding=True,
                      probe_s=0.3, note=None)  # fmt: skip
    job.sup[0].at(DECLARED + 1.0, "supervisor_end", exit_code=8, reason=reason)
    report = job.close()
    (node_b,) = report.suspects
    assert (node_b.host, node_b.lost, node_b.suspect) == ("node-b", 1, False)
    assert node_b.evidence == ["supervisor lost, node still ran a SLURM step: not excluded"]
    assert report.exclude is None


def _spare_took_over(log_dir: Path, responding: bool, excluded_by_a_rank: bool = False) -> Report:
    """A spare takes node-b's place at once; afterwards the probe of node-b (``node_probe``)
    says whether it still runs SLURM steps. ``excluded_by_a_rank``: node-b's supervisor had
    left with exit 10 (``ExcludeThisNode``)."""
    job = Job(log_dir, {0: "node-a", 1: "node-b", 2: "node-c"}, nnodes=3, spares=1)
    _before_the_loss(job)
    if excluded_by_a_rank:
        job.sup[1].at(DECLARED - 0.05, "supervisor_end", exit_code=10, reason="excluded")
    job.sup[2].at(DECLARED + 0.1, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.1)
    job.node_lost("spare", replaced_by=2, slurm_state={"State": "MIXED", "Reason": "none"})
    job.sup[0].at(
        DECLARED + 0.4, "node_probe", lost_slot=1, lost_host="node-b", responding=responding,
        probe_s=0.3,
    )  # fmt: skip
    job.round_restart(DECLARED + 0.2, [0, 1])
    job.round_start(18.0, 1, [0, 1, 2, 3])
    job.complete(26.0, [0, 1, 2, 3])
    return job.close()


@pytest.mark.parametrize("responding", [True, False])
def test_a_spare_takeovers_probe_decides_whether_the_lost_node_is_excluded(
    tmp_path: Path, responding: bool
) -> None:
    """The probe that ran after the spare took over tells whether node-b's supervisor or
    the node itself was lost."""
    report = _spare_took_over(tmp_path / "job", responding)
    (node_b,) = report.suspects
    assert (node_b.host, node_b.lost, node_b.suspect) == ("node-b", 1, not responding)
    assert report.exclude == (None if responding else "node-b")
    if responding:
        assert node_b.evidence == ["supervisor lost, node still ran a SLURM step: not excluded"]
        text = report.to_text(width=None)
        answer = text[: text.index("Summary")]  # on the first screen, with the advice
        assert "exclude next time: nothing" in answer, answer
        assert (
            "kept node-b (node 1): supervisor lost, node still ran a SLURM step: not excluded"
            in answer
        ), answer


def test_a_node_a_rank_asked_to_exclude_is_excluded_though_it_answers(tmp_path: Path) -> None:
    """node-b's rank asked to exclude its node (``ExcludeThisNode``): that the node still
    runs SLURM steps does not clear it, the job's own code said it is unfit."""
    report = _spare_took_over(tmp_path / "job", True, excluded_by_a_rank=True)
    (node_b,) = report.suspects
    assert (node_b.host, node_b.suspect) == ("node-b", True)
    assert node_b.evidence == ["a rank asked to exclude this node (ExcludeThisNode)"]
    assert report.exclude == "node-b"


@pytest.mark.parametrize("nnodes", [1, 2], ids=["one-node", "liveness-off"])
def test_a_node_a_rank_asked_to_exclude_is_excluded_with_no_loss_recorded(
    tmp_path: Path, nnodes: int
) -> None:
    """A rank sent ``ExcludeThisNode`` where no loss is declared for it (a job of one node,
    or node liveness off): its supervisor's exit 10 alone is the evidence."""
    hosts = {0: "node-a", 1: "node-b"} if nnodes == 2 else {0: "node-a"}
    job = Job(tmp_path / "job", hosts, nnodes=nnodes, spares=0)
    for rank in range(2 * nnodes):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(5.0, 0, list(range(2 * nnodes)))
    job.sup[0].at(9.0, "workload_control", rank=0, local_rank=0, child_pid=100,
                  action="ExcludeThisNode", description="bad GPU")  # fmt: skip
    reason = "rank 0 asked to exclude this node: bad GPU"
    job.sup[0].at(9.5, "supervisor_end", exit_code=10, reason=reason)
    if nnodes == 2:
        job.sup[1].at(10.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = job.close()
    assert report.exclude == "node-a", report.to_text(width=None)
    (node_a,) = [n for n in report.suspects if n.host == "node-a"]
    assert node_a.suspect and node_a.evidence == ["a rank asked to exclude this node (ExcludeThisNode)"]
    assert "exclude next time: --exclude=node-a" in report.to_text(width=None)


def test_a_lost_node_slurm_still_calls_responding_is_excluded_without_a_step(
    tmp_path: Path,
) -> None:
    """A crashed node looks MIXED to SLURM for its SlurmdTimeout: without a step that it ran,
    its loss counts against it."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    job.node_lost("stop", slurm_state={"State": "MIXED", "Reason": "none"})
    job.sup[0].at(
        DECLARED + 0.5, "requeue", cause="node_failure", count=1, excluded=["node-b"], answered=[]
    )
    report = job.close()
    (node_b,) = report.suspects
    assert node_b.suspect and report.exclude == "node-b"
    assert node_b.evidence == [
        "lost: silent 3.0 s to the job, SLURM MIXED when declared (SLURM notices a dead node later)"
    ]


def _faults_in_turn(
    log_dir: Path, messages: list[str], raisers: list[int] | None = None
) -> Report:
    """Rank ``raisers[i]`` (rank 2, on node-b, by default) raises ``messages[i]`` in round
    i; its peers stop for it."""
    job = Job(log_dir, {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    for rnd, message in enumerate(messages):
        t, raiser = 2.0 + 10 * rnd, (raisers or [2] * len(messages))[rnd]
        job.round_start(t, rnd, [0, 1, 2, 3])
        _raises(job, raiser, t + 3, "RuntimeError", message)
        for rank in {0, 1, 2, 3} - {raiser}:
            job.ranks[rank].at(t + 3.1, "fault", fault_kind="peer", origin_rank=raiser)
        job.round_restart(t + 3.5, [0, 1, 2, 3])
    return job.close()


def test_a_node_with_repeated_faults_of_its_own_is_excluded(tmp_path: Path) -> None:
    """Two ranks of node-b (2, then 3) raise the same error, seen on no other host."""
    report = _faults_in_turn(tmp_path / "job", ["bad value", "bad value"], raisers=[2, 3])
    (node_b,) = report.suspects
    assert (node_b.host, node_b.first_failures, node_b.suspect) == ("node-b", 2, True)
    sig = "RuntimeError at train.py:40 in train"
    assert node_b.evidence == [f"2 faults of its own seen on no other host: {sig}"]
    assert report.exclude == "node-b"


def test_one_ranks_repeated_exception_is_its_codes_and_excludes_no_node(tmp_path: Path) -> None:
    """Rank 2 alone raises the same error twice (code that rank alone runs: its checkpoint
    save, say): that rank raises it on whichever node it runs, so node-b is not excluded."""
    report = _faults_in_turn(tmp_path / "job", ["bad value", "bad value"])
    (node_b,) = report.suspects
    assert (node_b.host, node_b.first_failures, node_b.suspect) == ("node-b", 2, False)
    assert node_b.evidence == [
        "2 faults of its own seen on no other host, each an exception rank 2 raised (RuntimeError "
        "at train.py:40 in train): its code may raise it on any node; not enough to exclude"
    ]
    assert report.exclude is None


def test_one_ranks_repeated_full_disk_is_its_codes_not_a_device_error(tmp_path: Path) -> None:
    """"No space left on device" names no device of the rank: rank 2's checkpoint save
    failing twice so excludes no node."""
    full = "[Errno 28] No space left on device"
    report = _faults_in_turn(tmp_path / "job", [full, full])
    assert report.exclude is None and not report.suspects[0].suspect


@pytest.mark.parametrize(
    "message",
    ["CUDA error: an illegal memory access was encountered",
     "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5) ran for 600012 milliseconds"],
    ids=["cuda", "nccl-watchdog"],
)  # fmt: skip
def test_one_ranks_repeated_device_error_still_excludes_its_node(tmp_path: Path, message: str) -> None:
    """Ranks are tied to GPUs: a bad GPU shows as one rank raising the same CUDA error round
    after round. An error whose message names a device still counts against the node."""
    report = _faults_in_turn(tmp_path / "job", [message, message])
    (node_b,) = report.suspects
    assert node_b.suspect and report.exclude == "node-b"
    assert node_b.evidence == ["2 faults of its own seen on no other host: RuntimeError at train.py:40 in train"]


def test_a_fault_seen_on_several_hosts_is_the_codes_and_excludes_no_node(tmp_path: Path) -> None:
    """The same error twice on node-b, then once on node-a: the code's, not node-b's."""
    report = _faults_in_turn(tmp_path / "job", ["bad value"] * 3, raisers=[2, 2, 0])
    assert report.exclude is None and not [s for s in report.suspects if s.suspect]
    evidence = [line for s in report.suspects for line in s.evidence]
    assert not [line for line in evidence if "seen on no other host" in line], evidence
    text = report.to_text("table", width=None)
    assert "a fault seen on several hosts is the code's" in text, text


def test_one_fault_of_its_own_is_not_enough_but_a_device_fault_is(tmp_path: Path) -> None:
    once = _faults_in_turn(tmp_path / "once", ["bad value"])
    assert once.exclude is None and not once.suspects[0].suspect
    ecc = _faults_in_turn(tmp_path / "ecc", ["CUDA error: uncorrectable ECC error encountered"])
    (node_b,) = ecc.suspects
    assert node_b.suspect and ecc.exclude == "node-b"
    assert "device or driver fault: RuntimeError at train.py:40 in train" in node_b.evidence


def test_a_follow_on_error_is_not_the_cause_when_another_fault_is_at_hand(tmp_path: Path) -> None:
    """Rank 0's collective breaks (NCCL aborted) before rank 2's own error is written, on
    another host with no store vote: rank 2's error is the cause, rank 0 a follower."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    for rank in range(4):
        job.start_rank(0.5, rank, rank // 2, rank // 2)
    job.round_start(2.0, 0, [0, 1, 2, 3])
    _survivor_error(job, 5.0, "torch.distributed.DistBackendError", "NCCL communicator was aborted")
    job.ranks[2].at(5.2, "fault", fault_kind="exception", exc_type="ValueError", message="bad")
    job.round_restart(5.5, [0, 1, 2, 3])
    report = job.close()
    first = report.timeline[0]
    assert (first.first_rank, first.cause, first.also_failed) == (2, "ValueError", [])
    assert first.peer_notified == 3  # rank 0's error followed; 1 and 3 restarted with it


def test_a_job_stopped_by_a_loss_trains_again_after_its_requeue(tmp_path: Path) -> None:
    """No spare: the loss stops run 0 (exit 8) and the job is requeued; run 1, on node-a and
    node-c, trains again at world size 4 from 45 s: that is when it trained again."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    reason = "node lost, no spare: 1 nodes left, below --min-nodes 2"
    job.node_lost("stop")
    job.sup[0].at(DECLARED + 0.001, "job_stop", reason=reason, exit_code=8)
    job.sup[0].at(DECLARED + 0.5, "requeue", cause="node_failure", count=1, excluded="node-b")
    job.sup[0].at(DECLARED + 1.0, "supervisor_end", exit_code=8, reason=reason)
    job.others.append(job.sup[1])
    job.hosts[1] = "node-c"
    job.sup[1] = Proc(job.dir, Host("node-c", 1), "supervisor")
    for sup in job.sup.values():
        sup.at(40.0, "supervisor_start", nnodes=2, nproc_per_node=2, spare_nodes=0)
    for rank in range(4):
        job.others.append(job.ranks[rank])
        job.start_rank(40.5, rank, rank // 2, rank // 2)
    job.round_start(45.0, 0, [0, 1, 2, 3])
    job.complete(60.0, [0, 1, 2, 3])
    report = job.close()
    (loss,) = report.node_losses
    assert loss.action == "stop" and loss.recovered_wall == pytest.approx(T0 + 45.0)
    assert loss.recovery_s == pytest.approx(45.0 - LAST_SEEN) and loss.world_size == 4
    assert "never (job stopped)" not in report.to_text()
    assert report.summary.runs == 2


def _survivor_hang(job: Job, rank: int, told: float, stale: float) -> None:
    """Survivor ``rank``'s monitor tells a soft hang in round 0 at ``told``, ``stale``
    seconds after the rank's last progress."""
    monitor = job.monitor(rank, node=0, slot=0)
    monitor.round(0).at(told, "hang", timeout="soft", stale_s=stale)
    monitor.at(told, "fault", fault_kind="hang_soft", origin_rank=rank, signature="hang_soft", detection_s=stale)


def test_a_wrapper_hang_in_the_detection_window_does_not_push_the_loss_into_the_next_round(
    tmp_path: Path,
) -> None:
    """Survivor rank 0 hangs from 9.4 s, within the 3 s before slot 1's last beat (11.4 s),
    on the peer that is dying; the survivors restart and begin round 1 before slot 1 is
    declared lost (14.4 s). The hang follows from the loss, so it is no fault of round 0's
    own: the loss interrupted round 0, the round it fell silent in, not round 1."""
    job = Job(tmp_path / "job", {0: "vm0", 1: "vm1", 2: "vm2"}, nnodes=3, spares=1)
    _before_the_loss(job)
    _survivor_hang(job, 0, LAST_SEEN - 0.2, 1.8)
    job.round_restart(LAST_SEEN + 0.12, [0, 1])
    job.round_start(LAST_SEEN + 0.35, 1, [0, 1])
    for rank in (0, 1):  # round 1 is at world size 4: ranks 2 and 3 are not known lost yet
        job.ranks[rank].round(1).at(LAST_SEEN + 0.36, "round_start", world_size=4)
    report = _lost_in_round_1_and_trained_again(job)
    (loss,) = report.node_losses
    assert loss.round == 0
    first = report.timeline[0]
    assert (first.round, first.cause, first.first_host) == (0, "node lost", "vm1")


def test_of_two_hangs_of_one_signature_only_the_one_the_loss_does_not_explain_is_marked(
    tmp_path: Path,
) -> None:
    """Survivor rank 0 hangs from 5.9 s, long before slot 1's last beat (11.4 s): its own
    fault. Survivor rank 1 hangs from 9.4 s, within the 3 s before that beat: it follows
    from the loss. Both hangs have one signature, so the failure table lists it; the
    activity page marks rank 0's hang only."""
    job = Job(tmp_path / "job", {0: "vm0", 1: "vm1", 2: "vm2"}, nnodes=3, spares=1)
    _before_the_loss(job)
    _survivor_hang(job, 0, LAST_SEEN + 0.5, 6.0)
    _survivor_hang(job, 1, LAST_SEEN - 0.2, 1.8)
    report = _recovered_by_the_spare(job)
    assert [f.count for f in report.failures if f.signature == HANG] == [1]
    assert [(m.rank, m.round) for m in report.activity.faults if m.signature == HANG] == [(0, 0)]


@pytest.mark.parametrize(
    ("cause", "silent_s", "detected", "against"),
    [
        (None, 3.003, "silent 3.003 s, seen by slot 0", "lost: silent 3.0 s to the job"),
        (
            "never_ready", None,
            "never ready for a job-wide restart (its supervisor stalled while its node beat), seen by slot 0",
            "lost: never ready for a job-wide restart while its node beat,",
        ),
        ("excluded", 0.0, "excluded: it left the job itself, seen by slot 0", None),
    ],
)  # fmt: skip
def test_the_lost_nodes_row_says_why_the_node_was_declared_lost(
    tmp_path: Path, cause: str | None, silent_s: float | None, detected: str, against: str | None
) -> None:
    """``node_lost``'s ``cause`` as its writer sets it (``silent_s`` none for a slot never
    ready, 0 for one that left; no cause in events of older versions): the *detected* cell
    and the evidence against the host say why, not "silent" for every loss."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    more = {} if cause is None else {"cause": cause}
    job.node_lost("shrink", silent_s=silent_s, **more)
    job.round_start(DECLARED + 0.5, 1, [0, 1])
    job.complete(22.0, [0, 1])
    report = job.close()
    (loss,) = report.node_losses
    assert loss.cause == (cause or "silent")
    assert detected in report.to_text(width=None)
    evidence = [e for n in report.suspects if n.host == "node-b" for e in n.evidence]
    if against is not None:
        assert any(e.startswith(against) for e in evidence), evidence


def test_a_spares_supervisor_names_the_node_rank_it_holds_in_its_faults(tmp_path: Path) -> None:
    """After spare slot 2 took node rank 1 over, its supervisor finds rank 3 silent in round
    1: the fault is node rank 1's (``rank_node``), as the ranks' own events are, not slot
    2's (a row of its own, which split the host's counts)."""
    job = Job(tmp_path, {0: "a", 1: "b", 2: "c"}, nnodes=3, spares=1)
    _before_the_loss(job)
    _spare_takes_over(job)
    job.round_restart(DECLARED + 0.01, [0, 1])
    job.round_start(17.6, 1, [0, 1, 2, 3])
    job.sup[2].at(
        22.0, "fault", fault_kind="unresponsive", origin_rank=3, rank=3, round=1, local_rank=1,
        child_pid=203, message="no heartbeat for 3.0 s", signature="unresponsive",
        detection_s=3.0, rank_node=1,
    )  # fmt: skip
    for r in (0, 1, 2):
        job.ranks[r].at(22.5, "fault", fault_kind="peer", origin_rank=3, message="peer")
    job.round_restart(22.6, [0, 1, 2])
    job.round_start(24.0, 2, [0, 1, 2])
    job.complete(26.0, [0, 1, 2])
    for slot in (0, 2):
        job.sup[slot].at(28.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = job.close()
    [row] = [row for row in report.timeline if row.round == 1]
    assert (row.first_rank, row.first_node, row.first_host) == (3, 1, "c"), report.to_text(width=None)
    assert 2 not in {s.node for s in report.suspects if s.host == "c"}

    # --node keeps a supervisor's events by its slot, as the docs say: the spare's fault too
    job_dir = tmp_path
    by_slot = build_report(job_dir, sacct=False, workers=1, node=2)
    assert [f.signature for f in by_slot.failures] == ["unresponsive (no heartbeat)"]
