"""What a survivor does once its store host is gone and the survivors found no majority to
elect a successor, or their successor published no store (``Failover``): which elections
leave it to SLURM, which survivor asks, and what each answer of
``node_requeue.probe_step_nodes`` leads to. SLURM itself answers in
``tests/slurm/test_node_loss_slurm.py``; here its answer is given, and the election runs on
a real job directory, so the decision is checked on any machine."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.store import snapshot
from nvrx.store.seal import Sealer
from nvrx.store.sealed_keys import SealedChain, entry_payload
from nvrx.supervisor import failover as failover_module
from nvrx.supervisor import node_keys, node_requeue, store_failover
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course, CourseTracker
from nvrx.supervisor.failover import Failover
from nvrx.supervisor.node_requeue import StepAnswers
from nvrx.supervisor.node_roles import Loss, NodeRoles
from nvrx.supervisor.store_link import StoreLinkError

EPOCH = 1
SEALER = Sealer(b"the job's secret", 0)


def _ended(nnodes: int, slot: int, store: dict[str, str] | None = None) -> Any:
    """``NodeRoles.ended`` of ``slot`` of ``nnodes``, under ``SEALER``: what a survivor reads
    of a slot's end in a store's snapshot, or in the store that serves the job, whose keys
    ``store`` holds (read as a snapshot's: only ``ended`` reads it here)."""
    cfg = SupervisorConfig(command=["true"], job=local_job(nnodes=nnodes, node_rank=slot))
    link = None if store is None else snapshot.KeptKeys(store)
    return NodeRoles(cfg, link, lambda kind, **fields: None, lambda: SEALER).ended  # type: ignore[arg-type]


def _declared_lost(slot: int) -> dict[str, str]:
    """A store's keys that show ``slot`` declared lost (by slot 3)."""
    claim = node_keys.claim(slot)
    return {claim: SEALER.entry(claim, entry_payload(3))}


class _Survivor:
    """A Failover over plain stand-ins that record what it did, at ``slot`` of ``nnodes``."""

    def __init__(self, job_dir: Path, nnodes: int = 2, slot: int = 1, store_slot: int = 0) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.lost: list[tuple[int, str]] = []
        self.kept: list[dict[str, str]] = []  # the snapshot each loss was recorded from
        self.requeued: list[tuple[list[str | None], bool]] = []
        self.fenced: list[bool] = []  # ``NodeMessages.fenced`` called
        self.hosted: list[int] = []  # the slots whose store a stand-in started (where one does)
        config = SimpleNamespace(
            nnodes=nnodes, node_timeout=3.0, store_timeout=0.2, events_dir=job_dir,
            store_host="node1", store_port=1,
        )  # fmt: skip
        roles = SimpleNamespace(
            enabled=True, slot=slot, ended=_ended(nnodes, slot), cfg=config, store_slot=store_slot,
            record_lost_unreplaced=self._record,
        )  # fmt: skip
        roles.next_in_line = functools.partial(NodeRoles.next_in_line, roles)  # the real rule
        self.store = SimpleNamespace(
            config=config, service=None, roles=roles, slot=store_slot, epoch=EPOCH, lost_slot=store_slot
        )
        control = SimpleNamespace(emit=lambda kind, **fields: self.events.append((kind, fields)))
        self.failover = Failover(
            self.store, SimpleNamespace(stopping=False), control, None, None,  # type: ignore[arg-type]
            lambda hosts, probe=True: self.requeued.append((list(hosts), probe)), None,
            lambda: self.fenced.append(True),
        )  # fmt: skip
        store_failover.announce(job_dir, EPOCH, slot)  # the epoch's folder, as the election left it

    def _record(self, slot: int, host: str, wall: float, kept: Any) -> None:
        self.lost.append((slot, host))
        self.kept.append(kept.keys)

    def decide(self, alive: set[int]) -> None:
        self.failover._requeue_without_lost_nodes(123.0, frozenset(alive))


def _answers(
    nodes: str, asked: str, answered: str, took: float = 0.2, batch: str | None = "node1"
) -> StepAnswers:
    return StepAnswers(
        tuple(nodes.split(",")), batch, tuple(asked.split(",")),
        frozenset(answered.split(",")) - {""}, dict.fromkeys(asked.split(","), took),
    )  # fmt: skip


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """SLURM's answer about the step's nodes, given; what was asked and ended, recorded."""
    seen: dict[str, Any] = {"answer": None, "asked": [], "ended": []}

    def probe(
        job_id: str, slot: int, nslots: int, silent: set[int], settle_s: float, *, claim: Any
    ) -> StepAnswers | None:
        if not claim():  # (after this node answered)
            return None
        seen["asked"].append((job_id, slot, sorted(silent), settle_s))
        return seen["answer"]

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(node_requeue, "probe_step_nodes", probe)
    monkeypatch.setattr(node_requeue, "end_unrequeued", lambda job, node: seen["ended"].append((job, node)))
    return seen


def test_an_election_without_a_majority_is_left_to_slurm(tmp_path: Path) -> None:
    alone = _Survivor(tmp_path, nnodes=3, slot=2)
    alone.store.config.node_timeout = 0.1
    assert alone.failover._elect_and_connect(0.0) == (None, None)
    assert alone.failover._unelected == frozenset({2})


def _second_store_lost(tmp_path: Path, slot: int, declared_lost: int) -> _Survivor:
    """Survivor ``slot`` of 7 at the loss of slot 1's store, the second: slot 0 hosted the
    first (lost at the failover before) and ``declared_lost``'s claim is in slot 1's
    snapshot; the node timeout is an hour."""
    survivor = _Survivor(tmp_path, nnodes=7, slot=slot, store_slot=1)
    survivor.store.lost_slot = 0
    survivor.store.config.node_timeout = 3600.0
    claim = node_keys.claim(declared_lost)
    snapshot.write(
        store_failover.snapshot_path(tmp_path, EPOCH, 1), {claim: SEALER.entry(claim, entry_payload(3))}
    )
    return survivor


@pytest.mark.timeout(60)
def test_the_election_waits_for_no_slot_known_lost(tmp_path: Path) -> None:
    """7 slots; slot 0, the first store host, was lost, and then slot 6 (its end is in the
    snapshot of slot 1's store, which a lagging snapshot may not show for slot 0 yet); now
    slot 1's store is lost. Slots 2 to 5 announce themselves: the election goes on at once,
    with the node timeout an hour, and the survivors connect to slot 2's store."""
    survivor = _second_store_lost(tmp_path, slot=5, declared_lost=6)
    for slot in (2, 3, 4):
        store_failover.announce(tmp_path, EPOCH + 1, slot)
    successor = store_failover.StoreAddress("node3", 1, 2, EPOCH + 1)
    store_failover.publish(tmp_path, successor)
    connected: list[store_failover.StoreAddress] = []
    survivor.failover._connect = lambda address: bool(connected.append(address))  # gone again
    assert survivor.failover._elect_and_connect(0.0) == (None, None)
    assert connected == [successor] and survivor.failover._unelected is None


@pytest.mark.timeout(60)
def test_a_survivor_that_sees_a_slot_known_lost_announced_connects_to_the_store_published(
    tmp_path: Path,
) -> None:
    """7 slots; slot 0 was lost at the failover before, and slot 2 declared lost in slot 1's
    store, whose loss this is. Slots 3 to 6 announce themselves, and slot 2 too (a slot known
    lost that announces all the same, say one that read the snapshot before it showed its
    end), after slot 3 looked: slot 3 named itself and published its store. Slot 4, looking
    later, counts slot 2 but names slot 3 again, and connects to the store published: one
    store for the epoch."""
    survivor = _second_store_lost(tmp_path, slot=4, declared_lost=2)
    for slot in (2, 3, 5, 6):
        store_failover.announce(tmp_path, EPOCH + 1, slot)
    published = store_failover.StoreAddress("node4", 1, 3, EPOCH + 1)
    assert store_failover.claim(tmp_path, published) and store_failover.publish(tmp_path, published)
    connected: list[store_failover.StoreAddress] = []
    survivor.failover._connect = lambda address: bool(connected.append(address))  # gone again
    assert survivor.failover._elect_and_connect(0.0) == (None, None)
    assert connected == [published] and survivor.failover._unelected is None
    elected = store_failover.elect(tmp_path, EPOCH + 1, {3, 4, 5, 6}, 0.0, 7, frozenset({0, 2}))
    assert (elected.alive, elected.successor) == ({2, 3, 4, 5, 6}, 3)


def test_a_slot_known_lost_that_announces_counts_toward_the_majority_but_is_never_elected(
    tmp_path: Path,
) -> None:
    """5 slots, slot 0's store lost, slot 1 known lost: with slots 1, 2 and 3 announced, a
    majority of 5, slot 2 is the successor; slots 2 and 3 alone are no majority, and
    neither are slots 1 and 2."""
    for slot in (1, 2, 3):
        store_failover.announce(tmp_path, EPOCH, slot)
    assert store_failover.elect(tmp_path, EPOCH, {2, 3, 4}, 0.0, 5, frozenset({1})).successor == 2
    store_failover.withdraw(tmp_path, EPOCH, 1)
    assert store_failover.elect(tmp_path, EPOCH, {2, 3, 4}, 0.0, 5, frozenset({1})).successor is None
    store_failover.announce(tmp_path, EPOCH, 1)
    store_failover.withdraw(tmp_path, EPOCH, 3)
    assert store_failover.elect(tmp_path, EPOCH, {2, 3, 4}, 0.0, 5, frozenset({1})).successor is None


def _slot_1_declared_lost(tmp_path: Path, slot: int) -> _Survivor:
    """Survivor ``slot`` of 5 at the loss of slot 0's store, whose snapshot shows slot 1
    declared lost (by slot 3, while slot 1 stalled); a node timeout of an hour, and a
    successor's store that records it was started and claims nothing."""
    survivor = _Survivor(tmp_path, nnodes=5, slot=slot)
    survivor.store.config.node_timeout = 3600.0
    snapshot.write(store_failover.snapshot_path(tmp_path, EPOCH, 0), _declared_lost(1))
    survivor.failover._host_store = lambda job_dir: survivor.hosted.append(slot)
    return survivor


@pytest.mark.timeout(60)
def test_a_slot_declared_lost_that_announces_is_never_elected_successor(tmp_path: Path) -> None:
    """Slot 1, declared lost while it stalled, announces itself (alive after all, it read the
    snapshot before it showed its end) with slots 3 and 4: slot 2, the lowest slot not known
    lost, starts the next store (before, every survivor named slot 1)."""
    survivor = _slot_1_declared_lost(tmp_path, slot=2)
    for slot in (1, 3, 4):
        store_failover.announce(tmp_path, EPOCH + 1, slot)
    survivor.store.config.store_timeout = 0.0  # a successor that published nothing: no wait
    survivor.store.config.node_timeout = 0.1  # (after the election, which waits for nobody)
    assert survivor.failover._elect_and_connect(0.0) == (None, None)  # its store: not started
    assert survivor.hosted == [2]


@pytest.mark.timeout(60)
def test_a_slot_declared_lost_does_not_stand_and_ends_as_fenced(tmp_path: Path) -> None:
    """Slot 1, declared lost while it stalled, finds its own end in the lost store's snapshot
    when the store is lost: it announces nothing, starts no store (before, it named itself,
    the lowest slot, and hosted the job's next store), and ends as fenced, not for the store's
    loss. The others elect slot 2 without it."""
    survivor = _slot_1_declared_lost(tmp_path, slot=1)
    for slot in (2, 3, 4):
        store_failover.announce(tmp_path, EPOCH + 1, slot)
    stops: list[int] = []
    failover, store = survivor.failover, survivor.store
    failover.course = CourseTracker()
    failover.course.to(Course.TRAINING)
    failover.ranks, failover.standbys = SimpleNamespace(running=list), SimpleNamespace(discard=lambda: None)
    failover.control.reap = lambda: None
    failover.control.request_stop = lambda reason, code, broadcast: stops.append(code)
    failover._start_ahead = lambda: (None, None)  # (no node agent, no store kept ready here)
    store.link = SimpleNamespace(answered_wall=None, close=lambda: None)
    assert not failover.store_lost("connection closed")
    assert survivor.fenced == [True] and stops == [] and survivor.hosted == []
    assert not (store_failover.epoch_dir(tmp_path, EPOCH + 1) / "alive-1").exists()
    assert failover._unelected is None  # it asks SLURM nothing
    assert store_failover.elect(tmp_path, EPOCH + 1, {2, 3, 4}, 0.0, 5, frozenset({1})).successor == 2


@pytest.mark.parametrize("slot", [1, 2, 3])
def test_the_slot_next_in_line_is_the_lowest_not_known_lost_in_the_store(tmp_path: Path, slot: int) -> None:
    """5 slots, slot 0 hosts the store, which shows slot 1 declared lost: slot 2 keeps a
    store service ready for a failover, not slot 1 (before, slot 1 did, and slot 2 did not)."""
    survivor = _Survivor(tmp_path, nnodes=5, slot=slot)
    survivor.store.roles.ended = _ended(5, slot, _declared_lost(1))
    assert survivor.failover._next_in_line() is (slot == 2)


@pytest.mark.parametrize(("slot", "kept_ready"), [(1, True), (2, True), (2, False)])
def test_at_a_failover_a_store_kept_ready_on_a_slot_known_lost_is_stopped(
    tmp_path: Path, slot: int, kept_ready: bool
) -> None:
    """5 slots, slot 0's store lost, its snapshot shows slot 1 declared lost: when the
    failover begins, slot 1 stops the store service it kept ready, slot 2 lets its own go to
    serve, or starts one for the next epoch where it kept none ready (before, slot 1 let its
    own go, and slot 2 stopped its own or started none)."""
    survivor = _slot_1_declared_lost(tmp_path, slot)
    used: list[str] = []
    failover = survivor.failover
    failover._roles.node_rank = None  # (a spare: no standby to start)
    failover._prepared_link = SimpleNamespace(running=True)
    kept = SimpleNamespace(alive=True, stop=lambda: used.append("stop"), release=lambda: used.append("release"))
    failover._prepared_service = kept if kept_ready else None
    started = SimpleNamespace()
    failover._successor_store = lambda epoch, held=False: SimpleNamespace(
        launch=lambda: used.append(f"start e{epoch}") or started
    )
    link, service = failover._start_ahead()
    if slot == 1:
        assert (used, service) == (["stop"], None)
    else:
        assert (used, service) == ((["release"], kept) if kept_ready else ([f"start e{EPOCH + 1}"], started))


@pytest.mark.parametrize("stopping", [False, True])
def test_a_slot_next_in_line_keeps_a_store_ready_unless_the_job_is_stopping(
    tmp_path: Path, stopping: bool
) -> None:
    """Slot 1 of 3, next in line after slot 0: ``prepare`` (called at the start, and after
    each failover for the next one) watches its ``hold_store`` chain and keeps a node agent
    and a held store ready; once the job is stopping (a stop taken before the start's
    ``prepare``) it starts neither."""
    survivor = _Survivor(tmp_path, nnodes=3, slot=1)
    failover, roles = survivor.failover, survivor.store.roles
    failover.course.stopping = stopping
    roles.keeps_store_ready = True
    roles.ended = _ended(3, 1, {})  # the job's store: no slot lost
    watched: list[str] = []
    roles.watch_chain = watched.append
    survivor.store.beats_fd = None
    survivor.store.config.store_timeout = 0.2
    started: list[str] = []
    failover._successor_store = lambda epoch, held=False: SimpleNamespace(
        launch=lambda: started.append(f"store e{epoch} held={held}")
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(failover_module, "StoreLink", lambda *args: SimpleNamespace(
            launch=lambda: started.append("agent")))  # fmt: skip
        failover.prepare()
    if stopping:
        assert (watched, started) == ([], [])
    else:
        assert watched == [node_keys.hold_store(1)]
        assert started == ["agent", f"store e{EPOCH + 1} held=True"]


@pytest.mark.parametrize("claimed", [False, True], ids=["lost-before-its-claim", "lost-after-it"])
def test_a_majority_whose_successor_publishes_no_store_leaves_it_to_slurm_with_the_successor_silent(
    tmp_path: Path, slurm, claimed: bool
) -> None:
    majority = _Survivor(tmp_path, nnodes=4, slot=3)
    majority.store.config.node_timeout = 0.1
    for slot in (1, 2):  # the election's epoch: slots 1 and 2 survived too, slot 1 is elected
        store_failover.announce(tmp_path, EPOCH + 1, slot)
    if claimed:
        assert store_failover.claim(tmp_path, store_failover.StoreAddress("node2", 1, 1, EPOCH + 1))
    assert majority.failover._elect_and_connect(0.0) == (None, None)  # slot 1's store never came
    assert majority.failover._unelected == frozenset({2, 3})
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "")
    majority.decide(majority.failover._unelected)
    assert slurm["asked"][0][:3] == ("7", 3, [0, 1])  # the old store host and the successor
    assert majority.lost == [(0, "node1"), (1, "node2")]
    assert majority.requeued == [(["node1", "node2"], False)]


def test_a_claimant_other_than_the_successor_that_publishes_no_store_counts_as_silent(
    tmp_path: Path, slurm
) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=1)
    survivor.store.config.node_timeout = 0.1
    for slot in (2, 3):  # slot 2 elected itself without seeing slot 1, claimed, and was lost
        store_failover.announce(tmp_path, EPOCH + 1, slot)
    assert store_failover.claim(tmp_path, store_failover.StoreAddress("node3", 1, 2, EPOCH + 1))
    survivor.failover._host_store = lambda job_dir: None  # slot 1's own store lost the claim
    assert survivor.failover._elect_and_connect(0.0) == (None, None)
    assert survivor.failover._unelected == frozenset({3})
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node3", "")
    survivor.decide(survivor.failover._unelected)
    assert slurm["asked"][0][:3] == ("7", 1, [0, 1, 2])  # the claimant's node among them
    assert survivor.requeued == [(["node1", "node3"], False)]


