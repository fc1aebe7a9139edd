"""Job-wide restarts across a store failover (``JobRestart.after_failover``): every node
counts on from what the new store shows, whatever it saw of the lost one; and a ready slot's
wait for the others: its end, with and without node liveness.

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
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course, CourseTracker
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.job_restart import JobRestart, _key
from nvrx.supervisor.store_link import StoreLinkError

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


class _Control:
    """The supervisor as a ready slot's wait sees it: its events, stops and declarations."""

    def __init__(self) -> None:
        self.node_rank, self.kill_at = 0, None
        self.events: list[dict[str, Any]] = []
        self.stops: list[tuple[str, int]] = []
        self.declared: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, **fields})

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        self.stops.append((reason, exit_code))

    def declare_lost(self, report: dict[str, Any]) -> None:
        self.declared.append(report)


class _LiveRoles(_Roles):
    """Node roles with node liveness on, for this slot (0), in a job of slots 0 to 2."""

    enabled, slot, store_slot = True, 0, 0

    def __init__(self, lost: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__([s for s in range(3) if s not in lost])

    def ended(self, slot: int) -> bool:
        return slot not in self.running


def _waiting(link: Any, liveness: bool, ready: tuple[int, ...] = (0, 1)) -> JobRestart:
    """A slot ready for restart 1 with the others of ``ready``, past the end of its wait for
    the last of slots 0 to 2."""
    for slot in ready:
        sealed_keys.count_up(link, SEALER, _key(1, "ready"), slot)
    config = SupervisorConfig(
        ["train"], job=local_job(nnodes=3), grace_period=1, store_timeout=8, node_timeout=2,
        node_liveness=liveness,
    )  # fmt: skip
    store = SimpleNamespace(
        link=link, epoch=0, config=config, roles=_LiveRoles() if liveness else None,
        known_sealer=lambda: SEALER,
    )  # fmt: skip
    course = CourseTracker()
    course.to(Course.TRAINING)
    course.to(Course.RESTARTING)
    ranks = SimpleNamespace(running=lambda: [])
    restart = JobRestart(store, course, _Control(), ranks, None, set(), None)  # type: ignore[arg-type]
    restart.pending, restart._ready, restart._ready_by = 1, 1, 0.0  # ready, and the wait is over
    return restart


def test_with_liveness_a_slot_never_ready_is_declared_lost_as_a_silent_one_is() -> None:
    """Its node agent beats for a supervisor that is stuck: the wait ends after
    grace_period + store_timeout + node_timeout, and the slot goes the silent slots' way."""
    restart = _waiting(_Link(), liveness=True)
    assert restart.ready_limit() == 11
    restart.progress()
    control = restart.control
    assert control.declared == [
        {"event": "node_silent", "slot": 2, "cause": "never_ready", "silent_s": None}
    ]
    timed_out = [e for e in control.events if e.get("phase") == "timed_out"]
    assert [(e["missing"], e["limit_s"]) for e in timed_out] == [([2], 11)]
    assert control.stops == [] and restart.ready_deadline() is None


def test_with_liveness_a_store_host_never_ready_stops_the_job_instead() -> None:
    """Declared lost while its store serves, it would take that store down once it ran
    again: the job stops, naming it and the settings the wait added up."""
    restart = _waiting(_Link(), liveness=True, ready=(1, 2))
    restart.progress()
    control = restart.control
    assert control.declared == [] and len(control.stops) == 1
    reason, code = control.stops[0]
    assert code == ExitCode.PEER_LOST and "slot(s) 0 never became ready within 11 s" in reason
    assert "--grace-period 1 s + --store-timeout 8 s + --node-timeout 2 s" in reason
    assert "store's host" in reason


def test_without_liveness_a_slot_never_ready_stops_the_job_naming_what_to_raise() -> None:
    restart = _waiting(_Link(), liveness=False)
    assert restart.ready_limit() == 9
    restart.progress()
    control = restart.control
    assert control.declared == [] and len(control.stops) == 1
    reason, code = control.stops[0]
    assert code == ExitCode.PEER_LOST and "slot(s) 2" in reason
    assert reason.endswith("raise fork_and_monitor's store_timeout")


class _Unanswered(_Link):
    """A store whose lists cannot be read (its link failed)."""

    def get(self, key: str) -> str | None:
        raise StoreLinkError("no answer")


def test_with_liveness_a_wait_the_store_cannot_tell_about_waits_again() -> None:
    """No slot is declared lost on a store that did not say which are ready: its loss
    reaches the loop by itself; else the next wait asks again."""
    link = _Link()
    restart = _waiting(link, liveness=True)
    restart.store.link = _Unanswered()
    restart.progress()
    assert restart.control.declared == [] and restart.control.stops == []
    assert restart.ready_deadline() is not None
    # nor is the wait said to have timed out: it goes on
    assert [e for e in restart.control.events if e.get("phase") == "timed_out"] == []


def test_a_slot_declared_lost_during_the_restart_starts_no_child_on_the_go() -> None:
    """A stuck supervisor that runs again reads the go before its agent's fence: it waits
    for the fence, in the restart, with no child started."""
    restart = _waiting(_Link(), liveness=True)
    restart.store.roles = _LiveRoles(lost={0})
    restart._start_again()
    assert restart.pending == 1 and restart.course.state is Course.RESTARTING
