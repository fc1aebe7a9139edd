"""Thin typed wrappers around the SLURM client commands nvrx needs.

Each call runs the command in its own process group with a time limit, kills
the group when the limit passes, and raises ``SlurmCommandError`` (naming the
command, its exit status and stderr) when it fails. Output is parsed from the
machine-friendly forms (``-o``/``--parsable2``), never from human tables.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from nvrx import processes

#: Default time limit of one client command, in seconds.
COMMAND_TIMEOUT_S = 30.0

#: Job states after which a job will not run again by itself.
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)

#: Fields ``sacct_rows`` asks for unless told otherwise.
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "NodeList", "Start", "End", "Elapsed")

_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_:/.]*=")


class SlurmCommandError(RuntimeError):
    """A SLURM client command failed or did not finish in time."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        status = "timed out" if returncode is None else f"exited {returncode}"
        super().__init__(f"{' '.join(self.argv)} {status}: {stderr.strip() or '(no stderr)'}")


class SlurmCommandMissing(SlurmCommandError):
    """The SLURM client command cannot be started here (common inside containers)."""

    #: A shell's status for a command it cannot find or run (not None: that means a timeout).
    RETURNCODE = 127

    def __init__(self, argv: Sequence[str], detail: str) -> None:
        super().__init__(argv, self.RETURNCODE, detail)
        self.args = (
            f"{argv[0]} cannot run here ({detail}): are SLURM's client commands on this node? "
            "(inside a container, bind-mount them and munge's socket, or put them on PATH)",
        )


