"""Which events are a failed child's: its pid's, of its node, written since it started, from
all its files in the order it wrote them. Pids repeat on other nodes and, in a fresh pid
namespace (a container), in a requeued run of the same job; one process writes one file per
writer (the application's, the Wrapper's). Every file here is written by the real writer."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from nvrx import processes
from nvrx.events import EventWriter, ProcessKey, process_events
from nvrx.supervisor.children import Child
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.job_restart import job_wide, uses_wrapper
from nvrx.supervisor.non_retryable import exception_text
from nvrx.supervisor.policy import LastFault, last_fault
from nvrx.supervisor.supervisor import Supervisor

_FATAL = {
    "fault_kind": "exception",
    "exc_type": "FatalDataError",
    "message": "corrupt shard 17",
    "signature": "FatalDataError at train.py:6 in <module>",
}

#: A child that finds, under its own pid, the fault of another process (``WHOSE``: another
#: node's, an earlier run's, its clock an hour back, or another host's that had this node
#: rank: a node cut off, still running, whose node rank a spare took over), then is
#: SIGKILLed without a fault.
_CHILD = f"""
import os, signal, time
from nvrx import events
context = events.context_from_env()
if os.environ["WHOSE"] == "other node":
    context["node"] = 1
elif os.environ["WHOSE"] == "other host":
    events.writer._BOOT_ID = "the boot id of a host cut off"
else:
    real = time.time
    time.time = lambda: real() - 3600
