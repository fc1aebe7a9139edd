"""Local jobs of 1-2 nvrx-supervise processes on one machine: restarts, stops, budget, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from nvrx.checkpoint_flag import flag_path_for
from nvrx.events import read_dir
from nvrx.report import build_report
from nvrx.store.wire import WireStore
from nvrx.supervisor import node_keys
from nvrx.supervisor.preemption import SUBMITIT_LOCAL_REQUEUE_EXIT
from nvrx.supervisor.warning_cause import window_s
from tests.support.ports import free_ports
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "train_demo.py"


class Job:
    """N local supervisors forming one job.

    Without ``--warm-standby`` in ``options`` the job runs with ``--no-warm-standby``:
    no process started ahead with torch imported (the standbys, and the node agent and
    held store service kept ready for a failover), CPU that only a test of those needs;
    such a test passes ``--warm-standby``."""

    def __init__(
        self, tmp_path: Path, nnodes: int, nproc: int, command: list[str], *options: str,
        node_env: dict[int, dict[str, str]] | None = None, later: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        """``later``: nodes whose supervisor the test starts itself (``start``)."""
        if "--warm-standby" not in options and "--no-warm-standby" not in options:
            options = ("--no-warm-standby", *options)
        self.tmp_path = tmp_path
        self.log_dir = tmp_path / "logs"
        self.job_id = f"t{os.getpid()}-{time.monotonic_ns() % 10**9}"
        master, store = free_ports(2)
        self.store_port = store
        self.started: dict[int, subprocess.Popen[str]] = {}
        self.outputs: list[Path] = []
        self._launch: list[tuple[list[str], dict[str, str]]] = []
        for node in range(nnodes):
            cmd = [
                sys.executable, "-m", "nvrx.supervisor.cli",
                "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc),
                "--master-port", str(master), "--store-port", str(store),
                "--job-id", self.job_id, "--log-dir", str(self.log_dir), *options, "--", *command,
            ]  # fmt: skip
            # a file, not a pipe: nobody reads until the end, and a full pipe would block the job
            self.outputs.append(tmp_path / f"supervisor-{self.job_id}-{node}.out")
            self.outputs[-1].touch()  # read for the output even where a node never started
            self._launch.append((cmd, {**os.environ, **(node_env or {}).get(node, {})}))
        for node in range(nnodes):
            if node not in later:
                self.start(node)

    def start(self, node: int) -> None:
        """Start ``node``'s supervisor."""
        cmd, env = self._launch[node]
        with self.outputs[node].open("w") as sink:
            self.started[node] = subprocess.Popen(
                cmd, cwd=self.tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
                text=True, start_new_session=True,
            )  # fmt: skip

    @property
    def procs(self) -> list[subprocess.Popen[str]]:
        """The supervisors started, in node order: index them by node only once every node
        started (before, ``started[node]``)."""
        return [self.started[node] for node in sorted(self.started)]

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes of the supervisors; None for one still running at the deadline (then killed)."""
        assert len(self.started) == len(self._launch), "start every node before waiting for them"
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return codes

    def wait_for_beat(self, slot: int, timeout: float = 60) -> None:
        """Until ``slot``'s node agent has beaten in the store: a slot that never beat is
        given the store timeout to arrive before it is reported, not the node timeout.

        The children start while node 0's store service still imports torch, so the store
        may only answer well after they run: the connection is given the whole ``timeout``."""
        deadline = time.monotonic() + timeout
        store = WireStore("127.0.0.1", self.store_port, timeout=timeout)
        try:
            wait_until(
                f"slot {slot} to beat in the store",
                lambda: store.add(node_keys.alive(slot), 0) > 0,
                max(1.0, deadline - time.monotonic()),
                state=self.output,
            )
        finally:
            store.close()

    def output(self) -> str:
        """Supervisor output and a digest of the supervisors' events (for assertion messages)."""
        text = "\n".join(out.read_text(errors="replace") for out in self.outputs)
        digest = [
            f"{e['node']} {e['kind']} {e.get('local_rank')} {e.get('exit_code')} {e.get('signal')} {e.get('reason')}"
            for e in self.events()
        ]
        return text + "\n--- events ---\n" + "\n".join(digest)

    def events(self, kind: str | None = None, component: str | None = "supervisor") -> list[dict]:
        found, _ = read_dir(self.log_dir / self.job_id)
        return [
            e
            for e in found
            if (kind is None or e["kind"] == kind)
            and (component is None or e["component"] == component)
        ]


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text("import os, sys, time, signal\nRANK = int(os.environ['RANK'])\n"
                    "RESTART = int(os.environ['NVRX_RESTART_COUNT'])\n" + body)  # fmt: skip
    return [sys.executable, str(path)]


