"""Losing node 0, the store host, locally: supervisors x ranks of the demo inside the Wrapper;
node 0's whole process tree (its store service included) is SIGKILLed mid-training, or frozen
(a hung node: its connections stay open, nothing answers). The lowest surviving slot starts
the next store from the old one's snapshot and every rank starts again in a new generation
past every round used before:

* with ``--spare-nodes 1`` (3 x 2): the spare takes node rank 0, the job completes at world
  size 4;
* without a spare, ``--min-nodes 2`` (3 x 2): node 0's ranks are marked gone before the new
  store is published, and the job completes at world size 4 on the 2 nodes left;
* a job that shrank before (5 x 1, ``--min-nodes 3``): what the old store knew of the gone
  ranks comes back from its snapshot, and the job goes on smaller still.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

import psutil
import pytest
from test_node_loss import (
    KILL_AFTER_STEP,
    STEPS,
    _demo_job,
    _kill_node_mid_training,
    _lose_node_and_finish,
    _no_process_left,
    kill_tree,
)
from test_supervisor_local import DEMO, Job, script

from nvrx.events import read_dir
from nvrx.report import build_report
from nvrx.store import rounds, snapshot
from nvrx.store.seal import Sealer, read_secret_file
from nvrx.supervisor import node_keys
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.job_secret import SECRET_FILE
from tests.support.waiting import wait_until


@pytest.mark.timeout(300)
def test_losing_the_store_host_fails_over_and_the_job_completes(tmp_path: Path) -> None:
    job = _demo_job(tmp_path, 3, "--spare-nodes", "1", "--warm-standby")
    killed, output = _lose_node_and_finish(job, 0, 4)
    failovers = job.events("store_failover")
    assert sorted(e["node"] for e in failovers) == [1, 2], output
    switch = min(e["wall"] for e in failovers)
    assert {(e["epoch"], e["successor"], e["lost_slot"]) for e in failovers} == {(1, 1, 0)}
    assert len({e["new_store"] for e in failovers}) == 1
    lost = job.events("node_lost")
    assert [(e["lost_slot"], e["lost_node"], e["action"], e["replaced_by"]) for e in lost] == [
        (0, 0, "spare", 2)
    ], output
    takeover = job.events("node_takeover")
    assert [(e["node"], e["node_rank"]) for e in takeover] == [(2, 0)]
    # every rank of the new generation ran in a standby started while the store failed over
    restarted = [e for e in job.events("child_start") if e["wall"] >= switch]
    assert sorted(e["global_rank"] for e in restarted) == [0, 1, 2, 3], restarted
    assert all(e["warm"] for e in restarted), restarted
    # the new generation's rounds come after every round of the old store
    events, _ = read_dir(job.log_dir / job.job_id)
    rounds = sorted(
        (e["wall"], e["round"])
        for e in events
        if e["kind"] == "round_start" and e["round"] is not None
    )
    before = [r for wall, r in rounds if wall < switch]
    after = [r for wall, r in rounds if wall > switch]
    assert before and after and min(after) > max(before), rounds
    # the training's own events carry the Wrapper's round, in the new generation too
    progress = {e["round"] for e in events if e["kind"] == "progress" and e.get("component") == "app"}
    assert progress and progress <= {r for _, r in rounds}, (progress, rounds)
    # the new store host removed the run's failover files and snapshot once every slot ended
    job_dir = job.log_dir / job.job_id
    assert not (job_dir / "failover").exists() and not (job_dir / "store").exists()
    _no_process_left(killed)
    report = build_report(job.log_dir / job.job_id, sacct=False)
    (loss,) = report.node_losses
    move = loss.store_failover
    assert move is not None, report.to_text()
    assert (move.successor, move.epoch, move.new_store) == (1, 1, failovers[0]["new_store"])
    assert loss.outcome.startswith(
        "spare slot 2 took over node rank 0; the job's store moved to slot 1 ("
    ), report.to_text()
    assert "the job's store moved to slot 1" in report.to_text(width=None)
    # the round it interrupted is the loss's: the loss counts from when the store last
    # answered, before the survivors' ranks and supervisors found it gone
    assert loss.round is not None, report.to_text(width=None)
    [interrupted] = [row for row in report.timeline if row.round == loss.round]
    assert (interrupted.ordering, interrupted.cause) == ("node_lost", "node lost"), interrupted
    assert "unknown to this nvrx" not in report.to_text(width=None)
    # one row per round the Wrapper ran: none made up from the training's own events
    assert [row.round for row in report.timeline] == sorted({r for _, r in rounds}), report.to_text(width=None)


@pytest.mark.timeout(300)
def test_a_plain_script_fails_over_when_the_store_host_is_lost(tmp_path: Path) -> None:
    """Without the Wrapper, the ranks of the other nodes die with the store host: their
    supervisors fail over (the store found lost by their agents, or while deciding on a
    failed child) instead of stopping the job, and the spare takes node rank 0."""
    job = _demo_job(tmp_path, 3, "--spare-nodes", "1", demo=("--no-wrapper",))
    killed, output = _lose_node_and_finish(job, 0, 4)
    failovers = job.events("store_failover")
    assert sorted(e["node"] for e in failovers) == [1, 2], output
    stops = [e for e in job.events("job_stop") if e["node"] != 0]
    assert not [e for e in stops if "store" in e["reason"]], stops
    _no_process_left(killed)


def _ready_for_failover(pid: int) -> dict[str, int]:
    """Node agents and held store services among the children of supervisor ``pid``."""
    lines = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile is not ready
            lines.append(" ".join(child.cmdline()))
    return {
        "agents": sum("-m nvrx.node_agent supervised" in line for line in lines),
        "held stores": sum("nvrx.store.service" in line and "--held" in line for line in lines),
    }


@pytest.mark.timeout(300)
def test_a_frozen_store_host_is_failed_over_within_seconds(tmp_path: Path) -> None:
    job = _demo_job(tmp_path, 3, "--spare-nodes", "1", "--warm-standby")  # keeps a failover ready
    wait_until(
        f"a checkpoint after step {KILL_AFTER_STEP}",
        lambda: any(e.get("step", 0) >= KILL_AFTER_STEP for e in job.events("progress", "app")),
        120,
        state=job.output,
    )
    # kept ready for the failover while the job runs: an agent per non-host supervisor (beside
    # its own), and a store service held before it binds on slot 1, next in line
    for slot in (1, 2):
        ready = _ready_for_failover(job.procs[slot].pid)
        assert ready == {"agents": 2, "held stores": int(slot == 1)}, (slot, ready)
    assert _ready_for_failover(job.procs[0].pid) == {"agents": 1, "held stores": 0}
    root = psutil.Process(job.procs[0].pid)
    frozen = [root, *root.children(recursive=True)]
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(
            "the survivors to finish",
            lambda: all(p.poll() is not None for p in job.procs[1:]),
            240,
            state=job.output,
        )
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGKILL)
    codes = job.wait(30)
    output = job.output()
    assert codes[1] == 0 and codes[2] == 0, output
    assert f"finished {STEPS} steps at world size 4" in output, output
    failovers = job.events("store_failover")
    assert {(e["epoch"], e["successor"], e["lost_slot"]) for e in failovers} == {(1, 1, 0)}, output


@pytest.mark.timeout(300)
def test_a_warning_after_losing_the_store_host_is_decided_by_its_successor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM's warning after node 0 was lost: the successor store host (slot 1) decides for
    the job (before, nobody did, and every node ended "made no decision in time"). That the
    decider waits only for the slots still in the job: test_preemption_logic."""
    monkeypatch.setenv("NVRX_PREEMPT_WINDOW_S", "15")
    job = _demo_job(tmp_path, 3, "--spare-nodes", "1")
    _kill_node_mid_training(job, 0)
    wait_until(
        "the spare to take over node rank 0 and the job to train again",
        lambda: (
            job.events("node_takeover")
            and any(
                e["wall"] > job.events("node_takeover")[0]["wall"]
                for e in job.events("progress", component="app")
            )
        ),
        120,
        state=job.output,
    )
    job.procs[1].send_signal(signal.SIGUSR2)  # the warning reaches one node; the flag, the rest
    codes = job.wait(120)
    output = job.output()
    warned = {e["node"] for e in job.events("preempt_signal")}
    assert warned == {1, 2}, output
    ends = {e["node"]: e["reason"] for e in job.events("supervisor_end")}
    assert ends[1] == ends[2] == "not requeued: not running under SLURM", output
    assert codes[1] == codes[2] == 128 + signal.SIGUSR2, output


