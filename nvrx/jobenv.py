"""The job-environment contract: every ``NVRX_*`` variable, its default, and a child's environment.

A supervisor tells its training children where they stand through environment
variables (``docs/conventions.md``); the children, the Wrapper, the store
service, the event writer and the report read them back. The names, the
defaults and the rules that derive one value from another (the store's port,
the job's log directory) live here and nowhere else, so both sides agree.

``JobEnv`` is one job as one process sees it, and the one type for a job's
topology: nothing else carries node count, node rank, ranks per node, master
host and ports. A supervisor builds it from its options or from SLURM
(``nvrx.slurm.topology``), holds it in its config and hands ``child_env()`` to
each child; anything else reads it with ``JobEnv.from_env()``.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# -- what a supervisor gives its children --------------------------------------------
LOG_DIR = "NVRX_LOG_DIR"
JOB_ID = "NVRX_JOB_ID"
NODE_RANK = "NVRX_NODE_RANK"
NNODES = "NVRX_NNODES"
NPROC_PER_NODE = "NVRX_NPROC_PER_NODE"
STORE_HOST = "NVRX_STORE_HOST"
STORE_PORT = "NVRX_STORE_PORT"
RESTART_COUNT = "NVRX_RESTART_COUNT"
SUPERVISED = "NVRX_SUPERVISED"
PREEMPT_FLAG = "NVRX_PREEMPT_FLAG"
#: "1" for children started after a store failover: every rank starts anew, none rejoins.
FRESH_START = "NVRX_FRESH_START"
#: "1" for children of a spare node that takes over a lost node: the job runs, they rejoin it.
TAKEOVER = "NVRX_TAKEOVER"
#: Descriptor on which a warm standby waits for the rank it becomes (``supervisor.standby``).
STANDBY_FD = "NVRX_STANDBY_FD"
#: Descriptor on which a warm standby says it is warm: one byte, after its imports.
STANDBY_READY_FD = "NVRX_STANDBY_READY_FD"
#: The supervisor's socket for heartbeats and sections (``nvrx.fault_tolerance``).
FT_SOCKET = "NVRX_FT_SOCKET"
#: The supervisor's ``FaultToleranceConfig``, as JSON.
FT_CONFIG = "NVRX_FT_CONFIG"
#: A fault-tolerance section whose durations the rank records as its step times
#: (``--straggler-section``), measured by the rank's client.
STRAGGLER_SECTION = "NVRX_STRAGGLER_SECTION"
#: The job's secret, hex (``nvrx.store.seal``): set by ``nvrx-srun`` or by the user, read
#: and removed from the environment by the supervisor, never passed to a child.
JOB_SECRET = "NVRX_JOB_SECRET"
#: The path of an owner-only file that holds the job's secret, for the processes a
#: supervisor starts (its ranks, their monitors, its node agent), which seal the fault
#: records of the Wrapper's rounds (``nvrx.store.seal.job_sealer``). The path only: the
#: secret itself is never in an environment.
JOB_SECRET_FILE = "NVRX_JOB_SECRET_FILE"
#: The wall time (seconds since the epoch, ``repr`` of a float) at which SLURM's warning
#: signal reached ``nvrx-srun`` before it became srun (``nvrx.slurm.early_warning``): set by
#: ``nvrx-srun`` for the job step's supervisors alone, taken out of the environment by each
#: supervisor before it starts anything, never passed to a child.
WARNED_AT = "NVRX_WARNED_AT"
#: The supervisor's socket for the heartbeats of the Wrapper's monitors
#: (``nvrx.node_agent.rank_wire``).
RANK_BEATS = "NVRX_RANK_BEATS"
#: The local rank the supervisor knows its child by, where it is not ``LOCAL_RANK``: set by
#: ``fork_and_monitor``, whose monitor has one child (0) while ``LOCAL_RANK`` stays the
#: launcher's. The child's beats and fault-tolerance hello name it (``supervisor_local_rank``).
SUPERVISOR_LOCAL_RANK = "NVRX_SUPERVISOR_LOCAL_RANK"
#: The level the supervisor logs at, for its node agent's lines (``logging`` level name).
AGENT_LOG_LEVEL = "NVRX_AGENT_LOG_LEVEL"

# -- what SLURM gives ---------------------------------------------------------------------
#: SLURM's count of its job's runs before this one (requeues): unset on the first run.
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"

# -- settings a user or a template may give --------------------------------------------
PREEMPT_SIGNAL = "NVRX_PREEMPT_SIGNAL"
SIGNAL_DELAY_S = "NVRX_SIGNAL_DELAY_S"
MAX_TIME_LIMIT_REQUEUES = "NVRX_MAX_TIME_LIMIT_REQUEUES"
PREEMPT_WINDOW_S = "NVRX_PREEMPT_WINDOW_S"
SPARE_NODES = "NVRX_SPARE_NODES"
MIN_NODES = "NVRX_MIN_NODES"
WARM_STANDBY = "NVRX_WARM_STANDBY"
STANDBY_WAIT_S = "NVRX_STANDBY_WAIT_S"
#: More srun options for ``nvrx-srun`` (split like a shell).
SRUN_ARGS = "NVRX_SRUN_ARGS"
NODE_TIMEOUT_S = "NVRX_NODE_TIMEOUT_S"
EVENTS_FSYNC = "NVRX_EVENTS_FSYNC"
RESULT_DIR = "NVRX_RESULT_DIR"
FR_TRACE_PATH = "NVRX_FR_TRACE_PATH"
MONITOR_DEBUG = "NVRX_MONITOR_DEBUG"
#: The address the job's store listens on: ``all`` for every interface (default: the address
#: the other nodes reach it at, alone).
STORE_BIND = "NVRX_STORE_BIND"
#: The host a Wrapper rank runs on, as its monitor names it to the others (default: SLURM's
#: node name, else the host name): ranks of one host share one heartbeat party without a
#: supervisor (``nvrx.node_agent.host``). Tests give processes of one machine several.
HOST_ID = "NVRX_HOST_ID"
#: Set (not 0) for the listing form of ``inprocess.utils.format_rank_set``, as in NVRx.
LOG_RANK_FORMAT_VERBOSE = "NVRX_LOG_RANK_FORMAT_VERBOSE"

#: torchrun's role name when none is given (``ROLE_NAME``): every rank has the one role.
TORCHRUN_ROLE = "default"

DEFAULT_LOG_DIR = "nvrx_logs"
DEFAULT_MASTER_ADDR = "127.0.0.1"
#: Torch's own rendezvous port when neither an option, MASTER_PORT nor SLURM says otherwise.
DEFAULT_MASTER_PORT = 29500
#: Job id of events written outside any job.
DEFAULT_JOB_ID = "local"
#: The supervisor's store is on ``MASTER_PORT + STORE_PORT_OFFSET`` unless given: past the two
#: ports NVRx's documented layout takes (the application's own store on ``MASTER_PORT + 1``,
#: the in-process Wrapper's on ``MASTER_PORT + 2``), so a script in that layout runs
#: unchanged under a supervisor.
STORE_PORT_OFFSET = 3
#: Each job derived from an id owns ``PORT_STRIDE`` consecutive ports from its
#: ``MASTER_PORT``: room for that layout and the store, and no port of a neighbouring job.
PORT_STRIDE = STORE_PORT_OFFSET + 1
#: Ports derived from a job id lie in [PORT_BASE, PORT_BASE + PORT_STRIDE * PORT_SLOTS): below
#: Linux's default ephemeral range (32768-60999), so outgoing connections never take them.
PORT_BASE = 20000
PORT_SLOTS = 2500


def ports_for_job(job_id: str) -> tuple[int, int]:
    """(master_port, store_port) derived from a job id, so the nodes agree without talking.

    A numeric id (SLURM) maps by its value, any other (``local-...``) by its CRC32;
    two jobs sharing a node differ unless their ids agree modulo ``PORT_SLOTS``.
    """
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    master = PORT_BASE + PORT_STRIDE * (key % PORT_SLOTS)
    return master, store_port_for(master)


def store_port_for(master_port: int) -> int:
    """The supervisor's store port when none is given: ``MASTER_PORT + STORE_PORT_OFFSET``
    (below it when that passes the last port). Every node computes it alike from
    ``MASTER_PORT``; it is never ``MASTER_PORT`` (torch's rendezvous) nor the two ports after
    it, which scripts written for NVRx use for their own stores.
    """
    if master_port + STORE_PORT_OFFSET <= 65535:
        return master_port + STORE_PORT_OFFSET
    return master_port - STORE_PORT_OFFSET


def resolve_ports(job_id: str, master_port: int | None, store_port: int | None) -> tuple[int, int]:
    """Fill in the ports not given: an explicit value wins, the store follows ``MASTER_PORT``,
    and without either both come from the job id. The two never coincide."""
    if master_port is None and store_port is None:
        return ports_for_job(job_id)
    if store_port is None:
        assert master_port is not None
        return master_port, store_port_for(master_port)
    if master_port is None:
        derived, _ = ports_for_job(job_id)
        return (derived if derived != store_port else store_port_for(derived)), store_port
    return master_port, store_port


def host_id(env: Mapping[str, str] | None = None) -> str:
    """This process's host, as the Wrapper's monitors group ranks by it (``HOST_ID``)."""
    env = os.environ if env is None else env
    return env.get(HOST_ID) or env.get("SLURMD_NODENAME") or socket.gethostname()


def job_id_from(env: Mapping[str, str] | None = None) -> str:
    """The job id: ``NVRX_JOB_ID``, else ``SLURM_JOB_ID``, else ``local``."""
    env = os.environ if env is None else env
    return env.get(JOB_ID) or env.get("SLURM_JOB_ID") or DEFAULT_JOB_ID


def slurm_restart_count(env: Mapping[str, str] | None = None) -> int:
    """Which run of its SLURM job this is: ``SLURM_RESTART_COUNT``, which SLURM sets one higher
    on each run after a requeue (0 when unset or empty: a job's first run, or outside SLURM).

    ValueError naming the variable when it is not a non-negative integer: the readers of one
    job must agree on its run (the preemption flag's name, the run a seal is made for, the
    store failover's folder), so none takes a guess; each caller says what a bad one means.
    """
    env = os.environ if env is None else env
    raw = env.get(SLURM_RESTART_COUNT)
    if raw is None or raw == "":
        return 0
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(
            f"{SLURM_RESTART_COUNT}={raw!r} is not a non-negative integer (SLURM's count of "
            "the job's runs before this one)"
        )
    return int(text)


def slurm_run(env: Mapping[str, str] | None = None) -> int | None:
    """Which run of its SLURM job this process is in (``slurm_restart_count``), as the events
    record it: None outside a SLURM job (no ``SLURM_JOB_ID``), or when the count is not a
    non-negative integer: unknown, never a guess."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    try:
        return slurm_restart_count(env)
    except ValueError:
        return None


def log_dir_from(env: Mapping[str, str] | None = None) -> Path:
    """The base log directory: ``NVRX_LOG_DIR``, else ``./nvrx_logs``."""
    env = os.environ if env is None else env
    return Path(env.get(LOG_DIR) or DEFAULT_LOG_DIR)


def job_dir(job_id: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """One job's directory of event files: ``<log dir>/<job id>``."""
    return log_dir_from(env) / (job_id or job_id_from(env))


def sets_omp_default(env: Mapping[str, str], nproc_per_node: int) -> bool:
    """Whether children get ``OMP_NUM_THREADS=1``: as torchrun, when several ranks share a
    node and nobody set it, so that they do not each take every core."""
    return "OMP_NUM_THREADS" not in env and nproc_per_node > 1


def flag_in(env: Mapping[str, str] | None, name: str) -> bool:
    """Whether boolean variable ``name`` is set to ``1``."""
    env = os.environ if env is None else env
    return env.get(name) == "1"


def int_from(env: Mapping[str, str] | None, name: str, default: int) -> int:
    """Integer variable ``name``; ValueError naming it when it is not a number."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def supervisor_local_rank_variable(env: Mapping[str, str] | None = None) -> str:
    """The variable that holds the local rank the supervisor knows this process by:
    ``NVRX_SUPERVISOR_LOCAL_RANK`` where set (``fork_and_monitor``), else ``LOCAL_RANK``."""
    env = os.environ if env is None else env
    return SUPERVISOR_LOCAL_RANK if env.get(SUPERVISOR_LOCAL_RANK) else "LOCAL_RANK"


#: The longest time a variable read by ``seconds_from`` (or a supervisor's duration option)
#: may give: a day, finite and far below what the waits take at once (epoll: about 24.8 days).
MAX_SECONDS = 86400.0


def seconds_from(env: Mapping[str, str] | None, name: str, default: float) -> float:
    """Seconds in variable ``name``, 0 to ``MAX_SECONDS``; ValueError naming it otherwise
    (infinity too: a wait that never ends, or a timeout that ``select`` refuses)."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value != value:  # NaN
        raise ValueError(f"{name}={raw!r} is not a number")
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    if value > MAX_SECONDS:
        raise ValueError(f"{name}={raw!r} must be at most {MAX_SECONDS:g} seconds")
    return value


def count_from(env: Mapping[str, str] | None, name: str, default: int) -> int:
    """A whole number >= 0 in variable ``name``; ValueError naming it otherwise."""
    value = int_from(env, name, default)
    if value < 0:
        raise ValueError(f"{name}={(os.environ if env is None else env).get(name)!r} must not be negative")
    return value


@dataclass(frozen=True)
class JobEnv:
    """One job as one process sees it: its id, log directory, topology and store."""

    job_id: str
    log_dir: str = DEFAULT_LOG_DIR
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    store_port: int = 0

    @classmethod
    def local(
        cls,
        *,
        nnodes: int = 1,
        node_rank: int = 0,
        nproc_per_node: int = 1,
        master_addr: str | None = None,
        master_port: int | None = None,
        store_port: int | None = None,
        job_id: str | None = None,
        log_dir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> JobEnv:
        """A job from explicit values; what is not given comes from ``env`` or the defaults.

        ``MASTER_PORT`` defaults to 29500 and the store's port follows it; the
        job id is ``NVRX_JOB_ID``, else ``SLURM_JOB_ID``, else ``local-<store port>``.
        """
        env = os.environ if env is None else env
        master_port = DEFAULT_MASTER_PORT if master_port is None else master_port
        store_port = store_port_for(master_port) if store_port is None else store_port
        return cls(
            job_id=job_id or env.get(JOB_ID) or env.get("SLURM_JOB_ID") or f"local-{store_port}",
            log_dir=str(log_dir or log_dir_from(env)),
            nnodes=nnodes,
            node_rank=node_rank,
            nproc_per_node=nproc_per_node,
            master_addr=master_addr or DEFAULT_MASTER_ADDR,
            master_port=master_port,
            store_port=store_port,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnv:
        """The job a supervisor described to this process, or one torchrun-style process.

        Reads the contract's variables; ``WORLD_SIZE``/``RANK``/``MASTER_*``
        stand in for them outside a supervisor. ValueError names a malformed one.
        """
        env = os.environ if env is None else env
        master_port = int_from(env, "MASTER_PORT", 0) or None
        store_port = int_from(env, STORE_PORT, 0) or None
        return cls.local(
            nnodes=int_from(env, NNODES, int_from(env, "WORLD_SIZE", 1)),
            node_rank=int_from(env, NODE_RANK, int_from(env, "RANK", 0)),
            nproc_per_node=int_from(env, NPROC_PER_NODE, 1),
            master_addr=env.get(STORE_HOST) or env.get("MASTER_ADDR"),
            master_port=master_port,
            store_port=store_port,
            env=env,
        )

    @property
    def store_host(self) -> str:
        """The store lives with the node-0 supervisor, on the master host."""
        return self.master_addr

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def job_dir(self) -> Path:
        """Where this job's events go: ``<log dir>/<job id>``, absolute (the paths children are
        given under it, a flag or an error file, must hold after a rank changes directory)."""
        return (Path(self.log_dir) / self.job_id).absolute()

    def rank(self, local_rank: int) -> int:
        """Global rank of ``local_rank`` on this node."""
        return self.node_rank * self.nproc_per_node + local_rank

    def child_env(
        self,
        local_rank: int,
        restart_count: int,
        base: Mapping[str, str] | None = None,
        extra: Mapping[str, str] | None = None,
        max_restarts: int | None = None,
    ) -> dict[str, str]:
        """Environment of the child of ``local_rank`` (docs/conventions.md), on top of ``base``:
        torchrun's variables with torchrun's meaning, then nvrx's own."""
        env = dict(os.environ if base is None else base)
        env.update(extra or {})
        env.pop(JOB_SECRET, None)  # the job's secret stays with the supervisors
        env.pop(WARNED_AT, None)  # a warning the supervisor acts on, not one for a child
        env.pop(SUPERVISOR_LOCAL_RANK, None)  # a monitor's, not this supervisor's
        if sets_omp_default(env, self.nproc_per_node):
            env["OMP_NUM_THREADS"] = "1"
        rank = str(self.rank(local_rank))
        env.update(
            {
                "RANK": rank,
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
                "GROUP_RANK": str(self.node_rank),
                "GROUP_WORLD_SIZE": str(self.nnodes),
                "ROLE_NAME": TORCHRUN_ROLE,
                "ROLE_RANK": rank,
                "ROLE_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(0 if max_restarts is None else max_restarts),
                "TORCHELASTIC_RUN_ID": self.job_id,
                "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 hosts torch's own store
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                STORE_HOST: self.store_host,
                STORE_PORT: str(self.store_port),
                JOB_ID: self.job_id,
                LOG_DIR: str(Path(self.log_dir).absolute()),
                NODE_RANK: str(self.node_rank),
                NNODES: str(self.nnodes),
                NPROC_PER_NODE: str(self.nproc_per_node),
                RESTART_COUNT: str(restart_count),
                SUPERVISED: "1",
                FRESH_START: "0",
                TAKEOVER: "0",
            }
        )
        return env