@pytest.mark.timeout(240)
def test_sigkilled_rank_is_replaced_and_the_job_completes_at_full_size(tmp_path) -> None:
    steps = 30
    job = Job(tmp_path, 2, 2, [sys.executable, str(DEMO), "--steps", str(steps), "--checkpoint-every", "5",
                               "--step-time", "0.05", "--fault", "kill:12:1"], "--max-restarts", "8")  # fmt: skip
    codes = job.wait(200)
    assert codes == [0, 0], job.output()
    exits = job.events("child_exit")
    killed = [e for e in exits if e["signal"] == "SIGKILL"]
    assert [(e["node"], e["local_rank"]) for e in killed] == [(0, 1)]
    restarts = [e for e in job.events("restart_decision") if e["decision"] == "restart"]
    assert any(
        e["node"] == 0 and e["local_rank"] == 1 and e["signature"] == "signal SIGKILL"
        for e in restarts
    )
    replacement = [e for e in job.events("child_start") if e["node"] == 0 and e["local_rank"] == 1]
    assert [e["attempt"] for e in replacement][:2] == [0, 1]
    # every rank reached the last step, and the job ended at full size
    final = {e["rank"] for e in job.events("progress", component="app") if e["step"] == steps}
    assert final == {0, 1, 2, 3}
    assert "finished 30 steps at world size 4" in job.output()
    assert all(e["exit_code"] == 0 for e in job.events("supervisor_end"))


@pytest.mark.timeout(180)
def test_exit_130_stops_every_child_on_both_nodes_with_exit_12(tmp_path) -> None:
    """A rank's exit 130 (its Wrapper gave up) stops the whole job without a restart; the
    training did not complete, so no supervisor says it did (exit 12, not 0)."""
    body = (
        "open(os.path.join(os.environ['NVRX_LOG_DIR'], f'ready-{RANK}'), 'w').close()\n"
        "if RANK == 3:\n"
        "    deadline = time.monotonic() + 120\n"
        "    while len([f for f in os.listdir(os.environ['NVRX_LOG_DIR']) if f.startswith('ready-')]) < 4:\n"
        "        assert time.monotonic() < deadline, 'the other ranks never started'\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(130)\n"
        "time.sleep(600)\n"
    )
    command = script(tmp_path, body)  # rank 3 stops the job once every rank runs
    job = Job(tmp_path, 2, 2, command, "--grace-period", "5")
    assert job.wait(150) == [12, 12], job.output()
    exits = job.events("child_exit")
    assert len(exits) == 4
    assert [e["exit_code"] for e in exits if e["global_rank"] == 3] == [130]
    others = [e for e in exits if e["global_rank"] != 3]
    assert all(e["signal"] == "SIGTERM" for e in others), others
    assert not [e for e in job.events("restart_decision") if e["decision"] == "restart"]
    stops = job.events("job_stop")
    assert {e["node"] for e in stops} == {0, 1} and all(e["exit_code"] == 12 for e in stops)
    assert len(job.events("child_start")) == 4


GIVES_UP = """
import torch.distributed as dist
import nvrx.inprocess as inprocess


@inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=2))
def train(call_wrapper: inprocess.CallWrapper = None) -> None:
    if RANK == 1:  # at once, while rank 0 may still be inside init_process_group
        raise RuntimeError(f"bad batch in round {call_wrapper.iteration}")
    dist.init_process_group("gloo")
    dist.barrier()


train()
"""


