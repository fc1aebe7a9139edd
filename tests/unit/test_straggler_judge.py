"""The store's host judging a running job (``StragglerJudge``), against a real TCPStore:
what each slot publishes is written as a node's ``StepTimes`` writes it."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from nvrx.jobenv import JobEnv
from nvrx.store.seal import Sealer
from nvrx.supervisor import node_keys
from nvrx.supervisor.config import SupervisorConfig
from nvrx.supervisor.course import Course, CourseTracker
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.job_store import JobStore
from nvrx.supervisor.node_roles import NodeRoles
from nvrx.supervisor.step_times import StepTimes
from nvrx.supervisor.stop_flag import StopFlag
from nvrx.supervisor.store_link import StoreLinkError
from nvrx.supervisor.straggler_judge import STALE_S, StragglerJudge


class _Link:
    """What the judge uses of a store link, over a real ``TCPStore`` client."""

    lost = None

    def __init__(self, store) -> None:
        self.store = store

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def append(self, key: str, value: str) -> None:
        self.store.append(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self.store.compare_set(key, expected, desired).decode()


class _Node:
    def __init__(self) -> None:
        self.node_rank, self.events, self.stops, self.rejected = 0, [], [], []

    def emit(self, kind: str, **fields) -> None:
        self.events.append(fields)

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        self.stops.append((reason, exit_code))


@pytest.fixture
def store():
    from tests.support.ports import free_port_run

    port = free_port_run()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))  # fmt: skip
    yield server


def _judge(store, nnodes=2, spares=0, action="report", slot=0):
    job = JobEnv.local(nnodes=nnodes, node_rank=slot, nproc_per_node=2, job_id="t")
    cfg = SupervisorConfig(command=["train"], job=job, spare_nodes=spares, straggler_action=action)
    job_store = JobStore(cfg)
    job_store.link = _Link(store)
    node = _Node()
    job_store.stop = StopFlag(SEALER.secret, SEALER.run)
    job_store.roles = NodeRoles(cfg, job_store.link, node.emit, lambda: job_store.sealer)  # type: ignore[arg-type]
    job_store.rejected = lambda key, reason, size: node.rejected.append(key)
    return StragglerJudge(job_store, node), node


class _Job:
    """Each slot's published medians, step by step: ``medians`` per rank, ``slot_of`` rank."""

    def __init__(self, store, slot_of: dict[int, int]) -> None:
        self.store, self.slot_of = store, slot_of
        self.steps = dict.fromkeys(slot_of, 0)

    def publish(self, medians: dict[int, float], steps: int = 3, moving=None) -> None:
        for rank in self.steps:
            if moving is None or rank in moving:
                self.steps[rank] += steps
        for slot in set(self.slot_of.values()):
            ranks = {str(r): [self.steps[r], medians[r]] for r, s in self.slot_of.items() if s == slot}
            payload = {"node_rank": slot, "host": f"h{slot}", "ranks": ranks}
            key = node_keys.step_times(slot)
            self.store.set(key, SEALER.seal(key, json.dumps(payload)))


SEALER = Sealer(bytes(range(32)), 0)
TWO_NODES = {0: 0, 1: 0, 2: 1, 3: 1}
HEALTHY = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
NODE_1_SLOW = {0: 1.0, 1: 1.0, 2: 1.5, 3: 1.5}


def _looks(judge, job, medians, looks, start=0.0, **publish):
    for i in range(looks):
        job.publish(medians, **publish)
        judge.look(start + i)


def _named(node, of="node"):
    return [(e["who"], e["state"]) for e in node.events if e["of"] == of]


def test_a_slow_node_is_named_after_enough_steps_and_looks_not_at_one_look(store):
    judge, node = _judge(store)
    job = _Job(store, TWO_NODES)
    _looks(judge, job, NODE_1_SLOW, 1, steps=100)  # the first look only counts from here
    _looks(judge, job, NODE_1_SLOW, 1, start=1, steps=100)  # many steps, but one look
    assert node.events == []
    _looks(judge, job, NODE_1_SLOW, 2, start=2, steps=100)
    assert _named(node) == [(1, "slow")]
    [event] = [e for e in node.events if e["of"] == "node"]
    assert (event["ranks"], event["slower_pct"], event["action"]) == ([2, 3], 50.0, "report")


