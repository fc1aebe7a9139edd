"""The Wrapper's per-round store protocol (nvrx.inprocess.store) against a real TCPStore."""

from __future__ import annotations

import json

import pytest

from nvrx.events import failures
from nvrx.inprocess import store as rstore
from nvrx.store import rounds


def test_fault_interrupts_the_round_unless_it_completed(base):
    r0 = rstore.round_store(base, 0)
    assert (
        rstore.record_fault(r0, failures.FaultRecord(rank=2, kind="exception", message="x")) is True
    )
    assert base.get("nvrx/r0/interrupted") == b"fault"
    assert [r.rank for r in rstore.fault_records(r0)] == [2]
    r1 = rstore.round_store(base, 1)
    assert rstore.interrupt(r1, "done") is True
    assert rstore.interrupt(r1, "fault") is False  # a fault after completion changes nothing
    assert base.get("nvrx/r1/interrupted") == b"done"


def test_terminated_ranks_are_ints_and_registered_once(base):
    r0 = rstore.round_store(base, 0)
    assert rstore.register_terminated(r0, 3) is True
    assert rstore.register_terminated(r0, 3) is False  # its monitor and a peer both report it
    rstore.register_terminated(r0, 0)
    assert rstore.terminated_ranks(r0) == {0, 3}


def test_iteration_barrier_publishes_one_decision(base):
    base.set("default_pg/0//rank_0", "addr")
    base.set("nvrx/r1/old", "1")
    r3 = rstore.round_store(base, 3)
    rstore.register_terminated(r3, 1)
    for rank in (0, 2):
        rounds.arrive_one(base, "iteration", r3.iteration, rank, 3)
    assert not r3.check([rounds.DECISION])
    rounds.arrive_one(base, "iteration", r3.iteration, 1, 3)  # the dead rank, by proxy, completes it
    rounds.wait_barrier(base, "iteration", 3, 3, 5.0)
    decision = rounds.decision_of(r3)
    assert decision == {"terminated": [1], "job_restarts": 1, "world_size": 3}
    assert rounds.current_round(base) == 4
    assert not base.check(["default_pg/0//rank_0"])  # torch's rendezvous keys are gone
    assert not base.check(["nvrx/r1/old"])  # rounds older than the previous one are collected
    assert rounds.job_restarts(base) == 0  # counted only when the next round starts
    r4 = rstore.round_store(base, 4)
    rstore.commit_round_start(r4, base, decision["job_restarts"])
    rstore.commit_round_start(r4, base, decision["job_restarts"])
    assert rounds.job_restarts(base) == 1


def test_proxy_leave_does_everything_peers_wait_for(base):
    r0 = rstore.round_store(base, 0)
    rounds.arrive_one(base, "iteration", r0.iteration, 0, 2)
    rstore.proxy_leave(r0, base, 1, 2, failures.FaultRecord(rank=1, kind="dead", message="gone"))
    assert json.loads(r0.get(rounds.DECISION))["terminated"] == [1]
    assert base.get("nvrx/r0/interrupted") == b"fault"
    assert rstore.fault_records(r0)[0].kind == "dead"


def test_mixin_barrier_on_the_round_store(base):
    r0 = rstore.round_store(base, 0)
    r0.iteration_barrier([0, 0], 1, 5.0)  # reentrant: a double arrival counts once
    assert r0.is_rank_at_reentrant_barrier(0, "iteration")
    r0.barrier([0], "grp", 1, 5.0)
    with pytest.raises(rstore.BarrierTimeout, match=r"ranks \[1\]"):
        r0.barrier([0], "grp2", 2, 0.3)


def test_barrier_timeout_chunk_lets_signal_handlers_run(base):
    import signal
    import time

    class Interrupted(Exception):
        pass

    def handler(_signum, _frame):
        raise Interrupted

    r0 = rstore.round_store(base, 0)
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            r0.barrier([0], "chunked", 2, 30.0, timeout_chunk=0.2)
        assert time.monotonic() - t0 < 5.0  # long before the 30 s timeout
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(rstore.BarrierTimeout, match=r"ranks \[1\]"):
        r0.reentrant_barrier([0], "chunked2", 2, 0.5, timeout_chunk=0.2)


def test_a_barrier_met_at_the_store_times_out_naming_the_whole_wait(base):
    """Without an agent (or once it gave up) the rank waits at the store for the time it has
    left: the timeout still names the wait the caller asked for."""
    from nvrx.node_agent.rank_wire import HostBarrierClient, Meeting

    with pytest.raises(rstore.BarrierTimeout) as info:
        HostBarrierClient(None).meet(base, Meeting("termination", 21, 2), 0, 0.3)
    assert info.value.missing == [1] and info.value.timeout == 0.3
    assert "barrier 'nvrx/g21/termination' timed out after 0.3 s" in str(info.value)


def _raised(exc):
    try:
        raise exc
    except Exception as caught:
        return caught


def test_fault_events_keep_their_fields(base):
    from nvrx.inprocess.round_run import record_rank_fault

    events = []

    values = []

    def emit(kind, **fields):
        events.append((kind, list(fields)))
        values.append(fields)

    common = ["fault_kind", "origin_rank", "exc_type", "message", "traceback", "signature"]
    r0 = rstore.round_store(base, 0)
    assert record_rank_fault(r0, emit, 1, _raised(RuntimeError("own")), None) is True
    assert events.pop() == ("fault", [*common, "detected_mono", "detection_s"])
    assert [(r.rank, r.kind) for r in rstore.fault_records(r0)] == [(1, "exception")]

    assert record_rank_fault(r0, emit, 2, _raised(RuntimeError("peer")), 12.5) is True
    assert events.pop() == ("fault", [*common, "detected_mono"])
    # seen when the monitor thread saw the fault; blamed on the rank the store heard of first
    assert values[-1]["detected_mono"] == 12.5 and values[-1]["origin_rank"] == 1
    assert values[-1]["fault_kind"] == "peer"
    assert len(rstore.fault_records(r0)) == 1  # a peer fault is not written to the store

    r1 = rstore.round_store(base, 1)

    dead = failures.FaultRecord(rank=1, kind="dead", message="x")
    failures.announce_leave(emit, 1, dead)  # the monitor's event, at once
    rstore.proxy_leave(r1, base, 1, 2, dead)  # then the store's part
    assert events.pop() == (
        "fault",
        ["fault_kind", "origin_rank", "message", "signature", "detected_mono"],
    )
    assert values[-1]["signature"] == "dead" and values[-1]["origin_rank"] == 1
    assert [r.kind for r in rstore.fault_records(r1)] == ["dead"]
