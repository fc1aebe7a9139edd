"""nvrx installed as people install Python tools: a wheel in a fresh virtual environment,
no checkout. Its ``nvrx-template`` writes a template that runs a real job on the local
cluster; and every template passes ``sbatch --test-only``."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from nvrx.events import read_dir
from nvrx.slurm import template_cli
from tests.support.slurm_cluster import LocalSlurmCluster
from tests.support.wheel_venv import build_wheel, fresh_venv

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", template_cli.names())
def test_every_rendered_template_passes_sbatch_test_only(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path, name: str
) -> None:
    script = tmp_path / f"{name}.sbatch"
    script.write_text(template_cli.render(name, str(REPO / "bin" / "nvrx-srun")))
    done = slurm_cluster.run(["sbatch", "--test-only", str(script), "true"], check=False)
    assert done.returncode == 0, done.stderr
    assert "to start at" in done.stderr


@pytest.mark.timeout(420)
def test_a_wheel_in_a_fresh_venv_runs_a_job_from_its_template(
    slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    venv = fresh_venv(tmp_path / "venv", build_wheel(tmp_path / "src", tmp_path / "dist"))
    python = venv / "bin" / "python"
    for script in ("nvrx-srun", "nvrx-template", "nvrx-supervise", "nvrx-report"):
        assert (venv / "bin" / script).is_file(), script
    where = subprocess.run(
        [str(python), "-c", "import nvrx; print(nvrx.__file__)"], capture_output=True, text=True,
        check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert where.startswith(str(venv)), where  # the wheel's nvrx, not the checkout's

    job_file = tmp_path / "job.sbatch"
    subprocess.run([str(venv / "bin" / "nvrx-template"), "train", "-o", str(job_file)], check=True)
    assert f"|| NVRX_SRUN={shlex.quote(str(venv / 'bin' / 'nvrx-srun'))}  # written" in job_file.read_text()
    check = slurm_cluster.run(["sbatch", "--test-only", str(job_file), "true"], check=False)
    assert check.returncode == 0, check.stderr

    # Each rank writes its own file: lines that ranks print to the job's one output file
    # may interleave mid-line.
    seen = tmp_path / "ranks"
    seen.mkdir()
    probe = (
        "import os, pathlib, nvrx; "
        f"pathlib.Path({str(seen)!r}, os.environ['RANK']).write_text("
        "f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {nvrx.__file__}\")"
    )
    logs = tmp_path / "logs"
    job = slurm_cluster.sbatch(
        job_file, "-N2", f"--export=ALL,NVRX_LOG_DIR={logs},NVRX_NPROC_PER_NODE=2", cwd=tmp_path,
        script_args=[str(python), "-c", probe],
    )  # fmt: skip
    out = tmp_path / f"nvrx-{job}.out"  # the template's output name, in the submit directory
    state = slurm_cluster.wait_job(job, timeout=240)
    text = out.read_text() if out.exists() else "no output file"
    assert state == "COMPLETED", text
    assert sorted(f.name for f in seen.iterdir()) == ["0", "1", "2", "3"], text
    for rank in range(4):
        assert (seen / str(rank)).read_text().startswith(f"rank {rank} of 4 {venv}"), text
    events, _ = read_dir(logs / str(job))
    assert {e["node"] for e in events if e["kind"] == "supervisor_end"} == {0, 1}
    slurm_cluster.sacct(job)  # the report's outcome is sacct's, which may lag slurmctld's end
    # nvrx-report of the fresh venv, run from the submit directory, finds the output file
    report = subprocess.run(
        [str(venv / "bin" / "nvrx-report"), str(logs / str(job)), "--format", "json"],
        capture_output=True, text=True, cwd=tmp_path, env=slurm_cluster.env, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["slurm"]["output_files"] == [str(out.resolve())]
    assert data["summary"]["outcome"].startswith("COMPLETED")

    # The README's quick start, as written there: its example under the template, on 2 nodes.
    shutil.copy(REPO / "examples" / "quickstart_train.py", tmp_path)
    job = slurm_cluster.sbatch(
        job_file, "-N2", f"--export=ALL,NVRX_LOG_DIR={logs},NVRX_NPROC_PER_NODE=2", cwd=tmp_path,
        script_args=[str(python), "quickstart_train.py"],
    )  # fmt: skip
    out = tmp_path / f"nvrx-{job}.out"
    state = slurm_cluster.wait_job(job, timeout=240)
    text = out.read_text() if out.exists() else "no output file"
    assert state == "COMPLETED", text
    slurm_cluster.sacct(job)
    report = subprocess.run(
        [str(venv / "bin" / "nvrx-report"), str(logs / str(job)), "--format", "json"],
        capture_output=True, text=True, cwd=tmp_path, env=slurm_cluster.env, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)["summary"]
    assert summary["outcome"].startswith("COMPLETED"), summary
    assert summary["restarts"]["in_process"] == 1, summary  # rank 1's injected fault
