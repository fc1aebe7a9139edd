"""A job-wide restart without node liveness (``fork_and_monitor``: one monitor per rank) whose
wait for every monitor to be ready ends when one never is: the job stops with exit code 6,
naming the missing slot and the option to change, and leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from nvrx.events import read_dir
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
    # the store's host waited for slot 2 to leave until finish_timeout passed
    assert any(e["node"] == 0 and "--finish-timeout" in e["reason"] for e in stops[1:]), stops
    assert "never became ready" in "".join(outputs), outputs
    assert not list(marks.glob("*-attempt1")), "a rank started again without every slot ready"
    assert started and not [pid for pid in started if _alive(pid)]
