"""Job-wide restarts across a store failover (``JobRestart.after_failover``): every node
counts on from what the new store shows, whatever it saw of the lost one.

The store is a dictionary behind the two calls sealed lists and chains make (``get``,
``append``, ``compare_set``), as the supervisor's store link answers them; the claims are
sealed with a job secret as the supervisors seal them.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.store import sealed_keys
from nvrx.store.seal import Sealer
from nvrx.supervisor.course import Course, CourseTracker
from nvrx.supervisor.job_restart import JobRestart, _key

SEALER = Sealer(b"s" * 32)


class _Link:
    """The new store, as a supervisor's store link sees it."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.watched: list[str] = []

    def get(self, key: str) -> str | None:
        return self.keys.get(key)

    def append(self, key: str, value: str) -> None:
        self.keys[key] = self.keys.get(key, "") + value

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        held = self.keys.get(key, "")
        if held == expected:
            self.keys[key] = desired
            return desired
        return held

    def watch(self, key: str) -> None:
        self.watched.append(key)


def _claim(link: _Link, epoch: int, by: int, store: int | None, **fields: Any) -> None:
    """A claim of restart ``epoch`` as a supervisor of store epoch ``store`` made it (None:
    one made before claims said which store)."""
    if store is not None:
        fields["store"] = store
    payload = sealed_keys.entry_payload(by, **fields)
    sealed_keys.append_entry(link, SEALER, _key(epoch, "claim"), payload)


def _node(link: _Link, epoch: int, pending: int | None, state: Course) -> JobRestart:
    """A node's job restarts after its failover to store epoch 1: it had taken part in
    ``epoch`` restarts and was in ``pending`` (its course ``state``) when the store was lost."""
    course = CourseTracker()
    course.to(Course.TRAINING)
    if state is Course.RESTARTING:
        course.to(Course.RESTARTING)
    store = SimpleNamespace(
        link=link, epoch=1, roles=None, config=SimpleNamespace(node_rank=0),
        known_sealer=lambda: SEALER,
    )  # fmt: skip
    control = SimpleNamespace(node_rank=0, kill_at=123.0 if pending else None)
    restart = JobRestart(store, course, control, None, None, set(), None)  # type: ignore[arg-type]
    restart.epoch, restart.pending = epoch, pending
    return restart


@pytest.mark.parametrize(
    ("epoch", "pending", "state"),
    [(1, None, Course.TRAINING), (2, 3, Course.RESTARTING), (0, None, Course.TRAINING)],
    ids=["behind", "in-a-restart-the-snapshot-lost", "far-behind"],
)
def test_every_node_counts_on_from_the_claims_the_new_store_kept(epoch, pending, state) -> None:
    link = _Link()
    _claim(link, 1, by=0, store=None)  # claimed before any failover, by an older version
    _claim(link, 2, by=1, store=0)  # (restart 3, claimed just before the loss, was not kept)
    node = _node(link, epoch, pending, state)
    node.after_failover()
    assert (node.epoch, node.pending) == (2, None)
    assert link.watched == [_key(3, "begin") + "/g1"]
    assert node.course.state is Course.TRAINING and node.control.kill_at is None


def test_a_restart_claimed_on_the_new_store_is_one_to_take_part_in() -> None:
    link = _Link()
    _claim(link, 1, by=0, store=0)
    _claim(link, 2, by=1, store=1)  # a fast node failed on the new store already
    node = _node(link, 1, None, Course.TRAINING)
    node.after_failover()
    assert node.epoch == 1 and link.watched == [_key(2, "begin") + "/g1"]


def test_a_nodes_end_claimed_on_the_lost_store_still_stops_the_next_failure() -> None:
    link = _Link()
    _claim(link, 1, by=0, store=0)
    _claim(link, 2, by=1, store=0, end=True, node=1)  # node 1's ranks had all completed
    node = _node(link, 1, None, Course.TRAINING)
    node.after_failover()
    assert node.epoch == 1  # the next failure claims 2 and finds the end claim: the job stops
    first = json.loads(sealed_keys.read_list(link, SEALER, _key(2, "claim")).first or "{}")
    assert first.get("end") is True


class _Roles:
    """Node roles that know which slots are still in the job."""

    def __init__(self, running: list[int]) -> None:
        self.running = running

    def running_slots(self) -> list[int]:
        return list(self.running)


@pytest.mark.parametrize(
    ("ready", "job_stops", "go"),
    [((0, 2), False, "1"), ((0, 2), True, None), ((0, 1), False, None)],
    ids=["job-goes-on", "job-stops", "lost-slots-entry-stands-for-no-one"],
)
def test_a_slot_lost_during_a_restart_lets_the_ready_ones_go_unless_the_job_stops(
    ready: tuple[int, int], job_stops: bool, go: str | None
) -> None:
    """Slots 0 and 2 are in the job, slot 1 was lost during restart 1: those ready go,
    unless the job stops; a ready entry of the lost slot stands for none still in the job
    (slot 2 still stops its ranks)."""
    link = _Link()
    for slot in ready:
        sealed_keys.count_up(link, SEALER, _key(1, "ready"), slot)
    node = _node(link, 0, 1, Course.RESTARTING)
    node.store.roles = _Roles([0, 2])
    node.slot_lost(job_stops=job_stops)
    assert sealed_keys.SealedChain(_key(1, "go"), SEALER).read(link) == go
