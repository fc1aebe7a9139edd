"""``nvrx.submit`` on a real two-node SLURM cluster: a job that completes, and checks before sbatch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvrx.events import read_dir
from nvrx.submission.submit import SubmitError, submit


def wrapped_step(fail_rank: int) -> dict:
    """One Wrapper call; ``fail_rank`` raises in the first round, so every rank restarts once."""
    from nvrx import inprocess

    @inprocess.Wrapper()
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> dict:
        assert call_wrapper is not None
        rank = int(os.environ["RANK"])
        if rank == fail_rank and call_wrapper.iteration == 0:
            raise RuntimeError(f"injected fault on rank {rank}")
        return {
            "rank": rank,
            "iteration": call_wrapper.iteration,
            "node": os.environ["SLURMD_NODENAME"],
        }

    return train()


@pytest.mark.timeout(180)
def test_two_node_function_completes_and_reports_rounds(slurm_cluster, tmp_path: Path) -> None:
    job = submit(
        wrapped_step,
        args=(3,),
        folder=tmp_path,
        nodes=2,
        nproc_per_node=2,
        timeout_min=5,
        cpus_per_task=2,
        slurm_partition=slurm_cluster.partition,
    )
    results = job.results(timeout=150)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["node"] for r in results} == set(slurm_cluster.nodes[:2])  # nodes=2 of the 4
    assert all(r["iteration"] == 1 for r in results)  # round 0 failed on rank 3, round 1 completed
    report = job.report()
    summary = report.to_dict()["summary"]
    assert summary["rounds"] == 2
    assert summary["restarts"]["in_process"] == 1
    assert summary["restarts"]["requeue"] == 0
    assert summary["outcome"].startswith("COMPLETED")
    text = job.report_text()
    assert f"nvrx report: job {job.job_id}" in text
    assert "injected fault on rank 3" in text or "RuntimeError" in text
    events, _ = read_dir(job.log_dir)
    assert {e["node"] for e in events if e["kind"] == "supervisor_start"} == {0, 1}


@pytest.mark.timeout(120)
def test_command_target_runs_on_every_rank(slurm_cluster, tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    job = submit(
        ["bash", "-c", f'echo "$SLURMD_NODENAME" > {out}/rank$RANK'],
        folder=tmp_path,
        nodes=2,
        nproc_per_node=2,
        cpus_per_task=1,
    )
    assert job.results(timeout=100) == [None, None, None, None]
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
    assert (out / "rank0").read_text().strip() == slurm_cluster.nodes[0]
    assert (out / "rank3").read_text().strip() == slurm_cluster.nodes[1]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"nodes": 0}, "nodes must be at least 1, got 0"),
        (
            {"slurm_partition": "nosuch"},
            r"slurm_partition='nosuch' is not a partition of this cluster \(known: debug, high\)",
        ),
        ({"nodes": 5}, "nodes=5 but the largest partition has only 4 node"),
        ({"nproc_per_node": 0}, "nproc_per_node must be at least 1, got 0"),
    ],
)
def test_bad_parameters_fail_before_sbatch(
    slurm_cluster, tmp_path: Path, params: dict, message: str
) -> None:
    before = slurm_cluster.run(["squeue", "-h", "-o", "%A"]).stdout.split()
    with pytest.raises(SubmitError, match=message):
        submit(wrapped_step, args=(0,), folder=tmp_path, **params)
    assert slurm_cluster.run(["squeue", "-h", "-o", "%A"]).stdout.split() == before
    assert not list(tmp_path.glob("*/*_submission.sh"))
