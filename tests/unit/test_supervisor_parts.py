"""The supervisor's parts: each is built with the supervisor as its ``NodeControl`` and shares
one job store, one course and one set of local ranks, so that every part sees a failover or a
stop at once."""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from nvrx import processes
from nvrx.supervisor.children import Child
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course
from nvrx.supervisor.node_control import NodeControl
from nvrx.supervisor.supervisor import Supervisor


def _supervisor(tmp_path: Path) -> Supervisor:
    job = local_job(nproc_per_node=2, log_dir=str(tmp_path))
    return Supervisor(SupervisorConfig(command=["train"], job=job))


_SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _start_children(sup: Supervisor, children: list[Child]) -> None:
    """Local ranks 0 and 1 as processes that exist until ``_end_children``: the standby
    for restarts reads their pids and start times; they run nothing."""
    _end_children(children)
    children[:] = [Child(i, 0, processes.start(_SLEEPER)) for i in range(2)]
    sup.ranks.children.update(enumerate(children))


def _end_children(children: list[Child]) -> None:
    for child in children:
        child.signal_group(signal.SIGKILL)
        child.proc.wait()


def test_the_supervisor_is_what_its_parts_ask_for(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    assert isinstance(sup, NodeControl)
    parts = [sup.workload, sup.job_restart, sup.messages, sup.failover, sup.hang_watch,
             sup.restart_standby, sup.job_end]  # fmt: skip
    assert all(part.control is sup for part in parts)
    assert all(part.store is sup.store for part in parts)
    assert all(part.course is sup.course for part in parts if hasattr(part, "course"))
    assert all(part.ranks is sup.ranks for part in parts if hasattr(part, "ranks"))


def test_a_new_store_address_is_the_configuration_of_every_part(tmp_path: Path) -> None:
    """A failover replaces the configuration once, in the job store: the supervisor and its parts see it."""
    sup = _supervisor(tmp_path)
    moved = replace(sup.config, job=replace(sup.config.job, store_port=41000))
    sup.store.config = moved
    assert sup.config is moved and sup.failover.store.config.store_port == 41000


def test_a_stop_moves_the_course_once_and_starts_nothing_more(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    sup.course.to(Course.TRAINING)
    sup.request_stop("test", 1, broadcast=False)
    sup.request_stop("again", 2, broadcast=False)  # a second request changes nothing
    assert sup.course.state is Course.STOPPING
    assert (sup.stop_reason, sup.exit_code) == ("test", 1)
    sup.start_child(0)
    assert sup.ranks.children == {}


def test_the_standby_for_restarts_waits_until_the_children_tell_they_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A standby imports torch: started while the ranks still import theirs, it would slow
    them. It waits for each child to tell it trains (its Wrapper monitor's beat from a round,
    or its fault-tolerance client's connection); with no end once one told anything (a
    Wrapper monitor beats first, before its round), then and after later restarts; else
    ``standby_wait`` after the last child started."""
    sup = _supervisor(tmp_path)
    sup.course.to(Course.TRAINING)
    started: list[range] = []
    monkeypatch.setattr(sup.standbys, "keep_ready", lambda _c, _e, r: started.append(r) or 4321)
    children: list[Child] = []
    wait, wait_s = sup.restart_standby, sup.config.standby_wait

    def long_ago() -> None:
        for child in children:
            child.started = time.monotonic() - wait_s

    try:
        # a script that tells nothing: the standby comes once the wait is over
        _start_children(sup, children)
        wait.keep_ready()
        assert started == []
        deadline = wait.deadline()
        assert deadline == max(c.started for c in children) + wait_s
        now = time.monotonic()
        assert sup._wait_s() <= deadline - now  # the loop wakes for it
        long_ago()
        assert wait.deadline() is None
        wait.keep_ready()
        assert started == [range(2)]

        # a Wrapper script: rank 0's monitor beats; the node waits for both, past the wait
        _start_children(sup, children)
        assert sup.hang_watch.on_message({"event": "wrapper_pid", "pid": children[0].pid})
        long_ago()
        with caplog.at_level(logging.INFO, logger="nvrx.supervisor.restart_standby"):
            wait.keep_ready()
            wait.keep_ready()
        assert started == [range(2)] and children[0].tells and not children[0].training
        said = [r.getMessage() for r in caplog.records if "waits for local ranks" in r.message]
        assert said == [
            "the standby for restarts waits for local ranks [0, 1] to train (their Wrapper in a "
            "round, or a fault-tolerance client connected); restarts start cold until then"
        ]  # once
        assert sup.hang_watch.on_message({"event": "rank_in_round", "pid": children[0].pid})
        wait.keep_ready()
        assert started == [range(2)] and children[0].training and not children[1].tells
        sup.ranks.told(children[1].pid, training=True)  # what a fault-tolerance client's init does
        wait.keep_ready()
        assert started == [range(2)] * 2

        # after a job-wide restart nobody told yet, and the command is known to tell
        _start_children(sup, children)
        long_ago()
        wait.keep_ready()
        assert started == [range(2)] * 2 and wait.deadline() is None
        for child in children:
            sup.ranks.told(child.pid, training=True)
        wait.keep_ready()
        assert started == [range(2)] * 3

        sup.standbys.enabled = False  # --no-warm-standby: nothing to wake up for
        _start_children(sup, children)
        assert wait.deadline() is None
    finally:
        _end_children(children)


def test_no_standby_for_restarts_starts_while_the_job_stops_fails_over_or_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Children that train would get their standby; not while the course is elsewhere."""
    sup = _supervisor(tmp_path)
    started: list[range] = []
    monkeypatch.setattr(sup.standbys, "keep_ready", lambda _c, _e, r: started.append(r) or 4321)
    children: list[Child] = []
    try:
        _start_children(sup, children)
        for child in children:
            sup.ranks.told(child.pid, training=True)
        for state in (Course.RESTARTING, Course.FAILING_OVER, Course.STOPPING):
            sup.course.state = state
            sup.restart_standby.keep_ready()
        assert started == []
        sup.course.state = Course.TRAINING
        sup.restart_standby.keep_ready()
        assert started == [range(2)]
    finally:
        _end_children(children)


def test_a_flood_of_forged_control_values_is_told_as_events_only_up_to_a_cap(tmp_path: Path, caplog) -> None:
    """A client without the job's secret may write forged values without end: the first
    ``MAX_REJECTIONS_TOLD`` are events (docs/security.md), every one of them is logged."""
    from nvrx.events import EventWriter, read_dir
    from nvrx.supervisor.stop_flag import MAX_REJECTIONS_TOLD

    sup = _supervisor(tmp_path)
    sup.writer = EventWriter(tmp_path / "events", "supervisor")
    with caplog.at_level(logging.WARNING, logger="nvrx.supervisor.supervisor"):
        for _ in range(MAX_REJECTIONS_TOLD + 5):
            sup._rejected("nvrx/stop", "no valid seal", 12)
    events, _ = read_dir(tmp_path / "events")
    assert [e["kind"] for e in events] == ["rejected_write"] * MAX_REJECTIONS_TOLD
    assert events[0]["key"] == "nvrx/stop" and events[0]["value_bytes"] == 12
    logged = [r for r in caplog.records if "rejected a value of nvrx/stop" in r.getMessage()]
    assert len(logged) == MAX_REJECTIONS_TOLD + 5
    assert f"({MAX_REJECTIONS_TOLD + 5} so far)" in logged[-1].getMessage()
