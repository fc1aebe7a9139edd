"""Documented Wrapper paths with real ranks (gloo-free, real store, monitor processes).

* ``disable_hang_protection()``: a block silent for longer than both timeouts
  restarts nothing, nor does the step after it when the rank ``ping()``s, nor a block
  nested in it;
* ``completion_timeout``: a rank that does not reach the completion barrier in
  time makes every rank restart;
* ``initialize`` raising an ``Exception`` restarts every rank, raising a
  ``BaseException`` takes that rank out and the others go on;
* ``store_kwargs["tcp_store_host_rank"]``: -1, no rank hosts the store, the
  job uses the one at ``MASTER_PORT + 1``; 1, rank 1's monitor process serves it;
* ``monitor_process_pidfile``: holds the monitor's pid while it runs;
* a wrapped function called outside the main thread is refused before anything runs;
* a rank that ignores SIGTERM is SIGKILLed after ``termination_grace_time``;
* a ``finalize`` or ``health_check`` that raises takes its rank out, the others go on;
* a ``finalize`` that hangs is ended by its monitor (the hard timeout applies between
  rounds), the others go on; a rank waiting at the iteration barrier for a slow peer,
  longer than the hard timeout, is not ended, nor one whose ``ThreadedFinalize`` works
  longer than the hard timeout within its own timeout;
* a rank alive but silent (``heartbeat_timeout``) is taken out by the monitor its host's
  monitors elected, or, when it is that monitor's rank, by the one that replaces it; a host
  whose ranks all went silent, by the host that watches it.
"""

from __future__ import annotations

import contextlib
import signal

import psutil
import pytest
from helpers_wrapper_paths import launch, node_agents
from test_wrapper import FAST

from nvrx import monitor_boot
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


def _kinds(events, kind, component="wrapper"):
    return [e for e in events if e["kind"] == kind and e["component"] == component]


def _iterations(ranks, rank):
    return [c["iteration"] for c in ranks.calls(rank)]


@pytest.mark.parametrize(
    "how",
    [
        {},
        # a ping before the block: its manual timestamp, older than the block, counted
        # at the block's end (a soft hang at the monitor's next look)
        {"ping": True, "after_s": 4 * FAST["monitor_process_interval"]},
        # a helper's block inside it: its end turned the timeouts back on for the rest
        {"nested": True},
    ],
    ids=["plain", "pinged", "nested"],
)
def test_disable_hang_protection_lets_a_block_outlast_both_timeouts(tmp_path, how):
    # Rank 1 is silent for longer than hard_timeout inside the block; rank 0 waits
    # for it at the completion barrier. Nobody restarts, nobody is terminated.
    block_s = FAST["hard_timeout"] + 4 * FAST["monitor_process_interval"]
    ranks = launch(
        tmp_path, 2, wrapper=FAST, scenario="no_hang_protection", fault_ranks=[1],
        block_s=block_s, **how,
    )  # fmt: skip
    assert ranks.wait(60) == [0, 0], ranks.logs()
    assert (tmp_path / "block-done-1").exists()
    for rank in range(2):
        assert _iterations(ranks, rank) == [0], ranks.logs()
        assert ranks.result(rank) == {"iteration": 0, "rank": str(rank), "world_size": "2"}
    events = ranks.events()
    assert not _kinds(events, "hang", component="monitor"), ranks.logs()
    assert not [e for e in events if e["kind"] == "fault"], ranks.logs()


def test_a_block_a_restart_cut_short_leaves_the_next_round_protected(tmp_path):
    # Rank 1 never leaves its block in round 0 and raises; in round 1 it hangs. Before, the
    # block's depth (and the timeouts off) outlived the round: nothing caught the hang.
    ranks = launch(tmp_path, 2, wrapper=FAST, scenario="block_left_open", fault_ranks=[1])
    assert ranks.wait(90) == [0, 0], ranks.logs()
    assert _iterations(ranks, 1) == [0, 1, 2], ranks.logs()
    hangs = [h for h in _kinds(ranks.events(), "hang", component="monitor") if h["rank"] == 1]
    assert [h["timeout"] for h in hangs] == ["soft"], ranks.logs()