writer = events.EventWriter(events.job_log_dir(), "app", context)
writer.emit("fault", **{_FATAL!r})
os.kill(os.getpid(), signal.SIGKILL)
"""


def _supervisor(tmp_path: Path, whose: str) -> Supervisor:
    """Node 0 of a one-rank job whose FatalDataError is non-retryable; the loop breaker stops
    at the first failure, with its signature, so no store is needed."""

    def spawn(local_rank: int, attempt: int, env: dict, directory: Path | None) -> Child:
        command = [sys.executable, "-c", _CHILD]
        return Child(local_rank, attempt, processes.start(command, env=dict(env, WHOSE=whose)))

    job = local_job(nproc_per_node=1, log_dir=str(tmp_path))
    config = SupervisorConfig(
        command=["train"], job=job, loop_breaker=1, ft_restart_policy="min-healthy",
        non_retryable_patterns=["FatalDataError"],
    )  # fmt: skip
    sup = Supervisor(config, spawn=spawn)
    sup.course.to(Course.TRAINING)  # what ``run`` does before it starts the children
    return sup


def _fail_once(sup: Supervisor) -> None:
    sup.start_child(0)
    child = sup.ranks.children[0]
    try:
        assert child.proc.wait(60) == -signal.SIGKILL
        sup.reap()  # records the end and decides on it
    finally:
        processes.stop(child.proc, ask=signal.SIGKILL)


def test_another_nodes_fault_under_the_same_pid_is_not_this_childs(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, "other node")
    _fail_once(sup)
    assert sup.exit_code == ExitCode.LOOP_BREAKER, sup.stop_reason  # not NON_RETRYABLE
    assert "failed with signal SIGKILL" in str(sup.stop_reason)


def test_an_earlier_runs_fault_under_the_same_pid_is_not_this_childs(tmp_path: Path) -> None:
    """A requeued run in a fresh pid namespace: its rank has the pid of the earlier run's rank
    that recorded a FatalDataError; its own SIGKILL is judged as what it is."""
    sup = _supervisor(tmp_path, "earlier run")
    _fail_once(sup)
    assert sup.exit_code == ExitCode.LOOP_BREAKER, sup.stop_reason
    assert "failed with signal SIGKILL" in str(sup.stop_reason)


def test_a_cut_off_hosts_fault_under_the_same_pid_and_node_is_not_this_childs(tmp_path: Path) -> None:
    """A spare took over node rank 0 from a host that is only cut off: a process there with
    the pid of this node's child writes, under node rank 0 and after the child started, a
    fault; it names that host's boot, not this one's."""
    sup = _supervisor(tmp_path, "other host")
    _fail_once(sup)
    assert sup.exit_code == ExitCode.LOOP_BREAKER, sup.stop_reason
    assert "failed with signal SIGKILL" in str(sup.stop_reason)


def _writers(tmp_path: Path, *specs: tuple[str, int]) -> list[EventWriter]:
    return [
        EventWriter(tmp_path, component, {"job": "j", "node": node, "rank": 0, "round": None})
        for component, node in specs
    ]


def test_a_process_with_several_files_is_read_in_the_order_it_wrote(tmp_path: Path) -> None:
    """The application recorded a fault that its Wrapper then recovered from (a new call):
    the fault did not end the process, whichever of its two files is listed first."""
    writers = _writers(tmp_path, ("app", 0), ("wrapper", 0))
    for writer in writers:
        writer.emit("progress", step=0)  # each file exists now, its place in a listing too
    listed = list(tmp_path.glob(f"*-p{os.getpid()}-*.jsonl"))
    last = next(w for w in writers if w.path == listed[-1])
    first = next(w for w in writers if w is not last)
    last.emit("fault", **_FATAL)  # the file listed last holds the earlier event
    first.emit("call_start")
    assert last_fault(tmp_path, os.getpid()) is None
    assert exception_text(tmp_path, os.getpid(), None) is None
    first.emit("fault", fault_kind="exception", exc_type="E", signature="E at t.py:1")
    assert last_fault(tmp_path, os.getpid()) == LastFault("E at t.py:1", "exception")
    kinds = [e["kind"] for e in process_events(tmp_path, os.getpid())]
    assert kinds == ["progress", "progress", "fault", "call_start", "fault"]


def test_the_lookups_keep_to_the_childs_node_and_start(tmp_path: Path) -> None:
    pid = os.getpid()
    config = SupervisorConfig(command=["train"], job=local_job(log_dir=str(tmp_path)))
    events_dir = Path(config.events_dir)
    node1_wrapper, node0_app = _writers(events_dir, ("wrapper", 1), ("app", 0))
    node1_wrapper.emit("fault", **_FATAL)
    node0_app.emit("fault", fault_kind="exception", exc_type="builtins.MemoryError", message="oom")
    mine, node1 = ProcessKey(pid, node=0), ProcessKey(pid, node=1)
    assert last_fault(events_dir, mine) == LastFault("MemoryError", "exception")
    assert exception_text(events_dir, mine, None) == ("builtins.MemoryError\noom", "events")
    assert last_fault(events_dir, node1) == LastFault(_FATAL["signature"], "exception")
    # node 1's process with this pid ran the Wrapper; this node's did not: its failure is job-wide
    assert uses_wrapper(str(events_dir), node1) and not uses_wrapper(str(events_dir), mine)
    assert job_wide(config, set(), mine) and not job_wide(config, set(), node1)
    # a child started after all of it: none of it is its
    later = time.time() + 1
    assert last_fault(events_dir, ProcessKey(pid, node=0, since=later)) is None
    assert exception_text(events_dir, ProcessKey(pid, node=0, since=later), None) is None
    assert not uses_wrapper(str(events_dir), ProcessKey(pid, node=1, since=later))


def _decoded_lines(monkeypatch) -> list[str]:
    """The lines the reader decodes from now on (``json`` parses, the costly part of a read)."""
    from nvrx.events import reader

    decoded: list[str] = []
    real = reader._objects_in_line

    def counted(text: str):
        decoded.append(text)
        return real(text)

    monkeypatch.setattr(reader, "_objects_in_line", counted)
    return decoded


def test_the_lookups_read_only_what_they_need(tmp_path: Path, monkeypatch) -> None:
    """A long run writes an event per step: the fault lookup decodes only its faults and what
    recovered them, and whether the child ran the Wrapper is told by its first Wrapper event;
    a file of a million steps is neither held nor parsed whole by each monitor."""
    app, wrapper = _writers(tmp_path, ("app", 0), ("wrapper", 0))
    for step in range(500):
        app.emit("progress", step=step, loss=1.0)
        wrapper.emit("heartbeat", step=step)
    app.emit("fault", **_FATAL)
    # two writes run together, a fault behind a progress event: that line is decoded
    with open(app.path, "ab") as fh:
        fh.write(b'{"kind":"progress","step":500}{"kind":"fault","fault_kind":"exception",'
                 b'"signature":"E at t.py:9"}\n')  # fmt: skip
    decoded = _decoded_lines(monkeypatch)
    key = ProcessKey(os.getpid(), node=0)
    assert last_fault(tmp_path, key) == LastFault("E at t.py:9", "exception")
    assert len(decoded) == 2, decoded
    decoded.clear()
    assert uses_wrapper(str(tmp_path), key)
    assert len(decoded) == 1, decoded
    events = process_events(tmp_path, key)
    assert next(events)["kind"] in ("progress", "heartbeat") and len(decoded) <= 3


def test_a_wrapper_ranks_pid_counts_until_a_new_child_has_it(tmp_path: Path) -> None:
    """Under ``auto`` a process whose Wrapper monitor beat restarts alone, and an ended one
    stays a Wrapper rank (a lost node's restart asks of ended children too). A new child
    that got the pid of an earlier Wrapper rank (a plain script's rank) is no Wrapper rank,
    and a beat told of a pid no running child has is not taken."""

    def spawn(local_rank: int, attempt: int, env: dict, directory: Path | None) -> Child:
        child = Child(local_rank, attempt, processes.start([sys.executable, "-c", "pass"], env=env))
        if attempt > 0:  # as if an earlier Wrapper rank had had its pid
            sup.job_restart.wrapper_pids.add(child.pid)
        return child

    job = local_job(nproc_per_node=1, log_dir=str(tmp_path))
    config = SupervisorConfig(command=["train"], job=job, ft_restart_policy="auto")
    sup = Supervisor(config, spawn=spawn)
    sup.course.to(Course.TRAINING)
    sup.start_child(0)
    first = sup.ranks.children[0]
    try:
        assert sup.hang_watch.on_message({"event": "wrapper_pid", "pid": first.pid})
        assert not sup.job_restart.job_wide(first.key)  # a Wrapper rank: restarted alone
        assert first.proc.wait(60) == 0
        sup.reap()  # it completed: nothing to restart
        assert not sup.job_restart.job_wide(first.key)  # ended, still a Wrapper rank
        assert sup.hang_watch.on_message({"event": "wrapper_pid", "pid": first.pid})
        assert first.pid in sup.job_restart.wrapper_pids  # kept from when it ran
        sup.job_restart.wrapper_pids.discard(first.pid)
        assert sup.hang_watch.on_message({"event": "wrapper_pid", "pid": first.pid})
        assert first.pid not in sup.job_restart.wrapper_pids  # told after it was reaped
        sup.ranks.restarts[0] += 1
        sup.start_child(0)
        second = sup.ranks.children[0]
        assert second.pid not in sup.job_restart.wrapper_pids
        assert second.proc.wait(60) == 0
    finally:
        for child in (first, sup.ranks.children[0]):
            processes.stop(child.proc, ask=signal.SIGKILL)
    assert sup.job_restart.job_wide(second.key)