def test_a_majority_whose_successor_publishes_a_store_it_cannot_reach_is_not_left_to_slurm(
    tmp_path: Path,
) -> None:
    majority = _Survivor(tmp_path, nnodes=3, slot=2)
    majority.store.config.node_timeout = 0.1
    store_failover.announce(tmp_path, EPOCH + 1, 1)
    store_failover.publish(tmp_path, store_failover.StoreAddress("127.0.0.1", 1, 1, EPOCH + 1))
    majority.failover._connect = lambda address: False  # that store is gone again: no answer at its port
    assert majority.failover._elect_and_connect(0.0) == (None, None)
    assert majority.failover._unelected is None


def test_a_silent_batch_host_is_recorded_lost_and_the_job_requeued_without_it(tmp_path, slurm) -> None:
    survivor = _Survivor(tmp_path)
    slurm["answer"] = _answers("node1,node2", "node1", "", 20.0)
    survivor.decide({1})
    assert slurm["asked"] == [("7", 1, [0], 3.0 + node_requeue.commands.PROBE_TIMEOUT_S)]
    assert survivor.lost == [(0, "node1")] and survivor.requeued == [(["node1"], False)]
    assert slurm["ended"] == [("7", "node1")] and survivor.events == []  # ended only if still RUNNING


def test_a_silent_batch_host_outside_the_step_is_excluded_too_but_recorded_in_no_slot(
    tmp_path, slurm
) -> None:
    survivor = _Survivor(tmp_path)
    slurm["answer"] = _answers("node1,node2", "login7,node1", "", batch="login7")
    survivor.decide({1})
    assert survivor.lost == [(0, "node1")] and survivor.requeued == [(["login7", "node1"], False)]
    assert slurm["ended"] == [("7", "login7")]


