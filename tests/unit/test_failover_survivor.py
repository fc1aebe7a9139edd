"""What a survivor does once its store host is gone and no successor was elected
(``Failover``): which slots ask SLURM at all, and what each answer of
``node_requeue.probe_step_nodes`` leads to. SLURM itself answers in
``tests/slurm/test_node_loss_slurm.py``; here its answer is given, so the decision is
checked on any machine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.supervisor import node_requeue
from nvrx.supervisor.failover import Failover
from nvrx.supervisor.node_requeue import StepAnswers


class _Survivor:
    """A Failover over plain stand-ins that record what it did."""

    def __init__(
        self, nnodes: int = 2, slot: int = 1, enabled: bool = True, hosts: bool = False,
        store_slot: int = 0,
    ) -> None:  # fmt: skip
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.lost: list[tuple[int, str]] = []
        self.requeued: list[tuple[list[str | None], bool]] = []
        roles = SimpleNamespace(
            enabled=enabled, slot=slot,
            record_lost_unreplaced=lambda s, host, wall: self.lost.append((s, host)),
        )  # fmt: skip
        config = SimpleNamespace(nnodes=nnodes, node_timeout=3.0, store_host="node1", store_port=1)
        self.store = SimpleNamespace(
            config=config, service=object() if hosts else None, roles=roles, slot=store_slot
        )
        control = SimpleNamespace(emit=lambda kind, **fields: self.events.append((kind, fields)))
        course = SimpleNamespace(stopping=False)
        self.failover = Failover(
            self.store, course, control, None, None,  # type: ignore[arg-type]
            lambda hosts, probe=True: self.requeued.append((list(hosts), probe)),
        )  # fmt: skip


def _answers(nodes: str, answered: str, took: float = 0.2) -> StepAnswers:
    return StepAnswers(
        tuple(nodes.split(",")), frozenset(answered.split(",")), dict.fromkeys(nodes.split(","), took)
    )


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """SLURM's answer about the step's nodes, given; what was asked and ended, recorded."""
    seen: dict[str, Any] = {"answer": None, "asked": [], "ended": []}

    def probe(job_id: str, settle_s: float) -> StepAnswers | None:
        seen["asked"].append((job_id, settle_s))
        return seen["answer"]

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(node_requeue, "probe_step_nodes", probe)
    monkeypatch.setattr(node_requeue, "end_unrequeued", lambda job, node: seen["ended"].append((job, node)))
    return seen


@pytest.mark.parametrize(
    ("kwargs", "survivor"),
    [
        ({}, True),
        ({"nnodes": 3}, True),  # three slots, when too few were left to elect a successor
        ({"nnodes": 4, "slot": 3, "store_slot": 2}, True),  # after an earlier failover
        ({"slot": 0}, False),  # the store host's own slot
        ({"enabled": False}, False),  # node liveness off
        ({"hosts": True}, False),  # a slot that hosts the store lost its own service
        ({"nnodes": 1, "slot": 0}, False),  # one node: nobody to fail over to
    ],
)
def test_only_a_slot_that_survived_its_store_host_asks_slurm(
    kwargs: dict[str, Any], survivor: bool
) -> None:
    assert _Survivor(**kwargs).failover._survivor() is survivor


def test_a_silent_batch_host_is_recorded_lost_and_the_job_requeued_without_it(slurm) -> None:
    survivor, slurm["answer"] = _Survivor(), _answers("node1,node2", "node2", 20.0)
    survivor.failover._requeue_without_lost_nodes(123.0)
    assert slurm["asked"] == [("7", 3.0 + node_requeue.commands.PROBE_TIMEOUT_S)]
    assert survivor.lost == [(0, "node1")] and survivor.requeued == [(["node1"], False)]
    assert slurm["ended"] == [("7", "node1")] and survivor.events == []  # ended only if still RUNNING


def test_every_silent_node_of_a_larger_job_is_recorded_lost_and_excluded(slurm) -> None:
    survivor = _Survivor(nnodes=4, slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node3")
    survivor.failover._requeue_without_lost_nodes(123.0)
    assert survivor.lost == [(0, "node1"), (1, "node2"), (3, "node4")]
    assert survivor.requeued == [(["node1", "node2", "node4"], False)]
    assert slurm["ended"] == [("7", "node1")]


def test_a_batch_host_that_answers_is_a_node_probe_of_the_store_host_and_nothing_is_requeued(
    slurm,
) -> None:
    survivor, slurm["answer"] = _Survivor(), _answers("node1,node2", "node1,node2")
    survivor.failover._requeue_without_lost_nodes(123.0)
    assert survivor.events == [
        ("node_probe", dict(lost_slot=0, lost_host="node1", responding=True, probe_s=0.2, note=None))
    ]
    assert survivor.lost == [] and survivor.requeued == [] and slurm["ended"] == []


def test_a_store_host_that_moved_is_the_node_probed_when_the_batch_host_answers(slurm) -> None:
    survivor = _Survivor(nnodes=4, slot=1, store_slot=2)
    slurm["answer"] = _answers("node1,node2,node3,node4", "node1,node2")
    survivor.failover._requeue_without_lost_nodes(123.0)
    assert survivor.events == [
        ("node_probe", dict(lost_slot=2, lost_host="node3", responding=False, probe_s=0.2, note=None))
    ]
    assert survivor.lost == [] and survivor.requeued == []


def test_when_slurm_cannot_tell_nothing_is_recorded(slurm) -> None:
    survivor = _Survivor()
    survivor.failover._requeue_without_lost_nodes(123.0)
    assert slurm["asked"] and survivor.events == survivor.lost == survivor.requeued == []


def test_outside_slurm_nothing_is_asked(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    survivor = _Survivor()
    survivor.failover._requeue_without_lost_nodes(123.0)
    assert slurm["asked"] == [] and survivor.events == survivor.requeued == []
