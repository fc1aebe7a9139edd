"""The supervisor's stop: ranks not yet started stay unstarted, children stopped for SLURM's warning are not restarted."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx import checkpoint_flag, processes
from nvrx.events import EventWriter, read_dir
from nvrx.signal_pipe import FORWARD_SIGNALS, STOP_SIGNALS, SignalPipe
from nvrx.supervisor import job_end, preemption
from nvrx.supervisor.children import Child
from nvrx.supervisor.config import ALL_DONE_KEY, StopRequest, SupervisorConfig, local_job
from nvrx.supervisor.course import Course
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.preemption import PreemptionHandler
from nvrx.supervisor.stop_flag import StopFlag
from nvrx.supervisor.store_link import StoreLink
from nvrx.supervisor.supervisor import Supervisor


def _supervisor(
    tmp_path: Path, nproc: int, fail_rank: int | None = None
) -> tuple[Supervisor, list[int]]:
    started: list[int] = []

    def spawn(local_rank: int, attempt: int, env: dict, directory: Path | None) -> Child:
        if local_rank == fail_rank:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(local_rank)
        return Child(
            local_rank,
            attempt,
            processes.start([sys.executable, "-c", "import time; time.sleep(60)"]),
        )

    job = local_job(nproc_per_node=nproc, log_dir=str(tmp_path))
    config = SupervisorConfig(command=["train"], job=job, grace_period=1.0)
    sup = Supervisor(config, spawn=spawn)
    sup.course.to(Course.TRAINING)  # what ``run`` does before it starts the children
    return sup, started


def test_a_spawn_failure_stops_the_started_ranks_and_starts_no_more(tmp_path: Path) -> None:
    sup, started = _supervisor(tmp_path, 3, fail_rank=1)
    try:
        for local_rank in range(3):
            sup.start_child(local_rank)
        assert started == [0]  # rank 2 is never started once the job stops
        assert sup.stop_reason is not None and "cannot start 'train'" in sup.stop_reason
        assert sup.exit_code == ExitCode.SPAWN_FAILED
        assert sup.ranks.children[0].wait(30) is not None  # SIGTERMed by the stop
        assert sup.ranks.children[0].status.signal == signal.SIGTERM
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


def test_a_child_that_stopped_on_another_nodes_flag_is_not_restarted(tmp_path: Path) -> None:
    sup, started = _supervisor(tmp_path, 1)
    job_dir = sup.config.events_dir
    sup.preemption = PreemptionHandler(job_dir, 0, 2, slurm=False, export_env=False)
    sup.start_child(0)
    try:
        # node 1 raised the job's flag; this node's child checkpointed and exited 0
        checkpoint_flag.write_flag(
            sup.preemption.flag_path, {"cause": "preemption", "deadline_wall": time.time() + 30}
        )
        sup.ranks.children[0].proc.send_signal(signal.SIGTERM)
        sup.ranks.children[0].wait(30)
        sup._decide(0, sup.ranks.children[0].status, sup.ranks.children[0].pid)
        assert started == [0]  # not restarted
        assert sup.preemption.pending  # the flag became this node's warning
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


def test_a_wrapper_rank_stopped_by_a_job_wide_restart_is_neither_restarted_nor_counted(
    tmp_path: Path,
) -> None:
    """A job-wide restart (``auto``: a rank that never ran the Wrapper failed) SIGTERMs every
    child, Wrapper ranks too. Their exits are part of the restart: no rank is started on its
    own in the middle of it, and no unit of the restart budget is spent per rank."""
    sup, started = _supervisor(tmp_path, 2)
    sup.start_child(0)
    sup.start_child(1)
    try:
        for child in sup.ranks.children.values():
            sup.job_restart.wrapper_pids.add(child.pid)  # their Wrapper monitors beat
        sup.job_restart.pending = 1  # what ``JobRestart._begin`` sets before its SIGTERMs
        sup.course.to(Course.RESTARTING)
        for local_rank, child in sorted(sup.ranks.children.items()):
            child.proc.send_signal(signal.SIGTERM)
            child.wait(30)
            sup._decide(local_rank, child.status, child.pid)
        assert started == [0, 1]  # no rank started alone
        assert sup.ranks.restarts == {0: 0, 1: 0} and sup.stop_reason is None
        assert [e for e in read_dir(tmp_path)[0] if e["kind"] == "restart_decision"] == []
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


def _ended_in_a_job_wide_restart(sup: Supervisor) -> Child:
    """Local rank 0's child, ended (SIGKILL) while a job-wide restart is pending."""
    sup.job_restart.pending = 1
    sup.course.to(Course.RESTARTING)
    child = sup.ranks.children[0]
    child.proc.send_signal(signal.SIGKILL)
    child.wait(30)
    return child