def test_a_wrapped_function_called_outside_the_main_thread_is_refused(tmp_path):
    # Each rank calls the function in a worker thread; rank 1 would raise in round 0.
    # The restart and the progress watchdog work on the main thread only (before, the
    # main thread got a peer's RankShouldRestart): every rank refuses at once, before its
    # function or a round ran, and its main thread catches nothing.
    ranks = launch(
        tmp_path, 2, wrapper=FAST, scenario="exception", fault_ranks=[1], in_thread=True
    )
    assert ranks.wait(60) == [0, 0], ranks.logs()
    for rank in range(2):
        result = ranks.result(rank)
        assert result["error"] == "RuntimeError", ranks.logs()
        assert "called in thread 'trainer', not in the main thread" in result["message"]
        assert ranks.calls(rank) == []
        assert not (tmp_path / f"main-thread-{rank}").exists()
    assert not [e for e in ranks.events() if e["kind"] == "round_start"]


def test_completion_timeout_restarts_every_rank(tmp_path):
    # Rank 1 stays in its function (hang protection off, so only the completion
    # barrier can notice); rank 0's completion barrier times out: a fault, and
    # every rank restarts, rank 1's sleep included.
    wrapper = dict(FAST, completion_timeout=2)
    ranks = launch(tmp_path, 2, wrapper=wrapper, scenario="completion_timeout", fault_ranks=[1])
    assert ranks.wait(60) == [0, 0], ranks.logs()
    assert _iterations(ranks, 1) == [0, 1], ranks.logs()
    for rank in range(2):
        assert ranks.result(rank)["iteration"] == 1
        assert ranks.result(rank)["world_size"] == "2"
    faults = _kinds(ranks.events(), "fault")
    timeouts = [f for f in faults if "BarrierTimeout" in (f.get("exc_type") or "")]
    assert [f["rank"] for f in timeouts] == [0], faults
    assert "ranks [1]" in timeouts[0]["message"], timeouts[0]
    assert not _kinds(ranks.events(), "hang", component="monitor")


def test_initialize_exception_restarts_every_rank(tmp_path):
    ranks = launch(tmp_path, 2, wrapper=FAST, scenario="init_exception", fault_ranks=[1])
    assert ranks.wait(60) == [0, 0], ranks.logs()
    assert _iterations(ranks, 1) == [1], ranks.logs()  # initialize failed before round 0's call
    for rank in range(2):
        assert ranks.result(rank) == {"iteration": 1, "rank": str(rank), "world_size": "2"}
        assert (tmp_path / f"completion-{rank}").exists()
    faults = [
        f for f in _kinds(ranks.events(), "fault") if f["message"] == "initialize failed on rank 1"
    ]
    assert [(f["rank"], f["fault_kind"]) for f in faults] == [(1, "exception")], ranks.logs()
    assert not list(tmp_path.glob("terminate-*"))


def test_initialize_base_exception_takes_the_rank_out(tmp_path):
    ranks = launch(tmp_path, 2, wrapper=FAST, scenario="init_base_exception", fault_ranks=[1])
    codes = ranks.wait(60)
    assert codes == [0, 1], ranks.logs()
    assert ranks.result(1) == {"error": "LeaveJob", "message": "initialize leaves on rank 1"}
    assert _iterations(ranks, 1) == [], ranks.logs()  # it left before any call
    assert (tmp_path / "terminate-1").read_text() == "TERMINATED"
    assert not (tmp_path / "completion-1").exists()
    # rank 0 goes on alone, as rank 0 of a world of one
    assert ranks.result(0) == {"iteration": 1, "rank": "0", "world_size": "1"}
    assert (tmp_path / "completion-0").read_text() == "0"
    assert not (tmp_path / "terminate-0").exists()


