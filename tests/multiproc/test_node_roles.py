"""Declaring a slot lost, against a real store service through a real node agent: what
the declaration decides when the lost node's training had already ended, or had not."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvrx.store import rounds, sealed_keys, snapshot
from nvrx.store.seal import Sealer
from nvrx.store.sealed_keys import SealedChain
from nvrx.store.service import StoreService
from nvrx.supervisor import node_keys
from nvrx.supervisor.config import ALL_DONE_KEY, SupervisorConfig, local_job
from nvrx.supervisor.node_roles import NodeRoles
from nvrx.supervisor.store_link import StoreLink
from nvrx.supervisor.store_setup import snapshot_spec
from tests.support.waiting import wait_until

SEALER = Sealer(bytes(range(32)), 0)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def link() -> Iterator[StoreLink]:
    with StoreService("127.0.0.1", 0, node=None) as service:
        agent = StoreLink("127.0.0.1", service.port, timeout=30).launch()
        try:
            agent.wait_ready()
            yield agent
        finally:
            agent.close()


def _roles(
    link: StoreLink,
    events: list[dict[str, Any]],
    node_rank: int = 0,
    nnodes: int = 3,
    **options: Any,
) -> NodeRoles:
    job = local_job(nnodes=nnodes, node_rank=node_rank, nproc_per_node=2)
    cfg = SupervisorConfig(["python", "train.py"], job, **options)
    emit = lambda kind, **fields: events.append({"kind": kind, **fields})  # noqa: E731
    return NodeRoles(cfg, link, emit, lambda: SEALER)


def _lost(slot: int) -> dict[str, Any]:
    return {"slot": slot, "silent_s": 5.0, "last_seen_wall": 0.0}


def test_a_node_lost_after_its_training_ended_costs_nothing(link: StoreLink) -> None:
    events: list[dict[str, Any]] = []
    roles = _roles(link, events)  # no spare, no --min-nodes: a loss in training stops the job
    SealedChain(node_keys.done(1), SEALER).write(link, "1")
    loss = roles.declare(_lost(1))
    assert loss is not None
    assert (loss.action, loss.node_rank, loss.reason) == (
        "none",
        1,
        "its training had ended: nothing to replace",
    )
    assert roles.declare(_lost(1)) is None  # once for the whole job
    assert sealed_keys.count(link, SEALER, node_keys.SHRUNK) == 0  # no shrink, nor stop
    assert link.get(rounds.GONE_LIST) == "2,3,"  # they will not come back: nobody waits for them
    assert [(e["kind"], e["lost_slot"], e["action"], e["ranks"]) for e in events] == [
        ("node_lost", 1, "none", [2, 3])
    ]


def test_a_node_lost_after_the_whole_job_trained_costs_nothing(link: StoreLink) -> None:
    events: list[dict[str, Any]] = []
    roles = _roles(link, events)
    SealedChain(ALL_DONE_KEY, SEALER).write(link, "1")
    loss = roles.declare(_lost(2))
    assert loss is not None and loss.action == "none"
    assert sealed_keys.count(link, SEALER, node_keys.SHRUNK) == 0
    assert [(e["lost_slot"], e["action"]) for e in events] == [(2, "none")]


def test_a_node_lost_in_training_without_spare_or_allowance_stops_the_job(
    link: StoreLink,
) -> None:
    events: list[dict[str, Any]] = []
    roles = _roles(link, events)
    loss = roles.declare(_lost(1))
    assert loss is not None and loss.action == "stop"
    assert loss.reason == "node lost, no spare: 2 nodes left, below --min-nodes 3"
    assert link.get(rounds.GONE_LIST) == "2,3,"


def test_taking_a_slot_out_changes_the_store_and_records_nothing_until_told(link: StoreLink) -> None:
    """A successor store host takes the old host's slot out before it publishes its store
    and records the loss after: ``take_out`` then ``record`` is ``declare``."""
    events: list[dict[str, Any]] = []
    roles = _roles(link, events)
    loss = roles.take_out(_lost(1))
    assert loss is not None and loss.action == "stop" and loss.ranks == (2, 3)
    assert link.get(rounds.GONE_LIST) == "2,3,"  # in the store already
    assert events == [] and roles.take_out(_lost(1)) is None  # nothing recorded, once only
    roles.record(loss)
    assert [(e["kind"], e["lost_slot"], e["lost_node"], e["action"], e["ranks"], e["silent_s"])
            for e in events] == [("node_lost", 1, 1, "stop", [2, 3], 5.0)]  # fmt: skip


@pytest.mark.parametrize("warm", [True, False], ids=["warm-standbys", "no-warm-standbys"])
def test_the_slot_next_in_line_for_the_store_is_told_when_the_one_before_it_is_lost(
    link: StoreLink, warm: bool
) -> None:
    """5 slots, slot 0 hosts the store, slot 1 is next in line to host the next one (it keeps
    a store ready). Slot 3's loss changes nothing there and tells nobody; slot 1's makes
    slot 2 next in line, which its ``hold_store`` chain tells (naming slot 1), so that it
    keeps a store ready in slot 1's place (before, none did until the next failover).
    Without warm standbys nobody keeps a store ready, and nobody is told."""
    events: list[dict[str, Any]] = []
    roles = _roles(link, events, nnodes=5, min_nodes=1, warm_standby=warm)
    told = lambda: [SealedChain(node_keys.hold_store(s), SEALER).read(link) for s in range(5)]  # noqa: E731
    assert roles.next_in_line() == 1
    assert roles.declare(_lost(3)) is not None
    assert told() == [None] * 5 and roles.next_in_line() == 1
    assert roles.declare(_lost(1)) is not None
    assert roles.next_in_line() == 2
    assert told() == ([None, None, "1", None, None] if warm else [None] * 5)


def test_the_successor_store_host_declaring_the_old_one_lost_tells_no_slot_to_keep_a_store(
    link: StoreLink,
) -> None:
    """At a store failover the successor (slot 1, hosting the new store) takes the old store
    host's slot out: that slot was never next in line, and after a failover every slot
    looks for the next store itself, so no slot is told to keep one."""
    roles = _roles(link, [], node_rank=1, nnodes=5, min_nodes=1)
    roles.store_slot = 1  # ``relink`` to the new store comes first
    assert roles.take_out(_lost(0), fresh=True) is not None
    assert [SealedChain(node_keys.hold_store(s), SEALER).read(link) for s in range(5)] == [None] * 5


class _Counting:
    """A store client that counts its requests."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        return int(self.store.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.requests += 1
        return self.store.compare_set(key, expected, desired)


