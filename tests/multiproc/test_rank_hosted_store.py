"""A store that a rank hosts lives for one call of the wrapped function: a rank that does
not host it and calls again waits until the earlier call's store, about to close, is gone.

Without the wait, that rank arrived at the initial barrier of the old store, whose host
then closed it: the rank failed and its peer timed out at the new store's barrier.
"""

from __future__ import annotations

import threading
import time
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
from tests.support.waiting import wait_until


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _connections_to(port: int) -> list[object]:
    return [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]


@pytest.mark.timeout(60)
def test_a_fresh_store_is_this_calls_and_an_open_earlier_one_times_out() -> None:
    with StoreService("127.0.0.1", 0) as svc:
        client = _client(svc.port)
        assert rounds.await_earlier_call_closed(client, 5.0) is False
        rounds.publish_round(client, 0)
        with pytest.raises(TimeoutError, match=r"earlier call's rounds \(round 0\) 0.5 s later"):
            rounds.await_earlier_call_closed(client, 0.5)


@pytest.mark.timeout(120)
def test_a_rank_that_calls_again_connects_only_once_the_earlier_calls_store_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (STORE_HOST_ENV, STORE_PORT_ENV):
        monkeypatch.delenv(name, raising=False)
    old = StoreService("127.0.0.1", 0).start()
    port = old.port
    client = _client(port)
    rounds.publish_round(client, 0)  # the earlier call ran a round in it
    del client
    wrapper = Wrapper(store_kwargs={"host_name": "127.0.0.1", "port": port}, barrier_timeout=120)
    writer = events.EventWriter(tmp_path, "wrapper", {"job": "j", "node": 0, "rank": 1})
    services = RankServices(wrapper, 1, 2, writer)  # rank 1: rank 0 hosts the store
    services._resolve_store()
    assert services.rank_hosted and not services.host_store
    returned: list[float] = []
    waiter = threading.Thread(
        target=lambda: returned.append(services._await_earlier_store_closed() or time.monotonic())
    )
    new = None
    try:
        waiter.start()
        wait_until("rank 1 connected to the earlier call's store", lambda: _connections_to(port), 30)
        old.stop()
        new = StoreService("127.0.0.1", port).start()
        new_up = time.monotonic()
        waiter.join(60)
        assert returned and returned[0] >= new_up, "it went on before this call's store was up"
        assert rounds.current_round(_client(port)) is None  # what it now reaches is the new one
    finally:
        old.stop()
        if new is not None:
            new.stop()
        writer.close()