def test_tcp_store_host_rank_minus_one_uses_the_store_at_master_port_plus_one(tmp_path):
    from helpers_inprocess import free_port_pair
    from torch.distributed import TCPStore

    from nvrx.store import rounds

    port = free_port_pair()
    # Served here, where the ranks look for it; a rank that tried to host one
    # as well could not bind the port and would fail.
    store = TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False)
    wrapper = dict(FAST, store_kwargs={"tcp_store_host_rank": -1})
    ranks = launch(tmp_path, 2, port=port, wrapper=wrapper, scenario="exception", fault_ranks=[1])
    assert ranks.wait(60) == [0, 0], ranks.logs()
    for rank in range(2):
        assert ranks.result(rank)["iteration"] == 1
    # the restart went through this store
    assert rounds.current_round(store) == 1
    assert rounds.job_restarts(store) == 1


def test_tcp_store_host_rank_one_serves_the_store_beside_rank_one(tmp_path):
    wrapper = dict(FAST, store_kwargs={"tcp_store_host_rank": 1})
    ranks = launch(tmp_path, 2, wrapper=wrapper, scenario="exception", fault_ranks=[0])
    assert ranks.wait(60) == [0, 0], ranks.logs()
    for rank in range(2):
        calls = ranks.calls(rank)
        assert [c["iteration"] for c in calls] == [0, 1], ranks.logs()
        # the store service is a child of rank 1's monitor process, in every round
        services = [
            [cmd for cmd in c["monitor_children"] if "nvrx.store.service" in cmd] for c in calls
        ]
        assert all(len(s) == (1 if rank == 1 else 0) for s in services), calls


def test_monitor_process_pidfile_holds_the_monitor_pid_while_it_runs(tmp_path):
    wrapper = dict(FAST, monitor_process_pidfile=str(tmp_path / "monitor-{rank}.pid"))
    ranks = launch(tmp_path, 2, wrapper=wrapper, scenario="exception", fault_ranks=[1])
    assert ranks.wait(60) == [0, 0], ranks.logs()
    monitors = set()
    for rank in range(2):
        calls = ranks.calls(rank)
        assert [c["iteration"] for c in calls] == [0, 1], ranks.logs()
        for call in calls:  # the same monitor process for the whole Wrapper call
            assert call["pidfile"] == f"{call['monitor_pid']}\n", call
            assert monitor_boot.PROGRAM in call["pidfile_cmdline"], call
        assert calls[0]["monitor_pid"] == calls[1]["monitor_pid"]
        monitors.add(calls[0]["monitor_pid"])
    assert len(monitors) == 2
    for pid in monitors:  # stopped and reaped with its rank
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_time(tmp_path):
    # Rank 1 ignores SIGTERM and hangs holding the GIL: the soft timeout cannot
    # reach it, the hard timeout sends SIGTERM, and after termination_grace_time
    # SIGKILL. Rank 0 goes on alone.
    wrapper = dict(FAST, monitor_process_logfile=str(tmp_path / "monitor-{rank}.log"))
    ranks = launch(tmp_path, 2, wrapper=wrapper, scenario="sigterm_ignored", fault_ranks=[1])
    codes = ranks.wait(60)
    assert codes == [0, -9], ranks.logs()
    assert ranks.result(1) is None
    assert ranks.result(0) == {"iteration": 1, "rank": "0", "world_size": "1"}
    hangs = [h["timeout"] for h in _kinds(ranks.events(), "hang", component="monitor")]
    assert hangs == ["soft", "hard"], ranks.logs()
    monitor_log = (tmp_path / "monitor-1.log").read_text()
    grace = FAST["termination_grace_time"]
    assert f"still runs {grace:.1f} s after SIGTERM: SIGKILL" in monitor_log, monitor_log


