"""Bringing up the job's store: node 0 starts the store service, the other nodes wait for it."""

from __future__ import annotations

from nvrx.store.service import StorePortInUse, StoreService, StoreUnavailable, wait_for_store

from .config import SupervisorConfig
from .exit_codes import ExitCode, SupervisorError


def bring_up_store(cfg: SupervisorConfig) -> StoreService | None:
    """Node 0: the started store service; other nodes: None once the store answers.

    Raises ``SupervisorError`` (exit 2 for a port in use, 3 for a store that
    never came) naming host and port.
    """
    if cfg.node_rank != 0:
        try:
            wait_for_store(cfg.store_host, cfg.store_port, cfg.store_timeout)
        except StoreUnavailable as exc:
            raise SupervisorError(ExitCode.STORE_UNAVAILABLE, str(exc)) from exc
        return None
    service = StoreService(
        cfg.store_host, cfg.store_port, job_id=cfg.job_id, log_dir=cfg.log_dir, node=0
    )
    try:
        return service.start(cfg.store_timeout)
    except StorePortInUse as exc:
        raise SupervisorError(ExitCode.USAGE, str(exc)) from exc
    except RuntimeError as exc:
        raise SupervisorError(ExitCode.STORE_UNAVAILABLE, str(exc)) from exc
