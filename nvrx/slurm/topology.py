"""Where this process sits in the job: node rank, node list, master address, ports.

``Topology.from_env()`` reads it from SLURM's environment (or, outside SLURM,
from the nvrx contract variables a supervisor sets); ``Topology.local()`` makes
one for runs without SLURM.

Node rank inside SLURM: in a job step that runs one task per node (the nvrx
launch, ``srun --ntasks-per-node=1``) it is ``SLURM_PROCID``, which SLURM also
uses to order tasks; in any other step, or in the batch shell (no step), it is
``SLURM_NODEID``, the index of this node in the step's (or job's) node list.

Ports follow the job-environment contract (``nvrx.jobenv.resolve_ports``):
an explicit ``MASTER_PORT``/``NVRX_STORE_PORT`` wins, the store's port follows
``MASTER_PORT``, and without either both come from the job id, so the nodes of
one job agree on them without talking. ``job_env()`` turns a topology into that
contract's ``JobEnv``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from nvrx import jobenv
from nvrx.jobenv import PORT_BASE, PORT_SLOTS, JobEnv, ports_for_job, resolve_ports
from nvrx.slurm.nodelist import expand_nodelist

__all__ = ["PORT_BASE", "PORT_SLOTS", "Topology", "ports_for_job", "resolve_ports"]

logger = logging.getLogger(__name__)


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"{name} is not set; it is needed to know the job's topology")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _port_var(env: Mapping[str, str], name: str) -> int | None:
    if not env.get(name):
        return None
    port = _int_var(env, name)
    _check_port(name, port)
    return port


def _check_port(name: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={port} is not a TCP port (1-65535)")


@dataclass(frozen=True)
class Topology:
    """The job's shape as seen from this process. Immutable; build with the classmethods."""

    job_id: str
    step_id: str | None
    node_rank: int
    nnodes: int
    nodelist: tuple[str, ...]
    master_addr: str
    master_port: int
    store_port: int
    restart_count: int
    is_slurm: bool

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ValueError("job_id is empty")
        if self.nnodes < 1:
            raise ValueError(f"nnodes={self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is outside 0..{self.nnodes - 1}")
        if len(self.nodelist) != self.nnodes:
            raise ValueError(
                f"nodelist has {len(self.nodelist)} hosts {list(self.nodelist)} "
                f"but nnodes={self.nnodes}"
            )
        _check_port("master_port", self.master_port)
        _check_port("store_port", self.store_port)
        if self.master_port == self.store_port:
            raise ValueError(f"master_port and store_port are both {self.master_port}")
        if self.restart_count < 0:
            raise ValueError(f"restart_count={self.restart_count} is negative")

    def job_env(
        self, nproc_per_node: int = 1, log_dir: str | None = None, job_id: str | None = None
    ) -> JobEnv:
        """This topology as the job-environment contract (the contract's log directory unless given)."""
        return JobEnv(
            job_id=job_id or self.job_id,
            log_dir=str(log_dir or jobenv.log_dir_from()),
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            nproc_per_node=nproc_per_node,
            master_addr=self.master_addr,
            master_port=self.master_port,
            store_port=self.store_port,
        )

    @property
    def node_name(self) -> str:
        """Host name of this node in ``nodelist``."""
        return self.nodelist[self.node_rank]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology:
        """Read the topology from ``env`` (default ``os.environ``).

        Inside a SLURM job (``SLURM_JOB_ID`` set) from SLURM's variables; else
        from ``NVRX_JOB_ID``, ``NVRX_NNODES``, ``NVRX_NODE_RANK``, ``MASTER_ADDR``
        (all optional: one local node by default). ``MASTER_PORT`` and
        ``NVRX_STORE_PORT`` override the derived ports in both cases. Raises
        ``ValueError`` naming the variable and its value when one is malformed.
        """
        env = os.environ if env is None else env
        master_port = _port_var(env, "MASTER_PORT")
        store_port = _port_var(env, jobenv.STORE_PORT)
        if not env.get("SLURM_JOB_ID"):
            nnodes = _int_var(env, jobenv.NNODES, 1)
            return cls.local(
                nnodes=nnodes,
                node_rank=_int_var(env, jobenv.NODE_RANK, 0),
                master_addr=env.get("MASTER_ADDR") or jobenv.DEFAULT_MASTER_ADDR,
                master_port=master_port,
                store_port=store_port,
                job_id=env.get(jobenv.JOB_ID) or None,
            )
        return cls._from_slurm(env, master_port, store_port)

    @classmethod
    def _from_slurm(
        cls, env: Mapping[str, str], master_port: int | None, store_port: int | None
    ) -> Topology:
        job_id = env["SLURM_JOB_ID"]
        if not job_id.isdigit():
            raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a job number")
        step_id = env.get("SLURM_STEP_ID") or None
        if step_id is not None:
            list_var, nodes_var = "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES"
        else:
            list_var, nodes_var = "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"
        raw_list = env.get(list_var) or env.get("SLURM_NODELIST")
        if not raw_list:
            raise ValueError(f"{list_var} is not set in SLURM job {job_id}")
        try:
            nodelist = tuple(expand_nodelist(raw_list))
        except ValueError as err:
            raise ValueError(f"{list_var}={raw_list!r}: {err}") from None
        nnodes = _int_var(env, nodes_var, len(nodelist))
        if nnodes != len(nodelist):
            raise ValueError(
                f"{nodes_var}={nnodes} but {list_var}={raw_list!r} names {len(nodelist)} hosts"
            )
        if step_id is not None and env.get("SLURM_STEP_NUM_TASKS") == str(nnodes):
            rank_var = "SLURM_PROCID"
        else:
            rank_var = "SLURM_NODEID"
        node_rank = _int_var(env, rank_var, 0)
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"{rank_var}={node_rank} is outside 0..{nnodes - 1}")
        restart_count = _int_var(env, "SLURM_RESTART_COUNT", 0)
        if restart_count < 0:
            raise ValueError(f"SLURM_RESTART_COUNT={restart_count} is negative")
        master_port, store_port = resolve_ports(job_id, master_port, store_port)
        return cls(
            job_id=job_id,
            step_id=step_id,
            node_rank=node_rank,
            nnodes=nnodes,
            nodelist=nodelist,
            master_addr=nodelist[0],
            master_port=master_port,
            store_port=store_port,
            restart_count=restart_count,
            is_slurm=True,
        )

    @classmethod
    def local(
        cls,
        nnodes: int,
        node_rank: int,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        store_port: int | None = None,
        job_id: str | None = None,
    ) -> Topology:
        """A topology for runs without SLURM: ``nnodes`` "nodes" on ``master_addr``.

        ``job_id`` defaults to ``local-<pid>``; all "nodes" of one run must pass
        the same ``job_id`` (or the same ports) to agree on the ports. Every
        local node lives on ``master_addr``, so the node list repeats it.
        """
        if job_id is None:
            job_id = f"local-{os.getpid()}"
        master_port, store_port = resolve_ports(job_id, master_port, store_port)
        return cls(
            job_id=job_id,
            step_id=None,
            node_rank=node_rank,
            nnodes=nnodes,
            nodelist=(master_addr,) * nnodes,
            master_addr=master_addr,
            master_port=master_port,
            store_port=store_port,
            restart_count=0,
            is_slurm=False,
        )
