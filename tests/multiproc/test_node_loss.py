"""A lost node, locally: 3 supervisors x 2 ranks of the demo inside the Wrapper, one node's
whole process tree SIGKILLed mid-training (how a node loss looks from the other nodes).

* with ``--spare-nodes 1``: the spare (slot 2) takes node rank 1, its children rejoin,
  and the job completes at world size 4;
* without a spare, ``--min-nodes 1``: the job goes on and completes at world size 2;
* the same with in-process spares (the Wrapper's ``MaxActiveWorldSize``): they step in for
  the lost ranks;
* without a spare or an allowance: the job stops with "node lost, no spare", exit 8.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest
from test_demo_wrapper import same_state_on_every_rank
from test_supervisor_local import DEMO, Job

from nvrx import jobenv
from nvrx.report import build_report
from nvrx.supervisor.exit_codes import ExitCode
from tests.support.waiting import wait_until

STEPS = 80
STEP_TIME = 0.1
KILL_AFTER_STEP = 15


def kill_tree(pid: int) -> list[psutil.Process]:
    """Freeze, then SIGKILL, ``pid`` and every process below it: a node gone at once."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGSTOP)
    tree += [p for p in root.children(recursive=True) if p not in tree]
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    return tree


def _demo_job(
    tmp: Path, nnodes: int, *options: str, nproc: int = 2, demo: tuple[str, ...] = ()
) -> Job:
    command = [
        sys.executable, str(DEMO), "--steps", str(STEPS), "--checkpoint-every", "5",
        "--step-time", str(STEP_TIME), "--soft-timeout", "10", "--hard-timeout", "20",
        "--rejoin-timeout", "30", *demo,
    ]  # fmt: skip
    return Job(
        tmp, nnodes, nproc, command, "--max-restarts", "8", "--grace-period", "3",
        "--node-timeout", "3", "--node-heartbeat", "0.5", *options,
    )  # fmt: skip


def _kill_node_mid_training(job: Job, slot: int) -> list[psutil.Process]:
    wait_until(
        f"a checkpoint after step {KILL_AFTER_STEP}",
        lambda: any(
            e.get("step", 0) >= KILL_AFTER_STEP for e in job.events("progress", component="app")
        ),
        120,
        state=job.output,
    )
    return kill_tree(job.procs[slot].pid)


def _lose_node_and_finish(
    job: Job, slot: int, world_size: int
) -> tuple[list[psutil.Process], str]:
    """Kill node ``slot`` mid-training; every other supervisor ends with 0 and the demo
    finishes at ``world_size``. Returns the killed processes and the job's output."""
    killed = _kill_node_mid_training(job, slot)
    codes = job.wait(240)
    output = job.output()
    assert [c for i, c in enumerate(codes) if i != slot] == [0] * (len(codes) - 1), output
    assert f"finished {STEPS} steps at world size {world_size}" in output, output
    return killed, output


