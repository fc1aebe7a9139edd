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


def test_the_ranks_marked_gone_outlive_the_store_host(tmp_path: Path) -> None:
    """What a supervisor's store keeps for its successor includes the ranks marked gone, so
    a new process generation after a failover does not wait for ranks lost before it."""
    from nvrx.store import rounds
    from nvrx.supervisor.config import SupervisorConfig, local_job
    from nvrx.supervisor.store_setup import snapshot_spec

    old = _server()
    rounds.mark_gone(old, [6, 7])
    old.set("nvrx/r3/terminated", "1,")  # a round's keys stay behind
    cfg = SupervisorConfig(["python", "t.py"], local_job(nnodes=4, log_dir=str(tmp_path), job_id="j"))
    spec = snapshot_spec(cfg)
    saved = snapshot.take(old, spec.prefixes, spec.exclude)
    new = _server()
    snapshot.restore(new, saved)
    assert rounds.all_gone(new) == {6, 7}
    assert rounds.is_gone(new, 7) and not rounds.is_gone(new, 5)
    assert not new.check(["nvrx/r3/terminated"])
    rounds.mark_gone(new, [0, 1])  # the store host's own ranks, declared by its successor
    assert rounds.all_gone(new) == {0, 1, 6, 7}


def test_no_rank_is_gone_in_a_new_store() -> None:
    from nvrx.store import rounds

    assert rounds.all_gone(_server()) == set()


def test_a_keeper_writes_its_first_copy_before_its_first_interval(tmp_path: Path) -> None:
    """A store lost within its first interval still leaves its keys (those it was restored
    from) to its successor, which reads that store's own file only."""
    store = _server()
    store.set("sup/restarts", "2")
    path = tmp_path / "store" / "snapshot-run0-e1-s1.json"
    keeper = snapshot.Keeper(store, path, ("sup/",), interval=3600)  # no second copy in the test
    keeper.start()
    try:
        wait_until("the first snapshot", path.exists, 10)
    finally:
        keeper.stop()
    assert snapshot.read(path) == {"sup/restarts": "2"}
