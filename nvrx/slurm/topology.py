"""The job's topology from SLURM's environment, as the job-environment contract's ``JobEnv``.

``job_from_slurm()`` reads where this process sits in a SLURM job (node rank,
node count, master host, ports) and returns ``nvrx.jobenv.JobEnv``, the one
type for a job's topology; outside SLURM the contract's own constructors
(``JobEnv.local``, ``JobEnv.from_env``) build it.

Node rank inside SLURM: in a job step that runs one task per node (the nvrx
launch, ``srun --ntasks-per-node=1``) it is ``SLURM_PROCID``, which SLURM also
uses to order tasks; in any other step, or in the batch shell (no step), it is
``SLURM_NODEID``, the index of this node in the step's (or job's) node list.

Ports follow the contract (``nvrx.jobenv.resolve_ports``): an explicit
``MASTER_PORT``/``NVRX_STORE_PORT`` wins, the store's port follows
``MASTER_PORT``, and without either both come from the job id, so the nodes of
one job agree on them without talking.
"""

from __future__ import annotations

from collections.abc import Mapping

from nvrx import jobenv
from nvrx.jobenv import PORT_BASE, PORT_SLOTS, JobEnv, ports_for_job, resolve_ports
from nvrx.slurm.nodelist import expand_nodelist

__all__ = [
    "PORT_BASE",
    "PORT_SLOTS",
    "job_from_slurm",
    "ports_for_job",
    "resolve_ports",
    "task_place",
    "tasks_on_this_node",
]


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
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={port} is not a TCP port (1-65535)")
    return port


def job_from_slurm(
    env: Mapping[str, str], nproc_per_node: int = 1, log_dir: str | None = None
) -> JobEnv:
    """This process's job, read from SLURM's variables in ``env``.

    ``MASTER_PORT`` and ``NVRX_STORE_PORT`` override the derived ports and
    ``NVRX_JOB_ID`` SLURM's job id; ``log_dir`` defaults to the contract's.
    Raises ``ValueError`` naming the variable and its value when one is
    missing or malformed.
    """
    job_id = env.get("SLURM_JOB_ID") or ""
    if not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a job number")
    nnodes, node_rank, master_addr = _place(env, job_id)
    master_port, store_port = resolve_ports(
        job_id, _port_var(env, "MASTER_PORT"), _port_var(env, jobenv.STORE_PORT)
    )
    if master_port == store_port:
        raise ValueError(f"MASTER_PORT and {jobenv.STORE_PORT} are both {master_port}")
    return JobEnv(
        job_id=env.get(jobenv.JOB_ID) or job_id,
        log_dir=str(log_dir or jobenv.log_dir_from(env)),
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
        store_port=store_port,
    )


def _place(env: Mapping[str, str], job_id: str) -> tuple[int, int, str]:
    """(node count, node rank, first host) of this step, or of the job in its batch shell."""
    if env.get("SLURM_STEP_ID"):
        list_var, nodes_var = "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES"
    else:
        list_var, nodes_var = "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"
    if not env.get(list_var) and env.get("SLURM_NODELIST"):
        list_var = "SLURM_NODELIST"  # what was read is what an error names
    raw_list = env.get(list_var)
    if not raw_list:
        raise ValueError(f"{list_var} is not set in SLURM job {job_id}")
    try:
        nodelist = expand_nodelist(raw_list)
    except ValueError as err:
        raise ValueError(f"{list_var}={raw_list!r}: {err}") from None
    nnodes = _int_var(env, nodes_var, len(nodelist))
    if nnodes != len(nodelist):
        raise ValueError(
            f"{nodes_var}={nnodes} but {list_var}={raw_list!r} names {len(nodelist)} hosts"
        )
    one_task_per_node = env.get("SLURM_STEP_NUM_TASKS") == str(nnodes)
    rank_var = "SLURM_PROCID" if env.get("SLURM_STEP_ID") and one_task_per_node else "SLURM_NODEID"
    node_rank = _int_var(env, rank_var, 0)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"{rank_var}={node_rank} is outside 0..{nnodes - 1}")
    return nnodes, node_rank, nodelist[0]


def task_place(env: Mapping[str, str], default_count: int) -> tuple[int, int]:
    """(task count, task rank) of a step that runs one process per task: ``SLURM_NTASKS``
    (else ``SLURM_NPROCS``, else ``default_count``) and ``SLURM_PROCID``; ValueError naming
    a malformed one and its value."""
    name = next((n for n in ("SLURM_NTASKS", "SLURM_NPROCS") if env.get(n)), None)
    count = default_count if name is None else _int_var(env, name)
    if count < 1:
        raise ValueError(f"{name}={count} is not at least 1")
    rank = _int_var(env, "SLURM_PROCID")
    if not 0 <= rank < count:
        raise ValueError(f"SLURM_PROCID={rank} is outside 0..{count - 1}")
    return count, rank


#: Where SLURM tells how many tasks run on each node, the step's first.
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _counts_per_node(spec: str) -> list[int]:
    """SLURM's compact per-node counts, ``2(x3),1`` -> ``[2, 2, 2, 1]``; ValueError if malformed."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.strip().partition("(x")
        times = int(repeat.removesuffix(")")) if repeat else 1
        counts.extend([int(count)] * times)
    return counts


def tasks_on_this_node(env: Mapping[str, str]) -> int | None:
    """How many tasks of the step run on this node: ``SLURM_STEP_TASKS_PER_NODE`` (else
    ``SLURM_TASKS_PER_NODE``) at ``SLURM_NODEID``, else ``SLURM_NTASKS_PER_NODE``; None when
    none of them tells (unset or malformed)."""
    node = env.get("SLURM_NODEID", "")
    for name in _TASKS_PER_NODE_VARS:
        spec = env.get(name)
        if not spec or not node.isdigit():
            continue
        try:
            counts = _counts_per_node(spec)
        except ValueError:
            continue
        if int(node) < len(counts):
            return counts[int(node)]
    raw = env.get("SLURM_NTASKS_PER_NODE", "")
    return int(raw) if raw.isdigit() else None