def test_a_rank_that_gives_up_during_a_job_wide_restart_still_stops_the_job(tmp_path: Path) -> None:
    """Exit 130 (``RestartAbort``: the rank's Wrapper gave up) is no exit a restart's SIGTERM
    causes: it stops the job (exit 12) though a job-wide restart is under way."""
    from nvrx.supervisor.children import ExitStatus

    sup, started = _supervisor(tmp_path, 1)
    sup.start_child(0)
    try:
        child = _ended_in_a_job_wide_restart(sup)
        sup._decide(0, ExitStatus(130, None), child.pid)
        assert started == [0] and sup.exit_code == ExitCode.RANK_STOPPED, sup.stop_reason
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


def test_a_non_retryable_failure_during_a_job_wide_restart_still_stops_the_job(tmp_path: Path) -> None:
    """A rank that failed in the same pass as the failure that began a job-wide restart is
    still looked at for ``--ft-non-retryable-exception-file`` (whose match stops the job,
    exit 11: ``WorkloadControl.non_retryable``), and not restarted on its own."""
    from nvrx.supervisor.children import ExitStatus

    sup, started = _supervisor(tmp_path, 1)
    sup.start_child(0)
    try:
        checked = []
        sup.workload.non_retryable = lambda local_rank, who: checked.append(local_rank) or True  # type: ignore[method-assign]
        child = _ended_in_a_job_wide_restart(sup)
        sup._decide(0, ExitStatus(1, None), child.pid)
        assert checked == [0] and started == [0]
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


@pytest.mark.parametrize("stopping", [False, True])
def test_a_warning_that_came_with_a_one_node_jobs_clean_end_requeues_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopping: bool
) -> None:
    """SLURM's warning is read with the last child's exit 0: the training is over, and a
    requeue would run it again. A job that was stopping (a failure) is requeued as before."""
    monkeypatch.delenv(checkpoint_flag.PREEMPT_FLAG_ENV, raising=False)
    sup, _ = _supervisor(tmp_path, 1)
    sup.preemption = PreemptionHandler(
        sup.config.events_dir, 0, 1, slurm=False, local_requeue=True, export_env=False
    )
    sup.store.service = SimpleNamespace()  # type: ignore[assignment]  # the store host decides
    if stopping:
        sup.request_stop("the store was lost", ExitCode.STORE_UNAVAILABLE, broadcast=False)
    sup.preemption.on_signal(signal.SIGUSR2)
    sup._warning_at_the_end()
    decision = sup.preemption._decision
    assert decision is not None and decision.requeued is stopping, decision.reason
    assert (sup.exit_code == ExitCode.OK) is not stopping


def test_a_ranks_timeout_of_a_month_makes_no_wait_that_select_refuses(tmp_path: Path) -> None:
    """A rank's computed or restored timeouts have no upper bound (a checkpoint's 3e6 s):
    the loop waits a day at most, which ``select`` takes (it refuses about 25 days)."""
    import selectors

    sup, _ = _supervisor(tmp_path, 1)
    sup.hang_watch.timeout = lambda timeout: 3e6  # type: ignore[method-assign]
    wait = sup._wait_s()
    assert wait is not None and wait <= 86400
    with selectors.DefaultSelector() as selector:
        reader, writer = os.pipe()
        try:
            selector.register(reader, selectors.EVENT_READ)
            os.write(writer, b"x")
            assert selector.select(wait)  # ready at once; 3e6 raised OverflowError here
        finally:
            os.close(reader)
            os.close(writer)


