"""No orphans after a node loss: a SIGKILLed supervisor takes its children with it, and a
frozen node that thaws after the others declared it lost (the store's host too, after the
store failed over) ends its children and exits 9."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_supervisor_local import Job, script

from nvrx.supervisor.exit_codes import ExitCode
from tests.support.waiting import wait_until

NODE_OPTIONS = ("--node-timeout", "2", "--node-heartbeat", "0.5", "--grace-period", "2")
#: A store host lost: found by store requests that find no answer within ``--store-timeout``,
#: which also bounds the other nodes' wait for the store at the start (node 0's store
#: service imports torch meanwhile, well over 10 s on a loaded machine).
STORE_HOST_OPTIONS = (*NODE_OPTIONS, "--store-timeout", "30")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _child_pids(job: Job, node: int) -> list[int]:
    return [e["child_pid"] for e in job.events("child_start") if e["node"] == node]


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _job_with_a_spare(tmp_path: Path, body: str, *options: str) -> Job:
    """Nodes 0 and 1 of one rank each and one spare node, running ``body`` with ``d`` (the
    job's log directory) at hand for the files that mark a rank's progress."""
    head = "from pathlib import Path\nd = Path(os.environ['NVRX_LOG_DIR'])\n"
    return Job(tmp_path, 3, 1, script(tmp_path, head + body), "--spare-nodes", "1", *options)


def _lose_node(job: Job, node: int) -> None:
    """Node ``node`` lost at once: its supervisor and everything below it SIGKILLed, leaves first."""
    for proc in reversed(_tree(job.procs[node].pid)):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """The process tree of ``pid`` stopped (a hung node) for the block, then continued."""
    tree = _tree(pid)
    try:
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):  # it ended meanwhile
                proc.send_signal(signal.SIGSTOP)
        yield
    finally:
        for proc in tree:
            # a process of the tree may end while stopped (SIGKILL still acts): nothing to thaw
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)


# node 1's first children would sleep for 2 minutes: only being killed ends them in time; the
# others (the spare's too) run until the test, once node 1 was declared lost, writes ``go``
BODY = (
    "from pathlib import Path\n"
    "if RANK >= 2 and RESTART == 0:\n    time.sleep(120)\n"
    "go = Path(os.environ['NVRX_LOG_DIR']) / 'go'\n"
    "while not go.exists():\n    time.sleep(0.05)\n"
)


@pytest.mark.timeout(120)
def test_a_sigkilled_supervisor_takes_its_children_with_it(tmp_path: Path) -> None:
    job = Job(tmp_path, 2, 2, script(tmp_path, BODY), "--min-nodes", "1", *NODE_OPTIONS)
    wait_until("node 1's children", lambda: len(_child_pids(job, 1)) == 2, 60, state=job.output)
    job.wait_for_beat(1)  # else it is found lost only at --store-timeout, not --node-timeout
    children = _child_pids(job, 1)
    job.procs[1].send_signal(signal.SIGKILL)  # the supervisor alone, as the OOM killer would
    wait_until("node 1's children to die with it", lambda: all(_gone(p) for p in children), 5)
    wait_until("node 1 declared lost", lambda: job.events("node_lost"), 30, state=job.output)
    (job.log_dir / "go").touch()  # node 0's ranks still ran when it was
    codes = job.wait(60)
    assert codes[0] == 0, job.output()
    assert [e["action"] for e in job.events("node_lost")] == ["shrink"]


@pytest.mark.timeout(120)
def test_a_node_that_thaws_after_it_was_declared_lost_is_fenced(tmp_path: Path) -> None:
    job = Job(tmp_path, 3, 2, script(tmp_path, BODY), "--spare-nodes", "1", *NODE_OPTIONS)
    wait_until("node 1's children", lambda: len(_child_pids(job, 1)) == 2, 60, state=job.output)
    job.wait_for_beat(1)
    children = _child_pids(job, 1)
    with _frozen(job.procs[1].pid):
        wait_until("node 1 declared lost", lambda: job.events("node_lost"), 30, state=job.output)
    wait_until("the thawed node to end its children", lambda: all(_gone(p) for p in children), 10)
    (job.log_dir / "go").touch()  # node 0's ranks still ran when node 1 was declared lost
    codes = job.wait(60)
    output = job.output()
    assert codes == [0, ExitCode.FENCED, 0], output
    assert all(_gone(p) for p in children)
    stop = [e for e in job.events("job_stop") if e["node"] == 1]
    assert stop and "declared lost by the others" in stop[0]["reason"], output
    assert [(e["lost_slot"], e["action"]) for e in job.events("node_lost")] == [(1, "spare")]


@pytest.mark.timeout(240)
def test_a_store_host_that_thaws_after_the_failover_is_fenced(
    tmp_path: Path,
) -> None:
    # node 0 (the store's host, the store service in its tree) freezes; the survivors fail the
    # store over and the spare takes node rank 0. Thawed, node 0 must not train beside it
    # (two stores, two rank 0s): it finds it was declared lost, ends its children, exits 9.
    body = "time.sleep(120 if RESTART == 0 else 4)\n"
    job = Job(tmp_path, 3, 1, script(tmp_path, body), "--spare-nodes", "1", *STORE_HOST_OPTIONS)
    wait_until("the ranks' children", lambda: len(_child_pids(job, 0)) == 1, 60, state=job.output)
    for slot in (1, 2):
        job.wait_for_beat(slot)
    children = _child_pids(job, 0)
    with _frozen(job.procs[0].pid):
        wait_until(
            "the spare to take node rank 0 over",
            lambda: any(e["node_rank"] == 0 for e in job.events("node_takeover")),
            120,
            state=job.output,
        )
    wait_until("the thawed node to end its children", lambda: all(_gone(p) for p in children), 30)
    codes = job.wait(90)
    output = job.output()
    assert codes == [ExitCode.FENCED, 0, 0], output
    stop = [e for e in job.events("job_stop") if e["node"] == 0]
    assert stop and "declared lost by the others" in stop[0]["reason"], output
    assert {(e["epoch"], e["lost_slot"]) for e in job.events("store_failover")} == {(1, 0)}, output
    assert len(_child_pids(job, 0)) == 1, output  # node 0 started nothing once thawed


@pytest.mark.timeout(150)
def test_a_two_node_job_that_loses_its_store_host_stops_with_3_and_elects_no_store(
    tmp_path: Path,
) -> None:
    # a failover needs more than half of the job's slots: one survivor of two elects nothing
    job = Job(tmp_path, 2, 1, script(tmp_path, "time.sleep(120)\n"), *STORE_HOST_OPTIONS)
    wait_until("node 1's child", lambda: len(_child_pids(job, 1)) == 1, 60, state=job.output)
    job.wait_for_beat(1)
    children = _child_pids(job, 1)
    for proc in _tree(job.procs[0].pid):  # node 0 and its store service, lost at once
        proc.kill()
    codes = job.wait(120)
    output = job.output()
    assert codes == [-signal.SIGKILL, 3], output
    assert all(_gone(p) for p in children), output
    assert not job.events("store_failover"), output
    stop = [e for e in job.events("job_stop") if e["node"] == 1]
    assert stop and stop[0]["exit_code"] == 3, output
    assert not job.events("node_lost"), output  # outside SLURM no node can be asked: none declared


@pytest.mark.timeout(180)
def test_a_lost_nodes_restart_carries_the_loop_breakers_streak_on(tmp_path: Path) -> None:
    # rank 0 exits 3, node 1 is lost, rank 0 exits 3 again: with --loop-breaker 2 that is
    # the same failure twice in a row (the node loss between is no failure of the script)
    body = (
        "(d / f'start-{RANK}-{RESTART}').touch()\n"
        "if RANK == 0 and RESTART != 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    job = _job_with_a_spare(tmp_path, body, "--loop-breaker", "2", "--max-restarts", "10",
                            *NODE_OPTIONS)  # fmt: skip
    started = job.log_dir / "start-1-1"
    wait_until("rank 1 to start again", started.exists, 90, state=job.output)
    job.wait_for_beat(1)
    _lose_node(job, 1)
    codes = job.wait(120)
    output = job.output()
    assert codes[0] == codes[2] == ExitCode.LOOP_BREAKER, output
    decisions = sorted(job.events("restart_decision"), key=lambda e: e["wall"])
    assert [e["decision"] for e in decisions] == ["restart", "give_up"], output
    assert "the job failed with exit code 3 2 times in a row" in decisions[-1]["reason"]
    stops = [e for e in job.events("job_restart") if e["phase"] == "stopping" and e.get("cause")]
    lost = {e["cause"]["signature"]: e["cause"]["streak"] for e in stops}
    assert lost.get("node lost") == ["exit code 3", 1], stops


@pytest.mark.timeout(180)
def test_a_node_lost_while_the_job_restarts_does_not_hold_the_restart_up(tmp_path: Path) -> None:
    # Rank 0 exits 3: a job-wide restart. Rank 1 (node 1) ignores SIGTERM, so node 1 is still
    # stopping it when node 1 is lost; node 0 and the spare had counted themselves ready. The
    # lost slot never will: once it is declared lost, the restart goes on with the spare.
    body = (
        "if RESTART == 0 and RANK == 1:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    (d / 'deaf').touch()\n"
        "    time.sleep(120)\n"
        "if RESTART == 0 and RANK == 0:\n"
        "    while not (d / 'deaf').exists():\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(3)\n"
        "(d / f'done-{RANK}-{RESTART}').touch()\n"
    )
    options = ("--node-timeout", "2", "--node-heartbeat", "0.5", "--grace-period", "60")
    job = _job_with_a_spare(tmp_path, body, *options)
    job.wait_for_beat(1)

    def stopping(node: int) -> bool:
        return any(e["node"] == node and e["phase"] == "stopping" for e in job.events("job_restart"))

    wait_until("node 1 to stop its rank for the restart", lambda: stopping(1), 90, state=job.output)
    _lose_node(job, 1)  # its rank still stopping
    codes = job.wait(120)
    output = job.output()
    assert codes[0] == codes[2] == 0, output
    assert (job.log_dir / "done-0-1").exists() and (job.log_dir / "done-1-1").exists(), output
    [loss] = job.events("node_lost")
    assert loss["lost_slot"] == 1 and loss["action"] == "spare", loss
    started = [e for e in job.events("job_restart") if e["phase"] == "started"]
    assert sorted(e["node"] for e in started) == [0, 2], started