@pytest.mark.timeout(200)
def test_a_wrapper_that_gives_up_stops_the_job_with_code_12_and_its_cause(tmp_path) -> None:
    """Rank 1 raises in every round, while rank 0 is in ``init_process_group``: each abort
    leaves torch able to initialize again, the Wrapper gives up after its two rounds
    (``RestartAbort``, exit 130), and the supervisor stops the job with exit 12 and one
    root-cause line naming the rank and its exception; the report says it gave up."""
    job = Job(tmp_path, 1, 2, script(tmp_path, GIVES_UP), "--grace-period", "5")
    assert job.wait(150) == [12], job.output()
    out = job.output()
    assert "Process group cannot be None" not in out and "already registered" not in out, out
    (stop,) = job.events("job_stop")
    assert stop["exit_code"] == 12, out
    assert "root cause: rank 1 on node 0" in out and "RuntimeError" in out, out
    report = build_report(job.log_dir / job.job_id, sacct=False)
    # rounds 0 and 1 trained; the ranks' initialize gave up in a later round
    assert report.summary.outcome.startswith("gave up: restart_abort after "), report.to_text()
    rounds = [(row.round, row.first_rank, row.cause) for row in report.timeline][:2]
    cause = "RuntimeError at child.py:12 in train"
    assert rounds == [(0, 1, cause), (1, 1, cause)], report.to_text()


STOPS_THOUGH_TERMINATE_FAILS = """
import nvrx.inprocess as inprocess
from nvrx.inprocess.exception import RestartAbort


class Fails(inprocess.terminate.Terminate):
    def __call__(self, state):
        raise RuntimeError("the terminate plug-in failed")


@inprocess.Wrapper(terminate=Fails())
def train(call_wrapper: inprocess.CallWrapper = None) -> None:
    raise RestartAbort("the function asks to stop")


train()
"""


@pytest.mark.timeout(120)
def test_a_wrapper_that_stops_stops_the_job_though_its_terminate_plugin_fails(tmp_path) -> None:
    """The function raises ``RestartAbort``; the ``terminate`` plug-in raises as the rank
    leaves, so the Wrapper raises that error, caused by the ``RestartAbort``: the process
    still exits 130 and the supervisor stops the job (exit 12) instead of restarting it
    (before, it exited 1 and was restarted until the budget ran out)."""
    job = Job(tmp_path, 1, 1, script(tmp_path, STOPS_THOUGH_TERMINATE_FAILS), "--max-restarts", "2")
    assert job.wait(100) == [12], job.output()
    assert [e["exit_code"] for e in job.events("child_exit")] == [130], job.output()
    [end] = job.events("wrapper_end", component=None)
    assert end["outcome"] == "restart_abort", job.output()


@pytest.mark.timeout(120)
def test_budget_exhausted_stops_the_job_with_code_4(tmp_path) -> None:
    command = script(tmp_path, "sys.exit(1 + RESTART)\n")  # a new signature every time: no loop
    job = Job(tmp_path, 1, 1, command, "--max-restarts", "2", "--loop-breaker", "2")
    assert job.wait(100) == [4], job.output()
    decisions = job.events("restart_decision")
    assert [e["decision"] for e in decisions] == ["restart", "restart", "give_up"]
    assert [e["budget_left"] for e in decisions[:2]] == [1, 0]
    assert "budget exhausted" in decisions[-1]["reason"]
    (stop,) = job.events("job_stop")
    assert stop["exit_code"] == 4 and "--max-restarts" in stop["reason"]
    assert job.events("supervisor_end")[0]["exit_code"] == 4


@pytest.mark.timeout(120)
def test_loop_breaker_stops_a_repeating_failure_with_code_5(tmp_path) -> None:
    command = script(tmp_path, "sys.exit(3)\n")
    job = Job(tmp_path, 1, 2, command, "--max-restarts", "50", "--loop-breaker", "3")
    assert job.wait(100) == [5], job.output()
    give_up = [e for e in job.events("restart_decision") if e["decision"] == "give_up"]
    assert len(give_up) == 1 and give_up[0]["signature"] == "exit code 3"
    assert "loop breaker" in give_up[0]["reason"] and "3 times in a row" in give_up[0]["reason"]
    assert job.events("job_stop")[0]["exit_code"] == 5
    # both ranks fail in each round, either may be seen first: three job-wide decisions
    decisions = [e["decision"] for e in job.events("restart_decision")]
    assert decisions == ["restart", "restart", "give_up"], job.output()
    assert len(job.events("child_start")) == 6, job.output()
    # One line says what stopped the job, on which rank, and where to read the rest.
    causes = [line for line in job.output().splitlines() if "root cause:" in line]
    assert len(causes) == 1, job.output()
    assert "root cause: rank " in causes[0] and ": exit code 3 (loop breaker" in causes[0]
    assert f"nvrx-report {job.log_dir / job.job_id} " in causes[0], causes[0]