def test_a_warning_read_with_the_last_clean_exit_in_the_loop_requeues_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main loop reads the last child's exit 0 and SLURM's warning in one batch (the
    warning came while the loop was busy): the training is over, and the loop leaves the
    decision to its end, which requeues nothing (before: the loop's own look at the warning
    came first and requeued the finished job)."""
    import subprocess

    monkeypatch.delenv(checkpoint_flag.PREEMPT_FLAG_ENV, raising=False)

    def spawn(local_rank: int, attempt: int, env: dict, directory: Path | None) -> Child:
        argv = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # ends 0 at EOF
        return Child(local_rank, attempt, processes.start(argv, stdin=subprocess.PIPE))

    config = SupervisorConfig(command=["train"], job=local_job(log_dir=str(tmp_path)), grace_period=1.0)
    sup = Supervisor(config, spawn=spawn)
    sup.course.to(Course.TRAINING)
    sup.preemption = PreemptionHandler(
        sup.config.events_dir, 0, 1, slurm=False, local_requeue=True, export_env=False
    )
    sup.store.service = SimpleNamespace()  # type: ignore[assignment]  # the store host decides
    sup.signals = SignalPipe((*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD)).install()
    real_poll = sup._poll_once
    polls = []

    def busy_then_both(selector, timeout):
        if not polls:  # the child ends, and the warning comes, before the loop looks
            child = sup.ranks.children[0]
            child.proc.stdin.close()
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
            assert sup.preemption is not None
            sup.preemption.on_signal(signal.SIGUSR2)
        polls.append(timeout)
        return real_poll(selector, timeout)

    monkeypatch.setattr(sup, "_poll_once", busy_then_both)
    try:
        sup.start_child(0)
        sup._monitor()
        decision = sup.preemption.decision
        assert decision is not None and not decision.requeued, decision.reason
        assert sup.exit_code == ExitCode.OK
    finally:
        sup.signals.restore()
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


def test_a_second_stop_signal_kills_at_once(tmp_path: Path) -> None:
    sup, _ = _supervisor(tmp_path, 1)
    sup.start_child(0)
    try:
        sup.request_stop("test", ExitCode.OK, broadcast=False)
        assert sup.kill_at is not None and sup.kill_at > time.monotonic()
        sup._on_signals([signal.SIGTERM])
        assert sup.kill_at <= time.monotonic()
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


def test_a_stop_ends_what_was_kept_ready_for_a_failover(tmp_path: Path) -> None:
    """The slot next in line keeps a node agent and a held store (torch imported) ready for a
    failover; the job stops (here a stop of another node's; a failover that ends in a stop
    is told so the same way): both end at once, not at the supervisor's exit."""
    sup, _ = _supervisor(tmp_path, 1)
    ended: list[str] = []
    sup.failover._prepared_link = SimpleNamespace(close=lambda: ended.append("agent"))  # type: ignore[assignment]
    sup.failover._prepared_service = SimpleNamespace(stop=lambda: ended.append("store"))  # type: ignore[assignment]
    sup.request_stop("node 1 stopped the job", ExitCode.NODE_LOST, broadcast=False)
    assert ended == ["agent", "store"]
    assert sup.failover._prepared_link is None and sup.failover._prepared_service is None


def _store_host_to_warn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Supervisor, list[str]]:
    """The store host of SLURM job 123, one node: its decision on a warning would requeue
    the job (the list returned records each ``scontrol requeue``)."""
    requeued: list[str] = []
    monkeypatch.setattr(preemption.commands, "requeue", lambda job, **kw: requeued.append(job))
    sup, _ = _supervisor(tmp_path, 1)
    sup.preemption = PreemptionHandler(
        sup.config.events_dir, 0, 1, job_id="123", slurm=True, preempt_window_s=2.0, export_env=False
    )
    monkeypatch.setattr(sup.preemption, "_job_info", lambda: None)
    sup.store.service = object()  # the store host: the one that would requeue
    return sup, requeued


@pytest.mark.parametrize(
    "final",
    [ExitCode.OK, ExitCode.RANK_STOPPED, ExitCode.BUDGET_EXHAUSTED, ExitCode.LOOP_BREAKER, ExitCode.NON_RETRYABLE,
     ExitCode.AFTER_COMPLETION],
    ids=lambda c: c.name,
)
def test_a_warning_while_the_job_stops_for_good_requeues_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, final: ExitCode
) -> None:
    """A rank stopped the job (exit 130) or its restarts are spent; SLURM's warning in the
    stop's grace period must not requeue it (before: ``scontrol requeue`` and exit 75), and
    the decision the other nodes await says so, with the stop's exit code."""
    sup, requeued = _store_host_to_warn(tmp_path, monkeypatch)
    try:
        sup.start_child(0)
        sup.request_stop("stopped for good", final, broadcast=False)
        sup.preemption.on_signal(signal.SIGUSR2)
        sup._handle_preemption()
        assert (sup.exit_code, requeued, sup.preemption.ledger.count()) == (final, [], 0)
        # a node that acted on the flag reads the stop's exit code, not "no decision in time"
        written = json.loads(sup.preemption._decision_path().read_text())
        assert (written["requeued"], written["exit_code"]) == (False, final)
    finally:
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