def _gone_in_snapshot(job) -> set[int]:
    """The initial ranks marked gone in the snapshots the store keeps for a successor (a
    sealed list: read with the job's secret)."""
    job_dir = job.log_dir / job.job_id
    sealer = Sealer(read_secret_file(job_dir / SECRET_FILE), 0)
    gone: set[int] = set()
    for path in (job_dir / "store").glob("snapshot-*.json"):
        listed = sealer.entries(rounds.GONE_LIST, snapshot.read(path).get(rounds.GONE_LIST))
        gone |= {int(r) for r in listed.valid}
    return gone


def _world_sizes_after(job, wall: float) -> set[int]:
    return {
        e["world_size"]
        for e in job.events("round_start", component="wrapper")
        if e["wall"] > wall and e.get("world_size") is not None
    }


@pytest.mark.timeout(300)
def test_losing_the_store_host_without_a_spare_shrinks_the_job(tmp_path: Path) -> None:
    """No spare, ``--min-nodes 2`` of 3: node 0 (the store host) is lost; the new store marks
    its ranks gone before it publishes its address, so the new generation meets without
    them and completes at world size 4."""
    job = _demo_job(tmp_path, 3, "--min-nodes", "2")
    killed, output = _lose_node_and_finish(job, 0, 4)
    failovers = job.events("store_failover")
    assert {(e["epoch"], e["successor"], e["lost_slot"]) for e in failovers} == {(1, 1, 0)}
    switch = min(e["wall"] for e in failovers)
    lost = job.events("node_lost")
    assert [(e["lost_slot"], e["lost_node"], e["action"], e["ranks"]) for e in lost] == [
        (0, 0, "shrink", [0, 1])
    ], output
    assert _world_sizes_after(job, switch) == {4}, output
    _no_process_left(killed)
    report = build_report(job.log_dir / job.job_id, sacct=False)
    (loss,) = report.node_losses
    assert (loss.node, loss.slot, loss.action) == (0, 0, "shrink")
    assert loss.outcome.startswith(
        "job shrank to 2 nodes; the job's store moved to slot 1 ("
    ), report.to_text()
    assert loss.store_failover is not None and loss.store_failover.successor == 1
    assert loss.recovery_s is not None and loss.world_size == 4
    assert report.summary.restarts.node_loss == 1