def test_every_silent_node_of_a_larger_job_is_recorded_lost_and_excluded(tmp_path, slurm) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2,node4", "")
    survivor.decide({2})
    assert slurm["asked"][0][:3] == ("7", 2, [0, 1, 3])
    assert survivor.lost == [(0, "node1"), (1, "node2"), (3, "node4")]
    assert survivor.requeued == [(["node1", "node2", "node4"], False)]
    assert slurm["ended"] == [("7", "node1")]


def test_the_losses_are_recorded_from_this_runs_store_snapshot(tmp_path, slurm) -> None:
    survivor = _Survivor(tmp_path, nnodes=3, slot=2)
    # the snapshot the lost store (the epoch before the failed election's) kept
    snapshot.write(store_failover.snapshot_path(tmp_path, EPOCH - 1, 0), {"nvrx_supervisor/node/claim/1": "x"})
    slurm["answer"] = _answers("node1,node2,node3", "node1,node2", "")
    survivor.decide({2})
    assert survivor.kept == [{"nvrx_supervisor/node/claim/1": "x"}] * 2


def test_only_the_survivor_that_claims_it_asks_slurm(tmp_path, slurm) -> None:
    first, second = _Survivor(tmp_path, nnodes=4, slot=3), _Survivor(tmp_path, nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "")
    first.decide({2, 3})
    second.decide({2, 3})
    assert [asked[1] for asked in slurm["asked"]] == [3]
    assert first.requeued == [(["node1", "node2"], False)] and second.requeued == []


