"""The handle of a submitted job: its state, results, and report."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvrx.slurm import commands
from nvrx.submission.private_files import check_private

log = logging.getLogger(__name__)

#: Seconds ``NvrxJob.wait`` waits, after the results, for accounting to record the job's end.
ACCOUNTING_WAIT_S = 60.0


class JobFailed(RuntimeError):
    """The job ended without results: a rank failed, or a supervisor stopped the job."""


@dataclass
class NvrxJob:
    """A submitted job: the submitit job, where its files are, its results and its report."""

    job: Any  # submitit.Job
    cluster: str
    folder: Path
    log_dir: Path
    nodes: int
    nproc_per_node: int

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def state(self) -> str:
        """Current state (SLURM's, asked now rather than from submitit's cache)."""
        if self.cluster == "slurm":
            with contextlib.suppress(commands.SlurmCommandError):
                state = commands.job_state(self.job_id)
                if state:
                    return state
        return str(self.job.state)

    def done(self) -> bool:
        return bool(self.job.done())

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> None:
        """Block until the job finished: its results are written and, on SLURM, its end is accounted.

        The tasks write their results before their supervisors have exited, so
        on SLURM this also waits until accounting (``sacct``, what reports are
        built from) records a final state for the job's latest run, at most
        ``ACCOUNTING_WAIT_S`` once the results are in (accounting may lag or be
        off). SLURM offers no blocking wait for a job, so this polls every
        ``poll_s`` seconds. Raises TimeoutError after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def wait_until(finished: Callable[[], bool], what: str) -> None:
            while not finished():
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"job {self.job_id}: {what} after {timeout:g} s (state {self.state})"
                    )
                time.sleep(poll_s)

        wait_until(self.job.done, "no results")
        if self.cluster != "slurm":
            return
        accounted_by = time.monotonic() + ACCOUNTING_WAIT_S
        if deadline is None or deadline > accounted_by:
            deadline = accounted_by
            timeout = ACCOUNTING_WAIT_S
        try:
            wait_until(self._end_accounted, "its end not in SLURM's accounting")
        except TimeoutError as exc:
            if deadline != accounted_by:
                raise
            log.warning("%s; the report may show it still running", exc)

    def _end_accounted(self) -> bool:
        try:
            return commands.accounted_state(self.job_id) in commands.TERMINAL_STATES
        except commands.SlurmCommandError as exc:
            log.warning(
                "cannot ask sacct whether job %s ended (%s); not waiting for it", self.job_id, exc
            )
            return True

    def results(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, by global rank (None for a rank that returned nothing).

        Raises ``JobFailed`` with the node's error when the job failed, and PermissionError
        when submitit's pickle of a task's result is not the user's own, or others can write
        it or its folder (``check_private``): it is not unpickled.
        """
        import submitit

        self.wait(timeout)
        self._check_result_pickles()
        try:
            per_node = self.job.results()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
            raise JobFailed(f"job {self.job_id} failed; events in {self.log_dir}:\n{exc}") from exc
        by_rank: dict[int, Any] = {}
        for node_result in per_node:
            by_rank.update(node_result["results"])
        return [by_rank.get(rank) for rank in range(self.nodes * self.nproc_per_node)]

    def _check_result_pickles(self) -> None:
        """Refuse (PermissionError) submitit's result pickles of the job's tasks unless they and
        their folder are the user's own and nobody else can write them, before submitit
        unpickles them (``private_files``); one not written yet is left to submitit."""
        for task in getattr(self.job, "_sub_jobs", None) or [self.job]:
            paths = getattr(task, "paths", None)
            if paths is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                check_private(paths.result_pickle)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value (waits for the job)."""
        return self.results(timeout)[0]

    def cancel(self) -> None:
        self.job.cancel(check=False)

    def report(self, sacct: bool | None = None) -> Any:
        """The ``nvrx-report`` summary of this job (``.to_dict()``, ``.to_text()``).

        ``sacct`` (default: on SLURM jobs only) adds SLURM's accounting records.
        """
        from nvrx.report import build_report

        if sacct is None:
            sacct = self.cluster == "slurm"
        return build_report(
            self.log_dir, job=self.job_id, sacct=sacct, submitit_folders=[self.folder]
        )

    def report_text(self, fmt: str = "table", sacct: bool | None = None) -> str:
        """The report as text: ``table``, ``markdown`` or ``json``."""
        return str(self.report(sacct=sacct).to_text(fmt))