@pytest.mark.parametrize("decider", [True, False], ids=["store-host", "other-node"])
def test_a_stop_signal_during_the_warning_stops_the_job_without_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decider: bool
) -> None:
    """scancel while the children checkpoint for a warning: the supervisor reads it at once,
    ends its children, and nobody requeues the cancelled job (before: its signals were not
    read until the window ended, and the store host ran ``scontrol requeue`` after it)."""
    requeued: list[str] = []
    monkeypatch.setattr(preemption.commands, "requeue", lambda job, **kw: requeued.append(job))
    sup, _ = _supervisor(tmp_path, 1)
    sup.preemption = PreemptionHandler(
        sup.config.events_dir, 0 if decider else 1, 2, job_id="123", slurm=True,
        preempt_window_s=120.0, export_env=False,
    )  # fmt: skip
    # what scontrol shows of a job being cancelled: not CANCELLED, while its steps end
    monkeypatch.setattr(sup.preemption, "_job_info", lambda: {"JobState": "COMPLETING"})
    if decider:
        sup.store.service = object()
    if not decider:  # the store host decided: the job was cancelled
        sup.preemption._decision_path().parent.mkdir(parents=True, exist_ok=True)
        sup.preemption._decision_path().write_text(json.dumps(
            {"cause": "unknown", "requeued": False, "exit_code": 143,
             "reason": "not requeued: stopped by SIGTERM during the warning", "requeue_count": 0}
        ))  # fmt: skip
    sup.signals = SignalPipe((*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD)).install()
    try:
        sup.start_child(0)  # a child that ignores the flag: it would run out the window
        sup.preemption.on_signal(signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # scancel, with the warning
        sup._handle_preemption()
        deadline = json.loads(sup.preemption.flag_path.read_text())["deadline_wall"]
        assert time.time() < deadline  # the window was cut short
        decision = sup.preemption.decision
        assert not sup.running()  # ended and reaped
        assert sup.signalled == signal.SIGTERM
        assert decision is not None and not decision.requeued and requeued == []
        assert sup.exit_code == 128 + signal.SIGTERM
    finally:
        sup.signals.restore()
        for child in sup.ranks.children.values():
            processes.stop(child.proc, ask=signal.SIGKILL)


class _Roles:
    """What the store host's warning decision asks of its node roles: whether every training
    node's children ended (the job's ``all_done`` flag) and which slots are still in the job."""

    def __init__(self, all_done: bool) -> None:
        self.all_done = all_done

    def flag_set(self, base: str) -> bool:
        assert base == ALL_DONE_KEY
        return self.all_done

    def running_slots(self) -> list[int]:
        return [0]

    def on_chain_value(self, key: object, value: str) -> None:
        return None  # no chain of the node roles is watched here


def _finishing_store_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, all_done: bool
) -> tuple[Supervisor, list[str]]:
    """A store host (SLURM job 123) whose children ended: it waits for the other nodes."""
    sup, requeued = _store_host_to_warn(tmp_path, monkeypatch)
    sup.store.roles = _Roles(all_done)  # type: ignore[assignment]
    sup.course.to(Course.FINISHING)  # what ``run`` does once its children ended
    return sup, requeued


@pytest.mark.parametrize("all_done", [False, True], ids=["others-train", "all-ended"])
def test_a_warning_while_the_store_host_waits_for_the_others_is_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, all_done: bool
) -> None:
    """The store host's children ended and it waits for the other nodes: a warning then is
    decided on (before: nobody decided, and the nodes still training gave up 15 s after the
    window, unrequeued); where every training node's children had ended, the decision
    requeues nothing and the job's exit code stays 0."""
    sup, requeued = _finishing_store_host(tmp_path, monkeypatch, all_done)
    sup.preemption.on_signal(signal.SIGUSR2)
    assert sup._warned_while_finishing()
    decision = sup.preemption.decision
    assert decision is not None and sup.course.stopping
    written = json.loads(sup.preemption._decision_path().read_text())
    assert written == decision.to_dict()  # what the other nodes read
    if all_done:
        assert (decision.requeued, requeued, sup.exit_code) == (False, [], ExitCode.OK)
        assert "had ended on every node" in decision.reason
    else:
        assert decision.requeued and requeued == ["123"]
        assert sup.exit_code == preemption.EXIT_REQUEUED


