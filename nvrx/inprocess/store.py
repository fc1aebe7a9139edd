"""The Wrapper's store: reference-compatible classes and the round protocol.

``StoreMixin`` puts the reference's helper methods (barriers, terminated
ranks, interruption records, Tree state exchange) on a torch store. It is the
*first* base class, so its ``barrier`` is never shadowed by torch's native
``Store.barrier`` (reference bug 4). The barriers are nvrx.store barriers:
O(1) requests per rank, waits answered by the server.

``TCPStore`` is always a client. Hosting is the Wrapper's job: it starts an
``nvrx.store.service`` process (or uses ``NVRX_STORE_HOST``/``NVRX_STORE_PORT``),
so a fault in training code never takes the store down. The port defaults to
``NVRX_STORE_PORT``, else ``MASTER_PORT + 1``: never ``MASTER_PORT`` itself,
which torch's own rendezvous uses. Under a supervisor (``NVRX_STORE_HOST``/
``NVRX_STORE_PORT`` set) the Wrapper uses the supervisor's store whatever
``store_kwargs`` name (``wrapper_address``): a script written for NVRx passes its
own port there, which no nvrx store listens on.

The per-round protocol that the main process and the monitor process share is
``nvrx.store.rounds``; its functions keep their names here too.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from nvrx.events import failures
from nvrx.store import barrier as nvrx_barrier
from nvrx.store import rounds as nvrx_rounds
from nvrx.store.client import STORE_HOST_ENV, STORE_PORT_ENV, external_store_address
from nvrx.store.rounds import (  # noqa: F401 - functions of the protocol, re-exported here
    commit_round_start,
    fault_records,
    interrupt,
    proxy_leave,
    record_fault,
    register_terminated,
    terminated_ranks,
)

log = logging.getLogger(__name__)

BarrierError = nvrx_barrier.BarrierError
BarrierTimeout = nvrx_barrier.BarrierTimeout
BarrierOverflow = nvrx_barrier.BarrierOverflow


def _seconds(timeout: datetime.timedelta | float | None) -> float:
    if timeout is None:
        return 300.0
    if isinstance(timeout, datetime.timedelta):
        if timeout >= datetime.timedelta(days=365):
            return 365 * 86400.0
        return timeout.total_seconds()
    return float(timeout)


def _chunk_seconds(chunk: datetime.timedelta | float | None) -> float | None:
    return None if chunk is None else _seconds(chunk)


class StoreMixin:
    """Reference helper methods on top of any torch ``Store`` API.

    The barriers take the reference's ``timeout_chunk``: the wait is split
    into waits of at most that long, so that the calling thread's Python
    signal handlers (``KeyboardInterrupt``, the Wrapper's restart) run between
    them; None (the default) waits in one piece, answered by the server.
    """

    def barrier(
        self,
        ranks: Iterable[int],
        group_name: str,
        rendezvous_count: int,
        timeout: datetime.timedelta | float,
        timeout_chunk: datetime.timedelta | float | None = None,
    ) -> None:
        """Counting barrier: each of ``ranks`` arrives once; waits for ``rendezvous_count`` arrivals."""
        name = f"nvrx_barrier/{group_name}"
        for rank in set(ranks):
            nvrx_barrier.arrive(self, name, rank, rendezvous_count)
        nvrx_barrier.wait(
            self, name, rendezvous_count, _seconds(timeout), chunk=_chunk_seconds(timeout_chunk)
        )

    def reentrant_barrier(
        self,
        ranks: Iterable[int],
        group_name: str,
        rendezvous_count: int,
        timeout: datetime.timedelta | float,
        timeout_chunk: datetime.timedelta | float | None = None,
    ) -> None:
        """Barrier where a rank may arrive more than once (by itself and by proxy)."""
        name = f"nvrx_reentrant_barrier/{group_name}"
        for rank in set(ranks):
            nvrx_barrier.arrive(self, name, rank, rendezvous_count, reentrant=True)
        nvrx_barrier.wait(
            self, name, rendezvous_count, _seconds(timeout), chunk=_chunk_seconds(timeout_chunk)
        )

    def is_rank_at_reentrant_barrier(self, rank: int, group_name: str) -> bool:
        return nvrx_barrier.has_arrived(self, f"nvrx_reentrant_barrier/{group_name}", rank)

    def initial_barrier(self, ranks, rendezvous_count, timeout, timeout_chunk=None) -> None:  # noqa: ANN001
        self.barrier(ranks, "initial", rendezvous_count, timeout, timeout_chunk)

    def completion_barrier(self, ranks, rendezvous_count, timeout, timeout_chunk=None) -> None:  # noqa: ANN001
        self.barrier(ranks, "completion", rendezvous_count, timeout, timeout_chunk)

    def iteration_barrier(self, ranks, rendezvous_count, timeout, timeout_chunk=None) -> None:  # noqa: ANN001
        self.reentrant_barrier(ranks, "iteration", rendezvous_count, timeout, timeout_chunk)

    def termination_barrier(self, ranks, rendezvous_count, timeout, timeout_chunk=None) -> None:  # noqa: ANN001
        self.reentrant_barrier(ranks, "termination", rendezvous_count, timeout, timeout_chunk)

    # terminated ranks ------------------------------------------------------------
    def record_terminated_ranks(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            register_terminated(self, int(rank))

    def get_terminated_ranks(self) -> set[int]:
        return terminated_ranks(self)

    def record_interrupted(self, records: Iterable[Any]) -> None:
        """Interrupt the round for every rank: ``records`` (``attribution.InterruptionRecord``s,
        or one) become fault records of the round, then its interruption flag is set."""
        from .attribution import TO_FAULT_KIND, InterruptionRecord

        if isinstance(records, InterruptionRecord):
            records = [records]
        for record in records:
            kind = TO_FAULT_KIND[record.interruption]
            message = f"{record.interruption.name} recorded through record_interrupted"
            record_fault(self, failures.FaultRecord(rank=record.rank, kind=kind, message=message))
        interrupt(self, "fault")

    # Tree state exchange (JSON, one key per rank) --------------------------------
    def send_state(self, state: Any, rank: int) -> None:
        self.set(f"state_{rank}", json.dumps(state, default=str))

    def get_states(self, ranks: Iterable[int]) -> list[Any]:
        ranks = list(ranks)
        if not ranks:
            return []
        return [json.loads(v) for v in self.multi_get([f"state_{r}" for r in ranks])]

    def send_key(self, key: Any, rank: int) -> None:
        self.set(f"key_{rank}", json.dumps(key, default=str))

    def get_keys(self, ranks: Iterable[int]) -> list[Any]:
        ranks = list(ranks)
        if not ranks:
            return []
        return [json.loads(v) for v in self.multi_get([f"key_{r}" for r in ranks])]


class TCPStore(StoreMixin, dist.TCPStore):
    """Client of the Wrapper's TCPStore (reference name and keyword arguments).

    ``tcp_store_host_rank``: rank whose process starts the store service when no
    external store is configured; -1 means the store is external (never hosted
    by a rank). ``port`` None: ``NVRX_STORE_PORT``, else ``MASTER_PORT + 1``.
    """

    TCP_STORE_HOST_RANK = 0

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        use_libuv: bool = True,
        tcp_store_host_rank: int = TCP_STORE_HOST_RANK,
    ) -> None:
        host, port = resolve_address(host_name, port)
        self.tcp_store_host_rank = tcp_store_host_rank
        dist.TCPStore.__init__(
            self,
            host,
            port,
            world_size=None,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
            use_libuv=use_libuv,
        )


class PrefixStore(StoreMixin, dist.PrefixStore):
    """A view of ``store`` with every key under the prefix of restart round ``iteration``."""

    def __init__(self, iteration: int, store: Any) -> None:
        dist.PrefixStore.__init__(self, nvrx_rounds.RoundView(iteration, store).prefix, store)
        self.base_store = store
        self.iteration = iteration


class FileStore(StoreMixin, dist.FileStore):
    """A torch FileStore with the reference helpers (tests, single host)."""


def round_store(base: Any, round_: int) -> PrefixStore:
    """The view of one restart round with the reference's helper methods, as the ranks'
    code sees it (a rank assignment's ``RankAssignmentCtx.store``); nvrx's own protocol
    needs only ``rounds.round_store``."""
    return PrefixStore(round_, base)


def wrapper_address(kwargs: dict[str, Any]) -> tuple[str, int]:
    """Where the Wrapper's ``TCPStore`` is; pops ``host_name``/``port`` from ``kwargs``.

    Under a supervisor its store wins over the ones ``kwargs`` name: a script in NVRx's
    layout gives the Wrapper a port of its own, where nothing of nvrx listens.
    """
    host, port = kwargs.pop("host_name", None), kwargs.pop("port", None)
    external = external_store_address()
    if external is not None and (host, port) != (None, None):
        _say_ignored(host, port, external)
        host = port = None
    return resolve_address(host, port)


@functools.cache
def _say_ignored(host: str | None, port: int | None, external: tuple[str, int]) -> None:
    log.info(
        "store_kwargs name host_name=%s port=%s, ignored: the Wrapper uses the nvrx "
        "supervisor's store at %s:%d (%s/%s), which every rank of the job shares",
        host, port, *external, STORE_HOST_ENV, STORE_PORT_ENV,
    )  # fmt: skip


def resolve_address(host: str | None = None, port: int | None = None) -> tuple[str, int]:
    """Where the Wrapper's store is: explicit values, else the env contract, else MASTER_ADDR/MASTER_PORT+1."""
    external = external_store_address()
    if host is None:
        host = external[0] if external else os.environ.get("MASTER_ADDR")
    if port is None:
        port = external[1] if external else _standalone_port()
    if host is None:
        raise ValueError(
            f"store host unknown: pass store_kwargs={{'host_name': ...}}, or set {STORE_HOST_ENV} or MASTER_ADDR"
        )
    if not 0 < int(port) < 65536:
        raise ValueError(f"store port must be in 1..65535, got {port}")
    return host, int(port)


def _standalone_port() -> int:
    """``MASTER_PORT + 1`` (below it at the last port): the store a Wrapper without a
    supervisor starts, never on torch's rendezvous port."""
    master_port = os.environ.get("MASTER_PORT")
    if master_port is None:
        raise ValueError(
            f"store port unknown: pass store_kwargs={{'port': ...}}, or set {STORE_PORT_ENV} "
            "or MASTER_PORT (the store then uses MASTER_PORT + 1)"
        )
    try:
        port = int(master_port)
    except ValueError:
        raise ValueError(f"MASTER_PORT must be an integer, got {master_port!r}") from None
    return port + 1 if port < 65535 else port - 1