@pytest.mark.timeout(180)
def test_the_loop_breaker_counts_a_job_wide_failure_whichever_node_sees_it_first(tmp_path) -> None:
    # the failing rank alternates between the nodes: each node sees every other failure
    command = script(tmp_path, "if RANK == RESTART % 2: sys.exit(3)\ntime.sleep(600)\n")
    job = Job(tmp_path, 2, 1, command, "--max-restarts", "50", "--loop-breaker", "3")
    assert job.wait(150) == [5, 5], job.output()
    decisions = sorted(job.events("restart_decision"), key=lambda e: e["wall"])
    assert [(e["node"], e["decision"]) for e in decisions] == [
        (0, "restart"), (1, "restart"), (0, "give_up")
    ], job.output()  # fmt: skip
    assert decisions[-1]["reason"] == "loop breaker: the job failed with exit code 3 3 times in a row"
    # each announcement carries the streak on to the next restart's claimer
    stops = [e for e in job.events("job_restart") if e["phase"] == "stopping" and e.get("cause")]
    streaks = {e["epoch"]: e["cause"]["streak"] for e in stops}
    assert streaks == {1: ["exit code 3", 1], 2: ["exit code 3", 2]}, job.output()


@pytest.mark.timeout(120)
def test_per_rank_restarts_share_one_budget_and_every_node_stops_with_code_4(tmp_path) -> None:
    # min-healthy: each failed rank restarts alone. Node 0 spends two of the job's three
    # restarts, then node 1 spends the last one and finds the budget used up at its next
    # failure (with a budget per node it would have two left)
    body = (
        "from pathlib import Path\n"
        "d = Path(os.environ['NVRX_LOG_DIR'])\n"
        "(d / f'start-{RANK}-{RESTART}').touch()\n"
        "if RANK == 0 and RESTART < 2:\n"
        "    sys.exit(1 + RESTART)\n"
        "if RANK == 0:\n"
        "    time.sleep(600)\n"
        "deadline = time.monotonic() + 60\n"
        "while not (d / 'start-0-2').exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "sys.exit(10 + RESTART)\n"
    )  # a new signature every time: no loop
    job = Job(tmp_path, 2, 1, script(tmp_path, body), "--ft-restart-policy", "min-healthy",
              "--max-restarts", "3")  # fmt: skip
    assert job.wait(100) == [4, 4], job.output()
    decisions = sorted(job.events("restart_decision"), key=lambda e: e["wall"])
    assert not [e for e in decisions if e.get("scope") == "job"], decisions  # each rank alone
    told = [(e["node"], e["decision"], e["budget_left"]) for e in decisions]
    assert told == [(0, "restart", 2), (0, "restart", 1), (1, "restart", 0), (1, "give_up", 0)]
    assert "budget exhausted" in decisions[-1]["reason"]
    assert sorted(e["node"] for e in job.events("job_stop") if e["exit_code"] == 4) == [0, 1]


@pytest.mark.timeout(120)
def test_a_per_rank_loop_stops_every_node_with_code_5(tmp_path) -> None:
    command = script(tmp_path, "sys.exit(3)\n")
    job = Job(tmp_path, 2, 1, command, "--ft-restart-policy", "min-healthy",
              "--max-restarts", "50", "--loop-breaker", "2")  # fmt: skip
    assert job.wait(100) == [5, 5], job.output()
    give_up = [e for e in job.events("restart_decision") if e["decision"] == "give_up"]
    assert give_up and all("local rank 0 failed with exit code 3 2 times" in e["reason"] for e in give_up)
    assert sorted(e["node"] for e in job.events("job_stop") if e["exit_code"] == 5) == [0, 1]


