"""``nvrx.submit`` and ``nvrx.Executor``: submitit jobs that run one nvrx supervisor per node.

A job is one submitit task per node (``tasks_per_node=1``). That task,
``run_node``, starts ``nvrx-supervise`` in its own process group with
``nproc_per_node`` children, relays SLURM's signals to it, and returns the
children's results. A Python callable reaches the children as a cloudpickle
file in the job folder, run by ``python -m nvrx.submission.run_callable``; a
command (list or string) is run as it is.

Submission asks SLURM for the warning signal (``--signal=USR2@signal_delay_s``,
to every task; ``SUBMITIT_PREEMPT_SIGNAL`` or ``NVRX_PREEMPT_SIGNAL`` picks
another) and marks the job requeueable; the supervisor turns the signal into the
flag of ``nvrx.checkpoint_flag`` and the store's host requeues the job
(``nvrx.supervisor.preemption``). A callable with submitit's checkpoint method
is checkpointed on rank 0 first (``nvrx.submission.checkpointing``). A requeued
run leaves no submitit result, so ``NvrxJob.result()`` returns the result of the
run that finished. submitit's names of nvrx's settings: ``conventions``.

Layout under ``folder``: ``<job id>/`` (submitit's script, pickles and logs),
``nvrx_logs/<job id>/`` (events, read by ``NvrxJob.report()``),
``specs/`` (pickled callables), ``results/<job id>/`` (one file per rank).
Without SLURM, submitit's local executor runs the same thing on one node.
"""

from __future__ import annotations

import copy
import logging
import os
import shlex
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nvrx.slurm import commands
from nvrx.submission.call_spec import dump_spec
from nvrx.submission.conventions import (
    NVRX_SIGNAL_ENV,
    SubmitError,
    cluster_names,
    merge_aliases,
    sbatch_signal,
    warning_signal_name,
)
from nvrx.submission.job import NvrxJob
from nvrx.submission.node_task import (
    SET_FOR_THE_JOB,
    NodeSpec,
    run_node,
    submitters_path,
    supervise_options,
)
from nvrx.submission.private_files import make_private_dir
from nvrx.supervisor.preemption import (
    DEFAULT_MAX_TIME_LIMIT_REQUEUES,
    DEFAULT_SIGNAL_DELAY_S,
    MAX_TIME_LIMIT_REQUEUES_ENV,
    SIGNAL_DELAY_ENV,
)

log = logging.getLogger(__name__)