@pytest.mark.parametrize("batch_host_answers", [False, True])
def test_a_store_elected_after_all_leaves_the_job_alone(tmp_path, slurm, batch_host_answers: bool) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "node1" * batch_host_answers)
    address = store_failover.StoreAddress("node4", 1, 3, EPOCH)
    assert store_failover.claim(tmp_path, address)
    assert store_failover.decide(tmp_path, EPOCH, store_failover.STORE)
    store_failover.publish(tmp_path, address)
    survivor.decide({2})
    assert survivor.lost == survivor.requeued == slurm["ended"] == survivor.events == []


@pytest.mark.parametrize("batch_host_answers", [False, True])
def test_a_store_decided_but_never_published_is_given_up_and_its_successor_counts_as_lost(
    tmp_path, slurm, batch_host_answers: bool
) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=2)  # (the store timeout: 0.2 s)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "node1" * batch_host_answers)
    late = store_failover.StoreAddress("node2", 1, 1, EPOCH)
    assert store_failover.claim(tmp_path, late)
    assert store_failover.decide(tmp_path, EPOCH, store_failover.STORE)  # then its claimant died
    survivor.decide({2, 3})
    assert survivor.lost == ([(1, "node2")] if batch_host_answers else [(0, "node1"), (1, "node2")])
    assert survivor.requeued == ([] if batch_host_answers else [(["node1", "node2"], False)])
    assert not store_failover.publish(tmp_path, late)  # given up: a late successor serves nobody


