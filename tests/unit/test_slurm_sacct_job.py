"""``sacct_job``: one job's records, found by the id SLURM_JOB_ID holds or by the one sacct prints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvrx.slurm import commands
from tests.support import fake_sacct

# What sacct -D lists for job array 70 asked about by its id: an element's own SLURM_JOB_ID is
# its JobIDRaw, and the element started last keeps the array's id.
ARRAY_RECORDS = [
    {"JobID": "70_0", "JobIDRaw": "71", "State": "FAILED"},
    {"JobID": "70_0.batch", "JobIDRaw": "71.batch", "State": "FAILED"},
    {"JobID": "70_1", "JobIDRaw": "70", "State": "COMPLETED"},
    {"JobID": "70_1.batch", "JobIDRaw": "70.batch", "State": "COMPLETED"},
]


@pytest.fixture
def sacct_lists_an_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``sacct`` first on PATH listing ``ARRAY_RECORDS``; the file of its arguments."""
    argv_log = fake_sacct.install(tmp_path / "bin", ARRAY_RECORDS)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return argv_log


@pytest.mark.parametrize(
    ("job_id", "job", "steps"),
    [
        ("71", ["70_0"], ["70_0.batch"]),  # SLURM_JOB_ID of element 0
        ("70", ["70_1"], ["70_1.batch"]),  # the array's id: element 1's SLURM_JOB_ID
        ("70_1", ["70_1"], ["70_1.batch"]),  # the element as sacct and submitit name it
    ],
)
def test_an_array_elements_records_are_its_own(
    sacct_lists_an_array: Path, job_id: str, job: list[str], steps: list[str]
) -> None:
    records = commands.sacct_job(job_id, fields=("State",))
    assert f"-j {job_id} -o JobID,JobIDRaw,State" in sacct_lists_an_array.read_text()
    assert [r["JobID"] for r in records.job] == job
    assert [r["JobID"] for r in records.steps] == steps


def test_the_accounted_state_of_an_array_element_by_its_slurm_job_id(
    sacct_lists_an_array: Path,
) -> None:
    assert commands.accounted_state("71") == "FAILED"
    assert commands.accounted_state("70_1") == "COMPLETED"
