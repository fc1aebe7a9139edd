"""``nvrx.submit`` and ``nvrx.Executor``: submitit jobs that run one nvrx supervisor per node.

A job is one submitit task per node (``tasks_per_node=1``). That task,
``run_node``, starts ``nvrx-supervise`` in its own process group with
``nproc_per_node`` children, relays SLURM's signals to it, and returns the
children's results. A Python callable reaches the children as a cloudpickle
file in the job folder, run by ``python -m nvrx.submission.run_callable``; a
command (list or string) is run as it is.

Submission asks SLURM for the warning signal (``--signal=USR2@signal_delay_s``,
to every task) and marks the job requeueable; the supervisor turns the signal
into the flag of ``nvrx.checkpoint_flag`` and node 0 requeues the job
(``nvrx.supervisor.preemption``). A requeued run leaves no submitit result, so
``NvrxJob.result()`` returns the result of the run that finished.

Layout under ``folder``: ``<job id>/`` (submitit's script, pickles and logs),
``nvrx_logs/<job id>/`` (events, read by ``NvrxJob.report()``),
``specs/`` (pickled callables), ``results/<job id>/`` (one file per rank).
Without SLURM, submitit's local executor runs the same thing on one node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvrx import processes
from nvrx.processes import warning_signal
from nvrx.slurm import commands
from nvrx.submission.run_callable import RESULT_DIR_ENV, dump_spec, read_outcome, result_path
from nvrx.supervisor.preemption import (
    DEFAULT_MAX_TIME_LIMIT_REQUEUES,
    DEFAULT_SIGNAL_DELAY_S,
    EXIT_REQUEUED,
    MAX_TIME_LIMIT_REQUEUES_ENV,
    SIGNAL_DELAY_ENV,
    SUBMITIT_LOCAL_REQUEUE_EXIT,
)

log = logging.getLogger(__name__)

DEFAULT_FOLDER = "nvrx_jobs"
#: Parameters nvrx handles itself; every other one goes to ``submitit.AutoExecutor``.
NVRX_PARAMETERS = ("nproc_per_node", "signal_delay_s", "max_time_limit_requeues", "supervise_args")


class SubmitError(ValueError):
    """Bad submission parameters; raised before anything is submitted. The message names the fix."""


class JobFailed(RuntimeError):
    """The job ended without results: a rank failed, or a supervisor stopped the job."""


@dataclass(frozen=True)
class NodeSpec:
    """What the submitit task of every node runs (pickled into the job by submitit)."""

    command: list[str]
    nproc_per_node: int
    supervise_args: list[str]
    log_dir: str
    result_root: str
    env: dict[str, str] = field(default_factory=dict)


def supervise_argv() -> list[str]:
    """How to start ``nvrx-supervise`` with the interpreter running this code."""
    return [sys.executable, "-m", "nvrx.supervisor.cli"]


def run_node(spec: NodeSpec) -> dict[str, Any]:
    """Body of one node's submitit task: supervise the node's children, return their results."""
    import submitit

    job_env = submitit.JobEnvironment()
    job_id = str(job_env.job_id)
    node = int(job_env.node)
    env = dict(os.environ)
    env.update(spec.env)
    env["NVRX_LOG_DIR"] = spec.log_dir
    env["NVRX_JOB_ID"] = job_id
    result_dir = Path(spec.result_root) / job_id
    env[RESULT_DIR_ENV] = str(result_dir)
    argv = [*supervise_argv(), "--nproc-per-node", str(spec.nproc_per_node), *spec.supervise_args]
    if not env.get("SLURM_JOB_ID"):
        from nvrx.slurm.topology import ports_for_job

        master_port, store_port = ports_for_job(f"local-{job_id}")
        argv += ["--master-port", str(master_port), "--store-port", str(store_port)]
    argv += ["--", *spec.command]
    local_ranks = [node * spec.nproc_per_node + k for k in range(spec.nproc_per_node)]
    for rank in local_ranks:  # a requeued run must not return the results of the run before
        result_path(result_dir, rank).unlink(missing_ok=True)
    rc = _supervise(argv, env, warning_signal(env))
    if rc == EXIT_REQUEUED or rc == SUBMITIT_LOCAL_REQUEUE_EXIT:
        # This run is over and will run again: leave no result, so the submitter keeps waiting.
        log.warning("node %d of job %s: requeued (supervisor exit %d)", node, job_id, rc)
        sys.exit(rc)
    if rc != 0:
        from nvrx.supervisor.exit_codes import describe

        raise JobFailed(
            f"nvrx-supervise on node {node} of job {job_id} exited {rc} ({describe(rc)}); "
            f"events in {Path(spec.log_dir) / job_id}"
        )
    results: dict[int, Any] = {}
    for rank in local_ranks:
        outcome = read_outcome(result_dir, rank)
        if outcome is None:
            continue
        status, value = outcome
        if status != "success":
            raise JobFailed(f"rank {rank} of job {job_id} failed:\n{value}")
        results[rank] = value
    return {"node": node, "job_id": job_id, "results": results}


def _supervise(argv: list[str], env: dict[str, str], warning: int) -> int:
    """Run the supervisor in its own process group, relaying the job's signals to it."""
    # The supervisor starts with the warning ignored and installs its own handler,
    # so that a warning during its start-up cannot kill it.
    proc = processes.start(argv, env=env)
    relayed = {warning, signal.SIGTERM, signal.SIGINT}

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    previous = {s: signal.signal(s, relay) for s in relayed}
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        processes.stop(proc, ask=signal.SIGKILL)  # and anything the supervisor left in its group


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
        built from) records a final state for the job's latest run. SLURM offers
        no blocking wait for a job, so this polls every ``poll_s`` seconds.
        Raises TimeoutError after ``timeout`` seconds.
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
        if self.cluster == "slurm":
            wait_until(self._end_accounted, "its end not in SLURM's accounting")

    def _end_accounted(self) -> bool:
        try:
            return commands.accounted_state(self.job_id) in commands.TERMINAL_STATES
        except commands.SlurmCommandError as exc:
            log.warning("cannot ask sacct whether job %s ended (%s); not waiting for it", self.job_id, exc)
            return True

    def results(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, by global rank (None for a rank that returned nothing).

        Raises ``JobFailed`` with the node's error when the job failed.
        """
        import submitit

        self.wait(timeout)
        try:
            per_node = self.job.results()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
            raise JobFailed(f"job {self.job_id} failed; events in {self.log_dir}:\n{exc}") from exc
        by_rank: dict[int, Any] = {}
        for node_result in per_node:
            by_rank.update(node_result["results"])
        return [by_rank.get(rank) for rank in range(self.nodes * self.nproc_per_node)]

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


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SubmitError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise SubmitError(f"{name} must be at least 1, got {value}")
    return value


def slurm_partitions() -> dict[str, int]:
    """Partitions of the cluster and their node counts (``sinfo -h -o %P|%D``)."""
    done = commands.run_command(["sinfo", "-h", "-o", "%P|%D"])
    parts: dict[str, int] = {}
    for line in done.stdout.splitlines():
        name, _, count = line.strip().partition("|")
        if name:
            name = name.rstrip("*")
            parts[name] = parts.get(name, 0) + (int(count) if count.isdigit() else 0)
    return parts


class Executor:
    """``submitit.AutoExecutor`` that runs one nvrx supervisor per node.

    Parameters are submitit's (``nodes``, ``timeout_min``, ``gpus_per_node``,
    ``cpus_per_task``, ``mem_gb``, ``slurm_partition``,
    ``slurm_additional_parameters``, ...) plus nvrx's: ``nproc_per_node``
    (children per node), ``signal_delay_s`` (warning seconds before the end,
    default 90), ``max_time_limit_requeues`` (default 3) and ``supervise_args``
    (extra ``nvrx-supervise`` options). ``tasks_per_node`` must stay 1: the
    one task per node is the supervisor.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str] = DEFAULT_FOLDER,
        cluster: str | None = None,
        **params: Any,
    ) -> None:
        import submitit

        self.folder = Path(folder).absolute()
        try:
            self._executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster=cluster)
        except (ValueError, RuntimeError, AssertionError) as exc:
            raise SubmitError(f"cluster={cluster!r}: {exc}") from exc
        self.cluster: str = self._executor.cluster
        self._nvrx: dict[str, Any] = {
            "nproc_per_node": 1,
            "signal_delay_s": DEFAULT_SIGNAL_DELAY_S,
            "max_time_limit_requeues": DEFAULT_MAX_TIME_LIMIT_REQUEUES,
            "supervise_args": [],
        }
        self._submitit: dict[str, Any] = {"nodes": 1, "tasks_per_node": 1}
        self.update_parameters(**params)

    def update_parameters(self, **params: Any) -> None:
        """Set parameters; numbers and names are checked now, the cluster at ``submit``."""
        for name, value in params.items():
            if name in NVRX_PARAMETERS:
                self._nvrx[name] = value
            else:
                self._submitit[name] = value
        self._check_values()

    def _check_values(self) -> None:
        nv, sp = self._nvrx, self._submitit
        _positive_int("nodes", sp.get("nodes"))
        _positive_int("nproc_per_node", nv["nproc_per_node"])
        if sp.get("tasks_per_node", 1) != 1:
            raise SubmitError(
                f"tasks_per_node must be 1 (one nvrx supervisor per node; set nproc_per_node for "
                f"ranks per node), got {sp['tasks_per_node']!r}"
            )
        if "timeout_min" in sp:
            _positive_int("timeout_min", sp["timeout_min"])
        delay = nv["signal_delay_s"]
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise SubmitError(f"signal_delay_s must be an integer >= 0, got {delay!r}")
        if "timeout_min" in sp and delay >= sp["timeout_min"] * 60:
            raise SubmitError(
                f"signal_delay_s={delay} must be below the time limit timeout_min={sp['timeout_min']} "
                f"({sp['timeout_min'] * 60} s), or the warning comes at the start"
            )
        cap = nv["max_time_limit_requeues"]
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise SubmitError(f"max_time_limit_requeues must be an integer >= 0, got {cap!r}")
        args = nv["supervise_args"]
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise SubmitError(f"supervise_args must be a list of strings, got {args!r}")
        if self.cluster == "local" and sp["nodes"] != 1:
            raise SubmitError(
                f"nodes={sp['nodes']} needs SLURM: submitit's local executor runs one node"
            )

    def _check_cluster(self) -> None:
        """Ask SLURM whether the partition exists and has the nodes asked for."""
        if self.cluster != "slurm":
            return
        partition = self._submitit.get("slurm_partition")
        try:
            partitions = slurm_partitions()
        except (commands.SlurmCommandError, OSError) as exc:
            raise SubmitError(
                f"cannot ask SLURM for its partitions (is slurmctld up?): {exc}"
            ) from exc
        if partition is not None:
            if partition not in partitions:
                known = ", ".join(sorted(partitions)) or "none"
                raise SubmitError(
                    f"slurm_partition={partition!r} is not a partition of this cluster (known: {known})"
                )
            size = partitions[partition]
        else:
            size = max(partitions.values(), default=0)
        nodes = self._submitit["nodes"]
        if size and nodes > size:
            where = f"partition {partition!r}" if partition else "the largest partition"
            raise SubmitError(f"nodes={nodes} but {where} has only {size} node(s)")

    def _submitit_parameters(self) -> dict[str, Any]:
        params = dict(self._submitit)
        delay = self._nvrx["signal_delay_s"]
        if self.cluster == "slurm":
            params.setdefault("slurm_signal_delay_s", delay)
            extra = dict(params.get("slurm_additional_parameters") or {})
            extra.setdefault("requeue", True)
            params["slurm_additional_parameters"] = extra
            srun_args = list(params.get("slurm_srun_args") or [])
            if not any(a.startswith("--kill-on-bad-exit") for a in srun_args):
                srun_args.append("--kill-on-bad-exit=0")
            params["slurm_srun_args"] = srun_args
        return params

    def _apply_parameters(self) -> None:
        try:
            self._executor.update_parameters(**self._submitit_parameters())
            if self.cluster == "local":
                # AutoExecutor does not pass signal_delay_s on to the local executor; set it there.
                self._executor._executor.update_parameters(
                    signal_delay_s=self._nvrx["signal_delay_s"]
                )
        except (ValueError, TypeError, NameError, AssertionError, NotImplementedError) as exc:
            raise SubmitError(f"submitit refused the parameters: {exc}") from exc

    def submit(
        self,
        target: Callable[..., Any] | Sequence[str] | str,
        *args: Any,
        **kwargs: Any,
    ) -> NvrxJob:
        """Submit ``target(*args, **kwargs)`` (or the command ``target``) on every rank of every node."""
        self._check_values()
        if isinstance(target, str):
            command, what = shlex.split(target), "command"
        elif callable(target):
            command, what = [], "callable"
        elif isinstance(target, Sequence) and target and all(isinstance(a, str) for a in target):
            command, what = list(target), "command"
        else:
            raise SubmitError(
                f"target must be a callable, a command string or a list of strings, got {target!r}"
            )
        if what == "command" and (args or kwargs):
            raise SubmitError(
                "arguments are for a callable target: put them in the command instead"
            )
        if what == "command" and not command:
            raise SubmitError("target is an empty command")
        self._check_cluster()
        self._apply_parameters()
        if what == "callable":
            spec_file = self.folder / "specs" / f"{uuid.uuid4().hex}.pkl"
            try:
                dump_spec(spec_file, target, args, kwargs)  # type: ignore[arg-type]
            except TypeError as exc:
                raise SubmitError(str(exc)) from exc
            command = [sys.executable, "-m", "nvrx.submission.run_callable", str(spec_file)]
        spec = NodeSpec(
            command=command,
            nproc_per_node=self._nvrx["nproc_per_node"],
            supervise_args=list(self._nvrx["supervise_args"]),
            log_dir=str(self.folder / "nvrx_logs"),
            result_root=str(self.folder / "results"),
            env={
                SIGNAL_DELAY_ENV: str(self._nvrx["signal_delay_s"]),
                MAX_TIME_LIMIT_REQUEUES_ENV: str(self._nvrx["max_time_limit_requeues"]),
                # cloudpickle refers to functions of importable modules by name: let the
                # children import them from where the submitter did.
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
            },
        )
        job = self._executor.submit(run_node, spec)
        handle = NvrxJob(
            job=job,
            cluster=self.cluster,
            folder=self.folder / str(job.job_id),
            log_dir=self.folder / "nvrx_logs" / str(job.job_id),
            nodes=self._submitit["nodes"],
            nproc_per_node=self._nvrx["nproc_per_node"],
        )
        log.info("submitted job %s (%s): %s", handle.job_id, self.cluster, handle.folder)
        return handle


def submit(
    target: Callable[..., Any] | Sequence[str] | str,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    folder: str | os.PathLike[str] = DEFAULT_FOLDER,
    cluster: str | None = None,
    **params: Any,
) -> NvrxJob:
    """Submit ``target`` with one nvrx supervisor per node; returns the job handle.

    ``target`` is a callable (run as ``target(*args, **kwargs)`` on every rank)
    or a command. ``params`` are ``Executor``'s: e.g. ``nodes=2,
    nproc_per_node=2, timeout_min=10, slurm_partition="debug"``. Bad
    parameters raise ``SubmitError`` before anything is submitted.
    """
    executor = Executor(folder=folder, cluster=cluster, **params)
    return executor.submit(target, *args, **dict(kwargs or {}))
