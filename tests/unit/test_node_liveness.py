"""Node liveness without a store: the ring watch, the failover election files, the options."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.node_agent import supervised
from nvrx.store.ring import OWN_CLAIM_EVERY, RingPlace, RingWatch
from nvrx.store.seal import Sealer
from nvrx.store.sealed_keys import entry_payload
from nvrx.supervisor import node_keys, store_failover
from nvrx.supervisor.cli import main
from nvrx.supervisor.config import ConfigError, SupervisorConfig, local_job
from nvrx.supervisor.store_failover import StoreAddress
from tests.support.waiting import wait_until


def test_each_slot_watches_the_next_one_that_has_not_ended() -> None:
    ring = RingWatch(own=1, nslots=4, timeout=3.0)
    assert ring.target == 2
    ring.ended_slot(2)
    assert ring.target == 3
    ring.ended_slot(3)
    assert ring.target == 0
    ring.ended_slot(0)
    assert ring.target is None  # alone: nobody to watch


def test_a_target_is_reported_once_after_timeout_without_a_beat() -> None:
    ring = RingWatch(own=0, nslots=3, timeout=3.0)
    assert ring.observe(5, now=10.0, wall=100.0) is None
    assert ring.observe(5, now=12.0, wall=102.0) is None
    assert ring.observe(6, now=12.5, wall=102.5) is None  # it beat: the clock restarts
    assert ring.observe(6, now=15.4, wall=105.4) is None
    report = ring.observe(6, now=15.6, wall=105.6)
    assert report == {
        "event": "node_silent",
        "slot": 1,
        "silent_s": 3.1,
        "last_seen_wall": 102.5,
    }
    assert ring.observe(6, now=20.0, wall=110.0) is None  # reported once
    ring.ended_slot(1)  # declared lost: the watch moves on, fresh
    assert ring.target == 2
    assert ring.observe(9, now=21.0, wall=111.0) is None


def test_a_target_seen_alive_otherwise_is_last_seen_then() -> None:
    """A target whose counter stands still but that the watcher learns is alive (its stamps
    moved) is silent from then on, and its report's last sign of life is that moment."""
    ring = RingWatch(own=0, nslots=2, timeout=3.0)
    assert ring.observe(5, now=0.0, wall=1000.0) is None
    ring.restart_clock(10.0, seen_wall=1010.0)
    assert ring.observe(5, now=12.0, wall=1012.0) is None  # 2 s since: within the timeout
    report = ring.observe(5, now=14.0, wall=1014.0)
    assert report is not None and (report["silent_s"], report["last_seen_wall"]) == (4.0, 1010.0)


def test_a_look_moves_past_ended_targets_and_reads_an_end_only_when_a_counter_stood_still() -> None:
    ring = RingWatch(own=0, nslots=4, timeout=3.0)
    counters, ended, asked = {1: 5, 2: 7, 3: 2}, {1, 2}, []

    def has_ended(slot: int, beats: int) -> bool:
        asked.append((slot, beats))
        return slot in ended

    assert ring.look(counters.get, has_ended) == 5  # a first read: it did not stand still yet
    assert ring.observe(5, now=1.0, wall=1.0) is None and asked == []
    assert ring.look(counters.get, has_ended) == 7  # 1 stood still and ended: on to 2, read once
    assert asked == [(1, 5)] and ring.target == 2
    ring.observe(7, now=2.0, wall=2.0)
    counters[2] = 8  # it beat: its end is not read
    assert ring.look(counters.get, has_ended) == 8 and asked == [(1, 5)] and ring.target == 2
    ring.observe(8, now=3.0, wall=3.0)
    assert ring.look(counters.get, has_ended) == 2 and ring.target == 3  # 2 stood still, ended
    ring.observe(2, now=4.0, wall=4.0)
    ended.add(3)
    assert ring.look(counters.get, has_ended) is None and ring.target is None  # alone


def test_a_slot_that_never_beat_is_given_the_startup_time() -> None:
    ring = RingWatch(own=0, nslots=2, timeout=1.0, startup_s=30.0)
    assert ring.observe(0, now=0.0, wall=0.0) is None
    assert ring.observe(0, now=29.0, wall=29.0) is None
    report = ring.observe(0, now=31.0, wall=31.0)
    assert report is not None and report["slot"] == 1