@pytest.mark.parametrize("code", [ExitCode.OK, ExitCode.NON_RETRYABLE], ids=lambda c: c.name)
def test_a_warning_after_another_node_stopped_the_job_for_good_requeues_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: ExitCode
) -> None:
    """While the store host waits for the others, another node stops the job for good (a
    workload's clean end, a non-retryable failure): a warning then requeues nothing."""
    sup, requeued = _finishing_store_host(tmp_path, monkeypatch, False)
    flag = sup.store.stop = StopFlag(b"s" * 32, 0)
    key = StopFlag.key(1)
    value = flag.sealer.seal(key, StopRequest("stopped for good", int(code), 1).encode())
    sup.job_end.poll = lambda selector, timeout: [{"event": "value", "key": key, "value": value}]
    assert not sup.job_end._other_nodes_done(None, time.monotonic() + 60)  # type: ignore[arg-type]
    assert sup.job_end.stop_request is not None and sup.exit_code == code
    sup.preemption.on_signal(signal.SIGUSR2)
    assert not sup._warned_while_finishing()
    assert (requeued, sup.exit_code) == ([], code)
    # the nodes that acted on the warning read the stop's exit code as the decision
    written = json.loads(sup.preemption._decision_path().read_text())
    assert (written["requeued"], written["exit_code"]) == (False, code)
    assert "not requeued" in written["reason"]


def test_the_store_hosts_wait_for_the_others_goes_on_after_its_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The time the store host spends deciding on a warning is not taken from the other
    nodes' time to end (``--finish-timeout``): they are given the stop's wait after it."""
    sup, _ = _finishing_store_host(tmp_path, monkeypatch, False)
    decided = iter([True, False])
    sup.job_end.on_warning = lambda: next(decided)
    past = time.monotonic() - 1.0  # --finish-timeout ran out while it decided
    extended = sup.job_end._after_warning(past)
    assert extended >= time.monotonic() + job_end.SIGNALLED_WAIT_S - 1.0
    assert sup.job_end._after_warning(past) == past  # nothing decided: the deadline stands


def test_a_store_that_stops_answering_as_a_node_counts_itself_ready_stops_the_job(
    tmp_path: Path,
) -> None:
    """A job-wide restart ended this node's children; counting itself ready is its first word
    to the store since, and the store does not answer it (the link gives up after
    ``--store-timeout``, as its request does). The job stops with exit code 3, as for any other
    request the store leaves unanswered: the supervisor's loop does not end with the error."""
    sup, _ = _supervisor(tmp_path, 1)
    sup.store.stop = StopFlag(b"s" * 32, 0)  # the job's secret is known
    link = sup.store.link = StoreLink("127.0.0.1", 1)
    link.lost = "no answer to append within the store timeout"  # what the request's wait sets
    sup.job_restart.pending = 1
    sup.course.to(Course.RESTARTING)
    sup.signals = SignalPipe((*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD)).install()
    try:
        sup._monitor()
    finally:
        sup.signals.restore()
    assert (sup.course.state, sup.exit_code) == (Course.STOPPING, ExitCode.STORE_UNAVAILABLE)
    assert sup.stop_reason is not None and "no answer to append" in sup.stop_reason


class _StoppedLink:
    """The store host's link to a store where a node wrote its stop (keys read with ``get``,
    None when absent, and written with ``compare_set``, as ``StoreLink``)."""

    lost = None
    has_events = False

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.pipe = os.pipe()  # what the wait selects on: no message comes

    def get(self, key: str) -> str | None:
        return self.values.get(key)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        held = self.values.get(key, "")
        if held == expected:
            self.values[key] = held = desired
        return held

    def fileno(self) -> int:
        return self.pipe[0]

    def close(self) -> None:
        for fd in self.pipe:
            os.close(fd)