@pytest.mark.timeout(180)
def test_a_job_wide_restart_kills_a_rank_that_ignores_sigterm_before_any_rank_starts_again(
    tmp_path,
) -> None:
    # rank 1 ignores SIGTERM: the restart's SIGKILL after --grace-period ends it, and no rank
    # of the next epoch starts while an old one lives (they would meet in the rendezvous)
    body = (
        "from pathlib import Path\n"
        "d = Path(os.environ['NVRX_LOG_DIR'])\n"
        "if RESTART == 0 and RANK == 1:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "(d / f'pid-{RANK}-{RESTART}').write_text(str(os.getpid()))\n"
        "if RESTART == 0 and RANK == 1:\n"
        "    time.sleep(600)\n"
        "if RESTART == 0:\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not (d / 'pid-1-0').exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    sys.exit(1)\n"
        "if RANK == 0:\n"
        "    try:\n"
        "        os.kill(int((d / 'pid-1-0').read_text()), 0)\n"
        "        (d / 'old-peer').write_text('alive')\n"
        "    except ProcessLookupError:\n"
        "        (d / 'old-peer').write_text('gone')\n"
    )
    command = script(tmp_path, body)
    job = Job(tmp_path, 2, 1, command, "--grace-period", "3", "--max-restarts", "2")
    assert job.wait(150) == [0, 0], job.output()
    assert [e["decision"] for e in job.events("restart_decision")] == ["restart"], job.output()
    exits = {(e["node"], e["attempt"]): e["signal"] for e in job.events("child_exit")}
    assert exits[(1, 0)] == "SIGKILL", exits  # it ignored the restart's SIGTERM
    assert (job.log_dir / "old-peer").read_text() == "gone"
    # node 1 reaped it before it counted itself ready, and nobody started before the last ready
    killed = [e["wall"] for e in job.events("child_exit") if (e["node"], e["attempt"]) == (1, 0)]
    again = [e["wall"] for e in job.events("child_start") if e["attempt"] == 1]
    assert len(killed) == 1 and len(again) == 2 and killed[0] <= min(again), job.output()


@pytest.mark.timeout(150)
def test_node_0_waits_for_the_others_only_for_the_finish_timeout_then_exits_6(tmp_path) -> None:
    # node 1's rank never ends: node 0 keeps the store up for it --finish-timeout long, then
    # stops with 6; node 1 loses the store (two nodes: no failover) and stops with 3
    command = script(tmp_path, "if RANK == 1:\n    time.sleep(600)\n")
    job = Job(tmp_path, 2, 1, command, "--finish-timeout", "3")
    assert job.wait(120) == [6, 3], job.output()
    stops = {e["node"]: e for e in job.events("job_stop")}
    assert stops[0]["exit_code"] == 6 and "--finish-timeout" in stops[0]["reason"], stops
    assert stops[1]["exit_code"] == 3, stops
    [done] = [e for e in job.events("child_exit") if e["node"] == 0]
    assert stops[0]["wall"] - done["wall"] >= 3, (done, stops[0])  # it waited, then gave up
    pids = [e["child_pid"] for e in job.events("child_start")]
    assert len(pids) == 2 and not [p for p in pids if _alive({p})], "a child outlived its node"