DEFAULT_FOLDER = "nvrx_jobs"
#: Time limit (minutes) of a job given none: submitit's SLURM default, written for every
#: cluster, so that submitit's local executor does not take its own 2 minutes, which leave
#: 30 s before the default 90 s warning.
DEFAULT_TIMEOUT_MIN = 5
#: Parameters nvrx handles itself; every other one goes to ``submitit.AutoExecutor``.
NVRX_PARAMETERS = ("nproc_per_node", "signal_delay_s", "max_time_limit_requeues", "supervise_args")
#: submitit's name of ``signal_delay_s``: the same setting.
SUBMITIT_DELAY = "slurm_signal_delay_s"
#: sbatch options nvrx sets from its parameters, refused in ``slurm_additional_parameters``:
#: the parameter to use instead.
SET_BY_NVRX = {
    "nodes": "nodes",
    "ntasks_per_node": "nproc_per_node (ranks per node; the one task per node is the supervisor)",
    "ntasks": "nodes and nproc_per_node (the job has one task per node, the supervisor)",
}


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
    default 90; submitit's ``slurm_signal_delay_s``), ``max_time_limit_requeues``
    (default 3; submitit's ``max_num_timeout`` / ``slurm_max_num_timeout``) and
    ``supervise_args`` (extra ``nvrx-supervise`` options). ``tasks_per_node``
    must stay 1: the one task per node is the supervisor.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str] = DEFAULT_FOLDER,
        cluster: str | None = None,
        **params: Any,
    ) -> None:
        import submitit

        self.folder = Path(folder).absolute()
        if not self.folder.exists():  # a new one is the user's alone (``private_files``)
            make_private_dir(self.folder)
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
        self._given_as: dict[str, str] = {}  # nodes -> slurm_nodes, when given so
        self.update_parameters(**params)

    def update_parameters(self, **params: Any) -> None:
        """Set parameters; numbers and names are checked now, the cluster at ``submit``. A
        refused update changes nothing.

        submitit's names of nvrx's settings (``slurm_signal_delay_s``, ``max_num_timeout``,
        ``slurm_max_num_timeout``) set them too, and so do its cluster-specific names of the
        parameters nvrx checks (``slurm_nodes``, ``slurm_time``, ...: ``conventions``); two
        names of one setting with different values is an error naming both. A parameter given
        None is not set (as submitit takes it)."""
        params = {name: value for name, value in params.items() if value is not None}
        params, given_as = cluster_names(merge_aliases(params), self.cluster)
        before = dict(self._nvrx), dict(self._submitit), dict(self._given_as)
        for name, value in params.items():
            if name in NVRX_PARAMETERS:
                self._nvrx[name] = value
            else:
                self._submitit[name] = value
        self._given_as.update(given_as)
        try:
            self._check_values()
            self._check_submitit_names()
        except SubmitError:
            self._nvrx, self._submitit, self._given_as = before
            raise

    def _check_submitit_names(self) -> None:
        """Have submitit check its parameters' names and values now, on a copy of its executor:
        one it refuses would otherwise stay and refuse every submission."""
        probe = copy.deepcopy(self._executor)
        try:
            probe.update_parameters(**self._submitit)
        except (ValueError, TypeError, NameError, AssertionError, NotImplementedError) as exc:
            raise SubmitError(f"submitit refused the parameters: {exc}") from exc

    def _named(self, name: str) -> str:
        """The name ``name`` was given under (``slurm_nodes`` for ``nodes``...)."""
        return self._given_as.get(name, name)

    def _check_values(self) -> None:
        self._check_topology()
        nv, sp = self._nvrx, self._submitit
        if "timeout_min" in sp:
            _positive_int(self._named("timeout_min"), sp["timeout_min"])
        delay = nv["signal_delay_s"]
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise SubmitError(f"signal_delay_s must be an integer >= 0, got {delay!r}")
        limit = sp.get("timeout_min", DEFAULT_TIMEOUT_MIN)
        if delay >= limit * 60:
            named = f"{self._named('timeout_min')}={limit}"
            if "timeout_min" not in sp:
                named = f"of nvrx's default timeout_min={limit}"
            raise SubmitError(
                f"signal_delay_s={delay} must be below the time limit {named} ({limit * 60} s), "
                "or the warning comes at the start"
            )
        cap = nv["max_time_limit_requeues"]
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise SubmitError(f"max_time_limit_requeues must be an integer >= 0, got {cap!r}")
        args = nv["supervise_args"]
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise SubmitError(f"supervise_args must be a list of strings, got {args!r}")
        for dest, option in supervise_options(args).items():
            if dest in SET_FOR_THE_JOB:
                raise SubmitError(
                    f"supervise_args: {option} is set for every node by nvrx.submit; "
                    f"use {SET_FOR_THE_JOB[dest]}"
                )

    def _check_topology(self) -> None:
        """One task per node, started by srun on every node, with the nodes nvrx counts."""
        sp = self._submitit
        _positive_int(self._named("nodes"), sp.get("nodes"))
        _positive_int("nproc_per_node", self._nvrx["nproc_per_node"])
        if sp.get("tasks_per_node", 1) != 1:
            raise SubmitError(
                f"{self._named('tasks_per_node')} must be 1 (one nvrx supervisor per node; set "
                f"nproc_per_node for ranks per node), got {sp['tasks_per_node']!r}"
            )
        if sp.get("slurm_use_srun", True) is not True:
            raise SubmitError(
                f"slurm_use_srun={sp['slurm_use_srun']!r}: nvrx needs srun, which starts the "
                "supervisor of every node (without it only the first node's runs)"
            )
        extra = sp.get("slurm_additional_parameters") or {}
        if not isinstance(extra, Mapping):
            raise SubmitError(f"slurm_additional_parameters must be a dict, got {extra!r}")
        for key in extra:
            instead = SET_BY_NVRX.get(str(key).replace("-", "_"))
            if instead is not None:
                raise SubmitError(
                    f"slurm_additional_parameters[{key!r}] sets what nvrx sets: use {instead}"
                )
        if self.cluster == "local" and sp["nodes"] != 1:
            raise SubmitError(
                f"{self._named('nodes')}={sp['nodes']} needs SLURM: submitit's local executor "
                "runs one node"
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
            raise SubmitError(f"{self._named('nodes')}={nodes} but {where} has only {size} node(s)")

    def _submitit_parameters(self, signal_name: str | None = None) -> dict[str, Any]:
        """What submitit's executor is given; on SLURM, ``--signal`` asks for ``signal_name``
        (default: the one the environment names) ``signal_delay_s`` seconds ahead."""
        params = dict(self._submitit)
        params.setdefault("timeout_min", DEFAULT_TIMEOUT_MIN)
        delay = self._nvrx["signal_delay_s"]
        if self.cluster == "slurm":
            params[SUBMITIT_DELAY] = delay
            extra = dict(params.get("slurm_additional_parameters") or {})
            extra.setdefault("requeue", True)
            if signal_name is None:
                signal_name = warning_signal_name(os.environ)
            params["slurm_additional_parameters"] = sbatch_signal(extra, signal_name, delay)
            srun_args = list(params.get("slurm_srun_args") or [])
            if not any(a.startswith("--kill-on-bad-exit") for a in srun_args):
                srun_args.append("--kill-on-bad-exit=0")
            params["slurm_srun_args"] = srun_args
        return params

    def _apply_parameters(self, signal_name: str) -> None:
        try:
            self._executor.update_parameters(**self._submitit_parameters(signal_name))
            if self.cluster == "local":
                # AutoExecutor does not pass signal_delay_s on to the local executor; set it there.
                self._executor._executor.update_parameters(
                    signal_delay_s=self._nvrx["signal_delay_s"]
                )
        except (ValueError, TypeError, NameError, AssertionError, NotImplementedError) as exc:
            if isinstance(exc, SubmitError):
                raise
            raise SubmitError(f"submitit refused the parameters: {exc}") from exc

    def _prepare(self) -> str:
        """Checks before any submission; the warning signal's name (``USR2``)."""
        self._check_values()
        signal_name = warning_signal_name(os.environ)
        self._check_cluster()
        self._apply_parameters(signal_name)
        return signal_name

    def _callable_command(
        self, target: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> list[str]:
        spec_file = self.folder / "specs" / f"{uuid.uuid4().hex}.pkl"
        try:
            dump_spec(spec_file, target, args, dict(kwargs))
        except TypeError as exc:
            raise SubmitError(str(exc)) from exc
        return [sys.executable, "-m", "nvrx.submission.run_callable", str(spec_file)]

    def _node_spec(self, command: list[str], signal_name: str) -> NodeSpec:
        return NodeSpec(
            command=command,
            nproc_per_node=self._nvrx["nproc_per_node"],
            supervise_args=list(self._nvrx["supervise_args"]),
            log_dir=str(self.folder / "nvrx_logs"),
            result_root=str(self.folder / "results"),
            env={
                SIGNAL_DELAY_ENV: str(self._nvrx["signal_delay_s"]),
                MAX_TIME_LIMIT_REQUEUES_ENV: str(self._nvrx["max_time_limit_requeues"]),
                NVRX_SIGNAL_ENV: signal_name,  # the signal SLURM is asked for
            },
            # cloudpickle refers to functions and classes of importable modules by name: let
            # the node task and the children import them from where the submitter did.
            python_path=submitters_path(sys.path),
        )

    def _handle(self, job: Any) -> NvrxJob:
        make_private_dir(self.folder / str(job.job_id))  # submitit's pickles and logs of the job
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
        self,
        target: Callable[..., Any] | Sequence[str] | str,
        /,
        *args: Any,
        **kwargs: Any,
    ) -> NvrxJob:
        """Submit ``target(*args, **kwargs)`` (or the command ``target``) on every rank of every
        node. ``self`` and ``target`` are positional-only: ``kwargs`` may use those names."""
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
        signal_name = self._prepare()
        if what == "callable":
            command = self._callable_command(target, args, kwargs)  # type: ignore[arg-type]
        try:
            job = self._executor.submit(run_node, self._node_spec(command, signal_name))
        except BaseException:  # sbatch failed: no job will read the spec
            if what == "callable":
                _discard_specs([command])
            raise
        return self._handle(job)

    def map_array(self, fn: Callable[..., Any], /, *iterables: Iterable[Any]) -> list[NvrxJob]:
        """One supervised job per element of ``zip(*iterables)``, running ``fn(*element)`` on
        every rank of every node of that job (submitit's ``map_array``).

        On SLURM the jobs are one job array (ids ``<array>_<index>``); submitit's local
        executor has no arrays and starts one job per element. Each job has its own
        ``nvrx_logs/<job id>`` and report. No elements: no job, an empty list.
        """
        if not callable(fn):
            raise SubmitError(f"map_array needs a callable, got {fn!r}")
        calls = [tuple(element) for element in zip(*iterables, strict=False)]  # as submitit
        if not calls:
            return []
        signal_name = self._prepare()
        argvs: list[list[str]] = []
        try:
            for call in calls:
                argvs.append(self._callable_command(fn, call, {}))
            specs = [self._node_spec(command, signal_name) for command in argvs]
            jobs = self._executor.map_array(run_node, specs)
        except BaseException:  # an element that cannot be pickled, or sbatch failed: no job
            _discard_specs(argvs)
            raise
        return [self._handle(job) for job in jobs]


def _discard_specs(commands: Iterable[list[str]]) -> None:
    """Remove the spec files of callable commands that no job will run."""
    for command in commands:
        Path(command[-1]).unlink(missing_ok=True)


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
    or a command; it may be given as ``target=`` (the callable's own keywords go in
    ``kwargs``). ``params`` are ``Executor``'s: e.g. ``nodes=2,
    nproc_per_node=2, timeout_min=10, slurm_partition="debug"``. Bad
    parameters raise ``SubmitError`` before anything is submitted.
    """
    executor = Executor(folder=folder, cluster=cluster, **params)
    return executor.submit(target, *args, **dict(kwargs or {}))