@pytest.mark.parametrize(
    ("scenario", "error", "message"),
    [
        ("finalize_fails", "RuntimeError", "finalize failed on rank 2"),
        ("health_fails", "HealthCheckError", "restart health check failed: RuntimeError('unhealthy rank 2')"),
    ],
)  # fmt: skip
def test_a_failing_finalize_or_health_check_takes_its_rank_out_and_the_others_go_on(
    tmp_path, scenario, error, message
):
    # Rank 0 raises in round 0: every rank restarts. On rank 2 the restart's
    # finalize (or health check) raises: rank 2 leaves, ranks 0 and 1 finish round 1
    # as a world of two.
    ranks = launch(tmp_path, 3, wrapper=FAST, scenario=scenario, fault_ranks=[2])
    codes = ranks.wait(60)
    assert codes == [0, 0, 1], ranks.logs()
    assert ranks.result(2) == {"error": error, "message": message}, ranks.logs()
    assert _iterations(ranks, 2) == [0], ranks.logs()
    assert (tmp_path / "terminate-2").read_text() == "TERMINATED"
    assert not (tmp_path / "completion-2").exists()
    for rank in range(2):
        assert _iterations(ranks, rank) == [0, 1], ranks.logs()
        assert ranks.result(rank) == {"iteration": 1, "rank": str(rank), "world_size": "2"}
    terminated = [e["ranks"] for e in ranks.events() if e["kind"] == "ranks_terminated"]
    assert terminated and all(r == [2] for r in terminated), ranks.logs()


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _monitor_pids(ranks, rank):
    return {c["monitor_pid"] for c in ranks.calls(rank)}


def _kill_left(ranks, logs):
    """What a failed test left: the ranks, their monitors (each in a session of its own) and
    the host's node agent."""
    ranks.kill()
    for pid in set().union(*(_monitor_pids(ranks, r) for r in range(ranks.world_size))):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    for agent in node_agents(logs):
        agent.kill()


def test_a_finalize_that_hangs_is_ended_by_its_monitor_and_the_others_go_on(tmp_path):
    # Rank 1 raises in round 0, then its finalize blocks for good: no progress, outside the
    # user's function. Its monitor process ends it after hard_timeout, as a hang in the
    # function (a hard hang's event and fault, SIGTERM), and leaves round 0 on its behalf:
    # rank 0, waiting at the iteration barrier, goes on alone at once, not after
    # barrier_timeout (30 s), and nothing of the job is left.
    ranks = launch(tmp_path, 2, wrapper=FAST, scenario="finalize_hangs", fault_ranks=[1])
    logs = tmp_path / "logs"
    try:
        codes = ranks.wait(60)
        assert codes[0] == 0 and codes[1] in (-15, -9), ranks.logs()
        assert ranks.result(0) == {"iteration": 1, "rank": "0", "world_size": "1"}
        assert ranks.result(1) is None and _iterations(ranks, 1) == [0]
        events = ranks.events()
        hangs = _kinds(events, "hang", component="monitor")
        assert [h["timeout"] for h in hangs] == ["hard"], ranks.logs()
        assert "_hang_for_good" in hangs[0]["stack"] and hangs[0]["stale_s"] > FAST["hard_timeout"]
        [fault] = [f for f in _kinds(events, "fault", "monitor") if f["fault_kind"] == "hang_hard"]
        assert fault["origin_rank"] == 1 and "between rounds" in fault["message"], fault
        assert [e["ranks"] for e in _kinds(events, "ranks_terminated")] == [[1]]
        [barrier] = [e for e in _kinds(events, "restart_phase") if e["phase"] == "iteration_barrier"]
        assert barrier["rank"] == 0 and barrier["ok"], barrier
        assert barrier["duration_s"] < FAST["barrier_timeout"], barrier
        [monitor] = _monitor_pids(ranks, 1)
        wait_until("rank 1's monitor process to end", lambda: not _running(monitor), 30)
        _, alive = psutil.wait_procs(node_agents(logs), timeout=60)
        assert not alive, alive
    finally:
        _kill_left(ranks, logs)