def test_a_declaration_fences_the_lost_slot_at_its_next_beat_and_a_leave_does_not(
    link: StoreLink,
) -> None:
    from nvrx.node_agent.supervised import NodeDuty
    from nvrx.store import client
    from nvrx.store.ring import RingPlace

    events: list[dict[str, Any]] = []
    store = _Counting(client.connect("127.0.0.1", link.port, timeout=30))
    sent: list[dict[str, Any]] = []
    watch = NodeDuty(sent.append, None)
    watch.place = RingPlace(node_keys.RING, 1, 3, 5.0, SEALER)
    assert watch.beat(store, time.monotonic()) and watch.beat(store, time.monotonic())  # alive
    _roles(link, events).declare(_lost(1))  # slot 0's supervisor declares it lost
    store.requests = 0
    assert not watch.beat(store, time.monotonic())
    # the beat showed the fence; the claim behind it was read and holds a valid declaration
    assert sent == [{"event": "fenced", "slot": 1}] and store.requests == 2
    # a clean leave claims the slot without fencing it
    leaving = _roles(link, events, node_rank=2)
    assert leaving.leave()
    assert 0 <= link.add(node_keys.alive(2), 0) < node_keys.FENCE


def _key_events(link: StoreLink) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    wait_until("a watched key", lambda: found.extend(e for e in link.read_events() if "key" in e) or found, 30)
    return found


def test_a_forged_assignment_is_rejected_and_the_spare_takes_the_real_one(link: StoreLink) -> None:
    """A client without the job's secret hands spare slot 2 a node rank: the spare records
    one rejection and waits on; the real assignment, written past the forged value, counts."""
    events: list[dict[str, Any]] = []
    spare = _roles(link, events, node_rank=2, spare_nodes=1)
    spare.watch_chain(node_keys.assign(2))
    forged = json.dumps({"node_rank": 0, "lost_slot": 0})
    link.set(sealed_keys.key_of(node_keys.assign(2), 1), forged)
    [seen] = _key_events(link)
    base, value = spare.on_chain_value(seen["key"], seen["value"])  # type: ignore[misc]
    assert value.payload is None and spare.node_rank is None
    assert [(e["kind"], e["key"]) for e in events] == [("rejected_write", seen["key"])]
    declarer = _roles(link, events, node_rank=0, spare_nodes=1)
    loss = declarer.declare(_lost(1))
    assert loss is not None and (loss.action, loss.replaced_by) == ("spare", 2)
    [seen] = _key_events(link)
    assert seen["key"] == sealed_keys.key_of(node_keys.assign(2), 2)
    base, value = spare.on_chain_value(seen["key"], seen["value"])  # type: ignore[misc]
    assert base == node_keys.assign(2) and spare.take_over(value.payload)["node_rank"] == 1