def _world_sizes(job: Job) -> list[int]:
    rounds = sorted(job.events("round_start", component="wrapper"), key=lambda e: e["wall"])
    return [e["world_size"] for e in rounds]


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs: not a zombie, and its pid not another process's since
    (``is_running`` compares start times; pids wrap around on a busy machine)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _no_process_left(procs: list[psutil.Process]) -> None:
    """Until none of ``procs`` runs (one in a session of its own, a rank's monitor say, ends
    once it finds its rank gone)."""
    wait_until(
        "no process of the lost node left", lambda: not [p for p in procs if _running(p)], 30,
        state=lambda: [p.pid for p in procs if _running(p)],
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_a_spare_node_takes_over_a_lost_node(tmp_path: Path) -> None:
    job = _demo_job(tmp_path, 3, "--spare-nodes", "1", "--warm-standby")
    killed, output = _lose_node_and_finish(job, 1, 4)
    lost = job.events("node_lost")
    assert [(e["lost_slot"], e["lost_node"], e["action"], e["replaced_by"]) for e in lost] == [
        (1, 1, "spare", 2)
    ], output
    assert lost[0]["ranks"] == [2, 3] and lost[0]["silent_s"] > 3
    takeover = job.events("node_takeover")
    assert [(e["node"], e["node_rank"], e["lost_slot"]) for e in takeover] == [(2, 1, 1)]
    starts = [e for e in job.events("child_start") if e["node"] == 2]
    assert sorted(e["global_rank"] for e in starts) == [2, 3]
    assert all(e["attempt"] == 1 and e["warm"] for e in starts)  # from the spare's standbys
    rejoined = {
        e["rank_rejoined"] for e in job.events("rejoin", component="wrapper") if "rank_rejoined" in e
    }
    assert rejoined == {2, 3}, output
    assert _world_sizes(job)[-1] == 4
    _no_process_left(killed)
    report = build_report(job.log_dir / job.job_id, sacct=False)
    (loss,) = report.node_losses
    assert (loss.node, loss.slot, loss.host, loss.ranks) == (1, 1, lost[0]["lost_host"], [2, 3])
    assert loss.outcome == "spare slot 2 took over node rank 1"
    assert loss.recovery_s is not None and loss.recovery_s > 3 and loss.world_size == 4
    assert report.summary.restarts.node_loss == 1 and report.summary.restarts.process == 0
    assert [f.signature for f in report.failures] == ["node lost"], report.to_text()
    # The spare's ranks take the kept state from a survivor: at most the running step lost.
    # A survivor restores from its own memory, or from the other survivor where the node
    # was lost inside a collective that one survivor left and the other did not: that one
    # committed a step the other never reached.
    (restore,) = report.restores
    assert restore.cause == "node lost"
    restored = {
        e["rank"]: (e["source"], e["step"])
        for e in job.events("state_restored", component=None)
        if e["round"] == restore.round
    }
    assert set(restored) == {0, 1, 2, 3}, restored
    assert {restored[r] for r in (2, 3)} == {("peer", restore.step)}, restored
    survivors = [restored[r][0] for r in (0, 1)]
    assert "memory" in survivors and set(survivors) <= {"memory", "peer"}, restored
    assert restore.sources == dict(Counter(source for source, _ in restored.values()))
    assert restore.steps_lost is not None and restore.steps_lost <= 1, report.to_text()
    assert restore.step >= KILL_AFTER_STEP
    progress = job.events("progress", component="app")
    same_state_on_every_rank(progress, 4, from_round=restore.round)  # the spare's ranks too
    assert (report.timeline[0].cause, report.timeline[0].first_node) == ("node lost", 1)
    assert "spare slot 2 took over node rank 1" in report.to_text(width=None)


@pytest.mark.timeout(300)
def test_without_a_spare_the_job_shrinks_down_to_min_nodes(tmp_path: Path) -> None:
    job = _demo_job(tmp_path, 2, "--min-nodes", "1")
    killed, output = _lose_node_and_finish(job, 1, 2)
    lost = job.events("node_lost")
    assert [(e["lost_slot"], e["action"], e["replaced_by"]) for e in lost] == [
        (1, "shrink", None)
    ]
    assert _world_sizes(job)[-1] == 2
    _no_process_left(killed)
    report = build_report(job.log_dir / job.job_id, sacct=False)
    (loss,) = report.node_losses
    assert (loss.node, loss.slot, loss.host, loss.action) == (1, 1, lost[0]["lost_host"], "shrink")
    assert loss.outcome == "job shrank to 1 node"
    assert loss.recovery_s is not None and loss.world_size == 2
    assert report.summary.restarts.node_loss == 1
    assert [f.signature for f in report.failures] == ["node lost"], report.to_text()
    assert "job shrank to 1 node" in report.to_text(width=None)


@pytest.mark.timeout(300)
def test_without_a_spare_node_in_process_spares_step_in_for_the_lost_ranks(
    tmp_path: Path,
) -> None:
    """6 ranks of which 4 train (the Wrapper's ``MaxActiveWorldSize``), ``--min-nodes 2``: node 1
    (ranks 2 and 3) is lost, the job shrinks, and the in-process spares (ranks 4 and 5, on
    node 2) step in, so it completes at world size 4 still."""
    job = _demo_job(tmp_path, 3, "--min-nodes", "2", demo=("--active-ranks", "4"))
    killed, output = _lose_node_and_finish(job, 1, 4)
    (lost,) = job.events("node_lost")
    assert (lost["lost_slot"], lost["action"], lost["ranks"]) == (1, "shrink", [2, 3]), output
    # Compared with the node's last sign of life, not with the event's own time: the
    # supervisor writes node_lost after taking the node's ranks out of the round, and the
    # ranks may restart (and change) in between.
    gone = lost["last_seen_wall"]
    became_active = {
        e["initial_rank"]
        for e in job.events("rank_change", component="wrapper")
        if e["wall"] > gone and e["active"]
    }
    assert {4, 5} <= became_active, output
    before = [
        e
        for e in job.events("round_start", component="wrapper")
        if e["wall"] < gone and e.get("initial_rank") in (4, 5)
    ]
    assert before and all(e["active_rank"] is None for e in before), before  # spares until then
    _no_process_left(killed)


@pytest.mark.timeout(300)
def test_without_a_spare_or_allowance_the_job_stops_with_the_reason(tmp_path: Path) -> None:
    job = _demo_job(tmp_path, 2)
    killed = _kill_node_mid_training(job, 1)
    codes = job.wait(120)
    output = job.output()
    assert codes[0] == ExitCode.NODE_LOST, output
    stops = [e for e in job.events("job_stop") if e["node"] == 0]
    assert stops and stops[0]["reason"].startswith("node lost, no spare"), output
    assert stops[0]["exit_code"] == ExitCode.NODE_LOST
    ends = [e for e in job.events("supervisor_end") if e["node"] == 0]
    assert ends[0]["exit_code"] == ExitCode.NODE_LOST
    _no_process_left(killed)
    report = build_report(job.log_dir / job.job_id, sacct=False)
    (loss,) = report.node_losses
    assert (loss.node, loss.slot, loss.action) == (1, 1, "stop")
    assert loss.outcome.startswith("job stopped: node lost, no spare"), loss.outcome
    assert loss.recovery_s is None
    # the survivors' monitors find their processes gone after the stop: not failures
    assert [f.signature for f in report.failures] == ["node lost"], report.to_text()
    assert (report.timeline[0].cause, report.timeline[0].first_node) == ("node lost", 1)
    assert report.summary.outcome == f"failed (exit code {int(ExitCode.NODE_LOST)})"
    assert "job stopped: node lost, no spare" in report.to_text(width=None)


def _processes_of_job(job_id: str) -> list[psutil.Process]:
    """Every process of this machine started for the job (they carry its id)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(jobenv.JOB_ID) == job_id and proc.status() != "zombie":
                found.append(proc)
    return found


@pytest.mark.timeout(300)
def test_the_demos_node_fault_leaves_no_process_of_the_lost_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``examples/fault_injection.lose_node``, fired by rank 2 itself: its node's whole tree
    (supervisor, ranks, their monitors, standbys) is gone, none of it left frozen, and the
    spare takes over."""
    monkeypatch.setenv("NVRX_DEMO_FAULTS", f"node:{KILL_AFTER_STEP}:2")
    # standbys on: the lost node's standbys and what it kept ready for a failover must go too
    job = _demo_job(tmp_path, 3, "--spare-nodes", "1", "--warm-standby")
    try:
        codes = job.wait(240)
        output = job.output()
        assert codes[0] == 0 and codes[2] == 0 and codes[1] == -signal.SIGKILL, (codes, output)
        assert f"finished {STEPS} steps at world size 4" in output, output
        lost = job.events("node_lost")
        assert [(e["lost_slot"], e["action"], e["replaced_by"]) for e in lost] == [
            (1, "spare", 2)
        ], output
        left = _processes_of_job(job.job_id)
        assert not left, [(p.pid, p.status(), p.cmdline()) for p in left]
    finally:
        for proc in _processes_of_job(job.job_id):
            with contextlib.suppress(psutil.Error):
                proc.kill()
