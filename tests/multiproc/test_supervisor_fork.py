"""fork_and_monitor(): the monitor restarts its forked child and exits with the supervisor's code."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from nvrx.events import read_dir
from tests.support.ports import free_port_run
from tests.support.waiting import wait_until

SCRIPT = """
import os, signal, sys
import nvrx
nvrx.fork_and_monitor(max_restarts=3, loop_breaker=0, store_timeout=60)
attempt = int(os.environ['NVRX_RESTART_COUNT'])
print(f'child pid {os.getpid()} attempt {attempt} rank {os.environ["RANK"]} supervised {os.environ["NVRX_SUPERVISED"]}', flush=True)
ignored = next(int(l.split()[1], 16) for l in open('/proc/self/status') if l.startswith('SigIgn:'))
print(f'child ignores USR2 {bool(ignored & (1 << 11))}', flush=True)
mode = sys.argv[1]
if mode == 'fail_once' and attempt == 0:
    os._exit(1)
if mode == 'clean_stop':
    sys.exit(130)
if mode == 'wait':  # tell the test its pid, then run until killed
    with open(os.path.join(os.environ['NVRX_LOG_DIR'], 'child.pid.tmp'), 'w') as fh:
        fh.write(str(os.getpid()))
    os.rename(fh.name, fh.name[:-4])
    while True:
        signal.pause()
print('child done', flush=True)
"""


def _env(tmp_path) -> dict[str, str]:
    port = free_port_run(2) + 1
    env = dict(os.environ, NVRX_LOG_DIR=str(tmp_path / "logs"), NVRX_JOB_ID="fork", MASTER_PORT=str(port - 1 or 2),
               NVRX_STORE_PORT=str(port))  # fmt: skip
    for name in ("NVRX_SUPERVISED", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return env


def _run(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), mode], env=_env(tmp_path), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    events, _ = read_dir(tmp_path / "logs" / "fork")
    return result, events


@pytest.mark.timeout(150)
def test_failed_child_is_forked_again_and_the_monitor_exits_0(tmp_path) -> None:
    result, events = _run(tmp_path, "fail_once")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attempt 0 rank 0 supervised 1" in result.stdout and "attempt 1 rank 0" in result.stdout
    # like every process a supervisor starts, the forked child ignores SLURM's warning signal
    assert result.stdout.count("child ignores USR2 True") == 2, result.stdout
    assert result.stdout.count("child done") == 1  # only the child ran the script body
    kinds = [e["kind"] for e in events if e["component"] == "supervisor"]
    assert kinds.count("child_start") == 2 and "restart_decision" in kinds
    exits = [e["exit_code"] for e in events if e["kind"] == "child_exit"]
    assert exits == [1, 0]


@pytest.mark.timeout(150)
def test_exit_130_of_the_forked_child_ends_the_monitor_with_12(tmp_path) -> None:
    result, events = _run(tmp_path, "clean_stop")
    assert result.returncode == 12, result.stdout + result.stderr
    assert [e["exit_code"] for e in events if e["kind"] == "child_exit"] == [130]
    assert not [e for e in events if e["kind"] == "restart_decision" and e["decision"] == "restart"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "name, value", [("NVRX_PREEMPT_SIGNAL", "TERM"), ("NVRX_PREEMPT_WINDOW_S", "inf")]
)
def test_a_bad_warning_setting_is_a_usage_error_of_one_line(tmp_path, name: str, value: str) -> None:
    """As ``nvrx-supervise`` refuses it, ``fork_and_monitor`` exits 2 naming the variable:
    no traceback into the user's script, no child started."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), "fail_once"], env={**_env(tmp_path), name: value},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"nvrx fork_and_monitor: error: {name}=" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "child pid" not in result.stdout


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (dead, its new parent not yet reaping)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.timeout(150)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_monitor_killed_by_sigkill_leaves_no_forked_child_behind(tmp_path) -> None:
    """The docs' promise of no orphans holds for ``fork_and_monitor`` too: the forked child
    dies with its monitor (``PR_SET_PDEATHSIG``), as a supervisor's children do."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = _env(tmp_path)
    pid_file = tmp_path / "logs" / "child.pid"
    monitor = subprocess.Popen(
        [sys.executable, str(script), "wait"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    child = None
    try:
        wait_until("the forked child's pid file", pid_file.exists, 60, state=monitor.poll)
        child = int(pid_file.read_text())
        assert not _ended(child)
        os.kill(monitor.pid, signal.SIGKILL)
        monitor.wait(30)
        wait_until(f"the end of forked child {child}", lambda: _ended(child), 20)
    finally:
        for group in (child, monitor.pid):
            if group is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
        monitor.wait(30)


PLACE_SCRIPT = """
import os, signal
import nvrx
nvrx.fork_and_monitor(max_restarts=0, store_timeout=60)
from nvrx import jobenv
from nvrx.fault_tolerance import FaultToleranceConfig, RankMonitorClient
print('child', os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], flush=True)
if os.environ['RANK'] == '0':
    raise SystemExit(0)
os.environ[jobenv.FT_CONFIG] = FaultToleranceConfig(initial_rank_heartbeat_timeout=1).to_json()
RankMonitorClient().init_workload_monitoring()  # and never a heartbeat: hung
while True:
    signal.pause()
"""


@pytest.mark.timeout(150)
def test_the_forked_child_keeps_the_launchers_local_rank_and_its_monitor_still_finds_it(
    tmp_path,
) -> None:
    """Under torchrun (or any launcher that sets ``LOCAL_RANK``) two ranks on one host: each
    child keeps its ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (docs/conventions.md: as torchrun
    sets them), not the one-rank monitor's 0 and 1; the monitor still knows its child, so the
    hang of local rank 1 is seen and stops the job."""
    script = tmp_path / "job.py"
    script.write_text(PLACE_SCRIPT)
    env = _env(tmp_path)
    for name in ("SLURM_JOB_ID", "SLURM_PROCID"):
        env.pop(name, None)
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rank.pid, signal.SIGKILL)
            rank.wait(30)
    assert "child 0 0 2" in outputs[0], outputs[0]
    assert "child 1 1 2" in outputs[1], outputs[1]
    events, _ = read_dir(tmp_path / "logs" / "fork")
    hangs = [e for e in events if e["kind"] == "hang"]
    assert [(e["rank"], e["local_rank"], e["timeout"]) for e in hangs] == [(1, 0, "initial_heartbeat")]
    assert ranks[1].returncode != 0, outputs[1]