def test_a_forged_value_met_again_by_a_chain_watched_again_is_recorded_once(link: StoreLink) -> None:
    """Slot 1 watches its ``hold_store`` chain, which holds a forged value; after a failover
    it watches the chain again from its start (the store restored from the snapshot) and
    meets that value again: one ``rejected_write``, not one per watch. Another forged value
    at the same place, met at the next watch, is another forgery: recorded."""
    events: list[dict[str, Any]] = []
    roles = _roles(link, events, node_rank=1)
    base, first = node_keys.hold_store(1), sealed_keys.key_of(node_keys.hold_store(1), 1)
    for value in ('{"slot": 0}', '{"slot": 0}', '{"slot": 2}'):
        link.set(first, value)
        roles.watch_chain(base)
        seen = [e for e in _key_events(link) if e["key"] == first]  # (the next place's watch waits)
        assert roles.on_chain_value(first, seen[0]["value"])[1].payload is None  # type: ignore[index]
    assert [(e["kind"], e["key"], e["value_bytes"]) for e in events] == [
        ("rejected_write", first, len('{"slot": 0}')), ("rejected_write", first, len('{"slot": 2}'))
    ]


def test_each_loss_gets_the_lowest_spare_alive_and_not_taken(link: StoreLink) -> None:
    # slots 0 and 1 train, 2 and 3 are spares: node rank 1 is lost twice, the second time
    # as the spare that had taken it over
    events: list[dict[str, Any]] = []
    roles = _roles(link, events, nnodes=4, spare_nodes=2)
    first = roles.declare(_lost(1))
    assert first is not None and (first.action, first.node_rank, first.replaced_by) == ("spare", 1, 2)
    second = roles.declare(_lost(2))
    assert second is not None
    assert (second.action, second.node_rank, second.replaced_by) == ("spare", 1, 3)
    assert [(e["lost_slot"], e["action"], e["replaced_by"]) for e in events] == [
        (1, "spare", 2), (2, "spare", 3)
    ]  # fmt: skip


def test_a_lost_spare_is_never_handed_out(link: StoreLink) -> None:
    events: list[dict[str, Any]] = []
    roles = _roles(link, events, nnodes=4, spare_nodes=2)
    spare = roles.declare(_lost(2))
    assert spare is not None and (spare.action, spare.node_rank) == ("none", None)
    assert spare.reason == "a spare was lost"
    loss = roles.declare(_lost(1))
    assert loss is not None and (loss.action, loss.replaced_by) == ("spare", 3)
    third = roles.declare(_lost(0))  # no spare alive and free is left
    assert third is not None and third.action == "stop", third


def test_a_survivor_without_a_store_records_each_loss_as_the_snapshot_last_knew_it(
    tmp_path: Path,
) -> None:
    # slots 0-2 train, 3 and 4 are spares; the store keeps the snapshot a failover would
    # (``snapshot_spec``). Slot 1 was lost while the store ran (spare 3 took node rank 1)
    # and slot 2's training ended; then the store was lost with no successor, and every
    # slot is silent but the survivor's
    events: list[dict[str, Any]] = []
    job = local_job(nnodes=5, node_rank=0, nproc_per_node=2, log_dir=str(tmp_path))
    cfg = SupervisorConfig(["python", "train.py"], job, spare_nodes=2)
    spec = snapshot_spec(cfg)
    with StoreService("127.0.0.1", 0, node=None, snapshot=spec) as service:
        agent = StoreLink("127.0.0.1", service.port, timeout=30).launch()
        try:
            agent.wait_ready()
            emit = lambda kind, **fields: events.append({"kind": kind, **fields})  # noqa: E731
            roles = NodeRoles(cfg, agent, emit, lambda: SEALER)
            assert roles.declare(_lost(1)) is not None
            done = SealedChain(node_keys.done(2), SEALER)
            done.write(agent, "1")
            keys = {node_keys.claim(1), SealedChain(node_keys.assign(3), SEALER).key(1), done.key(1)}
            wait_until(
                "the snapshot to keep slot 1's claim, spare 3's assignment and slot 2's end",
                lambda: keys <= snapshot.read(spec.path).keys(),
                30,
            )
        finally:
            agent.close()
    kept = snapshot.KeptKeys(snapshot.read(spec.path))
    events.clear()
    for slot in range(5):
        roles.record_lost_unreplaced(slot, f"node{slot + 1}", 12.0, kept)
    assert [(e["lost_slot"], e["lost_node"], e["action"], e["ranks"]) for e in events] == [
        (0, 0, "stop", [0, 1]),  # a training slot, its own node rank
        (2, 2, "none", [4, 5]),  # its training had ended
        (3, 1, "stop", [2, 3]),  # the spare that had taken node rank 1 over
        (4, None, "none", []),  # a free spare: its loss costs nothing
    ]  # slot 1's loss was recorded when it was declared
    assert {e["last_seen_wall"] for e in events} == {12.0}
    with pytest.raises(ValueError, match="read-only"):
        kept.compare_set(node_keys.claim(0), "", "x")