#: A child's wait until the first claim of job-wide restart 1 is in the store (a failure's, or
#: a node's end claimed against it): what orders one node's end and the other's failure.
AWAIT_CLAIM = """
from nvrx.store.wire import WireStore
store = WireStore(os.environ["NVRX_STORE_HOST"], int(os.environ["NVRX_STORE_PORT"]), timeout=60)
store.wait(["nvrx_supervisor/job_restart/1/claim"], 60)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("finisher", [0, 1], ids=["store-host-finished", "other-node-finished"])
def test_a_failure_after_another_nodes_ranks_completed_stops_the_job_with_13(
    tmp_path: Path, finisher: int
) -> None:
    # One node's rank completes; the other's fails once that node claimed its end. A job-wide
    # restart cannot run the completed ranks again (node 1 has left): the job stops at once
    # with 13 instead of waiting for a node that will never count itself ready.
    body = f"if RANK == {finisher}:\n    sys.exit(0)\n{AWAIT_CLAIM}sys.exit(1)\n"
    job = Job(tmp_path, 2, 1, script(tmp_path, body), "--finish-timeout", "300")
    codes = job.wait(150)
    assert codes == ([13, 13] if finisher == 0 else [13, 0]), job.output()
    [decision] = job.events("restart_decision")
    assert decision["decision"] == "give_up" and decision["global_rank"] == 1 - finisher, decision
    assert f"after every rank of node {finisher} had completed" in decision["reason"], decision
    assert decision["signature"] == "exit code 1", decision
    assert not [e for e in job.events("child_start") if e["attempt"] > 0], job.output()
    report = build_report(job.log_dir / job.job_id)
    assert report.summary.outcome == "failed (exit code 13)", report.to_text()
    assert f"node {finisher} had completed" in (report.summary.reason or ""), report.to_text()


@pytest.mark.timeout(200)
def test_a_node_whose_ranks_complete_as_another_fails_restarts_with_the_job(tmp_path: Path) -> None:
    # Node 1's rank fails; node 0's completes just after that failure claimed the restart
    # (before or after node 0 reads its announcement): node 0 takes part, and both run again.
    body = f"if RESTART == 0 and RANK == 1:\n    sys.exit(1)\nif RESTART == 0:\n{AWAIT_CLAIM}"
    body = body.replace("\nfrom", "\n    from").replace("\nstore", "\n    store") + "sys.exit(0)\n"
    job = Job(tmp_path, 2, 1, script(tmp_path, body), "--finish-timeout", "300")
    assert job.wait(150) == [0, 0], job.output()
    starts = sorted((e["global_rank"], e["attempt"]) for e in job.events("child_start"))
    assert starts == [(0, 0), (0, 1), (1, 0), (1, 1)], job.output()
    phases = [(e["node"], e["phase"]) for e in job.events("job_restart")]
    for node in (0, 1):
        assert [p for n, p in phases if n == node] == ["stopping", "ready", "started"], phases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("warned", [0, 1], ids=["node-0-warned", "node-1-warned"])
def test_a_warning_while_node_0_waits_for_the_others_is_decided_for_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warned: int
) -> None:
    """Node 0's rank ended and its supervisor waits for node 1, whose rank still trains;
    SLURM's warning reaches one node there (node 0 itself, or node 1, whose flag node 0 takes
    up): node 1's rank checkpoints and exits, and node 0 decides for both (before, nobody
    decided: node 1 waited for the decision in vain, or its rank trained on)."""
    monkeypatch.setenv("NVRX_PREEMPT_WINDOW_S", "60")
    command = script(tmp_path, (
        "from nvrx.checkpoint_flag import preemption_requested\n"
        "while RANK == 1 and not preemption_requested():\n"
        "    time.sleep(0.1)  # a training step\n"
        "print(f'rank {RANK} ends', flush=True)\n"
    ))  # fmt: skip
    job = Job(tmp_path, 2, 1, command, "--finish-timeout", "600")
    store = WireStore("127.0.0.1", job.store_port, timeout=60)
    try:
        wait_until(
            "node 0 to report its rank done and wait for node 1",
            lambda: any(k.startswith(node_keys.done(0) + "/") for k in store.list_keys()),
            120,
            state=job.output,
        )
    finally:
        store.close()
    job.procs[warned].send_signal(signal.SIGUSR2)
    codes = job.wait(120)
    output = job.output()
    assert codes == [128 + signal.SIGUSR2] * 2, output
    ends = {e["node"]: e["reason"] for e in job.events("supervisor_end")}
    assert ends == {n: "not requeued: not running under SLURM" for n in (0, 1)}, output
    assert {e["node"] for e in job.events("preempt_signal")} == {0, 1}, output
    exits = sorted((e["node"], e["exit_code"]) for e in job.events("child_exit"))
    assert exits == [(0, 0), (1, 0)], output  # node 1's rank ended on the flag, not killed


@pytest.mark.timeout(240)
def test_a_warning_that_came_while_waiting_for_the_store_is_acted_on_once_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 started its rank and waits for node 0's store when SLURM's warning reaches it:
    once the store answers it raises the job's flag at once, and both ranks checkpoint and
    exit (before, the warning waited for the next thing to wake the supervisor's loop: here
    none came, and the ranks trained on)."""
    monkeypatch.setenv("NVRX_PREEMPT_WINDOW_S", "60")
    command = script(tmp_path, (
        "open(os.path.join(os.environ['NVRX_LOG_DIR'], f'started-{RANK}'), 'w').close()\n"
        "from nvrx.checkpoint_flag import preemption_requested\n"
        "while not preemption_requested():\n"
        "    time.sleep(0.1)  # a training step\n"
    ))  # fmt: skip
    job = Job(tmp_path, 2, 1, command, later=frozenset({0}))
    wait_until(
        "node 1's rank to start while the store is away",
        lambda: (job.log_dir / "started-1").exists() or job.started[1].poll() is not None,
        120,
        state=job.output,
    )
    job.started[1].send_signal(signal.SIGUSR2)  # nobody serves the store yet: it cannot answer
    job.start(0)
    codes = job.wait(120)
    output = job.output()
    assert codes == [128 + signal.SIGUSR2] * 2, output
    ends = {e["node"]: e["reason"] for e in job.events("supervisor_end")}
    assert ends == {n: "not requeued: not running under SLURM" for n in (0, 1)}, output
    exits = sorted((e["node"], e["exit_code"]) for e in job.events("child_exit"))
    assert exits == [(0, 0), (1, 0)], output  # both ranks ended on the flag


