"""No orphans after a node loss: a SIGKILLed supervisor takes its children with it, and a
frozen node that thaws after the others declared it lost ends its children and exits 9."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import psutil
import pytest
from test_supervisor_local import Job, script

from nvrx.supervisor.exit_codes import ExitCode
from tests.support.waiting import wait_until

NODE_OPTIONS = (
    "--node-timeout", "2", "--node-heartbeat", "0.5", "--grace-period", "2", "--store-timeout", "20",
)  # fmt: skip


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


# node 1's first children would sleep for 2 minutes: only being killed ends them in time
BODY = "time.sleep(120 if RANK >= 2 and RESTART == 0 else 6)\n"


@pytest.mark.timeout(120)
def test_a_sigkilled_supervisor_takes_its_children_with_it(tmp_path: Path) -> None:
    job = Job(tmp_path, 2, 2, script(tmp_path, BODY), "--min-nodes", "1", *NODE_OPTIONS)
    wait_until("node 1's children", lambda: len(_child_pids(job, 1)) == 2, 60, state=job.output)
    children = _child_pids(job, 1)
    job.procs[1].send_signal(signal.SIGKILL)  # the supervisor alone, as the OOM killer would
    wait_until("node 1's children to die with it", lambda: all(_gone(p) for p in children), 5)
    codes = job.wait(60)
    assert codes[0] == 0, job.output()
    assert [e["action"] for e in job.events("node_lost")] == ["shrink"]


@pytest.mark.timeout(120)
def test_a_node_that_thaws_after_it_was_declared_lost_is_fenced(tmp_path: Path) -> None:
    job = Job(tmp_path, 3, 2, script(tmp_path, BODY), "--spare-nodes", "1", *NODE_OPTIONS)
    wait_until("node 1's children", lambda: len(_child_pids(job, 1)) == 2, 60, state=job.output)
    job.wait_for_beat(1)
    children = _child_pids(job, 1)
    frozen = _tree(job.procs[1].pid)
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        wait_until("node 1 declared lost", lambda: job.events("node_lost"), 30, state=job.output)
    finally:
        for proc in frozen:
            # a process of the tree may end while stopped (SIGKILL still acts): nothing to thaw
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
    wait_until("the thawed node to end its children", lambda: all(_gone(p) for p in children), 10)
    codes = job.wait(60)
    output = job.output()
    assert codes == [0, ExitCode.FENCED, 0], output
    assert all(_gone(p) for p in children)
    stop = [e for e in job.events("job_stop") if e["node"] == 1]
    assert stop and "declared lost by the others" in stop[0]["reason"], output
    assert [(e["lost_slot"], e["action"]) for e in job.events("node_lost")] == [(1, "spare")]
