"""The store's snapshot: what a successor store is rebuilt from (real TCPStores on loopback)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from nvrx.store import snapshot
from tests.support.waiting import wait_until

dist = pytest.importorskip("torch.distributed")


def _server() -> object:
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )


def test_a_successor_store_gets_the_saved_keys_and_counters_keep_counting(tmp_path: Path) -> None:
    old = _server()
    old.add("sup/restarts", 3)
    old.set("sup/stop", '{"reason": "x"}')
    old.add("sup/node/alive/1", 40)  # heartbeats change all the time: not kept
    old.set("nvrx/round", "7")
    old.set("nvrx/r7/faults", "not job-level")
    path = tmp_path / "store" / "snapshot.json"
    keeper = snapshot.Keeper(old, path, ("sup/", "nvrx/round"), ("sup/node/alive/",), interval=0.05)
    keeper.start()
    try:
        wait_until("the first snapshot", path.exists, 10)
        old.add("sup/restarts", 1)
        wait_until(
            "the snapshot of a change", lambda: snapshot.read(path).get("sup/restarts") == "4", 10
        )
    finally:
        keeper.stop()
    saved = snapshot.read(path)
    assert saved == {"sup/restarts": "4", "sup/stop": '{"reason": "x"}', "nvrx/round": "7"}
    new = _server()
    snapshot.restore(new, saved)
    assert new.add("sup/restarts", 1) == 5
    assert new.get("nvrx/round") == b"7"
    assert not new.check(["sup/node/alive/1"])


def test_an_unreadable_snapshot_restores_nothing(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    path.write_text("{half")
    assert snapshot.read(path) == {}
    assert snapshot.read(tmp_path / "missing.json") == {}