class _EndedRoles(_Roles):
    node_rank = 0

    def node_done(self) -> None:
        pass


def _store_host_of_two(tmp_path: Path, link: _StoppedLink, **options: Any) -> Supervisor:
    """The store host of a job of two nodes, its link ``link``, the job's stop flag known
    (``options``: more of its ``SupervisorConfig``)."""
    job = local_job(nnodes=2, nproc_per_node=1, log_dir=str(tmp_path))
    sup = Supervisor(SupervisorConfig(command=["train"], job=job, grace_period=1.0, **options))
    sup.store.service, sup.store.roles = object(), _EndedRoles(True)  # type: ignore[assignment]
    sup.store.stop = StopFlag(b"s" * 32, 0)
    sup.store.link = link  # type: ignore[assignment]
    sup.course.to(Course.TRAINING)
    return sup


def _finish_once_every_slot_ended(sup: Supervisor, link: _StoppedLink, ended: bool = True) -> None:
    """The end of the store host's run, the other slots' end (all ended) told already (not
    told, where not ``ended``)."""
    sup.job_end.messages.all_ended = ended
    sup.signals = SignalPipe((*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD)).install()
    try:
        sup.job_end.finish()
    finally:
        sup.signals.restore()
        link.close()


def test_a_stop_whose_writer_ended_before_its_value_reached_the_store_host_still_counts(
    tmp_path: Path,
) -> None:
    """Node 1 stops the job (13), then ends as the last slot; the store host's watch brings
    it that end (every slot ended) first, and its wait is over then: it still reads the stop
    node 1 wrote before it ended, and ends with 13, not 0 (a failed job is not a success)."""
    link = _StoppedLink({})
    sup = _store_host_of_two(tmp_path, link)
    assert sup.store.stop is not None
    key = StopFlag.key(1)
    request = StopRequest("rank 1 failed after node 0 completed", int(ExitCode.AFTER_COMPLETION), 1)
    link.values[key] = sup.store.stop.sealer.seal(key, request.encode())
    sup.course.to(Course.FINISHING)  # what ``run`` does once its children ended
    sup.writer = EventWriter(tmp_path / "events", "supervisor")
    _finish_once_every_slot_ended(sup, link)
    assert sup.exit_code == ExitCode.AFTER_COMPLETION
    assert sup.stop_reason == f"node 1 stopped the job: {request.reason}"
    # the event record says why this node ends with 13, as a stop taken while training does
    events, _ = read_dir(tmp_path / "events")
    stops = [(e["reason"], e["exit_code"]) for e in events if e["kind"] == "job_stop"]
    assert stops == [(sup.stop_reason, int(ExitCode.AFTER_COMPLETION))]


def test_a_warning_decided_while_a_stop_is_on_its_way_to_the_store_host_requeues_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 stopped the job for good and its stop is in the store, but the watch has not
    brought it to the waiting store host when SLURM's warning comes: the host reads the stop
    before it decides, and requeues nothing (a requeue would run a stopped job again)."""
    sup, requeued = _finishing_store_host(tmp_path, monkeypatch, False)
    flag = sup.store.stop = StopFlag(b"s" * 32, 0)
    key = StopFlag.key(1)
    request = StopRequest("a rank failed for good", int(ExitCode.NON_RETRYABLE), 1)
    link = _StoppedLink({key: flag.sealer.seal(key, request.encode())})
    sup.store.link = link  # type: ignore[assignment]
    try:
        sup.preemption.on_signal(signal.SIGUSR2)
        assert not sup._warned_while_finishing()
    finally:
        link.close()
    assert (requeued, sup.exit_code) == ([], ExitCode.NON_RETRYABLE)
    written = json.loads(sup.preemption._decision_path().read_text())
    assert (written["requeued"], written["exit_code"]) == (False, ExitCode.NON_RETRYABLE)


def test_the_store_hosts_own_stop_with_exit_0_keeps_its_reason_after_the_wait(
    tmp_path: Path,
) -> None:
    """A rank of the store host asked to shut the workload down: its stop (exit 0) is the
    first in the chain. Read there after the wait, it is this node's own, not another
    node's: the end's reason stays the rank's request."""
    link = _StoppedLink({})
    sup = _store_host_of_two(tmp_path, link)
    reason = "rank 0 asked to shut the workload down: done early"
    sup.request_stop(reason, ExitCode.OK, broadcast=True)  # written into the chain
    assert list(link.values) == [StopFlag.key(1)]
    _finish_once_every_slot_ended(sup, link)
    assert (sup.exit_code, sup.stop_reason) == (ExitCode.OK, reason)
    assert sup.job_end.stop_request is None