@pytest.mark.parametrize("claimant_node", ["answers", "not-asked"])
def test_when_the_batch_host_answers_a_decided_store_whose_claimant_may_live_is_left_to_it(
    tmp_path, slurm, claimant_node: str
) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=2)
    asked, answered = ("node1,node2", "node1,node2") if claimant_node == "answers" else ("node1", "node1")
    slurm["answer"] = _answers("node1,node2,node3,node4", asked, answered)
    late = store_failover.StoreAddress("node2", 1, 1, EPOCH)
    assert store_failover.claim(tmp_path, late)
    assert store_failover.decide(tmp_path, EPOCH, store_failover.STORE)  # slot 1: only slow
    survivor.decide({2, 3})
    assert survivor.lost == survivor.requeued == []
    assert store_failover.publish(tmp_path, late)  # its successor publishes it, however late


def test_a_store_given_up_by_the_requeue_is_never_published_and_a_published_one_never_given_up(
    tmp_path: Path,
) -> None:
    late = store_failover.StoreAddress("node2", 1, 1, EPOCH)
    store_failover.announce(tmp_path, EPOCH, 1)
    assert store_failover.abandon(tmp_path, EPOCH) and not store_failover.publish(tmp_path, late)
    assert store_failover.wait_address(tmp_path, EPOCH, 0.1) is None  # nobody connects to it
    (tmp_path / "b").mkdir()
    store_failover.announce(tmp_path / "b", EPOCH, 1)
    assert store_failover.publish(tmp_path / "b", late) and not store_failover.abandon(tmp_path / "b", EPOCH)
    assert store_failover.wait_address(tmp_path / "b", EPOCH, 0.1) == late
    assert not list(store_failover.epoch_dir(tmp_path / "b", EPOCH).glob(".*.tmp"))


