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

The module-level functions are the per-round protocol shared by the main
process and the monitor process.
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

from nvrx.store import barrier as nvrx_barrier
from nvrx.store import faults as nvrx_faults
from nvrx.store import keys, rounds
from nvrx.store.client import STORE_HOST_ENV, STORE_PORT_ENV, external_store_address

from .monitor_thread import DONE

log = logging.getLogger(__name__)

BarrierError = nvrx_barrier.BarrierError
BarrierTimeout = nvrx_barrier.BarrierTimeout
BarrierOverflow = nvrx_barrier.BarrierOverflow

INFINITE = datetime.timedelta.max

ITERATION_BARRIER = "iteration"
COMPLETION_BARRIER = "completion"


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
            record_fault(self, nvrx_faults.FaultRecord(rank=record.rank, kind=kind, message=message))
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
        dist.PrefixStore.__init__(self, keys.round_prefix(iteration).rstrip("/"), store)
        self.base_store = store
        self.iteration = iteration


class FileStore(StoreMixin, dist.FileStore):
    """A torch FileStore with the reference helpers (tests, single host)."""


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


# -- the per-round protocol --------------------------------------------------------


def round_store(base: Any, round_: int) -> PrefixStore:
    """The store view of one restart round."""
    return PrefixStore(round_, base)


def record_fault(store: Any, record: nvrx_faults.FaultRecord) -> bool:
    """Record a fault in the round and interrupt it; False when the round had completed already."""
    nvrx_faults.append_record(store, keys.FAULT_LIST, record)
    return interrupt(store, "fault")


def interrupt(store: Any, value: str) -> bool:
    """Set the round's interrupted key unless set; True when ``value`` (or a fault) holds now."""
    current = store.compare_set(keys.INTERRUPTED, "", value)
    # The key never changes once set, so writing its value again is safe, and a ``set``
    # wakes the monitor threads waiting on it on every server: torch's legacy TCPStore
    # backend (``use_libuv=False``) answers a ``compare_set`` without waking any waiter.
    store.set(keys.INTERRUPTED, current)
    text = current.decode(errors="replace") if isinstance(current, bytes) else str(current)
    return text != DONE or value == DONE


def fault_records(store: Any) -> list[nvrx_faults.FaultRecord]:
    return nvrx_faults.read_records(store, keys.FAULT_LIST)


def register_terminated(store: Any, rank: int) -> bool:
    """Register ``rank`` (its rank in this round) as terminated; idempotent. True if new."""
    if int(store.add(keys.terminated_flag(rank), 1)) != 1:
        return False
    store.append(keys.TERMINATED, f"{rank},")
    return True


def terminated_ranks(store: Any) -> set[int]:
    if not store.check([keys.TERMINATED]):
        return set()
    raw = store.get(keys.TERMINATED).decode()
    return {int(part) for part in raw.split(",") if part.strip()}


def _publish_decision(store: Any, base: Any, world_size: int) -> None:
    """Run by the last arrival at a round's iteration barrier, before anyone is released.

    ``world_size`` is in the decision for a replacement process: a round whose
    ranks all terminated has nobody left to take it back (``rejoin``).
    """
    # The restart is counted when the next round starts (commit_round_start), so
    # a round that every rank leaves (RestartAbort everywhere) counts nothing.
    decision = {
        "terminated": sorted(terminated_ranks(store)),
        "job_restarts": rounds.job_restarts(base) + 1,
        "world_size": world_size,
    }
    round_ = getattr(store, "iteration", None)
    if round_ is not None:
        _clear_stale_keys(base, round_)
        rounds.publish_round(base, round_ + 1)
    store.set(keys.DECISION, json.dumps(decision))


def _clear_stale_keys(base: Any, round_: int) -> None:
    """Delete torch's rendezvous keys (every rank left its groups) and rounds older than the previous one."""
    stale = tuple(keys.round_prefix(r) for r in range(max(0, round_ - 3), max(0, round_ - 1)))
    try:
        for key in base.list_keys():
            if key.startswith(keys.TORCH_DEFAULT_PG_PREFIX) or (stale and key.startswith(stale)):
                base.delete_key(key)
    except Exception as exc:  # a store without list_keys: nothing to collect
        log.debug("could not clear stale keys: %r", exc)


def commit_round_start(store: Any, base: Any, job_restarts: int) -> None:
    """The first rank to start a round after a restart records the new job restart count."""
    if int(store.add(keys.STARTED, 1)) == 1 and rounds.job_restarts(base) < job_restarts:
        rounds.set_job_restarts(base, job_restarts)


def arrive_iteration(store: Any, base: Any, rank: int, world_size: int) -> None:
    """Register ``rank`` at the round's iteration barrier (itself or by proxy)."""
    nvrx_barrier.arrive(
        store,
        ITERATION_BARRIER,
        rank,
        world_size,
        reentrant=True,
        before_release=lambda: _publish_decision(store, base, world_size),
    )


def wait_iteration(store: Any, world_size: int, timeout: float) -> dict[str, Any]:
    """Wait for the iteration barrier; returns the decision every rank reads alike."""
    nvrx_barrier.wait(store, ITERATION_BARRIER, world_size, timeout, range(world_size))
    return json.loads(store.get(keys.DECISION))


def proxy_leave(
    store: Any, base: Any, rank: int, world_size: int, record: nvrx_faults.FaultRecord | None
) -> None:
    """Everything peers need when ``rank`` leaves the round for good (it died or was killed)."""
    if record is not None:
        nvrx_faults.append_record(store, keys.FAULT_LIST, record)
    register_terminated(store, rank)
    interrupt(store, "fault")
    arrive_iteration(store, base, rank, world_size)
