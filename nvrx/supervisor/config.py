"""Configuration of one supervisor: topology of the job, restart policy, timeouts.

The job's place is the job-environment contract's ``nvrx.jobenv.JobEnv``, the
one type for a job's topology, which the config holds as ``job``. It comes from
SLURM (one supervisor per node, ``job_from_slurm``) or, for development and
tests, from explicit ``--nnodes/--node-rank/...`` options so that N local
supervisors form one job on a single machine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nvrx import jobenv
from nvrx.fault_tolerance.config import FaultToleranceConfig
from nvrx.jobenv import DEFAULT_JOB_ID, JobEnv
from nvrx.slurm import topology
from nvrx.straggler import StragglerRule

from .rank_logs import RankLogs

DEFAULT_MAX_RESTARTS = 10
DEFAULT_LOOP_BREAKER = 3
DEFAULT_GRACE_PERIOD_S = 5.0
DEFAULT_STORE_TIMEOUT_S = 60.0
DEFAULT_FINISH_TIMEOUT_S = 300.0
DEFAULT_NODE_HEARTBEAT_S = 1.0
DEFAULT_NODE_TIMEOUT_S = 5.0
#: How long a node waits for children that tell nothing before it starts its restart standby.
DEFAULT_STANDBY_WAIT_S = 5.0
#: The longest a duration option may give (a day): finite, and far below what the
#: supervisor's waits take at once (epoll: about 24.8 days; timedelta, time_t).
MAX_SECONDS = jobenv.MAX_SECONDS

KEY_PREFIX = "nvrx_supervisor/"
#: ``--ft-restart-policy`` values (``job_restart``).
RESTART_POLICIES = ("auto", "any-failed", "min-healthy")
#: Every key below is sealed with the job's secret (``nvrx.store.sealed_keys``).
#: Sealed chain of stop requests (``stop_flag``).
STOP_KEY = KEY_PREFIX + "stop"
#: Sealed count: restarts spent from the job-wide budget.
RESTARTS_KEY = KEY_PREFIX + "restarts"
#: Sealed count: training nodes whose children all ended.
NODES_DONE_KEY = KEY_PREFIX + "nodes_done"
#: Sealed chain set when every training node is done: waiting spares leave.
ALL_DONE_KEY = KEY_PREFIX + "all_done"
#: Sealed count: slots that ended (left, or were declared lost).
ENDED_KEY = KEY_PREFIX + "ended"
#: Sealed chain set when every slot but the store host's has ended: it may take the store down.
ALL_ENDED_KEY = KEY_PREFIX + "all_ended"


#: What the store's host does about a node named a straggler: name it, or also have it leave
#: the job when a spare is free to take its place (``step_times``).
STRAGGLER_ACTIONS = ("report", "exclude")


@dataclass(frozen=True)
class StopRequest:
    """What a node that stops the job writes under ``STOP_KEY`` for the others."""

    reason: str
    exit_code: int
    node: int | None

    def encode(self) -> str:
        return json.dumps({"reason": self.reason, "exit_code": self.exit_code, "node": self.node})

    @property
    def told(self) -> str:
        """The reason as the other nodes give it for their own stop."""
        return f"node {self.node} stopped the job: {self.reason}"

    @classmethod
    def decode(cls, value: str | None, default_exit: int) -> StopRequest:
        """Read a request; fields that are missing or unreadable take neutral values."""
        try:
            data = json.loads(value or "{}")
        except ValueError:
            data = {}
        data = data if isinstance(data, dict) else {}
        try:
            code = int(data.get("exit_code", default_exit))
        except (TypeError, ValueError):
            code = default_exit
        node = data.get("node")
        return cls(
            str(data.get("reason") or "no reason given"),
            code,
            node if isinstance(node, int) else None,
        )


class ConfigError(ValueError):
    """A bad option or environment value; the message names what to fix."""


def seconds_check(option: str, value: float, above_zero: bool = False) -> tuple[bool, str]:
    """(holds, what to fix) for the duration ``option``: seconds >= 0 (> 0 with
    ``above_zero``) up to ``MAX_SECONDS``; infinity and NaN fail."""
    if above_zero:
        return 0 < value <= MAX_SECONDS, (
            f"{option} must be > 0 and at most {MAX_SECONDS:g} seconds, got {value:g}"
        )
    return 0 <= value <= MAX_SECONDS, f"{option} must be in 0..{MAX_SECONDS:g} seconds, got {value:g}"


def _folder_name(name: str) -> bool:
    """Whether ``name`` is one new folder's name, not a hidden one: not '.' nor '..' (the
    log folder itself or the one around it), no '/' (a folder further down), no NUL."""
    return bool(name) and not name.startswith(".") and "/" not in name and "\0" not in name


def local_job(**values: Any) -> JobEnv:
    """A config's job unless given: one local node of one rank on torch's default ports, job
    id ``local``, whatever the environment; the ``JobEnv`` fields in ``values`` replace those
    (the store's port follows a master port given without it, as in ``JobEnv.local``)."""
    return JobEnv.local(**{"job_id": DEFAULT_JOB_ID, **values}, env={})


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything one supervisor needs; validated on construction.

    ``job`` is the job's topology with all slots, spares included; ``job_env_for``
    gives the one the training children see.
    """

    command: list[str]
    job: JobEnv = field(default_factory=local_job)
    max_restarts: int = DEFAULT_MAX_RESTARTS
    loop_breaker: int = DEFAULT_LOOP_BREAKER
    grace_period: float = DEFAULT_GRACE_PERIOD_S
    store_timeout: float = DEFAULT_STORE_TIMEOUT_S
    finish_timeout: float = DEFAULT_FINISH_TIMEOUT_S
    spare_nodes: int = 0
    min_nodes: int | None = None
    node_heartbeat: float = DEFAULT_NODE_HEARTBEAT_S
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S
    node_liveness: bool = True  # off where a "node" is one rank (fork_and_monitor)
    warm_standby: bool = True  # start children ahead where foreseeable (``standby``)
    standby_wait: float = DEFAULT_STANDBY_WAIT_S  # children that tell nothing (``restart_standby``)
    extra_env: dict[str, str] = field(default_factory=dict)
    rank_logs: RankLogs = field(default_factory=RankLogs)  # --redirects, --tee, ...
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)  # --ft-*
    ft_restart_policy: str = "auto"  # auto | any-failed | min-healthy (``job_restart``)
    non_retryable_patterns: list[str] = field(default_factory=list)  # ``non_retryable``
    straggler_action: str = "report"  # report | exclude (``step_times``)
    straggler_section: str | None = None  # a section whose durations are step times
    straggler_threshold: float = StragglerRule.threshold
    #: Settings taken from the job's variables, not options (``spare_nodes``: its variable's
    #: name): an error about one names the variable the user set.
    from_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError(
                "no training command: put it after '--', e.g. nvrx-supervise -- python train.py"
            )
        for ok, message in [
            *self._topology_checks(),
            *self._restart_checks(),
            *self._node_checks(),
        ]:
            if not ok:
                raise ConfigError(message)

    def _topology_checks(self) -> list[tuple[bool, str]]:
        """(holds, what to fix) for the topology: sizes, ranks, ports, address, job id."""
        return [
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
            (bool(self.master_addr), "--master-addr must not be empty"),
            (
                _folder_name(self.job_id),
                "--job-id must name a folder of its own in --log-dir: not empty, not starting "
                f"with '.' (as '.' and '..' do), without '/' or NUL; got {self.job_id!r}",
            ),
        ]

    def _restart_checks(self) -> list[tuple[bool, str]]:
        """(holds, what to fix) for restarts and the time limits of stops and waits."""
        named = self.setting  # fork_and_monitor takes these as keywords, not flags
        return [
            (self.max_restarts >= 0, f"{named('max_restarts')} must be >= 0, got {self.max_restarts}"),
            (
                self.ft_restart_policy in RESTART_POLICIES,
                f"--ft-restart-policy must be auto, any-failed or min-healthy, got {self.ft_restart_policy!r}",
            ),
            (
                self.loop_breaker >= 0,
                f"{named('loop_breaker')} must be >= 0 (0 disables it), got {self.loop_breaker}",
            ),
            seconds_check(named("grace_period"), self.grace_period),
            seconds_check(named("store_timeout"), self.store_timeout, above_zero=True),
            seconds_check(named("finish_timeout"), self.finish_timeout, above_zero=True),
        ]

    def _node_checks(self) -> list[tuple[bool, str]]:
        """(holds, what to fix) for spare nodes, shrinking and node liveness."""
        return [
            (
                0 <= self.spare_nodes < self.nnodes,
                f"{self.setting('spare_nodes')} must be in 0..{self.nnodes - 1} (smaller than --nnodes "
                f"{self.nnodes}: at least one node trains), got {self.spare_nodes}",
            ),
            (
                self.min_nodes is None or 1 <= self.min_nodes <= self.active_nodes,
                f"{self.setting('min_nodes')} must be in 1..{self.active_nodes} (the active nodes: --nnodes "
                f"{self.nnodes} minus --spare-nodes {self.spare_nodes}), got {self.min_nodes}",
            ),
            seconds_check("--node-heartbeat", self.node_heartbeat, above_zero=True),
            seconds_check("--node-timeout", self.node_timeout, above_zero=True),
            (
                self.node_timeout >= 2 * self.node_heartbeat,
                f"--node-timeout must be at least twice --node-heartbeat "
                f"({self.node_heartbeat:g} s), so that one late beat is no loss; "
                f"got {self.node_timeout:g}",
            ),
            seconds_check("--standby-wait", self.standby_wait),
            (
                self.straggler_action in STRAGGLER_ACTIONS,
                f"--straggler-action must be one of {', '.join(STRAGGLER_ACTIONS)}, "
                f"got {self.straggler_action!r}",
            ),
            (
                0 < self.straggler_threshold < 1,
                f"--straggler-threshold must be in (0, 1), got {self.straggler_threshold:g}",
            ),
        ]

    @property
    def straggler_rule(self) -> StragglerRule:
        """When a rank or node counts as a straggler (``--straggler-threshold``)."""
        clear_at = min(1.0, max(self.straggler_threshold, StragglerRule.clear_at))
        return StragglerRule(threshold=self.straggler_threshold, clear_at=clear_at)

    # The topology's values, read through the config; ``job`` holds them.
    @property
    def nproc_per_node(self) -> int:
        return self.job.nproc_per_node

    @property
    def nnodes(self) -> int:
        return self.job.nnodes

    @property
    def node_rank(self) -> int:
        return self.job.node_rank

    @property
    def master_addr(self) -> str:
        return self.job.master_addr

    @property
    def master_port(self) -> int:
        return self.job.master_port

    @property
    def store_port(self) -> int:
        return self.job.store_port

    @property
    def store_host(self) -> str:
        return self.job.store_host

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def log_dir(self) -> str:
        return self.job.log_dir

    @property
    def active_nodes(self) -> int:
        """Nodes that train from the start; the other ``spare_nodes`` slots wait as spares."""
        return self.nnodes - self.spare_nodes

    def setting(self, name: str) -> str:
        """How the user changes the setting of field ``name`` (``finish_timeout``, say): the
        ``nvrx-supervise`` flag (``--finish-timeout``), or, where a node is one rank (no node
        liveness: ``nvrx.fork_and_monitor``, which has no flags), that function's keyword; the
        job's variable (``$NVRX_SPARE_NODES``) where the value came from one."""
        if name in self.from_env:
            return f"${self.from_env[name]}"
        if self.node_liveness:
            return "--" + name.replace("_", "-")
        return f"fork_and_monitor's {name}"

    @property
    def least_nodes(self) -> int:
        """Fewest training nodes the job goes on with after losing nodes no spare replaced."""
        return self.active_nodes if self.min_nodes is None else self.min_nodes

    @property
    def starts_as_spare(self) -> bool:
        return self.node_rank >= self.active_nodes

    @property
    def world_size(self) -> int:
        return self.active_nodes * self.nproc_per_node

    @property
    def job_env(self) -> JobEnv:
        """This supervisor's job as the job-environment contract (its slot as node rank)."""
        return self.job_env_for(self.node_rank)

    def job_env_for(self, node_rank: int) -> JobEnv:
        """The job as the children of training node ``node_rank`` see it (spares not counted)."""
        return replace(self.job, nnodes=self.active_nodes, node_rank=node_rank)

    @property
    def events_dir(self) -> Path:
        """Where this job's events go: ``<log_dir>/<job_id>``."""
        return self.job_env.job_dir

    def rank(self, local_rank: int, node_rank: int | None = None) -> int:
        """Global rank of ``local_rank`` on training node ``node_rank`` (default: this slot's)."""
        return self.job_env_for(self.node_rank if node_rank is None else node_rank).rank(local_rank)

    def start_fields(self) -> dict[str, Any]:
        """What the ``supervisor_start`` event says of this configuration."""
        return {
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "command": self.command,
            "store": f"{self.store_host}:{self.store_port}",
            "spare_nodes": self.spare_nodes,
            "spare": self.starts_as_spare,
            "max_restarts": self.max_restarts,
            "loop_breaker": self.loop_breaker,
            "fault_tolerance": json.loads(self.ft.to_json()),
            "restart_policy": self.ft_restart_policy,
            "stragglers": {
                "action": self.straggler_action,
                "section": self.straggler_section,
                "threshold": self.straggler_threshold,
            },
        }

    def child_env(
        self,
        local_rank: int,
        restart_count: int,
        base: Mapping[str, str] | None = None,
        node_rank: int | None = None,
    ) -> dict[str, str]:
        """Environment of the child of ``local_rank`` (docs/conventions.md), on top of ``base``."""
        job = self.job_env_for(self.node_rank if node_rank is None else node_rank)
        return job.child_env(local_rank, restart_count, base, self.extra_env, self.max_restarts)


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether SLURM placed this process: a task of a job step (srun), or the batch shell of a
    job, which has ``SLURM_PROCID`` too but no ``SLURM_STEP_ID`` (``not_in_a_batch_shell``)."""
    return "SLURM_JOB_ID" in env and "SLURM_PROCID" in env


#: SLURM's variables a process started in a batch shell names when it refuses to start.
_BATCH_SHELL_VARS = ("SLURM_PROCID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS")


def not_in_a_batch_shell(env: Mapping[str, str], count: int, of_what: str, fix: str) -> None:
    """ConfigError when SLURM's variables in ``env`` are a batch shell's (no ``SLURM_STEP_ID``:
    srun did not start this process) in a job of ``count`` > 1 ``of_what`` (nodes, tasks):
    ``in_slurm_step`` holds there too, and the process would take itself for the first of them,
    wait for the others, which never start, and fail long after for a reason far from the
    mistake. ``fix`` says how to start one per node or task. With a count of 1 the batch
    shell is the only one, and starts."""
    if env.get("SLURM_STEP_ID") or count == 1:
        return
    seen = ", ".join(f"{name}={env[name]}" for name in _BATCH_SHELL_VARS if name in env)
    raise ConfigError(
        f"started in the batch script of a job of {count} {of_what}, not by srun ({seen}, no "
        f"SLURM_STEP_ID): {fix}"
    )


def job_from_slurm(
    env: Mapping[str, str],
    nproc_per_node: int,
    log_dir: str | None = None,
    master_port: int | None = None,
    store_port: int | None = None,
) -> JobEnv:
    """The job's place from SLURM's variables (``nvrx.slurm.topology``); ConfigError names a bad one.

    Ports given here win over ``MASTER_PORT``/``NVRX_STORE_PORT`` of ``env``, and
    a port not given follows the contract's rule with the other one; an
    ``NVRX_JOB_ID`` of ``env`` wins over SLURM's job id.
    """
    env = dict(env)
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    if store_port is not None:
        env[jobenv.STORE_PORT] = str(store_port)
    try:
        return topology.job_from_slurm(env, nproc_per_node, log_dir)
    except ValueError as exc:
        raise ConfigError(f"cannot read the SLURM topology: {exc}") from exc