def _successor(tmp_path: Path) -> tuple[_Survivor, store_failover.StoreAddress, list[bool]]:
    """Slot 1 of 3, elected with slot 2 after the store host's loss, whose store (a stand-in
    that records its stop) claims the next epoch: it, its address and the stops."""
    successor = _Survivor(tmp_path, nnodes=3, slot=1)
    successor.store.config.node_timeout = 0.1
    store_failover.announce(tmp_path, EPOCH + 1, 2)  # slot 2 survived too: a majority, slot 1 elected
    mine = store_failover.StoreAddress("node2", 1, 1, EPOCH + 1)
    stopped: list[bool] = []

    def host_store(job_dir: Path) -> store_failover.StoreAddress | None:
        assert store_failover.claim(job_dir, mine)
        successor.store.service = SimpleNamespace(stop=lambda: stopped.append(True))
        return mine

    successor.failover._host_store = host_store
    return successor, mine, stopped


def test_a_successor_whose_store_was_given_up_while_it_connected_stops_it(tmp_path: Path) -> None:
    successor, _, stopped = _successor(tmp_path)

    def slow_connect(address: store_failover.StoreAddress) -> bool:
        assert store_failover.abandon(tmp_path, EPOCH + 1)  # the requeuer's wait ran out meanwhile
        return True

    successor.failover._connect = slow_connect
    successor.failover._declare_lost_store_host = lambda lost_wall: None
    assert successor.failover._elect_and_connect(0.0) == (None, None)
    assert stopped == [True] and successor.store.service is None


def test_a_successor_that_cannot_reach_its_own_store_stops_it_unpublished(tmp_path: Path) -> None:
    successor, _, stopped = _successor(tmp_path)
    successor.failover._connect = lambda address: False  # its store answers nobody
    assert successor.failover._elect_and_connect(0.0) == (None, None)
    assert stopped == [True] and successor.store.service is None  # it does not end as a store host
    assert store_failover.wait_address(tmp_path, EPOCH + 1, 0.1) is None


def test_a_requeue_decides_the_epoch_and_a_batch_host_that_answers_decides_nothing(tmp_path, slurm) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()  # two jobs
    answering, silent = _Survivor(tmp_path / "a", nnodes=4, slot=2), _Survivor(tmp_path / "b", nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "node1")
    answering.decide({2, 3})
    assert answering.lost == [(1, "node2")] and answering.requeued == []
    assert not (store_failover.epoch_dir(tmp_path / "a", EPOCH) / "decided").exists()
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "")
    silent.decide({2, 3})
    assert silent.requeued == [(["node1", "node2"], False)]
    assert (store_failover.epoch_dir(tmp_path / "b", EPOCH) / "decided").read_text() == "requeue"


