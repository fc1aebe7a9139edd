"""``fork_and_monitor()``: the supervisor's child loop as a library call at the top of a script.

For jobs started one rank per srun task (or per process by any launcher):

    from nvrx import fork_and_monitor
    fork_and_monitor()          # before `import torch`
    import torch
    ...

The call forks. The parent becomes the monitor: it hosts the job's store on
rank 0, restarts the child when it fails (same RANK, ``NVRX_RESTART_COUNT`` + 1,
job-wide budget in the store), and exits with the supervisor's exit code; it
never returns. The child returns from the call and runs the script; it dies
with the monitor (``PR_SET_PDEATHSIG``), as a supervisor's children do, and keeps
the launcher's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` and node (``launcher_place``). The
monitor starts no thread and imports no torch (the store client lives in a
separate agent process), so every fork happens from a clean process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from nvrx import events, jobenv, processes
from nvrx.jobenv import JobEnv
from nvrx.slurm import topology

from .children import Child
from .config import (
    DEFAULT_FINISH_TIMEOUT_S,
    DEFAULT_GRACE_PERIOD_S,
    DEFAULT_LOOP_BREAKER,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_STORE_TIMEOUT_S,
    ConfigError,
    SupervisorConfig,
    in_slurm_step,
    job_from_slurm,
    not_in_a_batch_shell,
)

if TYPE_CHECKING:
    from .supervisor import Supervisor


class _BecomeChild(BaseException):
    """Raised in a freshly forked child to unwind the monitor's stack back to ``fork_and_monitor``.

    A BaseException, so that no ``except Exception`` of the loop can swallow it.
    """

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__("forked child")
        self.env = env


def _fork_child(
    local_rank: int, attempt: int, env: dict[str, str], directory: Path | None
) -> Child:
    """A forked child; its streams stay the monitor's (no ``--redirects`` here). It dies
    with the monitor, as a supervisor's children do: a monitor killed by SIGKILL leaves
    no training process behind."""
    pid = processes.fork(die_with_parent=True)
    if pid == 0:
        raise _BecomeChild(env)
    return Child.forked(local_rank, attempt, pid)


def _job(env: Mapping[str, str], log_dir: str | None) -> JobEnv:
    """The job of a one-rank-per-process launch: SLURM tasks, torchrun-style variables, or one process.

    Each process is a "node" of one rank here, so SLURM's task count is the node count.
    ConfigError for a bad SLURM variable, and in the batch script of a job of several tasks.
    """
    if in_slurm_step(env):
        job = job_from_slurm(env, 1, log_dir)
        try:
            ntasks, task_rank = topology.task_place(env, job.nnodes)
        except ValueError as exc:
            raise ConfigError(f"cannot read the SLURM topology: {exc}") from None
        not_in_a_batch_shell(
            env, ntasks, "tasks", "start the script once per task with `srun python SCRIPT ...` "
            "(fork_and_monitor runs one monitor per process)"
        )
        return replace(job, nnodes=ntasks, node_rank=task_rank)
    job = JobEnv.from_env(env)
    return replace(job, log_dir=log_dir or job.log_dir)


def fork_and_monitor(
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    loop_breaker: int = DEFAULT_LOOP_BREAKER,
    grace_period: float = DEFAULT_GRACE_PERIOD_S,
    store_timeout: float = DEFAULT_STORE_TIMEOUT_S,
    finish_timeout: float = DEFAULT_FINISH_TIMEOUT_S,
    log_dir: str | None = None,
) -> None:
    """Fork; the parent supervises the child and exits, the child returns and runs the script.

    Returns at once without forking when the process already runs under an nvrx
    supervisor (``NVRX_SUPERVISED=1``). Call it before importing torch. Before any fork,
    it ends the process with exit 2 and one line on stderr where the environment is no place
    for it: a bad SLURM variable, or the batch script of a job of several tasks.
    """
    if jobenv.flag_in(os.environ, jobenv.SUPERVISED):
        return
    from .exit_codes import SupervisorError
    from .supervisor import Supervisor

    try:
        job = _job(os.environ, log_dir)
    except ConfigError as exc:  # before any fork: this process is the script, and ends here
        print(f"nvrx fork_and_monitor: error: {exc}", file=sys.stderr)
        sys.exit(2)
    config = SupervisorConfig(
        command=list(getattr(sys, "orig_argv", sys.argv)),
        job=job,
        max_restarts=max_restarts,
        loop_breaker=loop_breaker,
        grace_period=grace_period,
        store_timeout=store_timeout,
        finish_timeout=finish_timeout,
        node_liveness=False,  # one monitor per rank here: liveness is per node, not per rank
    )
    supervisor = Supervisor(config, spawn=_fork_child)
    try:
        code = supervisor.run()
    except _BecomeChild as child:
        _become_child(supervisor, child.env)
        return
    except SupervisorError as exc:
        print(f"nvrx fork_and_monitor: error: {exc}", file=sys.stderr)
        code = exc.code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _become_child(supervisor: Supervisor, env: dict[str, str]) -> None:
    """In the forked child: drop the monitor's descriptors and handlers, take the child's environment."""
    if supervisor.signals is not None:
        supervisor.signals.restore()
    processes.ignore_warning_signal()  # restore() gave back the monitor's own disposition
    if supervisor.store.link is not None:
        supervisor.store.link.forget_in_child()
    supervisor.store.stop = None  # the job's secret stays with the monitor
    place = launcher_place(os.environ)
    os.environ.update(env)
    os.environ[jobenv.SUPERVISOR_LOCAL_RANK] = env["LOCAL_RANK"]  # the monitor's one child
    os.environ.update(place)
    events.configure("app")


def launcher_place(env: Mapping[str, str]) -> dict[str, str]:
    """``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (and ``GROUP_RANK``, ``GROUP_WORLD_SIZE``) as
    the launcher gave them to this process (docs/conventions.md: as torchrun sets them), for
    the child to keep. All from one source, so that they agree: the launcher's own (torchrun,
    mpirun wrappers) when it set ``LOCAL_RANK``, else SLURM's place of the task (``SLURM_LOCALID``,
    the node's task count, ``SLURM_NODEID`` of the step's nodes). Those not known are left
    out (the group's two together): the child's one-rank node gives 0 and 1, and its
    "node" (its task) the group's."""
    if env.get("LOCAL_RANK"):
        names = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
        place = {name: env.get(name) for name in names}
    else:
        nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES")
        size = topology.tasks_on_this_node(env)
        place = {
            "LOCAL_RANK": env.get("SLURM_LOCALID"),
            "LOCAL_WORLD_SIZE": None if size is None else str(size),
            "GROUP_RANK": env.get("SLURM_NODEID"),
            "GROUP_WORLD_SIZE": nodes,
        }
    if not (place["GROUP_RANK"] and place["GROUP_WORLD_SIZE"]):  # a pair, or the monitor's
        place["GROUP_RANK"] = place["GROUP_WORLD_SIZE"] = None
    return {name: value for name, value in place.items() if value}
