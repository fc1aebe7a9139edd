"""``fork_and_monitor()``: the supervisor's child loop as a library call at the top of a script.

For jobs started one rank per srun task (or per process by any launcher):

    from nvrx import fork_and_monitor
    fork_and_monitor()          # before `import torch`
    import torch
    ...

The call forks. The parent becomes the monitor: it hosts the job's store on
rank 0, restarts the child when it fails (same RANK, ``NVRX_RESTART_COUNT`` + 1,
job-wide budget in the store), and exits with the supervisor's exit code; it
never returns. The child returns from the call and runs the script. The
monitor starts no thread and imports no torch (the store client lives in a
separate agent process), so every fork happens from a clean process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from nvrx import events, processes

from .children import Child
from .config import (
    DEFAULT_FINISH_TIMEOUT_S,
    DEFAULT_GRACE_PERIOD_S,
    DEFAULT_LOG_DIR,
    DEFAULT_LOOP_BREAKER,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_STORE_TIMEOUT_S,
    SupervisorConfig,
    in_slurm_step,
    place_from_slurm,
)

log = logging.getLogger(__name__)


class _BecomeChild(BaseException):
    """Raised in a freshly forked child to unwind the monitor's stack back to ``fork_and_monitor``.

    A BaseException, so that no ``except Exception`` of the loop can swallow it.
    """

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__("forked child")
        self.env = env


def _fork_child(local_rank: int, attempt: int, env: dict[str, str]) -> Child:
    pid = processes.fork()
    if pid == 0:
        raise _BecomeChild(env)
    return Child.forked(local_rank, attempt, pid)


def _topology(env: Mapping[str, str]) -> dict:
    """nnodes/node_rank/master/store of a one-rank-per-process job: SLURM tasks, torchrun-style env, or one process."""
    if in_slurm_step(env):
        place = place_from_slurm(env)
        return {
            "nnodes": int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or place.nnodes),
            "node_rank": int(env["SLURM_PROCID"]),
            "master_addr": place.master_addr,
            "master_port": place.master_port,
            "store_port": place.store_port,
            "job_id": env.get("NVRX_JOB_ID") or place.job_id,
        }
    master_port = int(env.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    store_port = int(env.get("NVRX_STORE_PORT") or master_port + 1)
    return {
        "nnodes": int(env.get("WORLD_SIZE") or 1),
        "node_rank": int(env.get("RANK") or 0),
        "master_addr": env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        "master_port": master_port,
        "store_port": store_port,
        "job_id": env.get("NVRX_JOB_ID") or f"local-{store_port}",
    }


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
    supervisor (``NVRX_SUPERVISED=1``). Call it before importing torch.
    """
    if os.environ.get("NVRX_SUPERVISED") == "1":
        return
    from .supervisor import Supervisor, SupervisorError

    env = os.environ
    topo = _topology(env)
    config = SupervisorConfig(
        command=list(getattr(sys, "orig_argv", sys.argv)),
        nproc_per_node=1,
        log_dir=log_dir or env.get("NVRX_LOG_DIR") or DEFAULT_LOG_DIR,
        max_restarts=max_restarts,
        loop_breaker=loop_breaker,
        grace_period=grace_period,
        store_timeout=store_timeout,
        finish_timeout=finish_timeout,
        **topo,
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


def _become_child(supervisor: object, env: dict[str, str]) -> None:
    """In the forked child: drop the monitor's descriptors and handlers, take the child's environment."""
    signals = getattr(supervisor, "signals", None)
    if signals is not None:
        signals.restore()
    link = getattr(supervisor, "link", None)
    if link is not None:
        link.forget_in_child()
    local_id = os.environ.get("SLURM_LOCALID")
    os.environ.update(env)
    if local_id is not None:
        os.environ["LOCAL_RANK"] = local_id
    events.configure("app")
