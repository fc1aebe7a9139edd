"""A node lost on the real local cluster (4 slurmd nodes; ``crash_node`` freezes the node's
cgroup and SIGKILLs its slurmd, step daemons and job processes at once).

* ``train_spares.sbatch`` with one spare loses node2 (slot 1): the spare takes over, the job
  completes;
* the same job loses node1 (slot 0: the batch host and the store host): the store fails over,
  the spare takes node rank 0, training completes and nvrx ends the orphaned job; where only
  node1's supervisor is killed, the store fails over the same, but the batch script, alive,
  ends the job;
* ``train.sbatch`` without a spare loses node2: the job stops with "node lost, no spare" and
  is requeued with node2 excluded, then completes elsewhere from its checkpoint;
* the same job loses node1 (the store host: two nodes cannot fail over): node2's supervisor
  stops, records node1 lost and requeues the job without it (ends it, when it was submitted
  with --no-requeue); where only node1's supervisor is killed (node1 still answers SLURM),
  the job ends there, not requeued;
* four nodes lose node2 and node1 at once: node3 and node4 cannot elect a store, so one of
  them records both lost and requeues the job without them, once;
* what a survivor asks SLURM, against a plain two-node job: the batch host answers while
  it runs, nodes that do not answer stop counting once the job is cancelled, and then
  nothing is asked and no requeue is made.

``nvrx-report`` names the lost node each time, and no process of ours is left afterwards.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from unittest.mock import ANY

import psutil
import pytest

from nvrx.events import read_dir
from nvrx.report import build_report
from nvrx.slurm import commands
from nvrx.slurm.nodelist import expand_nodelist
from nvrx.supervisor import node_requeue
from tests.support.slurm_cluster import LocalSlurmCluster
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "sbatch_templates"
DEMO = REPO / "examples" / "train_demo.py"
STEPS = 150
pytestmark = pytest.mark.timeout(420)


def _export(tmp_path: Path, **extra: str) -> str:
    values = {
        "NVRX_LOG_DIR": str(tmp_path / "logs"),
        "NVRX_NODE_TIMEOUT_S": "3",
        "NVRX_SRUN": str(REPO / "bin" / "nvrx-srun"),
        **extra,
    }
    return ",".join(["ALL", *(f"{k}={v}" for k, v in values.items())])


def _demo(steps: int = STEPS) -> list[str]:
    return [sys.executable, str(DEMO), "--steps", str(steps), "--checkpoint-every", "5",
            "--step-time", "0.1", "--rejoin-timeout", "30"]  # fmt: skip


def _events(job_dir: Path, kind: str) -> list[dict]:
    events, _ = read_dir(job_dir) if job_dir.exists() else ([], None)
    return [e for e in events if e["kind"] == kind]


def _wait_training(job_dir: Path, out: Path) -> None:
    wait_until(
        "a checkpoint after step 10",
        lambda: any(e.get("step", 0) >= 10 for e in _events(job_dir, "progress")),
        180,
        state=lambda: out.read_text()[-3000:] if out.exists() else "no output yet",
    )


def _ours_left(job: int) -> list[str]:
    """Processes of SLURM job ``job`` still alive (supervisors, agents, stores, ranks)."""
    left = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("SLURM_JOB_ID") == str(job):
                left.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def _wait_none_of_ours(job: int) -> None:
    """Until no process of SLURM job ``job`` is left."""
    wait_until("no process of ours", lambda: not _ours_left(job), 30, state=lambda: _ours_left(job))


def _sbatch(cluster: LocalSlurmCluster, tmp_path: Path, *args: str) -> int:
    done = cluster.run(["sbatch", "--parsable", *args], cwd=tmp_path)
    return int(done.stdout.strip().split(";")[0])


def _node_lost(
    cluster: LocalSlurmCluster, tmp_path: Path, nproc: int, *options: str, node: str = "node2"
) -> tuple[int, Path, Path]:
    """``train.sbatch`` on two nodes without a spare (sbatch ``options`` added) trains, then
    ``node`` crashes: the job's id, its directory and its output file. The crash stops the
    job's training at once, some steps past the tenth; a requeued run trains the rest."""
    out = tmp_path / "out.txt"
    export = _export(tmp_path, NVRX_NPROC_PER_NODE=str(nproc))
    job = _sbatch(
        cluster, tmp_path, "-N2", "--time=10", *options, f"--export={export}", "-o", str(out),
        str(TEMPLATES / "train.sbatch"), *_demo(60),
    )  # fmt: skip
    job_dir = tmp_path / "logs" / str(job)
    _wait_training(job_dir, out)
    cluster.crash_node(node)
    return job, job_dir, out