def _stop_of_node_1(sup: Supervisor, link: _StoppedLink, code: ExitCode, reason: str) -> StopRequest:
    """Node 1's stop with ``code``, written into the store behind ``link``."""
    assert sup.store.stop is not None
    key, request = StopFlag.key(1), StopRequest(reason, int(code), 1)
    link.values[key] = sup.store.stop.sealer.seal(key, request.encode())
    return request


def _job_stops(events_dir: Path) -> list[tuple[str, int]]:
    events, _ = read_dir(events_dir)
    return [(e["reason"], e["exit_code"]) for e in events if e["kind"] == "job_stop"]


@pytest.mark.parametrize("taken", ["while-training", "while-finishing"])
def test_another_nodes_stop_taken_before_the_store_hosts_last_read_is_recorded_once(
    tmp_path: Path, taken: str
) -> None:
    """Node 1's rank asked to shut the workload down (exit 0): the store host took that stop
    from its watch, while its children trained or while it waited for the others, and
    recorded it then; read again from the chain after its wait, it is not recorded twice
    (an exit-0 stop leaves the exit code at 0, which let each read take it anew)."""
    link = _StoppedLink({})
    sup = _store_host_of_two(tmp_path, link)
    sup.writer = EventWriter(tmp_path / "events", "supervisor")
    request = _stop_of_node_1(sup, link, ExitCode.OK, "rank 1 asked to shut the workload down: done")
    if taken == "while-training":
        sup._stopped_by(request)
    else:
        sup.course.to(Course.FINISHING)  # what ``run`` does once its children ended
        key = StopFlag.key(1)
        sup.job_end._on_control_value({"event": "value", "key": key, "value": link.values[key]})
    _finish_once_every_slot_ended(sup, link)
    reason = f"node 1 stopped the job: {request.reason}"
    assert (sup.exit_code, _job_stops(tmp_path / "events")) == (ExitCode.OK, [(reason, 0)])


def test_a_stop_on_its_way_when_the_finish_timeout_runs_out_is_the_jobs_end(tmp_path: Path) -> None:
    """Node 1 stopped the job for good (13) and still ends when the store host's
    ``--finish-timeout`` runs out, the stop not yet brought by the watch: the host reads it
    then and ends with 13 for node 1's reason, not with 6 for the others' lateness."""
    link = _StoppedLink({})
    sup = _store_host_of_two(tmp_path, link, finish_timeout=0.01)
    sup.writer = EventWriter(tmp_path / "events", "supervisor")
    request = _stop_of_node_1(sup, link, ExitCode.AFTER_COMPLETION, "rank 1 failed")
    sup.course.to(Course.FINISHING)
    _finish_once_every_slot_ended(sup, link, ended=False)
    reason = f"node 1 stopped the job: {request.reason}"
    assert (sup.exit_code, sup.stop_reason) == (ExitCode.AFTER_COMPLETION, reason)
    assert _job_stops(tmp_path / "events") == [(reason, int(ExitCode.AFTER_COMPLETION))]


@pytest.mark.parametrize("code", [ExitCode.OK, ExitCode.NON_RETRYABLE], ids=lambda c: c.name)
def test_a_warning_decided_while_another_nodes_stop_for_good_is_on_its_way_requeues_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: ExitCode
) -> None:
    """The store host trains on; node 1 stopped the job for good, its stop in the store but
    not yet brought by the watch, when SLURM's warning comes: the host reads the stop as it
    decides and requeues nothing, with the stop's exit code (before: ``scontrol requeue``
    and exit 75, a job stopped for good run again)."""
    sup, requeued = _store_host_to_warn(tmp_path, monkeypatch)
    sup.store.stop = StopFlag(b"s" * 32, 0)
    link = _StoppedLink({})
    sup.store.link = link  # type: ignore[assignment]
    request = _stop_of_node_1(sup, link, code, "a rank failed for good")
    try:
        sup.preemption.on_signal(signal.SIGUSR2)
        assert sup._handle_preemption()
    finally:
        link.close()
    assert (requeued, sup.exit_code) == ([], code)
    written = json.loads(sup.preemption._decision_path().read_text())
    assert (written["requeued"], written["exit_code"]) == (False, code)
    assert written["reason"] == f"not requeued: node 1 stopped the job: {request.reason}"