def test_a_rank_that_stopped_counting_holds_no_one_back_and_sets_no_reference(store):
    judge, node = _judge(store)
    job = _Job(store, TWO_NODES)
    slow = {0: 0.1, 1: 1.0, 2: 2.0, 3: 2.0}
    _looks(judge, job, slow, 1)
    # rank 0 stops (a rank left inactive, say): it holds the looks back for a while only,
    # then its old fast median drops out of the reference too
    _looks(judge, job, slow, 8, start=STALE_S + 1, moving={1, 2, 3})
    assert _named(node) == [(1, "slow")]
    # of ranks 1-3, not rank 0's; a node's among the nodes: node 0's median is rank 1's
    assert {e["reference_s"] for e in node.events if e["of"] == "rank"} == {1.5}
    assert [(e["reference_s"], e["median_s"]) for e in node.events if e["of"] == "node"] == [(1.0, 2.0)]


def test_a_healthy_job_and_a_job_slow_as_a_whole_name_no_one(store):
    judge, node = _judge(store)
    job = _Job(store, TWO_NODES)
    _looks(judge, job, HEALTHY, 10)
    _looks(judge, job, {r: 2.0 for r in HEALTHY}, 10, start=10)
    assert node.events == []


def test_one_spare_is_promised_to_one_slow_node_and_never_to_the_stores_own(store):
    judge, node = _judge(store, nnodes=4, spares=1, action="exclude")
    slots = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    job = _Job(store, slots)
    # nodes scored against nodes: the reference of three is halfway from the fastest to the next
    _looks(judge, job, {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0, 4: 2.1, 5: 2.1}, 5)
    actions = {e["who"]: e["action"] for e in node.events if e["of"] == "node"}
    assert sorted(actions.values()) == ["exclude", "none"], actions
    listed = [k for k, a in actions.items() if a == "exclude"]
    sealed = store.get(node_keys.STRAGGLERS).decode()
    assert json.loads(SEALER.unseal(node_keys.STRAGGLERS, sealed)) == {"exclude": listed}


def test_a_rank_that_does_more_on_every_node_makes_no_node_slow(store):
    """Local rank 0 of each node works twice as long (it logs, say): it is named, its node
    is not, nor excluded; the nodes are alike."""
    judge, node = _judge(store, nnodes=3, spares=1, action="exclude")
    job = _Job(store, TWO_NODES)
    _looks(judge, job, {0: 2.0, 1: 1.0, 2: 2.0, 3: 1.0}, 10)
    assert sorted(_named(node, of="rank")) == [(0, "slow"), (2, "slow")]
    assert _named(node) == []
    assert not store.check([node_keys.STRAGGLERS])


def test_the_stores_own_slot_is_never_excluded(store):
    judge, node = _judge(store, nnodes=3, spares=1, action="exclude")
    job = _Job(store, TWO_NODES)
    _looks(judge, job, {0: 1.5, 1: 1.5, 2: 1.0, 3: 1.0}, 5)
    assert [(e["who"], e["action"]) for e in node.events if e["of"] == "node"] == [(0, "store_host")]


class _FailsOnce(_Link):
    """A link whose first write of the exclusion list meets a store error."""

    failed = False

    def set(self, key: str, value: str) -> None:
        if key == node_keys.STRAGGLERS and not self.failed:
            self.failed = True
            raise StoreLinkError("the store did not answer in time")
        super().set(key, value)