@pytest.mark.parametrize(
    ("scenario", "phase", "rank"),
    [("finalize_slow", "iteration_barrier", 0), ("finalize_threaded", "finalize", 1)],
    ids=["peer-waits-at-the-barrier", "threaded-finalize"],
)
def test_a_wait_past_the_hard_timeout_within_its_own_limit_is_not_ended(
    tmp_path, scenario, phase, rank
):
    # Rank 1 raises in round 0; its finalize then works for 7 s, past the hard timeout (3 s).
    # finalize_slow: rank 0 waits for it at the iteration barrier, in waits that make no
    # progress for up to 5 s (the agent's resend interval); a wait for peers counts from its
    # limit, barrier_timeout. finalize_threaded: a ThreadedFinalize's thread does the work
    # within its own timeout (60 s); the main thread joins it in slices, stamped between them.
    # Either way nobody is ended and both go on; the long phase is on record.
    wrapper = dict(FAST, soft_timeout=2.5, hard_timeout=3)
    ranks = launch(tmp_path, 2, wrapper=wrapper, scenario=scenario, fault_ranks=[1], slow_s=7)
    try:
        assert ranks.wait(60) == [0, 0], ranks.logs()
        for each in range(2):
            assert ranks.result(each) == {"iteration": 1, "rank": str(each), "world_size": "2"}
        events = ranks.events()
        assert not _kinds(events, "hang", component="monitor"), ranks.logs()
        assert not _kinds(events, "ranks_terminated"), ranks.logs()
        [duration] = [
            e["duration_s"] for e in _kinds(events, "restart_phase")
            if e["phase"] == phase and e["rank"] == rank
        ]  # fmt: skip
        assert duration > wrapper["hard_timeout"], duration
    finally:
        _kill_left(ranks, tmp_path / "logs")


def _resume_and_end(ranks, silent_ranks):
    """Resume the frozen ranks and their monitors: they end by themselves (the job moved on)."""
    families = []
    for rank in silent_ranks:
        proc = psutil.Process(ranks.procs[rank].pid)
        families += [proc, *proc.children(recursive=True)]
    for proc in families:  # the host's node agent among them may end meanwhile: its job moved on
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGCONT)
    for rank in silent_ranks:
        assert ranks.procs[rank].wait(60) != 0, ranks.logs()
    _, alive = psutil.wait_procs(families, timeout=30)
    assert not alive, alive


def _kill_frozen(ranks, silent_ranks):
    """Whatever is left of the frozen ranks and their monitors: SIGKILL ends a stopped process."""
    for rank in silent_ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in psutil.Process(ranks.procs[rank].pid).children(recursive=True):
                proc.kill()
    ranks.kill()