@pytest.mark.timeout(400)
def test_a_job_that_shrank_then_loses_the_store_host_goes_on_smaller_still(
    tmp_path: Path,
) -> None:
    """5 nodes x 1 rank, no spare, ``--min-nodes 3``: node 4 is lost (the job shrinks to 4
    nodes), then node 0: the rank marked gone in the old store comes back from its snapshot,
    so the new generation goes on at 3 nodes instead of waiting for node 4's rank. (Five
    nodes, because an election needs more than half of all the job's slots, lost ones
    included: 3 of 5 survive here.)"""
    job = _demo_job(tmp_path, 5, "--min-nodes", "3", nproc=1)
    first = _kill_node_mid_training(job, 4)

    def trained_again_at_4() -> bool:
        lost = job.events("node_lost")
        # Any round at world size 4: the survivors may start it a few ms before the declaring
        # supervisor writes its node_lost event (the job only shrinks from 5). Node 0 dies only
        # once the store's snapshot, what its successor restores, holds rank 4 as gone.
        if not lost or 4 not in _world_sizes_after(job, 0.0) or 4 not in _gone_in_snapshot(job):
            return False
        return any(e["wall"] > lost[0]["wall"] for e in job.events("progress", component="app"))

    wait_until(
        "node 4 declared lost, marked gone in the store's snapshot, and training at world size 4",
        trained_again_at_4,
        120,
        state=job.output,
    )
    second = kill_tree(job.procs[0].pid)
    codes = job.wait(240)
    output = job.output()
    assert codes[1:4] == [0, 0, 0], output
    assert f"finished {STEPS} steps at world size 3" in output, output
    lost = sorted(job.events("node_lost"), key=lambda e: e["wall"])
    assert [(e["lost_slot"], e["action"], e["ranks"]) for e in lost] == [
        (4, "shrink", [4]),
        (0, "shrink", [0]),
    ], output
    switch = min(e["wall"] for e in job.events("store_failover"))
    assert _world_sizes_after(job, switch) == {3}, output
    _no_process_left(first + second)
    report = build_report(job.log_dir / job.job_id, sacct=False)
    outcomes = [loss.outcome for loss in report.node_losses]
    assert outcomes[0] == "job shrank to 4 nodes", report.to_text()
    assert outcomes[1].startswith(
        "job shrank to 3 nodes; the job's store moved to slot 1 ("
    ), report.to_text()