def _spare_job(
    cluster: LocalSlurmCluster, tmp_path: Path, steps: int = STEPS
) -> tuple[int, Path, Path]:
    out = tmp_path / "out.txt"
    export = _export(tmp_path, NVRX_NPROC_PER_NODE="2", NVRX_SPARE_NODES="1")
    job = _sbatch(
        cluster, tmp_path, "-N3", "--time=10", f"--export={export}", "-o", str(out),
        str(TEMPLATES / "train_spares.sbatch"), *_demo(steps),
    )  # fmt: skip
    return job, tmp_path / "logs" / str(job), out


def _supervisor_killed(
    cluster: LocalSlurmCluster, tmp_path: Path, nproc: int, node: int
) -> tuple[int, Path, Path]:
    """``train.sbatch`` on two nodes trains, then node rank ``node``'s supervisor is SIGKILLed
    (its node stays up): the job's id, its directory and its output file. Every rank
    faults at once, as with a crash (``_node_lost``)."""
    out = tmp_path / "out.txt"
    export = _export(tmp_path, NVRX_NPROC_PER_NODE=str(nproc))
    job = _sbatch(
        cluster, tmp_path, "-N2", "--time=10", f"--export={export}", "-o", str(out),
        str(TEMPLATES / "train.sbatch"), *_demo(60),
    )  # fmt: skip
    job_dir = tmp_path / "logs" / str(job)
    _wait_training(job_dir, out)
    _kill_supervisor(job_dir, node)
    return job, job_dir, out


def _kill_supervisor(job_dir: Path, node: int) -> None:
    (start,) = [e for e in _events(job_dir, "supervisor_start") if e["node"] == node]
    psutil.Process(start["supervisor_pid"]).kill()


def test_a_spare_node_takes_over_a_lost_node(slurm_cluster: LocalSlurmCluster, tmp_path) -> None:
    job, job_dir, out = _spare_job(slurm_cluster, tmp_path)
    _wait_training(job_dir, out)
    slurm_cluster.crash_node("node2")
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", out.read_text()[-4000:]
    final = {e["rank"] for e in _events(job_dir, "progress") if e["step"] == STEPS}
    assert final == {0, 1, 2, 3}, out.read_text()[-4000:]
    lost = _events(job_dir, "node_lost")
    assert [(e["lost_host"], e["lost_node"], e["action"]) for e in lost] == [("node2", 1, "spare")]
    # the spare took over at once; a SLURM step tried on node2 afterwards found it dead
    probes = _events(job_dir, "node_probe")
    assert [(e["lost_host"], e["responding"]) for e in probes] == [("node2", False)], probes
    report = build_report(job_dir)  # with sacct: the resized allocation is no requeue
    text = report.to_text(width=None)
    assert "node2" in text and "--exclude=node2" in text, text
    assert report.summary.restarts.requeue == 0, text
    slurm_cluster.run(["scancel", str(job)], check=False)
    _wait_none_of_ours(job)