def test_a_store_error_while_listing_a_slow_node_is_told_at_the_next_look(store):
    """The write of the exclusion list fails once: the node's change is taken back, and the
    next look lists it and writes its one event (before: no event, never listed, and its
    spare held for it, so a second slow node got none)."""
    judge, node = _judge(store, nnodes=4, spares=1, action="exclude")
    judge.store.link = _FailsOnce(store)
    job = _Job(store, {0: 0, 1: 0, 2: 1, 3: 1})
    errors = 0
    for i in range(6):
        job.publish(NODE_1_SLOW)
        try:
            judge.look(float(i))
        except StoreLinkError:  # as StepTimes.check, which logs it and goes on
            errors += 1
    assert errors == 1 and judge.store.link.failed
    assert [(e["who"], e["state"], e["action"]) for e in node.events if e["of"] == "node"] == [(1, "slow", "exclude")]
    assert _named(node, "rank") == [(2, "slow"), (3, "slow")]  # told before the error, once
    sealed = store.get(node_keys.STRAGGLERS).decode()
    assert json.loads(SEALER.unseal(node_keys.STRAGGLERS, sealed)) == {"exclude": [1]}


def test_a_slow_rank_that_goes_on_on_a_spare_is_judged_there_afresh(store):
    """Ranks 2-3, named slow on slot 1, go on on spare slot 2 (slot 1's key left behind,
    its counts standing still), as slow as before: they are named again, on slot 2 (before:
    their verdicts held, so nothing named them there)."""
    judge, node = _judge(store, nnodes=3, spares=1)
    job = _Job(store, TWO_NODES)
    _looks(judge, job, NODE_1_SLOW, 6)
    assert [(e["of"], e["who"], e["slot"]) for e in node.events] == [("rank", 2, 1), ("rank", 3, 1), ("node", 1, 1)]
    moved = _Job(store, {0: 0, 1: 0, 2: 2, 3: 2})
    moved.steps.update({0: job.steps[0], 1: job.steps[1]})
    node.events.clear()
    _looks(judge, moved, NODE_1_SLOW, 6, start=6)
    assert sorted((e["of"], e["who"], e["slot"], e["state"]) for e in node.events) == [
        ("node", 2, 2, "slow"), ("rank", 2, 2, "slow"), ("rank", 3, 2, "slow"),
    ]  # fmt: skip


def test_unreadable_values_in_the_store_are_skipped_not_fatal(store, caplog):
    judge, node = _judge(store)
    course = CourseTracker()
    course.to(Course.TRAINING)
    times = StepTimes(judge.store, course, node)
    times.judge.store.service = object()  # this slot hosts the store: it judges
    times.record(0, [0.1] * 30)
    store.set(node_keys.step_times(1), SEALER.seal(node_keys.step_times(1), "{not json"))
    times._next = 0.0  # due
    times.check()
    assert "unreadable value in the store" in caplog.text
    assert times.timeout(30.0) > 0  # and the next look waits for its interval
    times.store.link, times._next = None, 0.0  # the store is not usable: no spinning either
    times.check()
    assert times.timeout(30.0) > 0


def test_step_times_without_the_jobs_seal_are_told_once_and_name_no_one(store):
    """A client without the job's secret publishes slow medians for node 1: they are not
    read, each forged value is told once however often it is read, and nobody is named."""
    judge, node = _judge(store)
    job = _Job(store, {0: 0, 1: 0})  # node 0's ranks publish; node 1's medians are forged
    key = node_keys.step_times(1)
    for forged_steps in (1000, 2000):
        forged = {"node_rank": 1, "host": "h1", "ranks": {"2": [forged_steps, 9.0], "3": [forged_steps, 9.0]}}
        store.set(key, json.dumps(forged))
        for i in range(6):
            job.publish({0: 1.0, 1: 1.0})
            judge.look(float(i))
    assert node.events == [] and node.rejected == [key, key]


def test_a_forged_exclusion_list_makes_no_node_leave_and_a_sealed_one_does(store):
    judge, node = _judge(store, nnodes=3, spares=1, action="exclude", slot=1)
    course = CourseTracker()
    course.to(Course.TRAINING)
    times = StepTimes(judge.store, course, node)
    times.record(0, [0.1] * 30)
    store.set(node_keys.STRAGGLERS, json.dumps({"exclude": [1]}))  # no seal: not the job's
    times._next = 0.0
    times.check()
    assert node.stops == []
    store.set(node_keys.STRAGGLERS, SEALER.seal(node_keys.STRAGGLERS, json.dumps({"exclude": [1]})))
    times._next = 0.0
    times.check()
    assert [code for _, code in node.stops] == [ExitCode.EXCLUDED]
