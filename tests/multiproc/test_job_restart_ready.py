"""A job-wide restart whose wait for every slot to be ready ends when one never is. Without
node liveness (``fork_and_monitor``: one monitor per rank) the job stops with exit code 6,
naming the missing slot and the option to change; with it (``nvrx-supervise``), a slot whose
supervisor is stuck while its node agent beats on is declared lost as a silent one is, and
the job goes on without it. Neither leaves a process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_supervisor_local import Job, script

from nvrx.events import read_dir
from nvrx.report import build_report
from nvrx.supervisor.exit_codes import ExitCode
from tests.support.ports import free_port_run
from tests.support.waiting import wait_until

SCRIPT = """
import os, signal
import nvrx
nvrx.fork_and_monitor(max_restarts=3, loop_breaker=0, grace_period=1, store_timeout=10,
                      finish_timeout=5)
marks = os.path.join(os.environ['NVRX_LOG_DIR'], 'marks')
name = os.path.join(marks, f"rank{os.environ['RANK']}-attempt{os.environ['NVRX_RESTART_COUNT']}")
with open(name + '.tmp', 'w') as fh:
    fh.write(str(os.getpid()))
os.rename(name + '.tmp', name)
while True:
    signal.pause()
"""

NODES = 3


def _env(tmp_path: Path) -> dict[str, str]:
    port = free_port_run(2) + 1
    env = dict(os.environ, NVRX_LOG_DIR=str(tmp_path / "logs"), NVRX_JOB_ID="ready",
               MASTER_PORT=str(port - 1), NVRX_STORE_PORT=str(port), MASTER_ADDR="127.0.0.1",
               WORLD_SIZE=str(NODES))  # fmt: skip
    for name in ("NVRX_SUPERVISED", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_PROCID"):
        env.pop(name, None)
    return env


def _child(marks: Path, rank: int) -> int:
    return int((marks / f"rank{rank}-attempt0").read_text())


def _ready_nodes(job_dir: Path) -> set[int]:
    events, _ = read_dir(job_dir)
    return {e["node"] for e in events if e["kind"] == "job_restart" and e.get("phase") == "ready"}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(240)
def test_a_monitor_that_never_becomes_ready_stops_the_job_with_its_slot_named(tmp_path) -> None:
    """Monitor 2 is killed (its rank dies with it); then rank 1 fails: a job-wide restart.
    Monitors 0 and 1 stop their ranks and count themselves ready; slot 2 never does. Once
    ``grace_period + store_timeout`` passed, they stop the job (exit 6): a ``job_restart``
    event of phase ``timed_out`` names slot 2, the stop's reason names ``store_timeout``; no
    rank starts again, and every process the monitors started has ended."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    marks, job_dir = tmp_path / "logs" / "marks", tmp_path / "logs" / "ready"
    marks.mkdir(parents=True)
    env = _env(tmp_path)
    monitors = [
        subprocess.Popen(
            [sys.executable, str(script)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        for r in range(NODES)
    ]
    started: set[int] = set()
    try:
        running = lambda: all((marks / f"rank{r}-attempt0").exists() for r in range(NODES))  # noqa: E731
        wait_until("every rank's first start", running, 90, state=lambda: [m.poll() for m in monitors])
        for monitor in monitors[:2]:
            started |= {p.pid for p in psutil.Process(monitor.pid).children(recursive=True)}
        lost_child = _child(marks, 2)
        os.kill(monitors[2].pid, signal.SIGKILL)
        monitors[2].wait(30)
        wait_until("the killed monitor's rank to die with it", lambda: not _alive(lost_child), 30)
        os.kill(_child(marks, 1), signal.SIGUSR1)
        wait_until("monitors 0 and 1 ready", lambda: _ready_nodes(job_dir) >= {0, 1}, 90,
                   state=lambda: _ready_nodes(job_dir))  # fmt: skip
        for monitor in monitors[:2]:
            with contextlib.suppress(psutil.NoSuchProcess):
                started |= {p.pid for p in psutil.Process(monitor.pid).children(recursive=True)}
        outputs = [monitor.communicate(timeout=120)[0] for monitor in monitors[:2]]
    finally:
        for monitor in monitors:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(monitor.pid, signal.SIGKILL)
            monitor.wait(30)
    assert [m.returncode for m in monitors[:2]] == [ExitCode.PEER_LOST] * 2, outputs
    events, _ = read_dir(job_dir)
    timed_out = [e for e in events if e["kind"] == "job_restart" and e.get("phase") == "timed_out"]
    assert timed_out and all((e["missing"], e["limit_s"]) == ([2], 11) for e in timed_out), timed_out
    assert {e["node"] for e in timed_out} <= {0, 1}
    stops = [e for e in events if e["kind"] == "job_stop"]
    assert "slot(s) 2" in stops[0]["reason"] and "store_timeout" in stops[0]["reason"]
    # the store's host waited for slot 2 to leave until finish_timeout passed: named as
    # fork_and_monitor takes it (it has no flags)
    assert any(e["node"] == 0 and "fork_and_monitor's finish_timeout 5 s" in e["reason"]
               for e in stops[1:]), stops  # fmt: skip
    assert not any("--" in e["reason"] for e in stops), stops
    assert "never became ready" in "".join(outputs), outputs
    assert not list(marks.glob("*-attempt1")), "a rank started again without every slot ready"
    assert started and not [pid for pid in started if _alive(pid)]


#: Every rank waits; SIGUSR2 ends it with exit 0 (the job's end, when the test says so).
WAITING_BODY = "signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))\nwhile True:\n    signal.pause()\n"
#: Small limits: the wait for a stuck slot is ``grace_period + store_timeout + node_timeout``.
#: The store's host starts first and its store answers before the others start, so a short
#: store timeout is no race with its torch import.
STUCK_OPTIONS = (
    "--grace-period", "1", "--store-timeout", "8", "--node-timeout", "2", "--node-heartbeat",
    "0.5", "--min-nodes", "2", "--max-restarts", "3",
)  # fmt: skip


def _children_of(job: Job, node: int, attempt: int) -> list[int]:
    return [e["child_pid"] for e in job.events("child_start") if (e["node"], e["attempt"]) == (node, attempt)]


def _end_job(job: Job) -> None:
    """Every supervisor started (stopped or not) killed with its process group, and reaped."""
    for proc in job.started.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _descendants(pids: list[int]) -> set[int]:
    found: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
    return found


@pytest.mark.timeout(150)
def test_a_stuck_supervisor_whose_agent_beats_is_declared_lost_at_a_job_wide_restart(
    tmp_path: Path,
) -> None:
    """Node 2's supervisor is stopped (SIGSTOP; its node agent and rank run on, so its slot
    keeps beating); then rank 1 fails: a job-wide restart. Nodes 0 and 1 count themselves
    ready; slot 2 never does. Once ``grace_period + store_timeout + node_timeout`` passed,
    slot 2 is declared lost as a silent slot is (``node_lost``, cause ``never_ready``): with
    ``--min-nodes 2`` the job shrinks and nodes 0 and 1 start their ranks again. Node 2,
    continued, finds itself fenced, ends its rank and exits 9; nodes 0 and 1 end with 0, and
    no process of the job is left."""
    job = Job(tmp_path, NODES, 1, script(tmp_path, WAITING_BODY), *STUCK_OPTIONS, later=frozenset({1, 2}))
    try:
        job.wait_for_beat(0)
        for node in (1, 2):
            job.start(node)
        for node in (1, 2):
            job.wait_for_beat(node)
        first = lambda: all(_children_of(job, n, 0) for n in range(NODES))  # noqa: E731
        wait_until("every rank's first start", first, 60, state=job.output)
        started = _descendants([p.pid for p in job.procs])
        os.kill(job.procs[2].pid, signal.SIGSTOP)
        os.kill(_children_of(job, 1, 0)[0], signal.SIGUSR1)
        wait_until("slot 2 declared lost", lambda: job.events("node_lost"), 60, state=job.output)
        os.kill(job.procs[2].pid, signal.SIGCONT)
        job.procs[2].wait(30)
        again = lambda: all(_children_of(job, n, 1) for n in (0, 1))  # noqa: E731
        wait_until("ranks 0 and 1 started again", again, 30, state=job.output)
        started |= _descendants([p.pid for p in job.procs[:2]])
        for node in (0, 1):
            os.kill(_children_of(job, node, 1)[0], signal.SIGUSR2)
    except BaseException:
        _end_job(job)
        raise
    codes, output = job.wait(60), job.output()
    assert codes == [0, 0, ExitCode.FENCED], output
    lost = [(e["lost_slot"], e["action"], e["cause"]) for e in job.events("node_lost")]
    assert lost == [(2, "shrink", "never_ready")], output
    timed_out = [e for e in job.events("job_restart") if e.get("phase") == "timed_out"]
    assert timed_out and all(e["missing"] == [2] and e["limit_s"] == 11 for e in timed_out), timed_out
    assert not _children_of(job, 2, 1), output
    fenced = [e for e in job.events("job_stop") if e["node"] == 2]
    assert fenced and "declared lost by the others" in fenced[0]["reason"], output
    assert "not ready for job-wide restart 1 within" in fenced[0]["reason"], output
    assert started and not [pid for pid in started if _alive(pid)]
    # the report tells why it was lost, from the events the supervisors wrote
    report = build_report(job.log_dir / job.job_id, sacct=False)
    assert [(x.slot, x.cause) for x in report.node_losses] == [(2, "never_ready")]
    text = report.to_text(width=None)
    assert "never ready for a job-wide restart (its supervisor stalled while its node beat)" in text
