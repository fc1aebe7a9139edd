"""What runs on each node of a submitted job: the submitit task that starts one supervisor.

``run_node`` starts ``nvrx-supervise`` in its own process group with
``nproc_per_node`` children, relays SLURM's signals to it, and returns the
children's results (or raises ``JobFailed``). The warning signal submitit
itself would act on (its ``SUBMITIT_PREEMPT_SIGNAL``, what submitit's local
executor sends before the time limit) reaches the supervisor as nvrx's warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvrx import jobenv, processes
from nvrx.processes import warning_signal
from nvrx.submission.job import JobFailed
from nvrx.submission.private_files import make_private_dir
from nvrx.submission.run_callable import RESULT_DIR_ENV, read_outcome, result_path
from nvrx.supervisor.preemption import EXIT_REQUEUED, SUBMITIT_LOCAL_REQUEUE_EXIT

log = logging.getLogger(__name__)

#: Variables of SLURM's that a job outside SLURM must not inherit (``node_command``).
_SLURM_PREFIXES = ("SLURM_", "SLURMD_")
#: submitit's clusters whose task is a process of its own (not the submitter's).
OWN_PROCESS_CLUSTERS = ("slurm", "local")


@dataclass(frozen=True)
class NodeSpec:
    """What the submitit task of every node runs (pickled into the job by submitit)."""

    command: list[str]
    nproc_per_node: int
    supervise_args: list[str]
    log_dir: str
    result_root: str
    env: dict[str, str] = field(default_factory=dict)
    #: The submitter's ``sys.path`` less the interpreter's own folders (``submitters_path``):
    #: put before the node's ``PYTHONPATH`` for the children, after the node task's own
    #: ``sys.path`` for the results it unpickles.
    python_path: list[str] = field(default_factory=list)


#: ``nvrx-supervise`` options (by their ``dest``) that the node task or SLURM set for every
#: node, refused in ``supervise_args``: what sets them instead.
SET_FOR_THE_JOB = {
    "nproc_per_node": "the nproc_per_node parameter",
    "nnodes": "the nodes parameter (SLURM gives every node the job's topology)",
    "node_rank": "nothing: SLURM gives each node its rank",
    "master_addr": "nothing: the store runs on the job's first node",
    "job_id": "nothing: the job's id is its SLURM (or submitit) id, which NvrxJob reads by",
    "log_dir": "nothing: events go to <folder>/nvrx_logs/<job id>, where NvrxJob.report() "
    "reads them",
}


def supervise_options(args: Sequence[str]) -> dict[str, str]:
    """The ``nvrx-supervise`` options ``args`` give, by ``dest`` (``master_port``), each with
    the spelling given first (``--master_port``: either spelling, ``--opt value`` or
    ``--opt=value``); what follows ``--`` is the command, not options."""
    from nvrx.supervisor.cli import build_parser

    actions = build_parser()._option_string_actions
    given: dict[str, str] = {}
    for arg in args:
        if arg == "--":
            break
        action = actions.get(arg.split("=", 1)[0]) if arg.startswith("-") else None
        if action is not None:
            given.setdefault(action.dest, arg.split("=", 1)[0])
    return given


def _local_ports(job_id: str, supervise_args: list[str]) -> list[str]:
    """Ports for a job of submitit's local executor, which every node derives from the job
    id alike (no SLURM to agree through); none where ``supervise_args`` name them: the
    caller's own win."""
    if {"master_port", "store_port"} & set(supervise_options(supervise_args)):
        return []
    master_port, store_port = jobenv.ports_for_job(f"local-{job_id}")
    return ["--master-port", str(master_port), "--store-port", str(store_port)]


def supervise_argv() -> list[str]:
    """How to start ``nvrx-supervise`` with the interpreter running this code."""
    return [sys.executable, "-m", "nvrx.supervisor.cli"]


