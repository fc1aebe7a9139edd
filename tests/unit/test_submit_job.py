"""NvrxJob.wait: results alone are not the end of a SLURM job; accounting has to say so, within a bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvrx.slurm import commands
from nvrx.submission import job as job_module
from nvrx.submission.job import NvrxJob


class _DoneSubmititJob:
    job_id = "77"
    state = "RUNNING"

    def done(self) -> bool:
        return True


def _job(tmp_path: Path) -> NvrxJob:
    return NvrxJob(_DoneSubmititJob(), "slurm", tmp_path, tmp_path / "logs", 1, 1)


def test_wait_returns_once_accounting_records_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = iter(["RUNNING", "RUNNING", "COMPLETED"])
    asked: list[str] = []

    def accounted_state(job_id: str) -> str:
        asked.append(job_id)
        return next(states)

    monkeypatch.setattr(commands, "accounted_state", accounted_state)
    monkeypatch.setattr(commands, "job_state", lambda job_id: "COMPLETING")
    _job(tmp_path).wait(timeout=30, poll_s=0.01)
    assert asked == ["77", "77", "77"]


def test_wait_for_accounting_is_bounded_without_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "accounted_state", lambda job_id: "RUNNING")
    monkeypatch.setattr(commands, "job_state", lambda job_id: "RUNNING")
    monkeypatch.setattr(job_module, "ACCOUNTING_WAIT_S", 0.2)
    _job(tmp_path).wait(poll_s=0.01)  # returns (with a warning) instead of waiting for ever


def test_a_timeout_shorter_than_the_accounting_bound_still_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "accounted_state", lambda job_id: "RUNNING")
    monkeypatch.setattr(commands, "job_state", lambda job_id: "RUNNING")
    with pytest.raises(TimeoutError, match="its end not in SLURM's accounting"):
        _job(tmp_path).wait(timeout=0.2, poll_s=0.01)


def test_sacct_failing_does_not_block_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(job_id: str) -> str:
        raise commands.SlurmCommandError(["sacct"], 1, "slurmdbd down")

    monkeypatch.setattr(commands, "accounted_state", broken)
    _job(tmp_path).wait(timeout=30, poll_s=0.01)


class _TaskWithPickle:
    """A submitit task whose result pickle is loaded by ``results()``, as submitit does."""

    job_id = "77"

    def __init__(self, folder: Path) -> None:
        from submitit.core.utils import JobPaths

        self.paths = JobPaths(folder / "%j", job_id=self.job_id, task_id=0)

    def done(self) -> bool:
        return True

    def results(self) -> list:
        from submitit.core.utils import pickle_load

        return [pickle_load(self.paths.result_pickle)[1]]


class _Planted:
    """Unpickled, it creates the folder ``marker``: code of whoever wrote the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("where", ["file", "directory", "owner"])
def test_a_result_pickle_others_could_write_is_not_unpickled(tmp_path: Path, where: str) -> None:
    """docs/security.md: a pickle another user could have written is refused, not loaded.
    Before: submitit's result pickle was unpickled in the submitter whoever wrote it."""
    import os
    import pickle

    if where == "owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    task = _TaskWithPickle(tmp_path)
    marker = tmp_path / "planted"
    task.paths.folder.mkdir(mode=0o700)
    task.paths.result_pickle.write_bytes(pickle.dumps(("success", _Planted(marker))))
    if where == "file":
        task.paths.result_pickle.chmod(0o666)
    elif where == "directory":
        task.paths.folder.chmod(0o777)
    else:
        os.chown(task.paths.result_pickle, 65534, 65534)
    job = NvrxJob(task, "local", task.paths.folder, tmp_path / "logs", 1, 1)
    with pytest.raises(PermissionError, match="refusing to unpickle"):
        job.results(timeout=5)
    assert not marker.exists()