def test_an_exit_0_stop_does_not_hide_nodes_that_do_not_finish(tmp_path: Path) -> None:
    """Node 1's rank shut the workload down (exit 0), a stop the store host took as it waited;
    the other nodes still have not ended when ``--finish-timeout`` runs out: the host gives up
    on them with 6 and says so, as without the stop (no failure explains their lateness)."""
    link = _StoppedLink({})
    sup = _store_host_of_two(tmp_path, link, finish_timeout=0.01)
    sup.writer = EventWriter(tmp_path / "events", "supervisor")
    _stop_of_node_1(sup, link, ExitCode.OK, "rank 1 asked to shut the workload down: done")
    sup.course.to(Course.FINISHING)
    key = StopFlag.key(1)
    sup.job_end._on_control_value({"event": "value", "key": key, "value": link.values[key]})
    _finish_once_every_slot_ended(sup, link, ended=False)
    assert (sup.exit_code, sup.course.state) == (ExitCode.PEER_LOST, Course.STOPPING)
    assert [code for _, code in _job_stops(tmp_path / "events")] == [0, int(ExitCode.PEER_LOST)]


def test_another_nodes_failure_taken_after_the_store_hosts_own_exit_0_stop_is_recorded(
    tmp_path: Path,
) -> None:
    """The store host's rank shut the workload down (exit 0, recorded), while node 1's stop
    for good (13) stood first in the chain: its last read takes node 1's stop, and the new
    exit code is recorded too, not only the first stop's 0."""
    link = _StoppedLink({})
    sup = _store_host_of_two(tmp_path, link)
    sup.writer = EventWriter(tmp_path / "events", "supervisor")
    request = _stop_of_node_1(sup, link, ExitCode.AFTER_COMPLETION, "rank 1 failed")
    sup.request_stop("rank 0 asked to shut the workload down: done", ExitCode.OK, broadcast=True)
    _finish_once_every_slot_ended(sup, link)
    reason = f"node 1 stopped the job: {request.reason}"
    assert (sup.exit_code, sup.stop_reason) == (ExitCode.AFTER_COMPLETION, reason)
    assert _job_stops(tmp_path / "events") == [
        ("rank 0 asked to shut the workload down: done", 0),
        (reason, int(ExitCode.AFTER_COMPLETION)),
    ]



@pytest.mark.parametrize(("opening", "fresh"), [(True, "1"), (False, "0")])
def test_a_rank_restarted_while_a_failovers_generation_opens_starts_with_it(
    tmp_path: Path, opening: bool, fresh: str
) -> None:
    """After a store failover, until the survivors' new generation ran a round, a rank
    restarted alone starts with that generation (``NVRX_FRESH_START``), though it died
    before it wrote any Wrapper event: as a replacement it waited to rejoin a round nobody
    ran, and the others for it at their initial barrier."""
    from nvrx import jobenv
    from nvrx.supervisor.children import ExitStatus

    envs: list[dict] = []

    def spawn(local_rank: int, attempt: int, env: dict, directory: Path | None) -> Child:
        envs.append(env)
        return Child(local_rank, attempt, processes.start([sys.executable, "-c", "pass"]))

    job = local_job(nproc_per_node=1, log_dir=str(tmp_path))
    sup = Supervisor(SupervisorConfig(command=["train"], job=job, grace_period=1.0), spawn=spawn)
    sup.course.to(Course.TRAINING)
    sup.store.roles = SimpleNamespace(enabled=True, opening_fresh=lambda: opening, node_rank=0)
    # (the store's part of the decision, here with no store: nobody else stopped, no
    # job-wide restart, one restart spent)
    sup._stopped_by_another_node = lambda: False
    sup.job_restart.failure_handled = lambda *args: False
    sup.policy._spend = lambda: 1
    sup.start_child(0)
    sup.ranks.children[0].wait(30)
    sup._decide(0, ExitStatus(1, None), sup.ranks.children[0].pid)
    assert len(envs) == 2 and envs[1].get(jobenv.FRESH_START) == fresh
    sup.ranks.children[0].wait(30)