@pytest.mark.timeout(240)
def test_a_warning_that_reached_nvrx_srun_first_is_acted_on_as_a_signal_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvrx-srun got SLURM's warning before it became srun and passed on its wall time
    ($NVRX_WARNED_AT): the supervisor raises the job's flag, counting the window from then, its
    rank checkpoints and exits, and the job is requeued, as for the signal itself; the rank's
    environment holds no such variable (before, the variable did nothing: the rank trained on)."""
    monkeypatch.setenv("NVRX_PREEMPT_WINDOW_S", "60")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")  # a requeue without SLURM: exit 144
    command = script(tmp_path, (
        "with open(os.path.join(os.environ['NVRX_LOG_DIR'], 'inherited'), 'w') as f:\n"
        "    f.write(repr(os.environ.get('NVRX_WARNED_AT')))\n"
        "from nvrx.checkpoint_flag import preemption_requested\n"
        "while not preemption_requested():\n"
        "    time.sleep(0.1)  # a training step\n"
    ))  # fmt: skip
    warned = time.time() - 5.0
    job = Job(tmp_path, 1, 1, command, node_env={0: {"NVRX_WARNED_AT": repr(warned)}})
    codes = job.wait(120)
    output = job.output()
    assert codes == [SUBMITIT_LOCAL_REQUEUE_EXIT], output
    assert [e["reason"] for e in job.events("supervisor_end")] == [
        "requeued by submitit's local executor"
    ], output
    assert [e["issued_by"] for e in job.events("requeue")] == ["submitit-local"], output
    received = job.events("signal_received")
    assert [(e["signal"], "nvrx-srun" in e["action"]) for e in received] == [("SIGUSR2", True)]
    flag = json.loads(flag_path_for(job.log_dir / job.job_id, 0).read_text())
    window = window_s(None, "time_limit", None, 60.0)  # submitit's local warning: its time limit
    assert flag["deadline_wall"] == pytest.approx(warned + window, abs=1e-6), flag
    assert [e["exit_code"] for e in job.events("child_exit")] == [0], output  # ended on the flag
    assert (job.log_dir / "inherited").read_text() == "None"


def _tree(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.timeout(180)
def test_sigterm_forwards_then_kills_and_leaves_no_process_behind(tmp_path) -> None:
    # Each child leaves a grandchild in its group; local rank 1 ignores SIGTERM.
    body = (
        "import subprocess\n"
        "subprocess.Popen(['sleep', '600'])\n"
        "if int(os.environ['LOCAL_RANK']) == 1: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(os.path.join(os.environ['NVRX_LOG_DIR'], f'ready-{RANK}'), 'w').close()\n"
        "time.sleep(600)\n"
    )
    command = script(tmp_path, body)
    job = Job(tmp_path, 2, 2, command, "--grace-period", "2")
    def ready() -> bool:
        assert all(p.poll() is None for p in job.procs), job.output()
        return len(list(job.log_dir.glob("ready-*"))) == 4

    wait_until("every child to be ready", ready, 120, state=job.output)
    ours = set().union(*(_tree(p.pid) for p in job.procs))
    assert len(ours) >= 8  # 4 children + 4 grandchildren, plus store service and agents
    os.kill(job.procs[0].pid, signal.SIGTERM)  # one node signalled: the stop reaches the other too
    assert job.wait(60) == [143, 143], job.output()
    # a grandchild killed with its group last may take a moment to die after its supervisor
    wait_until("no process of the job left", lambda: not _alive(ours), 10, state=lambda: _alive(ours))
    received = job.events("signal_received")
    assert [(e["node"], e["signal"]) for e in received] == [(0, "SIGTERM")]
    exits = {(e["node"], e["local_rank"]): e["signal"] for e in job.events("child_exit")}
    assert exits[(0, 1)] == "SIGKILL" and exits[(0, 0)] == "SIGTERM"
    # node 1 ends a grace period after node 0 was signalled; node 0 kept the store up for it
    assert "could not report node 1 done" not in job.output(), job.output()
    assert not list((job.log_dir / job.job_id).glob("store/snapshot-run*.json")), job.output()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP])
def test_sigusr1_goes_to_the_children_and_sigint_or_sighup_stops_the_job(tmp_path, stop) -> None:
    """docs/supervisor.md, "Signals": a forwarded signal reaches the children's process
    groups, a stop signal ends the job with the shell's code for it."""
    body = (
        "def usr1(signum, frame):\n"
        "    open(os.path.join(os.environ['NVRX_LOG_DIR'], f'usr1-{RANK}'), 'w').close()\n"
        "signal.signal(signal.SIGUSR1, usr1)\n"
        "open(os.path.join(os.environ['NVRX_LOG_DIR'], f'ready-{RANK}'), 'w').close()\n"
        "while True: time.sleep(600)\n"
    )
    job = Job(tmp_path, 1, 2, script(tmp_path, body), "--grace-period", "5")
    def files(prefix: str) -> int:
        assert all(p.poll() is None for p in job.procs), job.output()
        return len(list(job.log_dir.glob(f"{prefix}-*")))

    wait_until("both children to be ready", lambda: files("ready") == 2, 60, state=job.output)
    os.kill(job.procs[0].pid, signal.SIGUSR1)
    wait_until("both children to get SIGUSR1", lambda: files("usr1") == 2, 30, state=job.output)
    os.kill(job.procs[0].pid, stop)
    assert job.wait(60) == [128 + int(stop)], job.output()
    received = [(e["signal"], e["action"]) for e in job.events("signal_received")]
    assert received == [("SIGUSR1", "forwarded to children"), (stop.name, "stop the job")]
    exits = {e["local_rank"]: e["signal"] for e in job.events("child_exit")}
    assert exits == {0: "SIGTERM", 1: "SIGTERM"}, job.output()


