"""Configuration of one supervisor: topology of the job, restart policy, timeouts.

The topology comes from SLURM (one supervisor per node, ``Topology.from_env``)
or, for development and tests, from explicit ``--nnodes/--node-rank/...``
options so that N local supervisors form one job on a single machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nvrx.events import job_log_dir
from nvrx.slurm.topology import Topology

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_MAX_RESTARTS = 10
DEFAULT_LOOP_BREAKER = 3
DEFAULT_GRACE_PERIOD_S = 5.0
DEFAULT_STORE_TIMEOUT_S = 60.0
DEFAULT_FINISH_TIMEOUT_S = 300.0
DEFAULT_LOG_DIR = "nvrx_logs"

KEY_PREFIX = "nvrx_supervisor/"
STOP_KEY = KEY_PREFIX + "stop"
RESTARTS_KEY = KEY_PREFIX + "restarts"
NODES_DONE_KEY = KEY_PREFIX + "nodes_done"
ALL_DONE_KEY = KEY_PREFIX + "all_done"


class ConfigError(ValueError):
    """A bad option or environment value; the message names what to fix."""


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything one supervisor needs; validated on construction."""

    command: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    store_port: int = DEFAULT_MASTER_PORT + 1
    job_id: str = "local"
    log_dir: str = DEFAULT_LOG_DIR
    max_restarts: int = DEFAULT_MAX_RESTARTS
    loop_breaker: int = DEFAULT_LOOP_BREAKER
    grace_period: float = DEFAULT_GRACE_PERIOD_S
    store_timeout: float = DEFAULT_STORE_TIMEOUT_S
    finish_timeout: float = DEFAULT_FINISH_TIMEOUT_S
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError(
                "no training command: put it after '--', e.g. nvrx-supervise -- python train.py"
            )
        checks = [
            (self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {self.nproc_per_node}"),
            (self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}"),
            (
                0 <= self.node_rank < self.nnodes,
                f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, got {self.node_rank}",
            ),
            (
                1 <= self.master_port <= 65535,
                f"--master-port must be in 1..65535, got {self.master_port}",
            ),
            (
                1 <= self.store_port <= 65535,
                f"--store-port must be in 1..65535, got {self.store_port}",
            ),
            (
                self.store_port != self.master_port,
                f"--store-port must differ from --master-port (both {self.store_port})",
            ),
            (self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}"),
            (
                self.loop_breaker >= 0,
                f"--loop-breaker must be >= 0 (0 disables it), got {self.loop_breaker}",
            ),
            (
                self.grace_period >= 0,
                f"--grace-period must be >= 0 seconds, got {self.grace_period}",
            ),
            (
                self.store_timeout > 0,
                f"--store-timeout must be > 0 seconds, got {self.store_timeout}",
            ),
            (
                self.finish_timeout > 0,
                f"--finish-timeout must be > 0 seconds, got {self.finish_timeout}",
            ),
            (bool(self.master_addr), "--master-addr must not be empty"),
            (
                bool(self.job_id) and "/" not in self.job_id,
                f"--job-id must be a non-empty name without '/', got {self.job_id!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def store_host(self) -> str:
        return self.master_addr

    @property
    def events_dir(self) -> Path:
        """Where this job's events go: ``<log_dir>/<job_id>``."""
        return job_log_dir(self.job_id, {"NVRX_LOG_DIR": self.log_dir})

    def rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def child_env(
        self, local_rank: int, restart_count: int, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment of the child of ``local_rank`` (docs/conventions.md), on top of ``base``."""
        env = dict(os.environ if base is None else base)
        env.update(self.extra_env)
        env.update(
            {
                "RANK": str(self.rank(local_rank)),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
                "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "NVRX_STORE_HOST": self.store_host,
                "NVRX_STORE_PORT": str(self.store_port),
                "NVRX_JOB_ID": self.job_id,
                "NVRX_LOG_DIR": str(Path(self.log_dir).absolute()),
                "NVRX_NODE_RANK": str(self.node_rank),
                "NVRX_NNODES": str(self.nnodes),
                "NVRX_NPROC_PER_NODE": str(self.nproc_per_node),
                "NVRX_RESTART_COUNT": str(restart_count),
                "NVRX_SUPERVISED": "1",
            }
        )
        return env


@dataclass(frozen=True)
class JobPlace:
    """Where this supervisor sits in the job: the part of the config SLURM can tell."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    store_port: int
    job_id: str


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a SLURM job step (srun)."""
    return "SLURM_JOB_ID" in env and "SLURM_PROCID" in env


def place_from_slurm(env: Mapping[str, str]) -> JobPlace:
    """The job's topology from SLURM, through ``nvrx.slurm.topology.Topology.from_env``."""
    try:
        topo = Topology.from_env(dict(env))
    except ValueError as exc:
        raise ConfigError(f"cannot read the SLURM topology: {exc}") from exc
    return JobPlace(
        nnodes=int(topo.nnodes),
        node_rank=int(topo.node_rank),
        master_addr=str(topo.master_addr),
        master_port=int(topo.master_port),
        store_port=int(topo.store_port),
        job_id=str(topo.job_id),
    )