def _unresponsive(ranks):
    return [
        f for f in _kinds(ranks.events(), "fault", component="node_agent")
        if f["fault_kind"] == "unresponsive"
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_a_host_that_thaws_while_the_job_trains_on_finds_itself_fenced(tmp_path):
    # As above, but ranks 0 and 1 hold in round 1, so the store still serves when the agent
    # of "b" is resumed alone: it reads that its place was ended while it stalled (at its
    # next beat, or as it first connects if it stalled before that), says so, and beats no
    # more; the job it was taken out of goes on at world size 2 unharmed.
    wrapper = dict(FAST, monitor_process_logfile=str(tmp_path / "monitor-{rank}.log"))
    ranks = launch(
        tmp_path, 4, wrapper=wrapper, scenario="host_silent", fault_ranks=[2, 3],
        hosts=["a", "a", "b", "b"], hold_after_restart=True,
    )  # fmt: skip
    logs = tmp_path / "logs"
    try:
        wait_until(
            "ranks 0 and 1 to call the function again",
            lambda: all((tmp_path / f"entered-1-{r}").exists() for r in (0, 1)),
            90,
            state=ranks.logs,
        )
        stopped = node_agents(logs, "b")
        assert [p.status() for p in stopped] == [psutil.STATUS_STOPPED]
        for agent in stopped:
            agent.send_signal(signal.SIGCONT)

        def fenced() -> bool:
            text = "".join(p.read_text() for p in tmp_path.glob("monitor-[23].log"))
            return "beats no more in the ring of hosts" in text

        wait_until("b's agent to find itself fenced", fenced, 60, state=ranks.logs)
        (tmp_path / "release").touch()
        for rank in (0, 1):
            assert ranks.procs[rank].wait(60) == 0, ranks.logs()
            assert ranks.result(rank) == {"iteration": 1, "rank": str(rank), "world_size": "2"}
        assert sorted(f["origin_rank"] for f in _unresponsive(ranks)) == [2, 3], ranks.logs()
        _resume_and_end(ranks, [2, 3])
        _, alive = psutil.wait_procs(stopped + node_agents(logs, "a"), timeout=60)
        assert not alive, alive
    finally:
        _kill_frozen(ranks, [2, 3])
        for agent in node_agents(logs):
            agent.kill()


@pytest.mark.parametrize("silent", [2, 0], ids=["rank-2", "rank-0"])
def test_a_live_rank_that_stops_answering_is_taken_out_by_its_peer(tmp_path, silent):
    # A rank stops its monitor process and then itself (SIGSTOP): its process lives, its
    # heartbeats end. Without a supervisor the host's monitors beat to the host's node
    # agent, a process of its own that runs no user code: it takes the silent rank out
    # after heartbeat_timeout, whichever rank it is (rank 0's monitor hosts the store);
    # the other two ranks restart without it.
    ranks = launch(tmp_path, 3, wrapper=FAST, scenario="unresponsive", fault_ranks=[silent])
    others = [rank for rank in range(3) if rank != silent]
    try:
        for rank in others:
            assert ranks.procs[rank].wait(60) == 0, ranks.logs()
        silent_proc = psutil.Process(ranks.procs[silent].pid)
        assert silent_proc.status() == psutil.STATUS_STOPPED  # alive all along
        for i, rank in enumerate(others):
            assert _iterations(ranks, rank) == [0, 1], ranks.logs()
            assert ranks.result(rank) == {"iteration": 1, "rank": str(i), "world_size": "2"}
        faults = _unresponsive(ranks)
        assert [f["origin_rank"] for f in faults] == [silent], ranks.logs()
        assert (faults[0]["rank"], faults[0]["round"]) == (silent, 0)  # the report files it so
        message = faults[0]["message"]
        assert message.startswith("no heartbeat for "), faults
        assert float(message.split()[3]) >= FAST["heartbeat_timeout"], faults
        _resume_and_end(ranks, [silent])
    finally:
        _kill_frozen(ranks, [silent])


def test_a_host_whose_ranks_all_stop_answering_is_taken_out_by_the_host_watching_it(tmp_path):
    # Two hosts on this machine (NVRX_HOST_ID): ranks 0, 1 on "a", ranks 2, 3 on "b". The
    # ranks of "b" stop its node agent, their monitors and themselves: nobody beats for "b"
    # any more. The agent of "a" watches "b" in the ring of hosts and takes both its ranks
    # out; ranks 0 and 1 restart at world size 2. Once resumed, "b"'s agent ends by itself.
    ranks = launch(
        tmp_path, 4, wrapper=FAST, scenario="host_silent", fault_ranks=[2, 3],
        hosts=["a", "a", "b", "b"],
    )  # fmt: skip
    try:
        for rank in (0, 1):
            assert ranks.procs[rank].wait(60) == 0, ranks.logs()
            assert ranks.result(rank) == {"iteration": 1, "rank": str(rank), "world_size": "2"}
        faults = _unresponsive(ranks)
        assert sorted(f["origin_rank"] for f in faults) == [2, 3], ranks.logs()
        assert sorted((f["rank"], f["round"]) for f in faults) == [(2, 0), (3, 0)]
        assert all(f["message"].startswith("its host sent no heartbeat for ") for f in faults)
        logs = tmp_path / "logs"
        stopped = node_agents(logs, "b")
        assert [p.status() for p in stopped] == [psutil.STATUS_STOPPED]
        for agent in stopped:
            agent.send_signal(signal.SIGCONT)
        _resume_and_end(ranks, [2, 3])
        _, alive = psutil.wait_procs(stopped + node_agents(logs, "a"), timeout=60)
        assert not alive, alive
    finally:
        _kill_frozen(ranks, [2, 3])
        for agent in node_agents(tmp_path / "logs"):
            agent.kill()
