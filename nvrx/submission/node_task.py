"""What runs on each node of a submitted job: the submitit task that starts one supervisor.

``run_node`` starts ``nvrx-supervise`` in its own process group with
``nproc_per_node`` children, relays SLURM's signals to it, and returns the
children's results (or raises ``JobFailed``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvrx import jobenv, processes
from nvrx.processes import warning_signal
from nvrx.submission.job import JobFailed
from nvrx.submission.run_callable import RESULT_DIR_ENV, read_outcome, result_path
from nvrx.supervisor.preemption import EXIT_REQUEUED, SUBMITIT_LOCAL_REQUEUE_EXIT

log = logging.getLogger(__name__)


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
    env[jobenv.LOG_DIR] = spec.log_dir
    env[jobenv.JOB_ID] = job_id
    result_dir = Path(spec.result_root) / job_id
    env[RESULT_DIR_ENV] = str(result_dir)
    argv = [*supervise_argv(), "--nproc-per-node", str(spec.nproc_per_node), *spec.supervise_args]
    if not env.get("SLURM_JOB_ID"):
        master_port, store_port = jobenv.ports_for_job(f"local-{job_id}")
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
        processes.stop(proc)  # normally ended already; then only its group's stragglers
