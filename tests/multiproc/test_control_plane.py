"""Only the job steers the job: forged and replayed stop flags, and the job's secret kept out
of every file the job leaves.

2 local nodes x 2 ranks of ``examples/ft_heartbeats.py`` under ``nvrx-supervise``. A
foreign client that reaches the store writes a stop flag it made up, one sealed for
another run of the job (a replay), one not even UTF-8 and an empty one: the job trains on
to completion at full size and the supervisor that hosts the store records one
``rejected_write`` event for each. After such
forgeries a real stop (a node's supervisor gets SIGTERM) still stops every node. The job's
secret appears in none of the events, logs, error files, supervisor outputs or the report.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import psutil
import pytest
from test_supervisor_local import REPO, Job

from nvrx import jobenv
from nvrx.store.seal import new_secret, seal
from nvrx.store.wire import WireStore
from nvrx.supervisor.job_secret import SECRET_FILE
from nvrx.supervisor.stop_flag import StopFlag
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

HEARTBEATS = [sys.executable, str(REPO / "examples" / "ft_heartbeats.py")]
COMMON = ("--max-restarts", "4", "--grace-period", "2", "--ft-safety-factor", "60")


def _job(tmp_path, steps: int, *options: str, node_env=None) -> Job:
    command = [*HEARTBEATS, "--steps", str(steps), "--step-time", "0.2",
               "--checkpoint-dir", str(tmp_path / "ck")]  # fmt: skip
    return Job(tmp_path, 2, 2, command, *COMMON, *options, node_env=node_env)


def _environ(process: psutil.Process) -> str:
    """The environment ``process`` started with, as text ("" once it ended)."""
    try:
        return "\n".join(f"{k}={v}" for k, v in process.environ().items())
    except psutil.Error:
        return ""


def _secret(job: Job) -> str:
    return (job.log_dir / job.job_id / SECRET_FILE).read_text().strip()


def _forge(job: Job) -> list[str]:
    """A foreign client's two writes, once every child trains: the keys it wrote."""
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 4, 120)
    secret = job.log_dir / job.job_id / SECRET_FILE
    wait_until("slot 0 to write the job's secret", secret.exists, 120)
    store = WireStore("127.0.0.1", job.store_port, timeout=10)
    forged = json.dumps({"reason": "forged", "exit_code": 0, "node": 0})
    store.set(StopFlag.key(1), forged)
    other_run = seal(bytes.fromhex(_secret(job)), StopFlag.key(2), forged, run=7)
    store.set(StopFlag.key(2), other_run)  # a value the job sealed, but for another run
    store.set(StopFlag.key(3), b"\xff\xfe" + "\x1fmac=é".encode())  # not even UTF-8
    store.set(StopFlag.key(4), "")  # empty: torch's compare_set takes it for "not set"
    return [StopFlag.key(g) for g in (1, 2, 3, 4)]


def test_forged_and_replayed_stop_flags_are_rejected_and_the_job_trains_on(tmp_path):
    job = _job(tmp_path, 90)
    keys = _forge(job)
    assert job.wait(240) == [0, 0], job.output()
    rejected = job.events("rejected_write")
    assert sorted(e["key"] for e in rejected) == keys, rejected  # one event per forged value
    assert not [e for e in job.events("job_stop") if "forged" in e["reason"]], job.output()
    done = [e for e in job.events("child_exit") if e["exit_code"] == 0]
    assert len(done) == 4, job.output()  # every rank of both nodes trained to the end
    assert "rank 3: done" in job.output()
    report = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job.log_dir / job.job_id), "--format", "json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert [r["key"] for r in json.loads(report.stdout)["rejected_writes"]] == keys


def test_a_real_stop_after_forged_values_still_stops_every_node(tmp_path):
    job = _job(tmp_path, 2000)
    _forge(job)
    wait_until("the forged values to be rejected", lambda: len(job.events("rejected_write")) == 4, 60)
    os.kill(job.procs[1].pid, signal.SIGTERM)
    codes = job.wait(120)
    assert codes[1] != 0 and codes[0] == codes[1], (codes, job.output())  # node 0 stopped too
    [stop] = [e for e in job.events("job_stop") if e["node"] == 0]
    assert stop["reason"].startswith("node 1 stopped the job: received SIGTERM"), stop


@pytest.mark.parametrize("given", [False, True], ids=["slot-0-writes-it", "from-the-environment"])
def test_the_jobs_secret_is_in_no_file_it_leaves_and_its_folder_is_private(tmp_path, given):
    secret = new_secret()
    env = {jobenv.JOB_SECRET: secret} if given else {}
    # rank output in files too; warm standbys on, so that their environments are checked too
    job = _job(tmp_path, 40, "--tee", "3", "--warm-standby", node_env={0: env, 1: env})
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 4, 120)
    wait_until("a warm standby to start", lambda: job.events("standby_start"), 120)
    started = [p for sup in job.procs for p in psutil.Process(sup.pid).children(recursive=True)]
    environments = [_environ(p) for p in started]
    assert len(environments) >= 6 and not [e for e in environments if secret in e]
    assert job.wait(240) == [0, 0], job.output()
    job_dir = job.log_dir / job.job_id
    assert (job_dir / SECRET_FILE).exists() != given
    secret = secret if given else _secret(job)
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    if not given:
        assert stat.S_IMODE((job_dir / SECRET_FILE).stat().st_mode) == 0o600
    report = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job_dir)], capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    files = [p for p in job_dir.rglob("*") if p.is_file() and p.name != SECRET_FILE]
    if given:
        assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert any(p.suffix == ".jsonl" for p in files) and any(p.name == "stdout.log" for p in files)
    holding = [str(p) for p in files if secret in p.read_text(errors="replace")]
    holding += [str(p) for p in job.outputs if secret in p.read_text(errors="replace")]
    assert holding == [] and secret not in report.stdout + report.stderr