def _node_1_without_its_store(
    tmp_path: Path, store_timeout: int, then: Any
) -> tuple[int, str, set[int], dict[str, Any], int]:
    """Supervisor of node 1 of 2 with nobody at node 0's store: once both its children
    started, ``then(proc)``; its (exit code, output, children, supervisor_end, store port)."""
    master, store = free_ports(2)
    log_dir = tmp_path / "logs"
    body = (
        "open(os.path.join(os.environ['NVRX_LOG_DIR'], f'started-{RANK}'), 'w').close()\n"
        "time.sleep(600)\n"
    )
    cmd = [
        sys.executable, "-m", "nvrx.supervisor.cli", "--nnodes", "2", "--node-rank", "1",
        "--nproc-per-node", "2", "--master-port", str(master), "--store-port", str(store),
        "--store-timeout", str(store_timeout), "--job-id", "nostore", "--log-dir", str(log_dir),
        "--", *script(tmp_path, body),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(
            "both children to start while the store is away",
            lambda: len(list(log_dir.glob("started-*"))) == 2 or proc.poll() is not None,
            60,
        )
        assert len(list(log_dir.glob("started-*"))) == 2
        children = _tree(proc.pid)
        then(proc)
        output, _ = proc.communicate(timeout=60)  # far below a long store timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    events, _ = read_dir(log_dir / "nostore")
    (end,) = [e for e in events if e["kind"] == "supervisor_end"]
    return proc.returncode, output, children, end, store


@pytest.mark.timeout(120)
def test_a_node_starts_its_children_before_the_store_answers_and_ends_them_if_it_never_does(
    tmp_path,
) -> None:
    """Node 1 of 2, with nobody at node 0's store: its children start at once (they do not
    wait for node 0's torch import), and when the store never answers (``--store-timeout``)
    the supervisor exits 3 naming it, and leaves no child behind."""
    # long enough for both children to start on a loaded machine before the store gives out
    code, output, children, end, store = _node_1_without_its_store(tmp_path, 15, lambda p: None)
    assert code == 3, output
    assert f"127.0.0.1:{store}" in output, output
    assert _alive(children) == set()
    assert end["exit_code"] == 3 and f":{store}" in end["reason"], end


@pytest.mark.timeout(120)
def test_a_stop_signal_while_waiting_for_the_store_ends_the_started_children(tmp_path) -> None:
    """Node 1 of 2 started its children and waits for node 0's store: SIGTERM ends it at once
    (not at ``--store-timeout``) with the signal's exit code, its children with it."""
    code, output, children, end, _ = _node_1_without_its_store(
        tmp_path, 600, lambda proc: os.kill(proc.pid, signal.SIGTERM)
    )
    assert code == 128 + signal.SIGTERM, output
    assert _alive(children) == set()
    assert end["reason"] == "received SIGTERM before the store answered", end