def run_command(
    argv: Sequence[str],
    *,
    timeout: float = COMMAND_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    cwd: str | os.PathLike[str] | None = None,
    outlive_job_end: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run one command in its own process group; kill the group on timeout.

    Returns the completed process (text stdout/stderr). With ``check`` a
    non-zero exit raises ``SlurmCommandError``; a timeout always raises it, and a
    command that is not installed raises ``SlurmCommandMissing`` (a subclass), so
    every caller's fallback for a failed command covers a missing one too.
    ``outlive_job_end``: the command ignores SIGTERM, for the commands that end
    (requeue) the very job they run in: SLURM sends SIGTERM to every process of
    the job, and they must still finish (a single-threaded caller only).
    """
    try:
        proc = processes.start(
            argv,
            env=env,
            ignore_warning=False,  # a short client command; keeps fork-free spawning in threaded callers
            ignore_signals=(signal.SIGTERM,) if outlive_job_end else (),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
    except (FileNotFoundError, PermissionError) as exc:
        raise SlurmCommandMissing(argv, exc.strerror or str(exc)) from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes.signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise SlurmCommandError(argv, None, f"no answer within {timeout:g} s; {err}") from None
    except BaseException:  # KeyboardInterrupt, a test timeout: leave no command behind
        processes.stop(proc, ask=signal.SIGKILL)
        raise
    if check and proc.returncode != 0:
        raise SlurmCommandError(argv, proc.returncode, err)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def parse_key_values(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line (``Key=value Key=value ...``).

    A word without ``Key=`` belongs to the previous value (values may hold spaces).
    """
    result: dict[str, str] = {}
    key = None
    for word in line.strip().split(" "):
        if _KEY.match(word):
            key, _, value = word.partition("=")
            result[key] = value
        elif key is not None:
            result[key] += " " + word
    return result


def show_hostnames(nodelist: str, *, env: Mapping[str, str] | None = None) -> list[str]:
    """Expand a node list with ``scontrol show hostnames`` (SLURM's own parser)."""
    done = run_command(["scontrol", "show", "hostnames", nodelist], env=env)
    if done.stderr.strip() or "Invalid hostlist" in done.stdout:
        # scontrol exits 0 on a bad list and says so on stdout/stderr
        raise SlurmCommandError(done.args, done.returncode, done.stderr + done.stdout)
    return done.stdout.split()


def show_job(job_id: int | str, *, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """``scontrol show job -o JOB`` as a dict, or None when slurmctld no longer knows it."""
    done = run_command(["scontrol", "show", "job", "-o", str(job_id)], env=env, check=False)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise SlurmCommandError(done.args, done.returncode, done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        return None
    # an array or het job prints several lines; the first is the one asked for
    return parse_key_values(lines[0])


#: How long a node may take to run a no-op step before it is taken for silent.
PROBE_TIMEOUT_S = 20.0


def node_answers_argv(job_id: int | str, node: str) -> list[str]:
    """The no-op step of ``node_answers``: it exits 0 only if ``node`` runs it."""
    return ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={node}", "--kill-on-bad-exit=1", "--quiet", "true"]  # fmt: skip


def node_answers(
    job_id: int | str, node: str, *, env: Mapping[str, str] | None = None,
    timeout: float = PROBE_TIMEOUT_S,
) -> bool:
    """Whether ``node``'s slurmd runs a no-op step of job ``job_id`` (``srun --overlap -w NODE
    true``) within ``timeout``: SLURM's own view of a node lags its death by its
    ``SlurmdTimeout``, a step answers now. False on any failure, a timeout included."""
    argv = node_answers_argv(job_id, node)
    try:
        return run_command(argv, env=env, check=False, timeout=timeout).returncode == 0
    except SlurmCommandError:
        return False


def show_node(
    name: str, *, env: Mapping[str, str] | None = None, timeout: float = COMMAND_TIMEOUT_S
) -> dict[str, str] | None:
    """``scontrol show node -o NAME`` as a dict, or None when slurmctld does not know it."""
    done = run_command(
        ["scontrol", "show", "node", "-o", name], env=env, check=False, timeout=timeout
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        return None
    return parse_key_values(lines[0])


def sacct_rows(
    job_id: int | str,
    *,
    fields: Sequence[str] = SACCT_FIELDS,
    all_runs: bool = True,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """Rows of ``sacct`` for one job and its steps, as dicts keyed by ``fields``.

    With ``all_runs`` (``sacct -D``) a requeued job shows one row per run.
    """
    argv = ["sacct", "-n", "--parsable2", "-j", str(job_id), "-o", ",".join(fields)]
    if all_runs:
        argv.append("-D")
    done = run_command(argv, env=env)
    rows = []
    for line in done.stdout.splitlines():
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(fields):
            raise SlurmCommandError(argv, 0, f"row with {len(values)} fields: {line!r}")
        rows.append(dict(zip(fields, values, strict=True)))
    return rows


class JobRecords(NamedTuple):
    """``sacct``'s rows of one job: its own (one per run with ``-D``) and its steps'."""

    job: list[dict[str, str]]
    steps: list[dict[str, str]]


def sacct_job(
    job_id: int | str,
    *,
    fields: Sequence[str] = SACCT_FIELDS,
    all_runs: bool = True,
    env: Mapping[str, str] | None = None,
) -> JobRecords:
    """``sacct_rows`` of one job, split into its own records and its steps'.

    A row is the job's when ``JobIDRaw`` (the id ``SLURM_JOB_ID`` holds) or ``JobID`` (the id
    as sacct prints it) is ``job_id``, a step's when either is ``<job_id>.<step>``. They differ
    for an element of a job array (``JobID`` ``<array id>_<index>``) and a component of a
    heterogeneous job (``<id>+<offset>``), and sacct asked about an array's id lists every
    element. ``JobID`` and ``JobIDRaw`` are asked for, whatever ``fields`` names.
    """
    asked = tuple(dict.fromkeys(("JobID", "JobIDRaw", *fields)))
    job, steps = str(job_id), f"{job_id}."
    records = JobRecords([], [])
    for row in sacct_rows(job_id, fields=asked, all_runs=all_runs, env=env):
        ids = (row["JobIDRaw"], row["JobID"])
        if job in ids:
            records.job.append(row)
        elif any(i.startswith(steps) for i in ids):
            records.steps.append(row)
    return records


def job_state(job_id: int | str, *, env: Mapping[str, str] | None = None) -> str | None:
    """Current state of a job (``RUNNING``, ``COMPLETED``, ...), None if unknown.

    Asks slurmctld first, then accounting for jobs slurmctld has forgotten.
    """
    info = show_job(job_id, env=env)
    if info is not None and "JobState" in info:
        return info["JobState"]
    rows = sacct_job(job_id, fields=("State",), env=env).job
    if not rows:
        return None
    # "CANCELLED by 0" -> "CANCELLED"; the last row is the latest run
    return rows[-1]["State"].split()[0]


def accounted_state(job_id: int | str, *, env: Mapping[str, str] | None = None) -> str | None:
    """State of the latest run of a job in SLURM's accounting (``sacct``), None if not recorded yet.

    Accounting lags slurmctld by a moment: a job slurmctld calls COMPLETED may
    still be RUNNING here, and reports are built from accounting.
    """
    rows = sacct_job(job_id, fields=("State",), env=env).job
    return rows[-1]["State"].split()[0] if rows else None


def queued_job_ids(*, env: Mapping[str, str] | None = None) -> list[int]:
    """Ids of all jobs slurmctld has pending, running or completing."""
    done = run_command(["squeue", "-h", "-o", "%A"], env=env)
    return sorted({int(word) for word in done.stdout.split()})


def cancel(
    job_ids: Sequence[int | str],
    *,
    signal_name: str | None = None,
    batch_only: bool = False,
    env: Mapping[str, str] | None = None,
) -> None:
    """``scancel`` jobs, or send them ``signal_name`` (e.g. ``USR2``).

    ``batch_only`` sends the signal to the batch shell only (``--batch``).
    """
    if not job_ids:
        return
    argv = ["scancel"]
    if signal_name:
        argv.append(f"--signal={signal_name}")
    if batch_only:
        argv.append("--batch")
    argv.extend(str(j) for j in job_ids)
    run_command(argv, env=env)


def requeue(job_id: int | str, *, env: Mapping[str, str] | None = None) -> None:
    """``scontrol requeue JOB``: end the running job and queue it again. Run from inside
    that job, the command outlives the SIGTERM that SLURM sends every process of it, itself
    included: killed by it, the command would say nothing of a requeue that was done."""
    run_command(["scontrol", "requeue", str(job_id)], env=env, outlive_job_end=True)
