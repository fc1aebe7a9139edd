"""A store that a rank hosts serves one call of the wrapped function: a rank that does not
host it and calls again waits until the earlier call's store, about to close, is gone.

Without the wait, that rank arrived at the initial barrier of the old store, whose host
then closed it: the rank failed and its peer timed out at the new store's barrier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from nvrx import events
from nvrx.inprocess import Wrapper
from nvrx.inprocess.rank_services import RankServices
from nvrx.store import rounds
from nvrx.store.client import STORE_HOST_ENV, STORE_PORT_ENV
from nvrx.store.service import StoreService


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _connections_to(port: int) -> list[object]:
    return [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]


def _end_call(port: int, initial_rank: int) -> None:
    """What a rank's earlier call left in the store at ``port``: its termination arrival."""
    client = _client(port)
    rounds.arrive_one(client, "termination", 0, initial_rank, 2)


@pytest.mark.timeout(60)
def test_a_store_where_the_rank_ended_a_call_is_told_apart_and_its_close_awaited() -> None:
    with StoreService("127.0.0.1", 0) as svc:
        client = _client(svc.port)
        assert not rounds.ended_here(client, 1)
        _end_call(svc.port, 0)
        assert not rounds.ended_here(client, 1)  # another rank's end says nothing of rank 1's
        _end_call(svc.port, 1)
        assert rounds.ended_here(client, 1)
        assert rounds.await_close(client, 0.5) is False  # still open
        closed: list[bool] = []
        waiter = threading.Thread(target=lambda: closed.append(rounds.await_close(client, 60)))
        waiter.start()
    waiter.join(60)
    assert closed == [True]


@pytest.fixture
def rank1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., RankServices]]:
    """Makes rank 1's services of a 2-rank call whose store rank 0 hosts (none started)."""
    for name in (STORE_HOST_ENV, STORE_PORT_ENV):
        monkeypatch.delenv(name, raising=False)
    made: list[RankServices] = []

    def make(port: int, barrier_timeout: float = 120.0) -> RankServices:
        kwargs = {"host_name": "127.0.0.1", "port": port}
        wrapper = Wrapper(store_kwargs=kwargs, barrier_timeout=barrier_timeout)
        writer = events.EventWriter(tmp_path, "wrapper", {"job": "j", "node": 0, "rank": 1})
        services = RankServices(wrapper, 1, 2, writer)
        made.append(services)
        services._resolve_store()
        assert services.rank_hosted and not services.host_store
        return services

    yield make
    for services in made:
        services.close()  # its progress board, its event file


@pytest.mark.timeout(120)
def test_a_rank_that_calls_again_connects_only_once_the_earlier_calls_store_closed(
    rank1, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = StoreService("127.0.0.1", 0).start()
    port = old.port
    _end_call(port, 1)
    services = rank1(port)
    found_earlier = threading.Event()
    ended_here = rounds.ended_here

    def spy(store: object, initial_rank: int) -> bool:
        ended = ended_here(store, initial_rank)
        if ended:
            found_earlier.set()
        return ended

    monkeypatch.setattr(rounds, "ended_here", spy)
    returned: list[float] = []
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            services._await_earlier_store_closed()
            returned.append(time.monotonic())
        except BaseException as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    new = None
    try:
        waiter.start()
        assert found_earlier.wait(60), "the rank did not look at the earlier call's store"
        assert waiter.is_alive(), (returned, failed)  # it waits while that store is open
        stopping = time.monotonic()
        old.stop()
        new = StoreService("127.0.0.1", port).start()
        waiter.join(60)
        assert not failed and returned and returned[0] > stopping, (returned, failed)
        assert _connections_to(port) == [], "the rank's probe of the stores stayed connected"
    finally:
        old.stop()
        if new is not None:
            new.stop()


@pytest.mark.timeout(120)
def test_an_earlier_calls_store_still_open_after_barrier_timeout_is_a_clear_error(rank1) -> None:
    with StoreService("127.0.0.1", 0) as old:
        _end_call(old.port, 1)
        services = rank1(old.port, barrier_timeout=91.0)
        services.wrapper.seconds.barrier_timeout = 1.0  # past the Wrapper's checks: fail fast
        expected = rf"127.0.0.1:{old.port} still serves this rank's earlier call .* \(1 s\)"
        with pytest.raises(TimeoutError, match=expected):
            services._await_earlier_store_closed()
        assert _connections_to(old.port) == []


@pytest.mark.timeout(60)
def test_a_fresh_store_is_joined_at_once(rank1) -> None:
    with StoreService("127.0.0.1", 0) as svc:
        _end_call(svc.port, 0)  # the host's arrival says nothing of rank 1
        services = rank1(svc.port)
        services._await_earlier_store_closed()
        assert _connections_to(svc.port) == []


def test_a_host_rank_outside_the_job_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (STORE_HOST_ENV, STORE_PORT_ENV):
        monkeypatch.delenv(name, raising=False)
    kwargs = {"host_name": "127.0.0.1", "port": 29999, "tcp_store_host_rank": 2}
    writer = events.EventWriter(tmp_path, "wrapper", {"job": "j", "node": 0, "rank": 1})
    services = RankServices(Wrapper(store_kwargs=kwargs), 1, 2, writer)
    try:
        expected = r"tcp_store_host_rank'\] is 2, but the job's ranks are 0..1 \(WORLD_SIZE\)"
        with pytest.raises(ValueError, match=expected):
            services._resolve_store()
    finally:
        services.close()