def test_the_lowest_announced_survivor_is_elected_and_one_address_wins(tmp_path: Path) -> None:
    for slot in (3, 1, 2):
        store_failover.announce(tmp_path, 1, slot)
    assert store_failover.elect(tmp_path, 1, expected={1, 2, 3}, settle_s=5.0, nslots=4).successor == 1
    first = StoreAddress("node2", 4000, 1, 1)
    assert store_failover.claim(tmp_path, first)
    assert not store_failover.claim(tmp_path, StoreAddress("node3", 4001, 2, 1))
    # claimed, not published yet: the old store is superseded, nobody connects to the new one
    assert store_failover.claimed(tmp_path, 1) and not store_failover.claimed(tmp_path, 2)
    assert store_failover.superseded(tmp_path, 0) and not store_failover.superseded(tmp_path, 1)
    assert store_failover.wait_address(tmp_path, 1, timeout=0.1) is None
    store_failover.publish(tmp_path, first)
    assert store_failover.wait_address(tmp_path, 1, timeout=1.0) == first
    store_failover.reset(tmp_path)  # node 0 of the next run with this job id
    assert not store_failover.superseded(tmp_path, 0)


def test_a_minority_cut_off_never_elects_a_store_and_one_of_it_asks_slurm(tmp_path: Path) -> None:
    store_failover.announce(tmp_path, 1, 2)
    store_failover.announce(tmp_path, 1, 3)
    election = store_failover.elect(tmp_path, 1, expected={1, 2, 3}, settle_s=0.2, nslots=4)
    assert election == store_failover.Election(frozenset({2, 3}), None)
    for slot in (2, 3):
        store_failover.withdraw(tmp_path, 1, slot)
    assert not list(store_failover.epoch_dir(tmp_path, 1).glob("alive-*"))  # none announced
    assert [store_failover.claim_requeue(tmp_path, 1, slot) for slot in (3, 2)] == [True, False]


def test_an_election_settles_without_the_slots_that_never_announce(tmp_path: Path) -> None:
    for slot in (3, 1, 4):
        store_failover.announce(tmp_path, 2, slot)
    assert store_failover.elect(tmp_path, 2, expected={1, 2, 3, 4}, settle_s=0.2, nslots=5).successor == 1
    assert store_failover.wait_address(tmp_path, 2, timeout=0.1) is None