def _five_nodes_losing_two(tmp_path: Path, steps: int, *options: str) -> Job:
    """The demo on 5 nodes x 1 rank, ``--min-nodes 3``, for a test that loses two store
    hosts one after the other (``options``: the node timeout, spares)."""
    command = [
        sys.executable, str(DEMO), "--steps", str(steps), "--checkpoint-every", "5",
        "--step-time", "0.1", "--soft-timeout", "10", "--hard-timeout", "20",
        "--rejoin-timeout", "30",
    ]  # fmt: skip
    return Job(
        tmp_path, 5, 1, command, "--max-restarts", "8", "--grace-period", "3",
        "--node-heartbeat", "0.5", "--min-nodes", "3", *options,
    )  # fmt: skip


def _completed_at_world_size_3_after_two_failovers(job: Job, codes: list, steps: int) -> str:
    """Asserts that the three nodes left completed the job at world size 3, after slot 1
    hosted the store that replaced slot 0's and slot 2 the one that replaced slot 1's;
    returns the job's output."""
    output = job.output()
    assert codes[2:] == [0, 0, 0], output
    assert f"finished {steps} steps at world size 3" in output, output
    moves = {(e["epoch"], e["successor"], e["lost_slot"]) for e in job.events("store_failover")}
    assert moves == {(1, 1, 0), (2, 2, 1)}, output
    return output


def _snapshots_knowing_the_end_of(job, slot: int) -> list[str]:
    """The store snapshots of the job that hold ``slot``'s end (its claim)."""
    job_dir = job.log_dir / job.job_id
    return [p.name for p in (job_dir / "store").glob("snapshot-*.json") if node_keys.claim(slot) in snapshot.read(p)]


@pytest.mark.timeout(500)
def test_a_store_host_that_wakes_after_its_failover_does_not_undo_the_next_failover(
    tmp_path: Path,
) -> None:
    """5 nodes x 1 rank, one spare, ``--min-nodes 3``. Node 0, the store host, freezes: slot 1
    hosts the next store and the spare (slot 4) takes node rank 0. Node 0 then wakes up: its
    old store keeps its own snapshot, from before the failover, until node 0 fences itself
    (exit 9), and must not overwrite the snapshot of slot 1's store. Then slot 1 is lost
    too: slot 2 hosts the third store, restored from slot 1's (slot 0's end, the spare
    taken), so node rank 1 finds no spare and the job completes at world size 3."""
    # long enough to outlast two failovers and a fence: the rounds before the second failover
    # train a few dozen steps; every step after it is waited out to the end
    steps = 200
    job = _five_nodes_losing_two(tmp_path, steps, "--node-timeout", "3", "--spare-nodes", "1")
    wait_until(
        f"a checkpoint after step {KILL_AFTER_STEP}",
        lambda: any(e.get("step", 0) >= KILL_AFTER_STEP for e in job.events("progress", "app")),
        120,
        state=job.output,
    )
    root = psutil.Process(job.procs[0].pid)
    frozen = [root, *root.children(recursive=True)]
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)

    def trained_after_takeover() -> bool:
        takeover = job.events("node_takeover")
        return bool(takeover) and any(
            e["wall"] > takeover[0]["wall"] for e in job.events("progress", component="app")
        )

    wait_until("the spare to take over node rank 0 and train", trained_after_takeover, 120, state=job.output)
    for proc in frozen:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGCONT)
    wait_until("node 0 to fence itself", lambda: job.procs[0].poll() is not None, 120, state=job.output)
    assert job.procs[0].returncode == ExitCode.FENCED, job.output()
    _no_process_left(frozen)
    wait_until(
        "a store snapshot that holds slot 0's end",
        lambda: _snapshots_knowing_the_end_of(job, 0),
        30,
        state=lambda: sorted(p.name for p in (job.log_dir / job.job_id / "store").glob("*")),
    )
    second = kill_tree(job.procs[1].pid)
    codes = job.wait(300)
    output = _completed_at_world_size_3_after_two_failovers(job, codes, steps)
    lost = sorted(job.events("node_lost"), key=lambda e: e["wall"])
    assert [(e["lost_slot"], e["lost_node"], e["action"], e["replaced_by"]) for e in lost] == [
        (0, 0, "spare", 4),
        (1, 1, "shrink", None),
    ], output
    _no_process_left(second)