def test_losing_the_batch_and_store_host_fails_over(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    job, job_dir, out = _spare_job(slurm_cluster, tmp_path)
    _wait_training(job_dir, out)
    slurm_cluster.crash_node("node1")
    wait_until(
        "every rank to finish",
        lambda: (
            {e["rank"] for e in _events(job_dir, "progress") if e["step"] == STEPS} == {0, 1, 2, 3}
        ),
        300,
        state=lambda: [(e["node"], e["kind"]) for e in _events(job_dir, "store_failover")],
    )
    # nvrx ends the job: its batch script died with node1, nothing else would
    state = slurm_cluster.wait_job(job, timeout=120)
    assert state in ("CANCELLED", "COMPLETED"), state
    ended = [e["reason"] for e in _events(job_dir, "job_stop") if "batch host" in e["reason"]]
    assert ended == (["the batch host node1 was lost; nvrx ends the job in SLURM after its "
                      "training ended"] if state == "CANCELLED" else []), ended  # fmt: skip
    failovers = _events(job_dir, "store_failover")
    assert {(e["epoch"], e["lost_slot"]) for e in failovers} == {(1, 0)}
    lost = _events(job_dir, "node_lost")
    assert [(e["lost_host"], e["lost_node"], e["action"]) for e in lost] == [("node1", 0, "spare")]
    report = build_report(job_dir, sacct=False)
    text = report.to_text(width=None)
    (loss,) = report.node_losses
    assert loss.host == "node1" and loss.store_failover is not None, text
    assert loss.store_failover.successor == 1, text
    assert "the job's store moved to slot 1" in text, text
    # The survivors' errors at node1's death follow from it: only the lost node is excluded.
    assert report.exclude == "node1", text
    _wait_none_of_ours(job)


def test_a_failover_whose_batch_host_still_runs_leaves_the_end_of_the_job_to_its_script(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    """node1's supervisor (the store host's, slot 0) SIGKILLed, its slurmd and the batch
    script up: the store fails over and the spare takes node rank 0 as when node1 crashes,
    but at the end the store host finds the batch host answering SLURM and cancels nothing:
    the batch script ends the job when its srun returns."""
    # Every rank faults as the supervisor dies and the store fails over at once; node1, up,
    # answers the probe at once too (a crashed node's probe takes seconds, which a job that
    # loses one must outlast): fewer steps do.
    steps = 60
    job, job_dir, out = _spare_job(slurm_cluster, tmp_path, steps)
    _wait_training(job_dir, out)
    _kill_supervisor(job_dir, 0)
    state = slurm_cluster.wait_job(job, timeout=300, fail_fast=False)
    assert state != "CANCELLED", out.read_text()[-4000:]
    final = {e["rank"] for e in _events(job_dir, "progress") if e["step"] == steps}
    assert final == {0, 1, 2, 3}, out.read_text()[-4000:]
    assert {(e["epoch"], e["lost_slot"]) for e in _events(job_dir, "store_failover")} == {(1, 0)}
    assert not [e for e in _events(job_dir, "job_stop") if "batch host" in e["reason"]]
    assert "nvrx: supervisors ended with exit code" in out.read_text(), out.read_text()[-4000:]
    _wait_none_of_ours(job)


def test_without_a_spare_the_job_is_requeued_without_the_lost_node(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    # submitted with --exclude=node4: the requeue adds node2 and keeps node4 out
    job, job_dir, out = _node_lost(slurm_cluster, tmp_path, 2, "--exclude=node4")
    # requeued held, node2 excluded, released: it runs again on its own, on other nodes
    wait_until(
        "the job to run again",
        lambda: (commands.show_job(job, env=slurm_cluster.env) or {}).get("Restarts") == "1",
        120,
    )
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", out.read_text()[-4000:]
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None, info
    excluded = commands.show_hostnames(info["ExcNodeList"], env=slurm_cluster.env)
    assert set(excluded) == {"node2", "node4"}, info
    ran_on = commands.show_hostnames(info["NodeList"], env=slurm_cluster.env)
    assert not {"node2", "node4"} & set(ran_on), info
    stops = [
        e for e in _events(job_dir, "job_stop") if e["reason"].startswith("node lost, no spare")
    ]
    assert stops and stops[0]["exit_code"] == 8
    requeues = _events(job_dir, "requeue")
    assert [(e["cause"], e.get("excluded"), e["count"], e.get("answered")) for e in requeues] == [
        ("node_failure", ["node4", "node2"], 1, [])
    ]  # and the next run did not take it for a requeue SLURM made by itself
    text = build_report(job_dir, sacct=False).to_text(width=None)
    assert "node2" in text and "--exclude=node2" in text, text
    _wait_none_of_ours(job)


def test_without_a_spare_losing_the_store_host_requeues_the_job_without_it(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    """Two nodes cannot fail over their store: node2's supervisor, left alone when node1 (the
    batch host and store host) crashes, stops the job and requeues it without node1, instead
    of leaving the allocation held until its time limit."""
    job, job_dir, out = _node_lost(slurm_cluster, tmp_path, 1, "--exclude=node4", node="node1")
    wait_until(
        "the job to run again",
        lambda: (commands.show_job(job, env=slurm_cluster.env) or {}).get("Restarts") == "1",
        120,
        state=lambda: commands.show_job(job, env=slurm_cluster.env),
    )
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", out.read_text()[-4000:]
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None, info
    excluded = commands.show_hostnames(info["ExcNodeList"], env=slurm_cluster.env)
    assert set(excluded) == {"node1", "node4"}, info
    stops = [e for e in _events(job_dir, "job_stop") if e["node"] == 1]
    assert stops and stops[0]["exit_code"] == 3, stops
    requeues = _events(job_dir, "requeue")
    assert [(e["cause"], e.get("excluded"), e.get("answered")) for e in requeues] == [
        ("node_failure", ["node4", "node1"], [])
    ], requeues
    lost = _events(job_dir, "node_lost")
    assert [(e["lost_host"], e["lost_node"], e["seen_by"], e["action"]) for e in lost] == [
        ("node1", 0, 1, "stop")
    ], lost
    report = build_report(job_dir, sacct=False)
    text = report.to_text(width=None)
    assert report.exclude == "node1" and "--exclude=node1" in text, text
    _wait_none_of_ours(job)


def test_four_nodes_that_lose_two_with_the_store_host_are_requeued_once_without_both(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    """node2 and node1 (the batch and store host) crash together: node3 and node4 are no
    majority of four, so no store is elected; one of them records both lost and requeues the
    job without them, once, which frees the allocation instead of holding node3 and node4
    until the time limit (the job then waits for four nodes)."""
    out = tmp_path / "out.txt"
    job = _sbatch(
        slurm_cluster, tmp_path, "-N4", "--time=10",
        f"--export={_export(tmp_path, NVRX_NPROC_PER_NODE='1')}", "-o", str(out),
        str(TEMPLATES / "train.sbatch"), *_demo(100),
    )  # fmt: skip
    job_dir = tmp_path / "logs" / str(job)
    _wait_training(job_dir, out)
    slurm_cluster.crash_node("node2")  # (its silence counts only after NVRX_NODE_TIMEOUT_S)
    slurm_cluster.crash_node("node1")
    show = lambda: commands.show_job(job, env=slurm_cluster.env) or {}  # noqa: E731
    wait_until(
        "the job to be requeued", lambda: show().get("Restarts") == "1", 180,
        state=lambda: (show().get("JobState"), out.read_text()[-3000:] if out.exists() else ""),
    )  # fmt: skip
    wait_until("the job to wait for nodes", lambda: show().get("JobState") == "PENDING", 60, state=show)
    excluded = commands.show_hostnames(show()["ExcNodeList"], env=slurm_cluster.env)
    assert set(excluded) == {"node1", "node2"}, show()
    _wait_none_of_ours(job)
    stops = sorted(e["node"] for e in _events(job_dir, "job_stop") if e["exit_code"] == 3)
    assert stops == [2, 3], _events(job_dir, "job_stop")
    lost = _events(job_dir, "node_lost")
    assert [(e["lost_host"], e["lost_node"], e["action"]) for e in lost] == [
        ("node1", 0, "stop"), ("node2", 1, "stop")
    ], lost
    assert len({e["seen_by"] for e in lost} & {2, 3}) == 1, lost  # one survivor asked SLURM
    requeues = _events(job_dir, "requeue")
    assert [(e["cause"], e.get("excluded"), e.get("answered")) for e in requeues] == [
        ("node_failure", ["node1", "node2"], [])
    ], requeues
    report = build_report(job_dir, sacct=False)
    text = report.to_text(width=None)
    assert report.exclude == "node[1-2]" and "--exclude=node[1-2]" in text, text


def test_a_killed_store_host_supervisor_on_a_responding_node_ends_the_job_unrequeued(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    """node1's supervisor (and with it the store) SIGKILLed, its slurmd up: node2 stops with
    exit 3, and since node1 answers SLURM nothing is declared lost or requeued: the job ends."""
    job, job_dir, out = _supervisor_killed(slurm_cluster, tmp_path, 1, node=0)
    assert slurm_cluster.wait_job(job, timeout=120) == "FAILED", out.read_text()[-4000:]
    stops = [e for e in _events(job_dir, "job_stop") if e["node"] == 1]
    assert stops and stops[0]["exit_code"] == 3, stops
    assert not _events(job_dir, "node_lost") and not _events(job_dir, "requeue")
    probes = _events(job_dir, "node_probe")
    assert [(e["lost_slot"], e["lost_host"], e["responding"], e["node"]) for e in probes] == [
        (0, "node1", True, 1)
    ], probes
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None and info.get("Restarts") == "0", info
    report = build_report(job_dir, sacct=False)
    assert report.exclude is None, report.to_text(width=None)
    _wait_none_of_ours(job)


def test_slurm_is_asked_about_the_steps_nodes_only_while_the_job_runs(
    slurm_cluster: LocalSlurmCluster, tmp_path, monkeypatch
) -> None:
    """What a survivor asks SLURM, against a real job on node1 and node2 (the survivor's node
    and step named through its variables): the batch host, node1, answers while the job
    runs; when the survivor's own node runs no step of the job, the answer is None; with the
    batch host taken to be node4 (no node of the job), nodes that do not answer count once
    the job still runs after the wait, and not when the job is cancelled during the wait;
    after that nothing is asked and no requeue is made (SLURM itself would requeue a
    cancelled job)."""
    job = _sbatch(slurm_cluster, tmp_path, "-N2", "-w", "node[1-2]", "--time=5", "--wrap", "sleep 600")
    state = lambda: (commands.show_job(job, env=slurm_cluster.env) or {}).get("JobState")  # noqa: E731

    wait_until("the job to run", lambda: state() == "RUNNING", 60, state=state)

    def probe(
        own: str, nodelist: str, silent: set[int], settle_s: float = 0.0
    ) -> node_requeue.StepAnswers | None:
        env = {**slurm_cluster.env, "SLURMD_NODENAME": own, "SLURM_STEP_NODELIST": nodelist}
        nslots = len(expand_nodelist(nodelist))
        return node_requeue.probe_step_nodes(str(job), 1, nslots, silent, settle_s, env=env)

    first = node_requeue.StepAnswers(
        ("node1", "node2"), "node1", ("node1",), frozenset({"node1"}), ANY
    )
    assert probe("node2", "node[1-2]", {0}) == first
    assert probe("node3", "node[1,3]", {0}) is None  # node3 runs no step of the job
    monkeypatch.setattr(node_requeue, "batch_host", lambda info: "node4")
    t0 = time.monotonic()
    answers = probe("node1", "node4,node1,node3", {0, 2}, settle_s=2.0)
    assert answers is not None and answers.silent == [(0, "node4"), (2, "node3")], answers
    assert time.monotonic() - t0 >= 2.0  # counted only once the job still ran 2 s later
    real, looks = node_requeue.job_running, []

    def job_running(job_id: str, env: Mapping[str, str] | None = None) -> bool:
        running = real(job_id, env)
        looks.append(running)
        if len(looks) == 1:  # the wait's first look saw the job RUNNING: it is cancelled now
            slurm_cluster.run(["scancel", str(job)])
        return running

    monkeypatch.setattr(node_requeue, "job_running", job_running)
    t0 = time.monotonic()
    assert probe("node2", "node4,node2", {0}, settle_s=300) is None
    assert looks[0] and not looks[-1] and time.monotonic() - t0 < 300, looks
    asked: list[str] = []
    monkeypatch.setattr(commands, "node_answers", lambda job_id, node, **kw: bool(asked.append(node)))
    assert probe("node2", "node[1-2]", {0}) is None and asked == []
    for key in [k for k in os.environ if k.startswith("SLURM_")]:  # as in slurm_cluster.env
        monkeypatch.delenv(key)
    assert node_requeue.requeue_excluding(str(job), ["node1"]) is None
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None and info.get("Restarts") == "0", info


def test_a_two_node_job_with_no_requeue_that_loses_its_store_host_is_ended(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    """Submitted with --no-requeue, node1 (the batch host and store host) crashes: node2 records
    it lost, cannot requeue, and ends the job instead of leaving it RUNNING until its limit."""
    job, job_dir, out = _node_lost(slurm_cluster, tmp_path, 1, "--no-requeue", node="node1")
    assert slurm_cluster.wait_job(job, timeout=300, fail_fast=False) == "CANCELLED", out.read_text()[-4000:]
    lost = _events(job_dir, "node_lost")
    assert [(e["lost_host"], e["seen_by"], e["action"]) for e in lost] == [("node1", 1, "stop")], lost
    assert not _events(job_dir, "requeue")
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None and info.get("Restarts") == "0", info
    _wait_none_of_ours(job)


def test_a_job_submitted_with_no_requeue_stops_for_a_lost_node_and_is_not_requeued(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    job, job_dir, out = _node_lost(slurm_cluster, tmp_path, 1, "--no-requeue")
    assert slurm_cluster.wait_job(job, timeout=300) != "COMPLETED", out.read_text()[-4000:]
    stops = [e for e in _events(job_dir, "job_stop") if e["node"] == 0]
    assert stops and stops[0]["exit_code"] == 8, out.read_text()[-4000:]
    assert not _events(job_dir, "requeue"), out.read_text()[-4000:]
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None and info.get("Restarts") == "0", info
    assert "not requeueable" in out.read_text(), out.read_text()[-4000:]
    _wait_none_of_ours(job)


def test_a_killed_supervisor_on_a_responding_node_is_not_excluded(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    """node2's supervisor SIGKILLed, its slurmd up: the job stops for the lost slot (no
    spare) and is requeued, but node2 answers SLURM, so neither the requeue nor the report
    excludes it."""
    job, job_dir, out = _supervisor_killed(slurm_cluster, tmp_path, 2, node=1)
    wait_until(
        "the job to run again",
        lambda: (commands.show_job(job, env=slurm_cluster.env) or {}).get("Restarts") == "1",
        120,
        state=lambda: out.read_text()[-3000:] if out.exists() else "no output yet",
    )
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", out.read_text()[-4000:]
    losses = _events(job_dir, "node_lost")
    assert losses and losses[0]["lost_host"] == "node2", losses
    lost = losses[0]
    assert "NOT_RESPONDING" not in (lost["slurm_state"] or {}).get("State", ""), lost
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None and info.get("ExcNodeList") in (None, "", "(null)"), info
    requeues = _events(job_dir, "requeue")
    assert [(e["cause"], e.get("excluded"), e.get("answered")) for e in requeues] == [
        ("node_failure", [], ["node2"])
    ], requeues
    report = build_report(job_dir, sacct=False)
    assert report.exclude is None, report.to_text()
    _wait_none_of_ours(job)
