"""SLURM's side of the story: ``sacct`` records and the job's stdout/stderr files.

Events cannot tell about a rank that died before nvrx started or a segfault
that killed the interpreter; SLURM and submitit output files can (found here,
read by ``output_scan``). Both sources are optional: when ``sacct`` is missing
or fails, the report says so and goes on.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from nvrx.slurm.commands import SlurmCommandError, sacct_job

from .model import SlurmContext, SlurmRow

SACCT_FIELDS = (
    "JobID", "JobIDRaw", "JobName", "State", "ExitCode", "Elapsed", "NodeList", "Start", "End"
)
_SLURM_JOB_ID = re.compile(r"[0-9]{1,20}(_[0-9]{1,20})?(\+[0-9]{1,20})?")


def is_slurm_job_id(job: str | None) -> bool:
    return job is not None and bool(_SLURM_JOB_ID.fullmatch(job))


def _row(values: dict[str, str]) -> SlurmRow:
    def get(name: str) -> str | None:
        return values.get(name) or None

    return SlurmRow(
        job_id=values.get("JobID", ""),
        name=get("JobName"),
        state=get("State"),
        exit_code=get("ExitCode"),
        elapsed=get("Elapsed"),
        node_list=get("NodeList"),
        start=get("Start"),
        end=get("End"),
    )


def query_sacct(job: str | None) -> SlurmContext:
    """Ask ``sacct`` about ``job`` and its steps (every run when requeued); never raises."""
    ctx = SlurmContext()
    if not is_slurm_job_id(job):
        ctx.error = f"job id {job!r} is not a SLURM job id; sacct not asked"
        return ctx
    if shutil.which("sacct") is None:
        ctx.error = "sacct not found on PATH; no SLURM accounting in this report"
        return ctx
    try:
        records = sacct_job(str(job), fields=SACCT_FIELDS, all_runs=True)
    except SlurmCommandError as exc:
        lines = [line.strip() for line in exc.stderr.splitlines() if line.strip()]
        status = (
            "did not answer in time"
            if exc.returncode is None
            else f"failed (exit code {exc.returncode})"
        )
        ctx.error = f"sacct {status}: {lines[-1] if lines else 'no message'}"
        return ctx
    except OSError as exc:
        ctx.error = f"could not run sacct: {exc.strerror or exc}"
        return ctx
    ctx.job = [_row(values) for values in records.job]
    ctx.steps = [_row(values) for values in records.steps]
    if not ctx.job and not ctx.steps:
        ctx.error = f"sacct knows no job {job}"
        return ctx
    ctx.available = True
    return ctx


#: sacct's state of the record an allocation leaves when the job is resized (a ``--no-kill``
#: job that lost a node goes on in a new record): not a run of its own.
RESIZED = "RESIZING"


def runs(ctx: SlurmContext) -> list[SlurmRow]:
    """The job's records that are runs of it, in order: one per start, requeues included."""
    if not ctx.available:
        return []
    return [row for row in ctx.job if (row.state or "").split(" ")[0] != RESIZED]


def sacct_requeues(ctx: SlurmContext) -> int:
    """Requeues as SLURM accounting saw them: one job record per run (resizes left out)."""
    return max(0, len(runs(ctx)) - 1)


def find_output_files(
    job: str | None, search_dirs: Iterable[Path], submitit_folders: Iterable[Path] = ()
) -> list[Path]:
    """``slurm-<job>.out``, ``nvrx-<job>.out`` of nvrx's templates and submitit
    ``<job>_<task>_log.out/err`` files.

    ``job`` is a SLURM job id, or a job array element's ``<array id>_<index>``, after which
    SLURM and submitit name the element's files (``slurm-%A_%a.out``). Other elements'
    files are not the job's, though the array's id is also one element's own id:
    ``slurm-<job>_<index>.out`` is not looked for, and a submitit ``<task>`` is a number.
    The job id is matched as it is written (``*`` or ``[`` in it match only themselves); an
    id that cannot be part of a file name (a ``/``, a NUL) has no such files.
    """
    found: list[Path] = []
    if not job or "/" in job or "\0" in job:
        return found
    name = glob.escape(job)
    patterns = [f"slurm-{name}.out", f"slurm-{name}.err"]
    patterns += [f"nvrx-{name}.out", f"nvrx-{name}.err"]  # nvrx's sbatch templates
    for directory in search_dirs:
        for pattern in patterns:
            found.extend(p for p in directory.glob(pattern) if p.is_file())
    for folder in submitit_folders:
        for suffix in ("out", "err"):
            end = f"_log.{suffix}"
            for path in Path(folder).glob(f"{name}_*{end}"):
                task = path.name[len(job) + 1 : -len(end)]
                if task.isdecimal() and path.is_file():
                    found.append(path)
    return list(dict.fromkeys(path.resolve() for path in found))


def default_search_dirs(job_dir: Path) -> list[Path]:
    """Where ``slurm-<job>.out`` usually is: the submit directory (cwd) and near the logs."""
    dirs = [Path(os.getcwd()), job_dir, job_dir.parent, job_dir.parent.parent]
    return list(dict.fromkeys(d.resolve() for d in dirs if d.is_dir()))