@pytest.mark.parametrize("requeued_first", [False, True], ids=["decides-first", "requeued-first"])
def test_a_successor_publishes_its_store_only_if_the_job_was_not_requeued_first(
    tmp_path: Path, requeued_first: bool
) -> None:
    successor, mine, stopped = _successor(tmp_path)
    used: list[str] = []
    successor.failover._connect = lambda address: bool(used.append("connect")) or True
    successor.failover._declare_lost_store_host = lambda lost_wall: used.append("declare")
    successor.failover._roles.start = lambda: None
    if requeued_first:  # a slow successor: the survivor that asked SLURM requeued the job already
        assert store_failover.decide(tmp_path, EPOCH + 1, store_failover.REQUEUE)
    elected = successor.failover._elect_and_connect(0.0)
    assert elected == ((None, None) if requeued_first else (mine, None))
    store = store_failover.epoch_dir(tmp_path, EPOCH + 1) / "store.json"
    assert store.exists() is not requeued_first
    assert stopped == [True] * requeued_first  # its store, withdrawn: it does not wait as a store host
    assert (successor.store.service is None) is requeued_first
    assert used == ([] if requeued_first else ["connect", "declare"])  # nothing of a store withdrawn


@pytest.mark.parametrize("given_up", [False, True], ids=["published", "given-up-meanwhile"])
def test_a_successor_records_the_old_hosts_loss_once_its_store_is_published_or_given_up(
    tmp_path: Path, given_up: bool
) -> None:
    """The successor takes the old store host's slot out in its new store before it publishes
    (its children must find it so), but its ``node_lost`` follows the publication: a store
    given up in between replaces nobody, and the loss is then recorded as a stop."""
    successor, mine, stopped = _successor(tmp_path)
    loss = Loss(0, "node1", 0, "spare", 2, 2, "spare slot 2 takes over node rank 0")
    store = store_failover.epoch_dir(tmp_path, EPOCH + 1) / "store.json"
    recorded: list[tuple[Loss, bool]] = []

    def take_out(report: dict[str, Any], fresh: bool = False) -> Loss:
        assert (report["slot"], fresh) == (0, True)
        if given_up:  # the survivor that asked SLURM ran out of its wait meanwhile
            assert store_failover.abandon(tmp_path, EPOCH + 1)
        return loss

    roles = successor.store.roles
    roles.take_out, roles.start = take_out, lambda: None
    roles.declare = lambda report, fresh=False: pytest.fail("declared (and recorded) before publishing")
    roles.record = lambda lost: recorded.append((lost, store.exists() and not stopped))
    successor.store.lost_slot = 0
    successor.failover._connect = lambda address: True
    elected = successor.failover._elect_and_connect(0.0)
    assert elected == ((None, None) if given_up else (mine, loss))
    assert stopped == [True] * given_up
    if not given_up:
        assert recorded == [(loss, True)]  # after its store.json
        return
    [(stop, published_and_serving)] = recorded  # after its store stopped: nothing took the node's place
    assert not published_and_serving
    assert (stop.slot, stop.node_rank, stop.action, stop.replaced_by) == (0, 0, "stop", None)


def test_a_successor_whose_epoch_another_slot_claimed_first_stops_its_store_and_uses_that_one(
    tmp_path: Path,
) -> None:
    """Two stores for one epoch: slot 1 finds itself successor, but slot 2 (elected on another
    view of the survivors) started a store and claimed and published the epoch first. Slot 1's
    store, started too, is stopped unclaimed and slot 1 connects to slot 2's: the job goes on
    with one store, and slot 1 does not end as a store host."""
    successor = _Survivor(tmp_path, nnodes=3, slot=1)
    successor.store.config.node_timeout = 0.1
    successor.store.config.store_timeout = 1.0
    store_failover.announce(tmp_path, EPOCH + 1, 2)
    theirs = store_failover.StoreAddress("node3", 2, 2, EPOCH + 1)
    assert store_failover.claim(tmp_path, theirs) and store_failover.publish(tmp_path, theirs)
    used: list[str] = []
    service = SimpleNamespace(host="node2", port=1, held=False, wait_started=lambda timeout: None,
                              stop=lambda: used.append("stop"))  # fmt: skip
    failover = successor.failover
    failover._successor_store = lambda epoch, held=False: SimpleNamespace(
        launch=lambda: used.append(f"start e{epoch}") or service
    )
    failover._connect = lambda address: bool(used.append(f"connect {address.host}")) or True
    failover._roles.start = lambda: None
    assert failover._elect_and_connect(0.0) == (theirs, None)
    assert used == [f"start e{EPOCH + 1}", "stop", "connect node3"]
    assert successor.store.service is None
    assert store_failover.wait_address(tmp_path, EPOCH + 1, 0.1) == theirs


def test_a_store_error_while_recording_the_old_hosts_loss_is_logged_not_raised(tmp_path: Path) -> None:
    successor, mine, _ = _successor(tmp_path)
    roles = successor.store.roles
    roles.take_out = lambda report, fresh=False: Loss(0, "node1", 0, "shrink", None, 1, "no spare left")
    roles.start = lambda: None

    def record(loss: Loss) -> None:
        raise StoreLinkError("the new store is gone")

    roles.record = record
    successor.failover._connect = lambda address: True
    assert successor.failover._elect_and_connect(0.0)[0] == mine