@pytest.mark.parametrize(
    ("nnodes", "settings", "message"),
    [
        (2, {"spare_nodes": 2}, "--spare-nodes must be in 0..1"),
        (3, {"spare_nodes": 1, "min_nodes": 3}, "--min-nodes must be in 1..2"),
        (3, {"min_nodes": 0}, "--min-nodes must be in 1..3"),
        (2, {"node_timeout": 1.5, "node_heartbeat": 1.0}, "--node-timeout must be at least"),
        (2, {"node_heartbeat": 0.0}, "--node-heartbeat must be > 0"),
    ],
)
def test_bad_node_options_name_the_fix(nnodes: int, settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SupervisorConfig(command=["true"], job=local_job(nnodes=nnodes), **settings)


def test_spare_slots_are_the_last_ones_and_do_not_count_in_the_world() -> None:
    job = local_job(nnodes=4, node_rank=3, nproc_per_node=2)
    cfg = SupervisorConfig(command=["true"], job=job, spare_nodes=1)
    assert cfg.active_nodes == 3 and cfg.starts_as_spare and cfg.world_size == 6
    assert cfg.least_nodes == 3  # never shrink unless --min-nodes says so
    env = cfg.child_env(1, 1, base={}, node_rank=1)
    assert (env["RANK"], env["WORLD_SIZE"], env["NVRX_NNODES"]) == ("3", "6", "3")


@pytest.mark.parametrize(
    "argv",
    [
        ["--nnodes", "2", "--spare-nodes", "2", "--", "true"],
        ["--nnodes", "3", "--spare-nodes", "1", "--min-nodes", "3", "--", "true"],
        ["--nnodes", "2", "--node-timeout", "0.5", "--node-heartbeat", "1", "--", "true"],
    ],
)
def test_bad_node_options_are_one_line_errors_with_exit_2(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvrx-supervise: error: --") and err.count("\n") == 1


class _CountingStore:
    """A torch HashStore that counts the requests a node watch sends it."""

    def __init__(self) -> None:
        from torch.distributed import HashStore

        self.store, self.requests = HashStore(), 0

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        return int(self.store.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.requests += 1
        return self.store.compare_set(key, expected, desired)


SEALER = Sealer(bytes(range(32)), 0)
FORGER = Sealer(bytes(range(1, 33)), 0)  # a client with another secret


def slot_place(
    own: int,
    nslots: int,
    timeout: float,
    sealer: Sealer,
    startup_s: float | None = None,
    job_dir: str | None = None,
    store_name: str = "",
) -> RingPlace:
    """Slot ``own``'s place in the supervisors' ring, as its node agent builds it from its
    supervisor's ``liveness`` request: with ``job_dir``, stamps in the store's folder."""
    stamps = None if job_dir is None else store_failover.beats_dir(Path(job_dir), store_name)
    return RingPlace(node_keys.RING, own, nslots, timeout, sealer, startup_s, stamps)


def _claim(store, slot: int, by: int, sealer=SEALER) -> None:
    """Append a claim on ``slot``'s end as ``NodeRoles`` does (``FORGER``: a forged one)."""
    store.store.append(node_keys.claim(slot), sealer.entry(node_keys.claim(slot), entry_payload(by)))


class _Slot:
    """A node agent's node duty beating in its slot's place at the test's ``clock``."""

    def __init__(self, sent: list, clock: list[float], **place) -> None:
        from nvrx.node_agent.supervised import NodeDuty

        self.duty, self.clock = NodeDuty(sent.append, None), clock
        self.duty.place = self.place = slot_place(sealer=SEALER, **place)

    @property
    def ring(self):
        return self.place.ring

    def tick(self, store) -> bool:
        return self.duty.beat(store, self.clock[0])


def _watch(own: int = 0):
    clock = [100.0]
    store, sent = _CountingStore(), []
    return _Slot(sent, clock, own=own, nslots=3, timeout=4.0), store, sent, clock


def test_a_node_watch_sends_two_requests_per_beat_and_still_sees_ends() -> None:
    watch, store, sent, clock = _watch()
    assert watch.tick(store)  # the first beat reads its own claim too
    assert watch.ring.target == 1 and store.requests == 3
    store.requests = 0
    for _ in range(OWN_CLAIM_EVERY - 1):
        clock[0] += 1.0
        store.store.add(node_keys.alive(1), 1)  # slot 1 beats
        assert watch.tick(store)
    assert store.requests == 2 * (OWN_CLAIM_EVERY - 1)  # beat + one read, no claims
    # slot 1 ends (its claim is taken) and stops beating: the watch moves on to slot 2
    _claim(store, 1, by=1)
    store.requests = 0
    clock[0] += 1.0
    assert watch.tick(store)
    # beat OWN_CLAIM_EVERY + 1 reads its own claim in place of slot 1's count: two requests
    assert watch.ring.target == 1 and store.requests == 2
    store.requests = 0
    clock[0] += 1.0
    assert watch.tick(store)
    assert watch.ring.target == 2 and sent == []
    # the next beat: slot 1's count stood still, so its claim, then slot 2's count
    assert store.requests == 1 + 2 + 1


def test_no_beat_after_the_first_sends_more_than_two_requests() -> None:
    """While the watched slot beats, store load is two requests per node per interval, the rare
    own-claim read included; its silence is still reported."""
    watch, store, sent, clock = _watch()
    assert watch.tick(store)
    for beat in range(3 * OWN_CLAIM_EVERY):
        store.requests = 0
        clock[0] += 1.0
        store.store.add(node_keys.alive(1), 1)  # slot 1 beats
        assert watch.tick(store)
        assert store.requests == 2, beat
    for _ in range(6):  # slot 1 falls silent (timeout 4 s): its claim is read too meanwhile
        clock[0] += 1.0
        assert watch.tick(store)
    assert [(r["event"], r["slot"]) for r in sent] == [("node_silent", 1)]


def test_a_slot_declared_lost_learns_it_from_its_own_next_beat() -> None:
    """A thawed slot's first beat may come before the others' declaration lands: the fence
    that the declaration adds to its counter shows at its next beat, with no claim read."""
    watch, store, sent, clock = _watch()
    assert watch.tick(store)
    clock[0] += 3.0  # frozen past half the timeout: late, not declared lost yet
    assert watch.tick(store)
    _claim(store, 0, by=2)  # the declaration lands after that beat,
    store.store.add(node_keys.alive(0), node_keys.FENCE)  # as NodeRoles._end makes it
    store.requests = 0
    clock[0] += 1.0
    assert not watch.tick(store)
    assert sent == [{"event": "fenced", "slot": 0}]
    assert store.requests == 2  # the beat, and the claim behind the fence it showed


def test_a_claim_without_its_fence_is_found_by_the_rare_own_claim_read() -> None:
    """A declarer that ended between its claim and its fence: the slot still learns it."""
    watch, store, sent, clock = _watch()
    assert watch.tick(store)
    _claim(store, 0, by=2)
    for _ in range(OWN_CLAIM_EVERY - 1):
        clock[0] += 1.0
        store.store.add(node_keys.alive(1), 1)
        assert watch.tick(store)
    assert sent == []
    clock[0] += 1.0
    assert not watch.tick(store)
    assert sent == [{"event": "fenced", "slot": 0}]


def test_a_watch_started_on_a_store_that_failed_over_reads_its_claim_first() -> None:
    """A successor store keeps the claims, not the counters (nor their fences)."""

    watch, store, sent, _clock = _watch()
    _claim(store, 0, by=2)  # restored from the snapshot
    assert not watch.tick(store)
    assert sent == [{"event": "fenced", "slot": 0}]


def test_a_forged_fence_and_claim_are_rejected_once_and_a_real_one_still_fences() -> None:
    """A client without the job's secret appends a claim and adds a fence, as a declarer
    would: the slot reports one rejection and beats on; a later real declaration fences it."""
    watch, store, sent, clock = _watch()
    assert watch.tick(store)
    _claim(store, 0, by=2, sealer=FORGER)
    store.store.add(node_keys.alive(0), node_keys.FENCE)
    for _ in range(3):
        clock[0] += 1.0
        store.store.add(node_keys.alive(1), 1)
        assert watch.tick(store)
    [rejected] = sent
    assert rejected["event"] == "rejected" and rejected["key"] == node_keys.claim(0)
    assert rejected["value_bytes"] > 0
    store.store.add(node_keys.alive(0), node_keys.FENCE)  # a fence alone: one more rejection
    clock[0] += 1.0
    assert watch.tick(store)
    assert [m["key"] for m in sent] == [node_keys.claim(0), node_keys.alive(0)]
    _claim(store, 0, by=2)  # the real declaration, behind the forged entry
    store.store.add(node_keys.alive(0), node_keys.FENCE)
    clock[0] += 1.0
    assert not watch.tick(store)
    assert sent[-1] == {"event": "fenced", "slot": 0} and len(sent) == 3


def test_a_forged_claim_neither_ends_a_watched_slot_nor_hides_a_real_end() -> None:
    watch, store, sent, clock = _watch()
    assert watch.tick(store) and watch.ring.target == 1
    _claim(store, 1, by=0, sealer=FORGER)  # slot 1 falls silent with a forged claim on it
    for _ in range(6):
        clock[0] += 1.0
        assert watch.tick(store)
    assert watch.ring.target == 1  # still watched: the forged claim ended nothing
    assert [(m["event"], m["slot"]) for m in sent] == [("node_silent", 1)]
    _claim(store, 1, by=0)  # slot 0 declares it lost, after the forged entry
    clock[0] += 1.0
    assert watch.tick(store) and watch.ring.target == 2


def test_a_sealed_claim_from_an_earlier_run_ends_nothing() -> None:
    earlier = Sealer(SEALER.secret, run=0)
    entry = earlier.entry(node_keys.claim(1), entry_payload(0))
    later = Sealer(SEALER.secret, run=1)
    assert later.entries(node_keys.claim(1), entry).valid == ()
    assert later.entries(node_keys.claim(2), None).invalid == 0
    assert earlier.entries(node_keys.claim(2), entry).invalid == 1  # another slot's key: refused too


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user (uid 65534)")
def test_another_user_can_neither_announce_nor_claim_a_failover_epoch() -> None:
    """The failover election is not in the store but in the job's folder, which is
    owner-only: a process of another user that reaches the folder's parent can neither
    take part in an election nor claim the next store for an address of its own."""
    from nvrx.supervisor.job_secret import private_job_dir

    parent = Path(tempfile.mkdtemp(prefix="nvrx-election-"))
    try:
        parent.chmod(0o755)  # the log folder: others may look into it
        job_dir = parent / "job"
        private_job_dir(job_dir)
        store_failover.announce(job_dir, 1, 0)  # a survivor's own announcement
        pid = os.fork()
        if pid == 0:  # the other user
            refused = 0
            try:
                os.setgid(65534)
                os.setuid(65534)
                for attempt in (
                    lambda: store_failover.announce(job_dir, 1, 5),
                    lambda: store_failover.claim(job_dir, StoreAddress("elsewhere", 1, 5, 1)),
                    lambda: store_failover.publish(job_dir, StoreAddress("elsewhere", 1, 5, 1)),
                ):
                    try:
                        attempt()
                    except PermissionError:
                        refused += 1
            finally:
                os._exit(refused)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3  # each attempt refused
        assert store_failover.elect(job_dir, 1, {0}, 0.0, 1).successor == 0
        assert not store_failover.claimed(job_dir, 1)
        assert store_failover.read_address(store_failover.epoch_dir(job_dir, 1) / "store.json") is None
    finally:
        shutil.rmtree(parent)


def test_node_0_forgets_every_earlier_runs_failover_files_and_a_run_its_own_at_its_end(
    tmp_path: Path, monkeypatch
) -> None:
    """A killed run leaves its snapshot and failover files (its store host could not tell
    its kill from its loss): the next run's node 0 removes them; a run that ended removes
    its own, and the folders once empty."""
    for run in ("0", "1"):
        monkeypatch.setenv("SLURM_RESTART_COUNT", run)
        store_failover.snapshot_path(tmp_path).parent.mkdir(exist_ok=True)
        store_failover.snapshot_path(tmp_path).write_text("{}")
        store_failover.announce(tmp_path, 1, 0)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    store_failover.reset(tmp_path)
    assert list((tmp_path / "store").iterdir()) == [] and list((tmp_path / "failover").iterdir()) == []
    for epoch, slot in ((0, 0), (1, 1), (1, 2)):  # node 0's store's, its successor's, a loser's
        store_failover.snapshot_path(tmp_path, epoch, slot).write_text("{}")
    store_failover.announce(tmp_path, 1, 0)
    store_failover.forget_run(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_beat_counter_set_back_by_another_client_is_reported_at_each_set_back() -> None:
    """Deleting a slot's counter, or adding a negative amount after each beat, holds the slot
    still for its watcher: the slot's next beat reads a count not above its last and reports
    it; a fence (which raises the count) is no set-back."""
    watch, store, sent, clock = _watch(own=1)
    alive = node_keys.alive(1)
    for _ in range(3):
        assert watch.tick(store)
        clock[0] += 1.0
    assert sent == []
    store.store.add(alive, -1)  # held still: the next beat reads what the last one did
    assert watch.tick(store)
    store.store.delete_key(alive)  # deleted: the next beat reads 1
    assert watch.tick(store)
    assert [(r["event"], r["key"]) for r in sent] == [("rejected", alive)] * 2
    assert "set back from 3 to 2" in sent[0]["reason"] and "from 3 to 0" in sent[1]["reason"]
    store.store.add(alive, 5)  # another client's beat: more, not less
    assert watch.tick(store)
    assert len(sent) == 2


def test_a_set_back_is_reported_before_a_look_that_fails(monkeypatch) -> None:
    """What a tick found goes out as it is found: a set-back's report is sent even when the
    look at the watched slot then fails (the store went)."""
    watch, store, sent, clock = _watch()
    for _ in range(2):
        assert watch.tick(store)
        clock[0] += 1.0
    store.store.add(node_keys.alive(0), -1)
    real_add = store.add

    def add(key: str, amount: int) -> int:
        if key != node_keys.alive(0):
            raise ConnectionError("the store is gone")
        return real_add(key, amount)

    monkeypatch.setattr(store, "add", add)
    with pytest.raises(ConnectionError):
        watch.tick(store)
    assert [r["event"] for r in sent] == ["rejected"]
    assert "not a write of this job's supervisors" in sent[0]["reason"]


STORE_NAME = "127.0.0.1-29501"
#: The wall clock of the node agents below, less their monotonic test clock.
WALL = 1_700_000_000.0


def _pair(job_dir, names=(STORE_NAME, STORE_NAME)):
    """Slot 0 watching slot 1 on one store, with ``job_dir`` as their job folder; ``names``,
    the store each slot's watch says it beats in (its host and port)."""
    clock = [100.0]
    store, sent = _CountingStore(), {0: [], 1: []}
    watches = [
        _Slot(sent[own], clock, own=own, nslots=2, timeout=3.0, job_dir=job_dir,
              store_name=names[own])  # three beats
        for own in (0, 1)
    ]  # fmt: skip
    return watches, store, sent, clock


def _held_still(watches, store, clock, beats: int, slot_1_beats: bool = True) -> None:
    """``beats`` intervals in which a client sets slot 1's counter back after each of its beats."""
    for _ in range(beats):
        if slot_1_beats:
            assert watches[1].tick(store)
            store.store.add(node_keys.alive(1), -1)
        assert watches[0].tick(store)
        clock[0] += 1.0


@pytest.mark.parametrize("shared", [True, False], ids=["job-folder", "no-job-folder"])
def test_a_slot_held_still_in_the_store_is_not_found_silent_while_it_stamps_the_job_folder(
    tmp_path, shared, monkeypatch
) -> None:
    """A client sets slot 1's counter back after each of its beats, for five times the node
    timeout (three heartbeats, the least this holds for): slot 1 reports each set-back, and its watcher, which reads its stamps in the
    job folder, does not find it silent (without the folder it does, as before). Once slot 1
    stops beating altogether, it is found silent within the timeout."""
    monkeypatch.setattr(supervised, "time", SimpleNamespace(
        monotonic=time.monotonic, time=lambda: WALL + clock[0]))  # fmt: skip
    watches, store, sent, clock = _pair(str(tmp_path) if shared else None)
    _held_still(watches, store, clock, 16)
    assert [r["key"] for r in sent[1]] == [node_keys.alive(1)] * 15  # each set-back but the last
    silent = [r for r in sent[0] if r["event"] == "node_silent"]
    if not shared:
        assert [r["slot"] for r in silent] == [1]  # a healthy node found silent
        return
    assert silent == [] and (store_failover.beats_dir(tmp_path, STORE_NAME) / "1").exists()
    _held_still(watches, store, clock, 5, slot_1_beats=False)  # slot 1 dies
    (silent,) = [r for r in sent[0] if r["event"] == "node_silent"]
    assert silent["slot"] == 1
    # its last sign of life: its last stamp, read at the last tick of the held stretch
    assert silent["last_seen_wall"] == WALL + 115.0, silent


def test_a_slot_that_stamps_for_another_store_does_not_keep_its_watcher_quiet(
    tmp_path
) -> None:
    """Slot 1 beats in an old store (cut off with it after a failover) and stamps there; its
    watcher, in the new store's ring, reads the new store's stamps: slot 1 is found silent."""
    from nvrx.supervisor import store_failover

    watches, store, sent, clock = _pair(
        str(tmp_path), names=(STORE_NAME, "127.0.0.1-29999")
    )
    _held_still(watches, store, clock, 16)
    assert (store_failover.beats_dir(tmp_path, "127.0.0.1-29999") / "1").exists()
    assert not (store_failover.beats_dir(tmp_path, STORE_NAME) / "1").exists()
    assert [r["slot"] for r in sent[0] if r["event"] == "node_silent"] == [1]


def test_a_forged_fence_set_back_does_not_hide_a_real_fence_after_it() -> None:
    """A forged fence raises the count a real one is measured from; a client that then takes
    it back (a set-back) must not leave a later real fence below that mark."""
    watch, store, sent, clock = _watch()
    assert watch.tick(store)
    _claim(store, 0, by=2, sealer=FORGER)
    store.store.add(node_keys.alive(0), node_keys.FENCE)
    clock[0] += 1.0
    assert watch.tick(store)  # rejected: no valid claim behind the fence
    store.store.add(node_keys.alive(0), -node_keys.FENCE)  # the forged fence taken back
    clock[0] += 1.0
    assert watch.tick(store)
    assert [r["key"] for r in sent] == [node_keys.claim(0), node_keys.alive(0)]
    _claim(store, 0, by=2)  # a real declaration, then its fence
    store.store.add(node_keys.alive(0), node_keys.FENCE)
    clock[0] += 1.0
    assert not watch.tick(store)
    assert sent[-1] == {"event": "fenced", "slot": 0}


def test_a_stamp_counts_when_it_appears_or_changes_within_a_stretch_not_when_found_there(
    tmp_path
) -> None:
    from nvrx.supervisor import store_failover

    watches, _store, _sent, _clock = _pair(str(tmp_path))
    watch, stamp = watches[0], store_failover.beats_dir(tmp_path, STORE_NAME) / "1"
    assert not watch.place._stamp_moved(1)  # absent, first read
    stamp.parent.mkdir(parents=True)
    stamp.write_text("7")
    assert watch.place._stamp_moved(1)  # it appeared: the slot started stamping
    assert not watch.place._stamp_moved(1)  # the same stamp: no beat since
    watch.place._stamp_read.pop(1)  # the counter moved: a new stretch
    assert not watch.place._stamp_moved(1)  # an old stamp found there is no beat
    stamp.write_text("8")
    assert watch.place._stamp_moved(1)


class _Frozen:
    """A store host that froze: a request waits until ``thawed`` (its connection stays
    open), then fails."""

    def __init__(self) -> None:
        self.thawed = threading.Event()

    def add(self, key: str, amount: int) -> int:
        self.thawed.wait()
        raise ConnectionError("the store came back too late")

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.add(key, 0)


def test_the_node_agents_ring_beat_has_a_thread_of_its_own_until_fenced() -> None:
    from nvrx.node_agent.supervised import NodeDuty

    store, sent = _CountingStore(), []
    duty = NodeDuty(sent.append, None)
    # its target never beats: given far longer than this test lasts, it is never reported
    duty.watch_ring(
        slot_place(0, 3, 4.0, SEALER, startup_s=600.0), lambda: store, interval=0.02, timeout=4.0
    )
    wait_until("three beats", lambda: int(store.store.add(node_keys.alive(0), 0)) >= 3, 30)
    with pytest.raises(ValueError, match="beats for slot 0 already"):
        duty.watch_ring(slot_place(0, 3, 4.0, SEALER), lambda: store, interval=0.02, timeout=4.0)
    _claim(store, 0, by=2)
    store.store.add(node_keys.alive(0), node_keys.FENCE)  # declared lost, as NodeRoles does
    assert duty.ring_thread is not None
    duty.ring_thread.join(30)
    assert not duty.ring_thread.is_alive() and duty.stopped.is_set()
    assert sent == [{"event": "fenced", "slot": 0}]


def test_a_store_that_holds_a_ring_beat_past_the_timeout_is_reported_lost_once() -> None:
    from nvrx.node_agent.supervised import NodeDuty

    frozen, sent = _Frozen(), []
    duty = NodeDuty(sent.append, None)
    duty.watch_ring(slot_place(0, 3, 0.2, SEALER), lambda: frozen, interval=0.05, timeout=0.2)
    wait_until("the store reported lost", lambda: sent, 30)
    frozen.thawed.set()  # the beat then fails as well: not told a second time
    assert duty.ring_thread is not None
    duty.ring_thread.join(30)
    assert [m["event"] for m in sent] == ["lost"], sent
    assert sent[0]["message"].startswith("the store did not answer a heartbeat for ")


class _FreezesLater(_CountingStore):
    """A store host that answers until ``frozen`` is set, then holds every request."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.froze_wall = threading.Event(), 0.0
        self.answered_walls: list[float] = []

    def add(self, key: str, amount: int) -> int:
        if self.frozen.is_set():
            threading.Event().wait()  # held for good: the test's daemon thread
        self.answered_walls.append(time.time())
        return super().add(key, amount)


def test_a_lost_store_is_reported_with_when_its_last_answered_beat_was_sent() -> None:
    """The survivors count the store host's loss from its last answer, not from when they
    noticed: what their ranks wrote once it was gone then follows from the loss."""
    from nvrx.node_agent.supervised import NodeDuty

    store, sent = _FreezesLater(), []
    duty = NodeDuty(sent.append, None)
    # its target never beats: given far longer than this test lasts, so that a test held up
    # past 0.3 s before the store freezes does not get that slot reported instead
    place = slot_place(0, 3, 0.3, SEALER, startup_s=600.0)
    duty.watch_ring(place, lambda: store, interval=0.02, timeout=0.3)
    wait_until("three beats", lambda: int(store.store.add(node_keys.alive(0), 0)) >= 3, 30)
    store.frozen.set()
    froze = time.time()
    wait_until("the store reported lost", lambda: sent, 30)
    [lost] = sent
    assert lost["event"] == "lost" and lost["answered_wall"] is not None, lost
    assert lost["answered_wall"] <= froze <= time.time(), lost
    assert lost["answered_wall"] <= max(store.answered_walls), lost


def test_a_beat_waits_for_the_store_in_the_time_its_own_process_ran() -> None:
    from nvrx.node_agent.supervised import BeatOverdue

    overdue = BeatOverdue(interval=0.5, now=100.0)
    assert overdue.late(None, 100.5) == 0.0  # no beat in flight
    assert overdue.late(100.6, 101.0) == pytest.approx(0.4)
    assert overdue.late(100.6, 101.6) == pytest.approx(1.0)  # a late wake (1 s; interval 0.5) counts
    assert overdue.late(100.6, 102.9) == pytest.approx(1.5)  # 1.3 s: 0.8 s of it this process stopped
    assert overdue.late(None, 103.0) == 0.0  # the beat came back
    assert overdue.late(103.2, 103.5) == pytest.approx(0.3)  # the next one counts from its start


def test_a_node_stopped_during_a_beat_counts_only_the_time_it_ran() -> None:
    from nvrx.node_agent.supervised import BeatOverdue

    overdue = BeatOverdue(interval=0.5, now=100.0)
    assert overdue.late(100.2, 100.5) == pytest.approx(0.3)
    # stopped from 100.5 to 110 with the beat in flight: 9.5 s between two wakes
    assert overdue.late(100.2, 110.0) == pytest.approx(0.8)
    assert overdue.late(100.2, 110.5) == pytest.approx(1.3)
    # stopped for less than the timeout (here 1.5 s) counts out too
    assert overdue.late(100.2, 112.0) == pytest.approx(1.8)
    # however late every wake comes, each adds an interval: a store that never answers is told
    assert [round(overdue.late(100.2, 112.0 + 2 * i), 6) for i in (1, 2, 3)] == [2.3, 2.8, 3.3]


def test_a_stop_before_a_beat_started_is_not_taken_off_its_wait() -> None:
    from nvrx.node_agent.supervised import BeatOverdue

    overdue = BeatOverdue(interval=0.5, now=100.0)
    assert overdue.late(None, 100.5) == 0.0
    # stopped from 100.5 to 160 between beats; at the thaw the next beat starts (160.0)
    # before the watchdog's first wake (160.001): at most those 0.001 s are taken off
    assert overdue.late(160.0, 160.001) == 0.0
    assert [round(overdue.late(160.0, t), 6) for t in (160.5, 161.0, 161.5)] == [0.499, 0.999, 1.499]


class _HeldClock:
    """The node agent's clock, which a test moves on (a stop of the whole process, as its
    threads see it), and how often the watchdog read it."""

    def __init__(self) -> None:
        import time

        self._time, self.offset, self.watchdog_reads = time, 0.0, 0

    def monotonic(self) -> float:
        if threading.current_thread().name == "node-watchdog":
            self.watchdog_reads += 1
        return self._time.monotonic() + self.offset

    def time(self) -> float:
        return self._time.time()


class _HeldStore(_CountingStore):
    """A store whose answer to slot 0's beat is held once ``hold`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.waiting = threading.Event(), threading.Event()

    def add(self, key: str, amount: int) -> int:
        if key == node_keys.alive(0) and self.hold.is_set():
            self.waiting.set()
            wait_until("the test to let the beat's answer go", lambda: not self.hold.is_set(), 60)
        return super().add(key, amount)


def test_a_node_stopped_while_its_beat_waits_does_not_blame_the_store_at_its_thaw(monkeypatch) -> None:
    from nvrx.node_agent import supervised

    clock, store, sent = _HeldClock(), _HeldStore(), []
    monkeypatch.setattr(supervised, "time", clock)
    duty = supervised.NodeDuty(sent.append, None)
    place = slot_place(0, 3, 1.0, SEALER, startup_s=600.0)  # its target never beats: no matter
    duty.watch_ring(place, lambda: store, interval=0.05, timeout=1.0)
    wait_until("three beats", lambda: int(store.store.add(node_keys.alive(0), 0)) >= 3, 30)
    store.hold.set()
    wait_until("a beat waiting for the store", store.waiting.is_set, 30)
    # the process was stopped for 0.9 s, its beat in flight: less than the timeout, but the
    # beat's wait may not count it, for it goes on waiting 0.4 s in time the process runs
    clock.offset += 0.9
    reads = clock.watchdog_reads
    wait_until("eight looks of the watchdog after the thaw", lambda: clock.watchdog_reads >= reads + 8 or sent, 30)
    assert sent == []
    store.hold.clear()  # the answer read at the thaw
    beats = int(store.store.add(node_keys.alive(0), 0))
    wait_until("more beats", lambda: int(store.store.add(node_keys.alive(0), 0)) >= beats + 3, 30)
    assert sent == []
    # a store that then holds a beat past the timeout, in time the process ran, is lost
    store.hold.set()
    wait_until("the store reported lost", lambda: sent, 30)
    store.hold.clear()
    assert [m["event"] for m in sent] == ["lost"], sent
    assert duty.ring_thread is not None
    duty.ring_thread.join(30)


def test_a_frozen_store_does_not_hold_the_ranks_beats(tmp_path: Path) -> None:
    """While the ring's beat waits for a store that froze, the node's rank beats are read
    and told as they come: the beat loop does not wait for the store."""
    import time

    from nvrx.node_agent.rank_wire import Beat, BeatSender, BeatSocket
    from nvrx.node_agent.supervised import NodeDuty

    frozen, sent = _Frozen(), []
    sock = BeatSocket(str(tmp_path / "beats.sock"))
    duty = NodeDuty(sent.append, sock)
    duty.watch_ring(slot_place(0, 3, 60.0, SEALER), lambda: frozen, interval=0.05, timeout=60.0)
    thaw = threading.Timer(60, frozen.thawed.set)  # a loop that waited for the store fails, not hangs
    thaw.start()
    try:
        wait_until("the ring's beat to wait for the store", lambda: duty._beat_started is not None, 30)
        assert BeatSender(sock.path).send(Beat(initial_rank=0, pid=4242, round=0))
        assert duty.loop is not None
        wait_until("the beat told", lambda: duty.loop.look(time.monotonic()) or sent, 30)
        assert sent[:2] == [{"event": "wrapper_pid", "pid": 4242}, {"event": "rank_in_round", "pid": 4242}]
        assert duty._beat_started is not None  # the ring's beat still waits
    finally:
        thaw.cancel()
        frozen.thawed.set()
        if duty.ring_thread is not None:
            duty.ring_thread.join(30)
        sock.close()


def test_a_store_that_cannot_be_reached_is_reported_lost() -> None:
    from nvrx.node_agent.supervised import NodeDuty

    def refused() -> Any:
        raise ConnectionRefusedError("nobody listens")

    sent: list[dict[str, Any]] = []
    duty = NodeDuty(sent.append, None)
    duty.watch_ring(slot_place(0, 3, 1.0, SEALER), refused, interval=0.05, timeout=1.0)
    assert duty.ring_thread is not None
    duty.ring_thread.join(30)
    assert sent == [
        {"event": "lost", "message": "node watch: ConnectionRefusedError: nobody listens",
         "answered_wall": None}  # it never answered
    ]  # fmt: skip
