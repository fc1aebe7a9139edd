"""nvrx-report on real jobs of the local SLURM cluster: events, sacct and SLURM's output files
together (``slurm-<id>.out``; an array element's ``slurm-<array id>_<index>.out``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx.report import build_report
from nvrx.slurm import commands
from tests.support.slurm_cluster import LocalSlurmCluster
from tests.support.slurm_errors import wait_for

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sbatch_templates" / "train.sbatch"
STEPS = 30
pytestmark = pytest.mark.timeout(300)


def _submit(
    cluster: LocalSlurmCluster, tmp_path: Path, faults: str, *sbatch_args: str
) -> tuple[int, Path]:
    """The demo job on 2 nodes x 2 ranks (``sbatch_args`` come after: ``-N1``...); stdout in
    ``tmp_path``, under the name SLURM gives when none is asked for (the template asks for
    one): ``slurm-<id>.out``, an array element's ``slurm-<array id>_<index>.out``."""
    logs = tmp_path / "logs"
    train = [sys.executable, str(REPO / "examples" / "train_demo.py"), "--steps", str(STEPS),
             "--checkpoint-every", "5", "--step-time", "0.05", "--no-wrapper"]  # fmt: skip
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
    array = any(a.startswith("--array") for a in sbatch_args)
    output = ["-o", str(tmp_path / ("slurm-%A_%a.out" if array else "slurm-%j.out"))]
    job = cluster.sbatch(
        TEMPLATE, "-N2", f"--export={export}", *output, *sbatch_args, cwd=tmp_path,
        script_args=train,
    )  # fmt: skip
    return job, logs


def test_report_of_a_two_node_job_with_a_killed_rank(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    job, logs = _submit(slurm_cluster, tmp_path, faults="kill:12:3")
    state = slurm_cluster.wait_job(job, timeout=240)
    out_file = tmp_path / f"slurm-{job}.out"
    out = out_file.read_text() if out_file.exists() else "(no output file)"
    assert state == "COMPLETED", out
    accounted = slurm_cluster.sacct(job)  # waits until accounting caught up with slurmctld
    node_list = next(r["NodeList"] for r in accounted if r["JobID"] == str(job))

    report = build_report(logs, job=str(job), sacct=True)
    s = report.summary
    # sacct is merged in: its final state leads the outcome, its node list is the job's
    assert report.slurm.available, report.slurm.error
    assert [r.state for r in report.slurm.job] == ["COMPLETED"]
    assert s.outcome == "COMPLETED (sacct, exit 0:0)"
    assert s.reason is not None and "events: completed" in s.reason
    assert s.slurm_nodes == node_list
    assert {r.job_id for r in report.slurm.steps} >= {f"{job}.batch", f"{job}.0"}
    # the events name the killed rank and its node
    assert (s.job, s.nodes, s.ranks, s.runs) == (str(job), 2, 4, 1)
    first = report.timeline[0]
    assert (first.first_rank, first.first_node, first.cause) == (3, 1, "signal SIGKILL")
    assert [(f.signature, f.ranks, f.nodes) for f in report.failures] == [
        ("signal SIGKILL", [3], [1])
    ]
    # no Wrapper: the default policy restarts every rank together, once
    assert (s.restarts.job_wide, s.restarts.process, s.restarts.in_process, s.restarts.requeue) == (1, 0, 0, 0)
    assert 0 < s.goodput <= 1 and s.training_time_s <= s.wall_time_s
    # slurm-<id>.out next to the logs is read; what it holds is already in the events
    assert str(out_file.resolve()) in report.slurm.output_files
    assert report.log_findings == [], [(f.signature, f.path, f.line) for f in report.log_findings]

    # The command line, with the output file named explicitly and JSON out.
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.report.cli", str(logs), "--job", str(job),
         "--slurm-output", str(out_file), "--format", "json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["slurm"]["output_files"] == [str(out_file.resolve())]
    assert data["summary"]["outcome"] == s.outcome
    assert data["slurm"]["job"][0]["node_list"] == node_list
    text = build_report(logs, job=str(job), sacct=True).to_text(width=None)
    assert "COMPLETED" in text and node_list in text and "rank 3 on" in text


def test_an_array_elements_report_reads_its_own_default_output_file(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """Each element of a real array job has its own SLURM_JOB_ID (one of them keeps the
    array's id) and writes ``slurm-<array id>_<index>.out``, SLURM's default name: the
    report of each element reads that file, and not the other element's."""
    array, logs = _submit(slurm_cluster, tmp_path, "", "-N1", "--array=0-1")
    rows: list[dict[str, str]] = []

    def both_ended() -> bool:
        rows[:] = commands.sacct_rows(
            array, fields=("JobID", "JobIDRaw", "State"), env=slurm_cluster.env
        )
        elements = [r for r in rows if r["JobID"] in (f"{array}_0", f"{array}_1")]
        return len(elements) == 2 and all(r["State"] in _ENDED for r in elements)

    wait_for(f"both elements of array job {array} to end", both_ended, 240)
    raw = {r["JobID"]: r["JobIDRaw"] for r in rows}
    elements = [raw[f"{array}_0"], raw[f"{array}_1"]]
    assert sorted(elements, key=int)[0] == str(array), raw  # one keeps it; the other is new
    for index in (0, 1):
        out_file = tmp_path / f"slurm-{array}_{index}.out"
        assert out_file.exists(), sorted(p.name for p in tmp_path.iterdir())
        report = build_report(logs, job=raw[f"{array}_{index}"], sacct=True)
        assert report.summary.outcome == "COMPLETED (sacct, exit 0:0)", out_file.read_text()
        assert [r.state for r in report.slurm.job] == ["COMPLETED"]  # this element's record
        assert report.slurm.output_files == [str(out_file.resolve())]


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