@pytest.mark.timeout(300)
def test_a_plain_scripts_failure_after_a_store_failover_restarts_every_node(tmp_path: Path) -> None:
    """After the store moved, a job-wide restart is claimed, announced and let go on the new
    store: each node watches it there, so a failure restarts every node's ranks (before, the
    failing node waited for nodes that watched the lost store, and the job hung)."""
    body = (
        "from pathlib import Path\n"
        "d = Path(os.environ['NVRX_LOG_DIR'])\n"
        "failed = d / 'failed'\n"
        "if failed.exists():  # after the job-wide restart\n"
        "    (d / f'done-{RANK}').touch()\n"
        "    sys.exit(0)\n"
        "if not (d / 'store-lost').exists():\n"
        "    time.sleep(120)  # the first generation, until the store host's loss ends it\n"
        "if RANK == 0:  # on the spare, after the failover\n"
        "    (d / 'up-0').touch()\n"
        "    time.sleep(120)  # until the job-wide restart stops it\n"
        "    sys.exit(0)\n"
        "while not (d / 'up-0').exists():\n"
        "    time.sleep(0.05)\n"
        "failed.touch()\n"
        "sys.exit(3)  # the first failure after the failover\n"
    )
    job = Job(
        tmp_path, 3, 1, script(tmp_path, body), "--spare-nodes", "1", "--grace-period", "3",
        "--node-timeout", "3", "--node-heartbeat", "0.5",
    )  # fmt: skip
    for slot in range(3):  # every slot joined the store before it is lost (a majority elects)
        job.wait_for_beat(slot)
    (job.log_dir / "store-lost").touch()
    killed = kill_tree(job.procs[0].pid)  # the store host lost, at once
    codes = job.wait(60)  # (rank 0 sleeps 120 s when no restart stops it)
    output = job.output()
    assert codes[1] == codes[2] == 0, output
    assert (job.log_dir / "done-0").exists() and (job.log_dir / "done-1").exists(), output
    assert sorted(e["node"] for e in job.events("store_failover")) == [1, 2], output
    started = [e for e in job.events("job_restart") if e["phase"] == "started"]
    assert sorted(e["node"] for e in started) == [1, 2], output
    _no_process_left(killed)


@pytest.mark.timeout(400)
def test_a_second_store_failover_waits_for_no_slot_known_lost(tmp_path: Path) -> None:
    """5 nodes x 1 rank, no spare, ``--min-nodes 3``, a node timeout far longer than a
    failover takes. Node 0, the store host, is lost: slot 1 hosts the next store. Then slot 1
    is lost too: the survivors (2, 3, 4, a majority of 5) elect slot 2 without waiting for
    slot 0, known lost since the first failover (before, they waited the whole node timeout
    for its announcement), and the job completes at world size 3."""
    steps = 300  # long enough to outlast two failovers
    job = _five_nodes_losing_two(tmp_path, steps, "--node-timeout", "120")
    killed: list[psutil.Process] = []
    try:
        killed += _kill_node_mid_training(job, 0)

        def failed_over(epoch: int, slots: set[int]) -> bool:
            done = {e["node"] for e in job.events("store_failover") if e["epoch"] == epoch}
            return slots <= done

        def trained_after_first_failover() -> bool:
            if not failed_over(1, {1, 2, 3, 4}):
                return False
            switch = max(e["wall"] for e in job.events("store_failover"))
            return any(e["wall"] > switch for e in job.events("progress", component="app"))

        wait_until("the first failover and training after it", trained_after_first_failover, 60, state=job.output)
        killed += kill_tree(job.procs[1].pid)
        # far less than the node timeout: an election that waits for slot 0 times out here
        wait_until("the second failover", lambda: failed_over(2, {2, 3, 4}), 60, state=job.output)
        codes = job.wait(240)
    finally:
        for proc in job.procs:
            if proc.poll() is None:
                killed += kill_tree(proc.pid)
                proc.wait()
    output = _completed_at_world_size_3_after_two_failovers(job, codes, steps)
    lost = sorted(job.events("node_lost"), key=lambda e: e["wall"])
    assert [(e["lost_slot"], e["action"]) for e in lost] == [(0, "shrink"), (1, "shrink")], output
    _no_process_left(killed)


