"""The quick start from a built wheel: a new virtual environment, no checkout, a 2-rank job, its report.

nvrx's wheel is built from a copy of the source the way pip builds it for a user (an
isolated build environment holding pyproject.toml's build requirements). A new virtual
environment gets the wheel, without submitit (``tests/support/wheel_venv``). From a directory
outside the checkout the test then does what the quick start shows: write the sbatch
template, run ``examples/quickstart_train.py`` (rank 1 raises once) as a 2-rank job under
``nvrx-supervise``, and read the job with ``nvrx-report``.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest

from nvrx.submission import MISSING_SUBMITIT
from nvrx.version import __version__
from tests.support.wheel_venv import ROOT, build_wheel, fresh_venv, run, tail, venv_env

pytestmark = pytest.mark.timeout(900)

QUICKSTART = ROOT / "examples" / "quickstart_train.py"
FAULT = "injected fault: rank 1, step 5"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nvrx's wheel, built by pip from a copy of the checkout's sources."""
    return build_wheel(tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A new virtual environment with the wheel; its dependencies borrowed (``wheel_venv``)."""
    return fresh_venv(tmp_path_factory.mktemp("venv") / "env", wheel)


def stop(job: subprocess.Popen[str]) -> None:
    """End a supervisor still running: SIGTERM first, so that it ends its ranks' process groups."""
    if job.poll() is not None:
        return
    os.killpg(job.pid, signal.SIGTERM)
    try:
        job.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return work


def test_the_wheel_declares_its_license_types_version_and_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"nvrx-{__version__}.dist-info"
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        license_text = whl.read(f"{info}/licenses/LICENSE").decode()
    assert meta["Version"] == __version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "nvrx/py.typed" in names
    assert {"nvrx/slurm/sbatch/train.sbatch", "nvrx/report/report.schema.json"} <= names
    requires = meta.get_all("Requires-Dist")
    assert 'submitit; extra == "submit"' in requires
    assert [r for r in requires if r.startswith("submitit") and "extra" not in r] == []


def test_the_installed_nvrx_is_the_wheels_and_works_without_submitit(
    venv: Path, workdir: Path
) -> None:
    probe = (
        "import importlib.metadata, nvrx\n"
        "print(nvrx.__file__)\n"
        "print(nvrx.__version__, importlib.metadata.version('nvrx'))\n"
        "try:\n"
        "    nvrx.submit\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    done = run(["python", "-c", probe], workdir, venv_env(venv))
    assert done.returncode == 0, tail(done)
    where, versions, missing = done.stdout.splitlines()
    assert Path(where).is_relative_to(venv), f"nvrx imported from {where}, not from {venv}"
    assert versions == f"{__version__} {__version__}"
    assert missing == MISSING_SUBMITIT
    done = run(["nvrx-supervise", "--version"], workdir, venv_env(venv))
    assert (done.returncode, done.stdout.strip()) == (0, f"nvrx-supervise {__version__}"), tail(done)


def test_the_template_runs_the_nvrx_srun_of_the_environment(venv: Path, workdir: Path) -> None:
    done = run(["nvrx-template", "train", "-o", "job.sbatch"], workdir, venv_env(venv))
    assert done.returncode == 0, tail(done)
    script = (workdir / "job.sbatch").read_text()
    srun = venv / "bin" / "nvrx-srun"
    assert str(srun) in script, f"job.sbatch does not run {srun}:\n{script}"
    assert os.access(srun, os.X_OK)
    syntax = run(["bash", "-n", "job.sbatch"], workdir)
    assert syntax.returncode == 0, tail(syntax)


def test_the_quickstart_job_restarts_once_in_process_and_the_report_shows_it(
    venv: Path, workdir: Path
) -> None:
    shutil.copy2(QUICKSTART, workdir / QUICKSTART.name)
    env = venv_env(venv)
    cmd = ["nvrx-supervise", "--nproc-per-node", "2", "--", "python", QUICKSTART.name]
    job = subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        stop(job)
        pytest.fail(f"the quick start job ran past 240 s:\n{job.communicate()[0][-4000:]}")
    finally:
        stop(job)
    assert job.returncode == 0, output[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: 20 steps done in round 1" in output, output[-4000:]

    shown = run(["nvrx-report", "nvrx_logs"], workdir, env)
    assert shown.returncode == 0, tail(shown)
    assert FAULT in shown.stdout, shown.stdout
    report = run(["nvrx-report", "nvrx_logs", "--format", "json"], workdir, env)
    assert report.returncode == 0, tail(report)
    parsed = json.loads(report.stdout)
    summary = parsed["summary"]
    assert (summary["outcome"], summary["rounds"]) == ("completed", 2), summary
    assert summary["restarts"] == {
        "in_process": 1, "process": 0, "requeue": 0, "node_loss": 0, "job_wide": 0
    }  # fmt: skip
    # rank 0 may fail too, in the all_reduce that rank 1 left: the injected fault came first
    (injected,) = [f for f in parsed["failures"] if f["message"] == FAULT]
    assert (injected["exc_type"], injected["ranks"], injected["rounds"]) == (
        "builtins.RuntimeError", [1], [0]
    ), injected  # fmt: skip
    first = parsed["timeline"][0]
    assert (first["outcome"], first["first_rank"], first["cause"]) == (
        "restart", 1, injected["signature"]
    ), first  # fmt: skip
