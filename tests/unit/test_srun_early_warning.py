"""SLURM's warning signal that reaches ``nvrx-srun`` before it becomes srun (``nvrx.slurm.early_warning``).

``nvrx-srun`` runs here for real, in a stand-in allocation whose ``srun`` on PATH records
its environment. Its check of the supervisor's options is held at a point the test controls:
the check reads ``--ft-non-retryable-exception-file``, here a FIFO, which blocks it until the
test writes the patterns, so the warning is sent while ``nvrx-srun`` waits for its check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvrx import jobenv, processes
from nvrx.slurm import early_warning
from nvrx.slurm.early_warning import EarlyWarning
from tests.support.fifo import open_for_writing
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def _allocation(tmp_path: Path) -> dict[str, str]:
    """A batch script's environment in a 2-node allocation, a stand-in srun first on PATH that
    writes the wall time it started at to ``srun.started`` and its environment to ``srun.env``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\ndate +%s.%N > "{tmp_path}/srun.started"\nenv > "{tmp_path}/srun.env"\n')
    srun.chmod(0o755)
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}  # fmt: skip


def _srun_env(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "srun.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_a_warning_while_nvrx_srun_checks_the_options_reaches_the_supervisors(tmp_path: Path) -> None:
    """Before: SLURM's warning that came while nvrx-srun waited for its check ended it with the
    signal's default action (exit 140): srun never ran, nothing was checkpointed, the job failed."""
    patterns = tmp_path / "patterns"
    os.mkfifo(patterns)
    argv = ["--ft-non-retryable-exception-file", str(patterns), "--", "true"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvrx.slurm.srun_cli", *argv], env=_allocation(tmp_path),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    opened: list[int] = []
    try:
        wait_until("nvrx-srun's check to open its pattern file",
                   lambda: open_for_writing(patterns, opened) or proc.poll() is not None, 60)  # fmt: skip
        assert proc.poll() is None and opened, proc.communicate()
        sent = time.time()
        proc.send_signal(signal.SIGUSR2)  # nvrx-srun waits for its check, held on the FIFO
        os.write(opened[0], b"NotRetryable\n")
        os.close(opened.pop())
        out, err = proc.communicate(timeout=60)
    finally:
        for fd in opened:
            os.close(fd)
        processes.stop(proc, ask=signal.SIGKILL)
    assert proc.returncode == 0, (proc.returncode, out, err)  # it became the stand-in srun
    warned = float(_srun_env(tmp_path)[jobenv.WARNED_AT])
    assert sent <= warned <= float((tmp_path / "srun.started").read_text())


def test_nvrx_srun_passes_on_no_warning_it_did_not_get(tmp_path: Path) -> None:
    """A value in the batch environment (set by hand, or left over) is not a warning of this
    run: before, nvrx-srun passed it on to srun, and every supervisor acted on it."""
    env = {**_allocation(tmp_path), jobenv.WARNED_AT: "1700000000.5"}
    done = subprocess.run([sys.executable, "-m", "nvrx.slurm.srun_cli", "--", "true"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert jobenv.WARNED_AT not in _srun_env(tmp_path)


@pytest.fixture
def usr2_restored() -> Iterator[None]:
    """The test process's USR1 and USR2 handlers and signal mask as they were, after the test."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGUSR2)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_the_first_warning_is_noted_and_one_pending_at_the_exec_is_taken(usr2_restored: None) -> None:
    kept = EarlyWarning.install({"NVRX_PREEMPT_SIGNAL": "bogus"})  # refused later, by the check
    assert kept.signum == signal.SIGUSR2 and kept.wall is None
    env = {jobenv.WARNED_AT: "1.0"}
    kept.pass_on(env)
    assert env == {}  # no warning: none passed on, whatever the environment held
    assert signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # blocked for srun
    before = time.time()
    os.kill(os.getpid(), signal.SIGUSR2)  # blocked: pending until pass_on takes it
    kept.pass_on(env)
    assert kept.wall is not None and before <= kept.wall <= time.time()
    assert env == {jobenv.WARNED_AT: repr(kept.wall)}
    assert signal.SIGUSR2 not in signal.sigpending()


def test_a_later_warning_leaves_the_first_one_s_time(usr2_restored: None) -> None:
    kept = EarlyWarning.install({"NVRX_PREEMPT_SIGNAL": "USR1"})
    assert kept.signum == signal.SIGUSR1
    kept = EarlyWarning.install({})
    signal.raise_signal(signal.SIGUSR2)  # the handler runs before raise_signal returns
    first = kept.wall
    assert first is not None
    signal.raise_signal(signal.SIGUSR2)
    assert kept.wall == first


def test_a_supervisor_takes_the_warning_out_of_its_environment() -> None:
    env = {jobenv.WARNED_AT: "1700000000.25", "PATH": "/bin"}
    assert early_warning.take(env) == 1700000000.25
    assert env == {"PATH": "/bin"}
    assert early_warning.take(env) is None
    for bad in ("soon", "nan", "-3", "inf", ""):
        with pytest.raises(ValueError, match=f"NVRX_WARNED_AT={bad!r} is not a wall time"):
            early_warning.take({jobenv.WARNED_AT: bad})


def test_a_child_of_a_supervisor_never_gets_the_warning_s_time() -> None:
    job = jobenv.JobEnv.local(job_id="j")
    assert jobenv.WARNED_AT not in job.child_env(0, 0, base={jobenv.WARNED_AT: "1700000000.25"})


def test_a_supervisor_refuses_a_value_that_is_no_wall_time(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "nvrx.supervisor.cli", "--nproc-per-node", "1",
               "--log-dir", str(tmp_path / "logs"), "--no-warm-standby", "--", "true"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), jobenv.WARNED_AT: "soon"}
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "nvrx-supervise: error: NVRX_WARNED_AT='soon' is not a wall time in seconds: nvrx-srun "
        "sets it for its job step alone; unset it"
    )
