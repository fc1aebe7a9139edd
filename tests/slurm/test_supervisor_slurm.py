"""sbatch_templates/train.sbatch on the real local cluster: completion, a killed rank, scancel cleanup."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from nvrx.events import read_dir
from nvrx.slurm import commands
from tests.support.slurm_cluster import LocalSlurmCluster
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
pytestmark = pytest.mark.timeout(300)


def _submit(
    cluster: LocalSlurmCluster,
    tmp_path: Path,
    steps: int,
    faults: str = "",
    step_time: float = 0.02,
) -> tuple[int, Path]:
    logs = tmp_path / "logs"
    train = [sys.executable, str(REPO / "examples" / "train_demo.py"), "--steps", str(steps),
             "--step-time", str(step_time)]  # fmt: skip
    export = ",".join(
        [
            "ALL",
            f"NVRX_SRUN={REPO / 'bin' / 'nvrx-srun'}",
            "NVRX_NPROC_PER_NODE=2",
            f"NVRX_LOG_DIR={logs}",
            "NVRX_SUPERVISE_ARGS=--max-restarts 10 --grace-period 3",
            f"NVRX_DEMO_FAULTS={faults}",
        ]
    )
    job = cluster.sbatch(
        TEMPLATE, "-N2", f"--export={export}", "-o", str(tmp_path / "out-%j.txt"), cwd=tmp_path,
        script_args=train,
    )  # fmt: skip
    return job, logs / str(job)


def _events(directory: Path, kind: str) -> list[dict]:
    events, _ = read_dir(directory) if directory.exists() else ([], None)
    return [e for e in events if e["kind"] == kind]


def test_two_node_job_runs_the_demo_to_completion(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    job, events_dir = _submit(slurm_cluster, tmp_path, steps=20)
    state = slurm_cluster.wait_job(job, timeout=240)
    out = "\n".join(p.read_text() for p in tmp_path.glob("out-*.txt"))
    assert state == "COMPLETED", out
    final = {e["rank"] for e in _events(events_dir, "progress") if e["step"] == 20}
    assert final == {0, 1, 2, 3}, out
    assert {e["node"] for e in _events(events_dir, "supervisor_end")} == {0, 1}
    # the SLURM job each supervisor ran in, which sacct knows whatever NVRX_JOB_ID says
    assert [e["slurm_job_id"] for e in _events(events_dir, "supervisor_start")] == [str(job)] * 2


def test_two_node_job_with_a_killed_rank_completes(
    slurm_cluster: LocalSlurmCluster, tmp_path
) -> None:
    job, events_dir = _submit(slurm_cluster, tmp_path, steps=30, faults="kill:12:3", step_time=0.05)
    state = slurm_cluster.wait_job(job, timeout=240)
    out = "\n".join(p.read_text() for p in tmp_path.glob("out-*.txt"))
    assert state == "COMPLETED", out
    killed = [e for e in _events(events_dir, "child_exit") if e["signal"] == "SIGKILL"]
    assert [(e["node"], e["global_rank"]) for e in killed] == [(1, 3)], out
    final = {e["rank"] for e in _events(events_dir, "progress") if e["step"] == 30}
    assert final == {0, 1, 2, 3}, out


def _ours(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(proc.info["cmdline"] or []) or proc.environ().get(
                "NVRX_LOG_DIR", ""
            ).startswith(marker):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_scancel_leaves_no_process_of_ours(slurm_cluster: LocalSlurmCluster, tmp_path) -> None:
    job, events_dir = _submit(slurm_cluster, tmp_path, steps=100000, step_time=0.05)
    wait_until(
        "the job to train on all 4 ranks",
        lambda: {e["rank"] for e in _events(events_dir, "progress")} == {0, 1, 2, 3},
        180,
        interval=0.5,
    )
    marker = str(tmp_path)
    assert len(_ours(marker)) >= 6  # 2 supervisors + 4 ranks (+ store service and agents)
    slurm_cluster.run(["scancel", str(job)])
    slurm_cluster.wait_job(job, timeout=60, fail_fast=False)
    # KillWait of the cluster bounds what may linger
    wait_until(
        "no process of ours left",
        lambda: not _ours(marker),
        30,
        interval=0.5,
        state=lambda: [p.info for p in _ours(marker)],
    )
    # a supervisor that saw the store go before its own SIGTERM must not requeue the job
    info = commands.show_job(job, env=slurm_cluster.env)
    assert info is not None and info.get("Restarts") == "0", info
    assert not _events(events_dir, "requeue") and not _events(events_dir, "node_lost")
