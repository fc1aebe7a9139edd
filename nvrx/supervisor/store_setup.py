"""Bringing up the job's store: node 0 starts the store service, the other nodes wait for it."""

from __future__ import annotations

import os
import time

from nvrx import jobenv
from nvrx.signal_pipe import STOP_SIGNALS, SignalPipe
from nvrx.store import rounds
from nvrx.store.service import (
    SnapshotSpec,
    StorePortInUse,
    StoreService,
    StoreUnavailable,
    store_port_is_free,
    wait_for_store,
)

from . import node_keys, store_failover
from .config import KEY_PREFIX, SupervisorConfig
from .exit_codes import ExitCode, SupervisorError


def snapshot_spec(
    cfg: SupervisorConfig, epoch: int = 0, slot: int = 0, replaces: int = 0
) -> SnapshotSpec:
    """What the store of failover ``epoch`` on ``slot`` keeps a copy of for a successor: the
    supervisors' keys (not the heartbeats or the step times of straggler scores), the
    Wrapper's job-level counters and the ranks marked gone (``store_failover``); past
    epoch 0, restored from the copy the store it replaces (the one ``replaces`` hosted) kept."""
    job_dir = cfg.events_dir
    return SnapshotSpec(
        store_failover.snapshot_path(job_dir, epoch, slot),
        prefixes=(KEY_PREFIX, *rounds.FAILOVER_KEYS),
        exclude=(node_keys.PREFIX + "alive/", node_keys.PREFIX + "steps/"),
        restore_from=store_failover.snapshot_path(job_dir, epoch - 1, replaces) if epoch > 0 else None,
    )


def check_store_port(cfg: SupervisorConfig) -> None:
    """Node 0: fail at once (exit 2) when the store's port is taken where it will listen, or
    its host is an address of no interface here, before anything starts."""
    if cfg.node_rank != 0:
        return
    host, port = cfg.store_host, cfg.store_port
    try:
        free = store_port_is_free(host, port)
    except OSError as exc:
        raise SupervisorError(ExitCode.USAGE, _cannot_listen(host, port, exc)) from None
    if not free:
        raise SupervisorError(ExitCode.USAGE, str(StorePortInUse(host, port)))


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    """Why node 0's store cannot listen where it would, naming the setting that chose the
    address: ``$NVRX_STORE_BIND`` where it is set (it wins over the host), else the host."""
    why = exc.strerror or exc
    bind = os.environ.get(jobenv.STORE_BIND)
    if bind:
        return (
            f"node 0's store cannot listen at {jobenv.STORE_BIND}={bind!r} (port {port}) on this "
            f"machine ({why}): set {jobenv.STORE_BIND} to an address of node 0, or to all to "
            "listen on every interface"
        )
    return (
        f"node 0's store cannot listen at {host}:{port} on this machine ({why}): {host} "
        "(--master-addr, else the first node of the SLURM job) must be an address of node 0, "
        f"or set {jobenv.STORE_BIND}=all to listen on every interface"
    )


def launch_store(cfg: SupervisorConfig) -> StoreService | None:
    """Node 0: its store service, started; other nodes: None. ``await_store`` then waits
    until the store answers, so that every node's children start while node 0's store
    imports torch (they retry connecting meanwhile).

    Raises ``SupervisorError`` (exit 2 for a port in use, 3 for a store that never
    came) naming host and port.
    """
    if cfg.node_rank != 0:
        return None
    try:
        if cfg.nnodes > 1:
            store_failover.reset(cfg.events_dir)
        service = StoreService(
            cfg.store_host,
            cfg.store_port,
            job_id=cfg.job_id,
            log_dir=cfg.log_dir,
            node=0,
            snapshot=snapshot_spec(cfg) if cfg.nnodes > 1 else None,
        ).launch()
        if not cfg.store_port:  # the children need the port it picks
            await_store(cfg, service)
        return service
    except StorePortInUse as exc:
        raise SupervisorError(ExitCode.USAGE, str(exc)) from exc
    except StoreUnavailable as exc:
        raise SupervisorError(ExitCode.STORE_UNAVAILABLE, str(exc)) from exc


def await_store(
    cfg: SupervisorConfig,
    service: StoreService | None,
    interrupt_fd: int | None = None,
    since: float | None = None,
) -> bool:
    """Until the job's store answers: node 0's own ``service``, or, on another node, node 0's
    (node 0 may come up much later than this one; a log line every 5 s says so). False when
    ``interrupt_fd`` (the supervisor's signals) became readable first, on another node.

    Raises ``SupervisorError`` (exit 3) after ``--store-timeout``, naming host and port.
    """
    if service is None:
        if cfg.node_rank == 0:
            return True
        try:
            return wait_for_store(
                cfg.store_host, cfg.store_port, cfg.store_timeout, True, interrupt_fd, since
            )
        except StoreUnavailable as exc:
            raise SupervisorError(ExitCode.STORE_UNAVAILABLE, str(exc)) from exc
    if not service.starting:
        return True
    try:
        service.wait_started(cfg.store_timeout)
    except StorePortInUse as exc:
        raise SupervisorError(ExitCode.USAGE, str(exc)) from exc
    except RuntimeError as exc:
        raise SupervisorError(ExitCode.STORE_UNAVAILABLE, str(exc)) from exc
    return True


def await_store_or_stop(
    cfg: SupervisorConfig, service: StoreService | None, signals: SignalPipe
) -> tuple[int | None, list[int]]:
    """``await_store`` while this node's children may already run: (the first stop signal
    received while a node other than 0 still waited, else None; the signals received
    meanwhile, for the caller to handle once connected: a stop among them too, once the
    store answered, so that it reaches the other nodes)."""
    later: list[int] = []
    since = time.monotonic()
    while True:
        answered = await_store(cfg, service, signals.fileno(), since)
        for signum in signals.read():  # node 0 waits for its own store without looking
            if signum in STOP_SIGNALS and not answered:
                return signum, later
            later.append(signum)
        if answered:
            return None, later