def _freeze(pid: int) -> list[psutil.Process]:
    """SIGSTOP ``pid`` and every process below it (a node that stalls); returns them."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGSTOP)
    return tree


def _thaw(tree: list[psutil.Process]) -> None:
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGCONT)


@pytest.mark.timeout(500)
def test_a_slot_declared_lost_while_it_stalled_never_hosts_the_next_store(tmp_path: Path) -> None:
    """5 nodes x 1 rank, no spare, ``--min-nodes 3``. Slot 1 stalls and is declared lost
    (the job shrinks to 4 nodes); the store's snapshot shows its end. The other slots stall
    too, node 0 (the store host) is lost, and slot 1 wakes first: it finds its own end in the
    lost store's snapshot, stands in no election (it announces nothing) and ends as fenced
    (exit 9). Slots 2 to 4 then wake and elect slot 2 (before, slot 1 announced itself, the
    lowest slot, and every survivor elected it: a node the job had given up hosted its
    store), and the job completes at world size 3."""
    steps = 200  # long enough to outlast the stalls and the failover
    job = _five_nodes_losing_two(tmp_path, steps, "--node-timeout", "10", "--warm-standby")
    frozen: list[psutil.Process] = []
    killed: list[psutil.Process] = []
    try:
        wait_until(
            f"a checkpoint after step {KILL_AFTER_STEP}",
            lambda: any(e.get("step", 0) >= KILL_AFTER_STEP for e in job.events("progress", "app")),
            120,
            state=job.output,
        )
        stalled = _freeze(job.procs[1].pid)
        frozen += stalled
        wait_until(
            "slot 1 declared lost and its end in the store's snapshot",
            lambda: _snapshots_knowing_the_end_of(job, 1),
            120,
            state=job.output,
        )
        wait_until(
            "slot 2, next in line now, to keep a store ready in slot 1's place",
            lambda: _ready_for_failover(job.procs[2].pid)["held stores"] == 1,
            60,
            state=job.output,
        )
        others = [p for slot in (2, 3, 4) for p in _freeze(job.procs[slot].pid)]
        frozen += others
        killed += kill_tree(job.procs[0].pid)
        _thaw(stalled)
        alive_1 = job.log_dir / job.job_id / "failover" / "run0" / "e1" / "alive-1"
        wait_until(
            "slot 1 to announce itself or end",
            lambda: alive_1.exists() or job.procs[1].poll() is not None,
            120,
            state=job.output,
        )
        announced = alive_1.exists()
        _thaw(others)
        codes = job.wait(300)
    finally:
        _thaw(frozen)
        for proc in job.procs:
            if proc.poll() is None:
                killed += kill_tree(proc.pid)
                proc.wait()
    output = job.output()
    moves = {(e["node"], e["epoch"], e["successor"]) for e in job.events("store_failover")}
    assert not announced and moves == {(2, 1, 2), (3, 1, 2), (4, 1, 2)}, output
    held = {e["node"]: e["store_held"] for e in job.events("store_failover")}
    assert held == {2: True, 3: None, 4: None}, output  # slot 2 served the store it kept ready
    assert codes[1] == ExitCode.FENCED, output
    assert codes[2:] == [0, 0, 0], output
    assert f"finished {steps} steps at world size 3" in output, output
    lost = sorted(job.events("node_lost"), key=lambda e: e["wall"])
    assert [(e["lost_slot"], e["action"]) for e in lost] == [(1, "shrink"), (0, "shrink")], output
    _no_process_left(killed + frozen)


@pytest.mark.timeout(400)
def test_a_node_lost_with_the_store_host_gets_a_spare_that_starts_with_the_new_generation(
    tmp_path: Path,
) -> None:
    """5 nodes x 1 rank, two spares. Slots 0 (the store host) and 1 are lost at once: slot 2
    hosts the next store and the survivors start a new generation, whose initial barrier
    waits for node rank 1 too. Slot 1 is found silent only in the new store: the spare
    that takes node rank 1 starts with that generation (before, it waited to rejoin a round
    nobody ran, and the survivors for it until their barrier's timeout)."""
    steps = 60
    job = _five_nodes_losing_two(
        tmp_path, steps, "--node-timeout", "3", "--spare-nodes", "2", "--store-timeout", "15"
    )
    wait_until(
        f"a checkpoint after step {KILL_AFTER_STEP}",
        lambda: any(e.get("step", 0) >= KILL_AFTER_STEP for e in job.events("progress", "app")),
        120,
        state=job.output,
    )
    killed = kill_tree(job.procs[0].pid) + kill_tree(job.procs[1].pid)
    codes = job.wait(300)
    output = job.output()
    assert codes[2:] == [0, 0, 0], output
    assert f"finished {steps} steps at world size 3" in output, output
    lost = sorted((e["lost_slot"], e["action"]) for e in job.events("node_lost"))
    assert lost == [(0, "spare"), (1, "spare")], output
    starts = {e["node"]: e for e in job.events("node_takeover")}
    assert sorted(starts) == [3, 4], output
    _no_process_left(killed)