def _interpreters_dirs() -> list[Path]:
    """Where this interpreter's own modules are: its standard library and its site-packages
    (a venv's and its base's), not whole prefixes: a system Python's prefix ``/usr`` holds
    projects too (``/usr/src/app``); a folder that is the file system's root is none."""
    import site
    import sysconfig

    dirs: list[str] = []
    for base in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=base)
        dirs += [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    dirs.append(site.getusersitepackages())
    found = [Path(d).absolute() for d in dirs if d]
    return list(dict.fromkeys(d for d in found if d != Path(d.anchor)))


def submitters_path(path: Sequence[str]) -> list[str]:
    """The folders of ``path`` (the submitter's ``sys.path``) the nodes need: not those of the
    interpreter itself (its standard library, its site-packages), which the nodes' same
    interpreter has on its own, after the node's ``PYTHONPATH``: put before it, they would
    shadow the node's packages."""
    own = _interpreters_dirs()
    return [
        p
        for p in path
        if p and os.path.isdir(p) and not any(Path(p).absolute().is_relative_to(d) for d in own)
    ]


def node_command(
    spec: NodeSpec, job_id: str, cluster: str, environ: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The supervisor's command line and environment on a node of job ``job_id``.

    Outside SLURM (submitit's local executor) the environment keeps none of ``environ``'s
    ``SLURM_*`` variables: run from a shell inside an allocation, they name the allocation's
    job, which the supervisor would otherwise take for its own (and requeue on a warning);
    the ports come from the job id instead. ``PYTHONPATH`` is the submitter's ``sys.path``
    (less this interpreter's own folders: ``submitters_path``) followed by the node's own
    ``PYTHONPATH``."""
    slurm = cluster == "slurm"
    env = {k: v for k, v in environ.items() if slurm or not k.startswith(_SLURM_PREFIXES)}
    env.update(spec.env)
    paths = [*submitters_path(spec.python_path), *env.get("PYTHONPATH", "").split(os.pathsep)]
    if any(paths):
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env[jobenv.LOG_DIR] = spec.log_dir
    env[jobenv.JOB_ID] = job_id
    env[RESULT_DIR_ENV] = str(Path(spec.result_root) / job_id)
    argv = [*supervise_argv(), "--nproc-per-node", str(spec.nproc_per_node), *spec.supervise_args]
    if not slurm:
        argv += _local_ports(job_id, spec.supervise_args)
    return [*argv, "--", *spec.command], env


def run_node(spec: NodeSpec) -> dict[str, Any]:
    """Body of one node's submitit task: supervise the node's children, return their results."""
    import submitit

    # The ranks' results are unpickled here: classes of the submitter's modules must import.
    sys.path.extend(p for p in spec.python_path if p not in sys.path)
    job_env = submitit.JobEnvironment()
    job_id = str(job_env.job_id)
    node = int(job_env.node)
    _make_job_folder_private(job_env)
    argv, env = node_command(spec, job_id, str(job_env.cluster), os.environ)
    result_dir = Path(env[RESULT_DIR_ENV])
    local_ranks = [node * spec.nproc_per_node + k for k in range(spec.nproc_per_node)]
    for rank in local_ranks:  # a requeued run must not return the results of the run before
        result_path(result_dir, rank).unlink(missing_ok=True)
    started = time.time()
    rc = _supervise(argv, env, warning_signal(env), _submitit_signal(job_env))
    if str(job_env.cluster) in OWN_PROCESS_CLUSTERS:
        # What this task writes from here on, submitit's pickle of the results (or of the
        # error) among it, is the user's alone; the supervisor and the ranks had the user's
        # umask. submitit's debug executor runs the task in the submitter's process, which
        # keeps its umask: it writes no result pickle.
        os.umask(0o077)
    if rc == EXIT_REQUEUED or rc == SUBMITIT_LOCAL_REQUEUE_EXIT:
        # This run is over and will run again: leave no result, so the submitter keeps waiting.
        log.warning("node %d of job %s: requeued (supervisor exit %d)", node, job_id, rc)
        sys.exit(rc)
    if rc != 0:
        from nvrx.supervisor.exit_codes import describe

        job_dir = Path(spec.log_dir) / job_id
        raise JobFailed(
            f"nvrx-supervise on node {node} of job {job_id} exited {rc} ({describe(rc)})"
            f"{_warning_decision(job_dir, started)}; events in {job_dir}"
            f"{_rank_errors(result_dir, range(_nodes(job_env) * spec.nproc_per_node))}"
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


def _make_job_folder_private(job_env: Any) -> None:
    """submitit's folder of this job (its pickles and logs) owner-only (0o700), whatever the
    umask of the submitter that created it."""
    try:
        folder = job_env.paths.folder
    except KeyError:  # not run by submitit's job runner ($SUBMITIT_FOLDER unset): no folder
        return
    make_private_dir(folder)


def _nodes(job_env: Any) -> int:
    """The job's number of nodes (1 where submitit cannot say)."""
    try:
        return max(1, int(job_env.num_nodes))
    except (KeyError, TypeError, ValueError):
        return 1


#: How many ranks' errors a ``JobFailed`` message quotes (a job of thousands of ranks whose
#: every rank failed would otherwise quote them all); the rest are counted.
MAX_RANK_ERRORS = 8


def _rank_errors(result_dir: Path, ranks: Iterable[int]) -> str:
    """The errors (tracebacks) the ranks wrote as their outcome, one paragraph each: those of
    every node of the job (the results folder is shared), since the rank that failed first,
    and stopped the job, may be another node's."""
    errors = []
    for rank in ranks:
        try:
            outcome = read_outcome(result_dir, rank)
        except Exception as exc:  # e.g. a file others could write: say so, not what it holds
            errors.append(f"\nrank {rank}: its outcome cannot be read: {exc}")
            continue
        if outcome is not None and outcome[0] != "success":
            errors.append(f"\nrank {rank} failed:\n{str(outcome[1]).rstrip()}")
    if len(errors) > MAX_RANK_ERRORS:
        more = len(errors) - MAX_RANK_ERRORS
        errors[MAX_RANK_ERRORS:] = [f"\n... and {more} more rank(s): their outcomes are in {result_dir}"]
    return "".join(errors)


def _submitit_signal(job_env: Any) -> int | None:
    """The warning signal submitit's own handler in this task waits for, if it names one."""
    try:
        return int(job_env._usr_sig())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _warning_decision(job_dir: Path, since: float) -> str:
    """``: <reason>`` of a decision not to requeue made during this run, else nothing."""
    latest: tuple[float, str] | None = None
    for path in (job_dir / "preempt").glob("r*.decision"):
        try:
            written = path.stat().st_mtime
            decision = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if written >= since and isinstance(decision, dict) and not decision.get("requeued"):
            if latest is None or written > latest[0]:
                latest = (written, str(decision.get("reason")))
    return f": {latest[1]}" if latest else ""


def _supervise(argv: list[str], env: dict[str, str], warning: int, alias: int | None) -> int:
    """Run the supervisor in its own process group, relaying the job's signals to it; ``alias``
    (submitit's warning signal, when it differs) is relayed as ``warning``."""
    # The supervisor starts with the warning ignored and installs its own handler,
    # so that a warning during its start-up cannot kill it.
    proc = processes.start(argv, env=env)
    relayed = {warning, signal.SIGTERM, signal.SIGINT}
    if alias is not None and alias not in relayed:
        relayed.add(alias)

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, warning if signum == alias else signum)

    previous = {s: signal.signal(s, relay) for s in relayed}
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        processes.stop(proc)  # normally ended already; then only its group's stragglers
