"""submitit's conventions under ``nvrx.submit`` on a real cluster: ``SUBMITIT_PREEMPT_SIGNAL``,
``__submitit_checkpoint__`` on a preempted job, and ``map_array`` as a SLURM job array."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from submitit.core.utils import DelayedSubmission
from submitit.helpers import Checkpointable

from nvrx.events import read_dir
from nvrx.submission.submit import Executor, submit
from tests.support.waiting import wait_until


def finish_from(step: int, marks: str) -> dict:
    """What the checkpoint asks the requeued run to do instead of training again."""
    rank = int(os.environ["RANK"])
    (Path(marks) / f"finished-rank{rank}").touch()
    return {"rank": rank, "run": os.environ["SLURM_RESTART_COUNT"], "resumed_from": step}


class TrainsUntilStopped(Checkpointable):
    """Trains without ever looking at nvrx.preemption_requested(); its checkpoint moves on."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self, marks: str) -> dict:
        (Path(marks) / f"started-rank{os.environ['RANK']}").touch()
        while True:  # only the warning ends this run
            self.step += 1
            time.sleep(0.05)

    def __submitit_checkpoint__(self, marks: str) -> DelayedSubmission:
        return DelayedSubmission(finish_from, self.step, marks)


def square_on_every_rank(x: int) -> tuple[int, int, str]:
    return int(os.environ["RANK"]), x * x, os.environ["SLURM_ARRAY_TASK_ID"]


@pytest.mark.timeout(240)
def test_submitit_checkpoint_on_a_job_preempted_with_usr1(
    slurm_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SUBMITIT_PREEMPT_SIGNAL=USR1: SLURM warns with USR1, the supervisors take it as the
    warning, rank 0's __submitit_checkpoint__ runs, every rank stops at once, node 0 requeues,
    and the requeued run calls what the checkpoint returned."""
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    monkeypatch.delenv("NVRX_PREEMPT_SIGNAL", raising=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    cpus = slurm_cluster.cpus_per_node
    job = submit(
        TrainsUntilStopped(),
        args=(str(marks),),
        folder=tmp_path,
        nodes=2,
        nproc_per_node=1,
        timeout_min=10,
        signal_delay_s=60,
        cpus_per_task=cpus,  # whole nodes: a job of the high partition must preempt it
        slurm_partition=slurm_cluster.partition,
    )
    assert "#SBATCH --signal=USR1@60\n" in (job.folder / f"{job.job_id}_submission.sh").read_text()
    wait_until("every rank to train", lambda: len(list(marks.glob("started-*"))) == 2, 90)
    every_node = f"-N{len(slurm_cluster.nodes)}"
    high = slurm_cluster.sbatch(
        "sleep 1\n", "-p", slurm_cluster.high_partition, every_node, f"-c{cpus}"
    )
    assert slurm_cluster.wait_job(high, timeout=90) == "COMPLETED"
    slurm_cluster.start_soon_when_requeued(int(job.job_id), 60)
    results = job.results(timeout=120)
    assert [(r["rank"], r["run"]) for r in results] == [(0, "1"), (1, "1")]
    assert results[0]["resumed_from"] > 0  # the step rank 0 had reached when it was warned
    assert results[1]["resumed_from"] == results[0]["resumed_from"]  # one checkpoint for all
    events, _ = read_dir(job.log_dir)
    warnings = [e for e in events if e["kind"] == "preempt_signal"]
    assert {(e["signal"], e["cause"]) for e in warnings} == {("SIGUSR1", "preemption")}
    assert 0 in {e["node"] for e in warnings}
    requeues = [e for e in events if e["kind"] == "requeue"]
    assert [(e["node"], e["cause"], e["count"]) for e in requeues] == [(0, "preemption", 1)]
    saves = [e for e in events if e["kind"] == "checkpoint" and e["action"] == "save"]
    assert [e["rank"] for e in saves] == [0]
    starts = [e for e in events if e["kind"] == "supervisor_start"]
    first_run = {e["pid"] for e in starts if e["wall"] < saves[0]["wall"]}
    stopped = [e for e in events if e["kind"] == "child_exit" and e["pid"] in first_run]
    # ended by the guard right after the checkpoint, not killed at the end of the window
    assert sorted((e["global_rank"], e["exit_code"], e["signal"]) for e in stopped) == [
        (0, 0, None),
        (1, 0, None),
    ]
    assert job.report().to_dict()["summary"]["restarts"]["requeue"] == 1


@pytest.mark.timeout(180)
def test_map_array_is_a_job_array_of_supervised_jobs(slurm_cluster, tmp_path: Path) -> None:
    executor = Executor(tmp_path, nproc_per_node=2, timeout_min=5, cpus_per_task=1)
    jobs = executor.map_array(square_on_every_rank, [3, 4])
    array_id = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array_id}_0", f"{array_id}_1"]
    assert [job.results(timeout=120) for job in jobs] == [
        [(0, 9, "0"), (1, 9, "0")],
        [(0, 16, "1"), (1, 16, "1")],
    ]
    for job in jobs:
        assert job.log_dir == tmp_path / "nvrx_logs" / job.job_id
        events, _ = read_dir(job.log_dir)
        assert {e["job"] for e in events} == {job.job_id}
        # results wait for accounting's record of the end, which slurmctld writes before the
        # job's nodes have cleaned up: scontrol may still say COMPLETING for a moment
        wait_until(f"{job.job_id} to leave COMPLETING", lambda j=job: j.state != "COMPLETING", 60)
        assert job.state == "COMPLETED"  # scontrol/sacct asked with the <array>_<index> id
        report = job.report()
        summary = report.to_dict()["summary"]
        assert summary["outcome"].startswith("COMPLETED"), summary  # sacct found the element
        # asked by the element's SLURM_JOB_ID, shown by sacct's name of it
        assert [r.job_id for r in report.slurm.job] == [job.job_id], report.slurm
        assert {r.job_id for r in report.slurm.steps} >= {f"{job.job_id}.batch"}
        assert f"nvrx report: job {job.job_id}" in job.report_text()