def test_a_store_claimed_and_never_published_does_not_leave_the_job_alone(tmp_path, slurm) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2", "")
    assert store_failover.claim(tmp_path, store_failover.StoreAddress("node2", 1, 1, EPOCH))
    survivor.decide({2, 3})
    assert survivor.requeued == [(["node1", "node2"], False)]


def test_a_batch_host_that_answers_is_a_node_probe_of_the_store_host_and_nothing_is_requeued(
    tmp_path, slurm
) -> None:
    survivor = _Survivor(tmp_path)
    slurm["answer"] = _answers("node1,node2", "node1", "node1")
    survivor.decide({1})
    assert survivor.events == [
        ("node_probe", dict(lost_slot=0, lost_host="node1", responding=True, probe_s=0.2, note=None))
    ]
    assert survivor.lost == [] and survivor.requeued == [] and slurm["ended"] == []


def test_when_the_batch_host_answers_the_other_silent_nodes_are_still_recorded_lost(
    tmp_path, slurm
) -> None:
    survivor = _Survivor(tmp_path, nnodes=4, slot=1, store_slot=2)  # after an earlier failover
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node3,node4", "node1")
    survivor.decide({1})
    assert survivor.lost == [(2, "node3"), (3, "node4")] and survivor.requeued == []
    assert survivor.events == [
        ("node_probe", dict(lost_slot=2, lost_host="node3", responding=False, probe_s=0.2, note=None))
    ]


def test_when_slurm_cannot_tell_nothing_is_recorded(tmp_path, slurm) -> None:
    survivor = _Survivor(tmp_path)
    survivor.decide({1})
    assert slurm["asked"] and survivor.events == survivor.lost == survivor.requeued == []


def test_outside_slurm_nothing_is_asked(tmp_path, slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    survivor = _Survivor(tmp_path)
    survivor.decide({1})
    assert slurm["asked"] == [] and survivor.events == survivor.requeued == []


class _LostLink:
    """A store link lost meanwhile: a watch fails (as ``StoreLink.request`` does then)."""

    lost = "the server closed the connection"

    def watch(self, key: str) -> None:
        raise StoreLinkError(f"store unavailable: {self.lost}")


def test_a_rejected_word_to_keep_a_store_ready_as_the_store_is_lost_is_not_a_crash(
    tmp_path: Path,
) -> None:
    """A value of this slot's ``hold_store`` chain that does not unseal comes with the store's
    loss: watching past it fails, and that is logged; the loss that follows fails over (before,
    the error left the supervisor's loop, which ended with an internal error)."""
    job = local_job(nnodes=4, node_rank=2, log_dir=str(tmp_path))
    cfg = SupervisorConfig(command=["train"], job=job)
    rejected: list[str] = []
    roles = NodeRoles(cfg, _LostLink(), lambda kind, **f: None, lambda: SEALER,  # type: ignore[arg-type]
                      lambda key, reason, size: rejected.append(key))  # fmt: skip
    base = node_keys.hold_store(2)
    roles._watched[base] = SealedChain(base, SEALER)  # watched since ``prepare``
    store = SimpleNamespace(config=cfg, service=None, roles=roles, slot=0, epoch=0, lost_slot=0)
    failover = Failover(
        store, SimpleNamespace(stopping=False), None, None, None, None, None, lambda: None,  # type: ignore[arg-type]
    )  # fmt: skip
    key = SealedChain(base, SEALER).key(0)
    assert failover.on_message({"event": "key", "key": key, "value": "forged"})
    assert rejected == [key]



def test_a_survivor_alone_in_its_election_that_requeued_nothing_gives_its_claim_back(
    tmp_path, slurm
) -> None:
    """Slot 1 alone lost its link (the store served the others): its election at epoch 1
    found no majority, it claimed the requeue, the batch host answered and it stops. When
    the store host is lost for real, the others elect at epoch 1 too: one of them may claim
    the requeue then (before, the claim left behind kept every survivor from asking SLURM)."""
    alone = _Survivor(tmp_path, nnodes=4, slot=1)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1", "node1")
    alone.decide({1})
    assert slurm["asked"] and alone.requeued == []
    later = _Survivor(tmp_path, nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1", "")
    later.decide({2, 3})
    assert len(slurm["asked"]) == 2 and later.requeued == [(["node1"], False)]


def test_a_survivor_among_others_keeps_its_claim(tmp_path, slurm) -> None:
    """In an election of several survivors the claim stays, so that no second one asks."""
    first = _Survivor(tmp_path, nnodes=4, slot=1)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1", "node1")
    first.decide({1, 2})
    assert not _Survivor(tmp_path, nnodes=4, slot=2).failover._claims_requeue()
