"""The Wrapper's restart loop with real ranks: gloo, a store service, monitor processes."""

from __future__ import annotations

import pytest
from helpers_inprocess import FAST, launch

pytestmark = pytest.mark.timeout(90)


def _kinds(events, kind, component="wrapper"):
    return [e for e in events if e["kind"] == kind and e["component"] == component]


def _assert_all_restarted_full(ranks, n):
    for r in range(n):
        calls = ranks.calls(r)
        assert [c["iteration"] for c in calls] == [0, 1], ranks.logs()
        result = ranks.result(r)
        assert result["iteration"] == 1
        assert result["world"] == n
        assert result["peers"] == list(range(n))
        assert result["rank"] == str(r)


def test_exception_on_one_rank_restarts_every_rank(tmp_path):
    ranks = launch(tmp_path, 3, wrapper=FAST, fault="exception", fault_ranks=[1])
    assert ranks.wait(60) == [0, 0, 0], ranks.logs()
    _assert_all_restarted_full(ranks, 3)
    events = ranks.events()
    faults = [
        e for e in _kinds(events, "fault") if e["rank"] == 1 and e["fault_kind"] == "exception"
    ]
    assert faults and faults[0]["message"] == "injected fault on rank 1"
    assert faults[0]["exc_type"] == "builtins.RuntimeError"
    assert "injected fault" in faults[0]["traceback"]
    signature = faults[0]["signature"]  # spelled by nvrx.events.failures: type and innermost frame
    assert "RuntimeError" in signature and "helpers_inprocess.py" in signature, signature
    assert "train" in signature, signature
    phases = {e["phase"] for e in _kinds(events, "restart_phase")}
    assert {"abort", "iteration_barrier", "rank_assignment", "initial_barrier"} <= phases
    starts = _kinds(events, "round_start")
    assert sorted((e["rank"], e["round"]) for e in starts) == [
        (r, k) for r in range(3) for k in (0, 1)
    ]
    latencies = [e["restart_latency_s"] for e in starts if e["round"] == 1]
    assert all(isinstance(x, float) and x >= 0 for x in latencies)
    assert len(_kinds(events, "wrapper_end")) == 3
    # the monitor process, started through nvrx.processes, ignores SLURM's warning signal
    assert all(c["monitor_ignores_usr2"] for r in range(3) for c in ranks.calls(r))


def test_exceptions_on_two_ranks_at_once(tmp_path):
    ranks = launch(tmp_path, 3, wrapper=FAST, fault="exception_together", fault_ranks=[0, 2])
    assert ranks.wait(60) == [0, 0, 0], ranks.logs()
    _assert_all_restarted_full(ranks, 3)
    origins = {
        e["rank"]
        for e in _kinds(ranks.events(), "fault")
        if e.get("message", "").startswith("injected")
    }
    assert origins == {0, 2}


def test_gil_released_hang_restarts_everyone_by_soft_timeout(tmp_path):
    ranks = launch(tmp_path, 2, wrapper=FAST, fault="sleep", fault_ranks=[1])
    assert ranks.wait(60) == [0, 0], ranks.logs()
    _assert_all_restarted_full(ranks, 2)
    events = ranks.events()
    hangs = _kinds(events, "hang", component="monitor")
    assert hangs and all(h["timeout"] == "soft" for h in hangs)
    stacks = "\n".join(h["stack"] for h in hangs)
    assert "helpers_inprocess.py" in stacks and "train" in stacks
    soft = [f for f in _kinds(events, "fault", component="monitor") if f["fault_kind"] == "hang_soft"]
    assert soft and all(f["signature"] == "hang_soft" for f in soft)
    assert all("train" in f["traceback"] and f["detection_s"] > 0 for f in soft)


def test_gil_held_hang_is_killed_and_the_rest_shift_ranks(tmp_path):
    # Rank 0 hangs holding the GIL: it is terminated by the hard timeout and the
    # two others go on as ranks 0 and 1, so rank 0 is another process now; the
    # store lives on in rank 0's monitor process.
    ranks = launch(tmp_path, 3, wrapper=FAST, fault="gil", fault_ranks=[0])
    codes = ranks.wait(60)
    assert codes[1:] == [0, 0], ranks.logs()
    assert codes[0] in (-15, -9)
    assert [c["iteration"] for c in ranks.calls(0)] == [0]
    for initial, new_rank in ((1, "0"), (2, "1")):
        result = ranks.result(initial)
        assert result["world"] == 2 and result["rank"] == new_rank
        assert result["peers"] == [1, 2]
    events = ranks.events()
    hard = [h for h in _kinds(events, "hang", component="monitor") if h["timeout"] == "hard"]
    assert hard and "_catastrophic_regex" in hard[0]["stack"]
    terminated = _kinds(events, "ranks_terminated")
    assert terminated and all(e["ranks"] == [0] for e in terminated)


def test_gil_held_hang_activates_a_spare(tmp_path):
    ranks = launch(tmp_path, 3, wrapper=FAST, fault="gil", fault_ranks=[0], max_active=2)
    codes = ranks.wait(60)
    assert codes[1:] == [0, 0], ranks.logs()
    assert [c["iteration"] for c in ranks.calls(2)] == [1]  # the spare ran only after the fault
    assert ranks.result(1)["peers"] == [1, 2]
    assert ranks.result(2)["rank"] == "1"


def test_sigkill_of_a_rank_is_noticed_and_peers_continue(tmp_path):
    ranks = launch(tmp_path, 3, wrapper=FAST, fault="sigkill", fault_ranks=[1])
    codes = ranks.wait(60)
    assert codes[0] == 0 and codes[2] == 0 and codes[1] == -9, ranks.logs()
    assert ranks.result(0)["peers"] == [0, 2]
    assert ranks.result(2)["world"] == 2
    events = ranks.events()
    dead = [e for e in _kinds(events, "fault", component="monitor") if e["fault_kind"] == "dead"]
    assert dead and dead[0]["origin_rank"] == 1


@pytest.mark.timeout(120)
def test_the_store_host_killed_keeps_serving_while_the_others_train_on(tmp_path):
    """Rank 0's monitor hosts the store: rank 0 SIGKILLed, the others restart and train
    longer than the monitor's own limit at the termination barrier (twice the longer of
    ``barrier_timeout`` and ``completion_timeout``). The store serves them while the job
    moves (its hosts beat), until every rank passed the termination barrier."""
    fast = dict(FAST, barrier_timeout=6, completion_timeout=4)  # the limit: 12 s
    ranks = launch(tmp_path, 3, wrapper=fast, fault="sigkill", fault_ranks=[0], train_s=20)
    codes = ranks.wait(100)
    assert codes == [-9, 0, 0], ranks.logs()
    assert ranks.result(1)["world"] == ranks.result(2)["world"] == 2
    assert "stopping the store without the termination barrier" not in ranks.logs()


@pytest.mark.timeout(120)
def test_the_store_host_that_leaves_alive_serves_while_the_others_train_on(tmp_path):
    """Rank 0 (its monitor hosts the store) leaves the job alive (an exception not worth a
    restart); the others restart and train past its ``barrier_timeout`` at the termination
    barrier: it waits on while the job moves, and its store serves them to their end."""
    fast = dict(FAST, barrier_timeout=6, completion_timeout=4)
    # rank 0 alone on its host: once it left, its host's agent ends, and the job moves by
    # the other host's beats only
    ranks = launch(
        tmp_path, 3, wrapper=fast, fault="base_exception", fault_ranks=[0], train_s=20,
        hosts=["a", "b", "b"],
    )  # fmt: skip
    codes = ranks.wait(100)
    assert codes[0] != 0 and codes[1:] == [0, 0], ranks.logs()
    assert ranks.result(0)["error"] == "KeyboardInterrupt"
    assert ranks.result(1)["world"] == ranks.result(2)["world"] == 2
    assert "keeps the store until they finish" in ranks.log(0)
    ends = sorted(e["outcome"] for e in ranks.events() if e["kind"] == "wrapper_end")
    assert ends == ["completed", "completed", "left"]  # the job completed without rank 0
    assert "termination barrier:" not in ranks.log(0)  # it did not give up


def test_ping_timeout_restarts_a_livelock(tmp_path):
    ranks = launch(tmp_path, 2, wrapper=FAST, fault="ping_stall", fault_ranks=[0], init_pg=False)
    assert ranks.wait(60) == [0, 0], ranks.logs()
    assert [c["iteration"] for c in ranks.calls(0)] == [0, 1]
    assert any(
        f["fault_kind"] == "hang_soft" for f in _kinds(ranks.events(), "fault", component="monitor")
    )


def test_atomic_section_defers_the_restart(tmp_path):
    ranks = launch(
        tmp_path, 2, wrapper=FAST, fault="atomic", fault_ranks=[0], init_pg=False, atomic_s=1.5
    )
    assert ranks.wait(60) == [0, 0], ranks.logs()
    assert (tmp_path / "atomic-0.done").exists()  # the section ran to its end
    assert [c["iteration"] for c in ranks.calls(0)] == [0, 1]


def test_retry_controller_ends_the_wrapper(tmp_path):
    ranks = launch(
        tmp_path,
        2,
        wrapper=FAST,
        fault="exception",
        fault_ranks=[0, 1],
        fault_rounds=99,
        max_iterations=2,
        init_pg=False,
    )
    codes = ranks.wait(60)
    assert codes == [1, 1], ranks.logs()
    called: set[int] = set()
    for r in range(2):
        # a rank slower to reach a round's call than its peer to fault restarts before calling,
        # in round 0 or round 1; but each round ends because some rank called and faulted
        iterations = [c["iteration"] for c in ranks.calls(r)]
        assert iterations == sorted(set(iterations)) and set(iterations) <= {0, 1}, ranks.logs()
        called.update(iterations)
        assert ranks.result(r)["error"] == "RestartAbort"
    assert called == {0, 1}, ranks.logs()
    ends = _kinds(ranks.events(), "wrapper_end")
    assert {e["outcome"] for e in ends} == {"restart_abort"}


def test_restart_abort_exits_130_under_a_supervisor(tmp_path):
    ranks = launch(
        tmp_path,
        2,
        wrapper=FAST,
        fault="exception",
        fault_ranks=[0, 1],
        fault_rounds=99,
        max_iterations=1,
        init_pg=False,
        env={"NVRX_SUPERVISED": "1"},
    )
    assert ranks.wait(60) == [130, 130], ranks.logs()


def test_base_exception_takes_one_rank_out_and_the_others_go_on(tmp_path):
    wrapper = dict(FAST, monitor_process_logfile=str(tmp_path / "monitor-{rank}.log"))
    ranks = launch(
        tmp_path, 3, wrapper=wrapper, fault="base_exception", fault_ranks=[2], callbacks=True
    )
    codes = ranks.wait(60)
    assert codes[:2] == [0, 0] and codes[2] not in (0, None), ranks.logs()
    assert ranks.result(2)["error"] == "KeyboardInterrupt"
    assert ranks.result(2)["gloo_restored"]  # torch's group factory is back after the raise
    assert ranks.result(0)["peers"] == [0, 1] and ranks.result(1)["world"] == 2
    # completion on the ranks that returned, terminate on the one that left
    assert (tmp_path / "completion-0").read_text() == "0"
    assert (tmp_path / "completion-1").read_text() == "1"
    assert not (tmp_path / "completion-2").exists()
    assert (tmp_path / "terminate-2").read_text() == "TERMINATED"
    assert not (tmp_path / "terminate-0").exists()
    assert sorted(p.name for p in tmp_path.glob("monitor-*.log")) == [
        f"monitor-{r}.log" for r in range(3)
    ]


def _external_store_job(tmp_path, world_size):
    """A job whose store is served here (as a supervisor's would be): its Ranks and the store."""
    import json

    from helpers_inprocess import Ranks, free_port_pair
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    params = dict(
        wrapper=FAST,
        env={"NVRX_STORE_HOST": "127.0.0.1", "NVRX_STORE_PORT": str(store.port)},
    )
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "params.json").write_text(json.dumps(params))
    return Ranks(tmp_path, port=free_port_pair(), world_size=world_size), store, params


def _trained_without_rank_1(ranks):
    assert ranks.wait(60) == [0, 0], ranks.logs()
    assert [ranks.result(r)["peers"] for r in (0, 2)] == [[0, 2], [0, 2]], ranks.logs()
    assert [ranks.result(r)["rank"] for r in (0, 2)] == ["0", "1"]
    assert ranks.result(2)["world"] == 2
    starts = _kinds(ranks.events(), "round_start")
    assert {e["world_size"] for e in starts} == {2}, starts


def test_a_new_generation_goes_on_without_the_ranks_marked_gone(tmp_path):
    """Rank 1's node was lost before this generation started and no spare took it over
    (it is marked gone in the job's store, as after a store failover without a spare):
    ranks 0 and 2 meet without it and train at world size 2."""
    from helpers_inprocess import spawn

    from nvrx.store import rounds

    ranks, store, params = _external_store_job(tmp_path, 3)
    rounds.mark_gone(store, [1])
    ranks.procs = [spawn(ranks, rank, params) for rank in (0, 2)]
    _trained_without_rank_1(ranks)


def test_a_rank_declared_gone_while_the_others_wait_to_start_is_not_waited_for(tmp_path):
    """Ranks 0 and 2 wait at the job's initial barrier when rank 1's node is declared lost
    with no spare (the supervisor's ``leave_round``): the declarer arrives for rank 1, and
    the job starts at world size 2 (without it, the barrier would time out and the ranks
    fail)."""
    from helpers_inprocess import spawn

    from nvrx.store import barrier, rounds
    from tests.support.waiting import wait_until

    ranks, store, params = _external_store_job(tmp_path, 3)
    ranks.procs = [spawn(ranks, rank, params) for rank in (0, 2)]
    name = rounds.initial_barrier(0)
    wait_until(
        "ranks 0 and 2 at the initial barrier",
        lambda: all(barrier.has_arrived(store, name, r) for r in (0, 2)),
        60,
        state=ranks.logs,
    )
    rounds.leave_round(store, [1], 3, "node rank 1 lost: no spare", gone=True)
    _trained_without_rank_1(ranks)


#: Timeouts long enough that a restart which does not wait for them shows: none of their faults.
SLOW = dict(FAST, soft_timeout=10, hard_timeout=20, heartbeat_timeout=20)


def _monitor_faults_but_no_timeout(ranks):
    """The monitors' fault events, once none of them is a heartbeat or progress timeout."""
    faults = _kinds(ranks.events(), "fault", component="monitor")
    timeouts = [f for f in faults if f["fault_kind"] in ("unresponsive", "hang_soft", "hang_hard")]
    assert not timeouts, ranks.logs()
    return faults


def _finished_as_two(ranks):
    """Ranks 0 and 1 completed a round of their own, the two of them. (Round 1 may be cut
    before a rank calls the function in it: a call count would race.)"""
    for r in (0, 1):
        last = ranks.calls(r)[-1]
        assert (last["world_size"], last["iteration"]) == ("2", 2), ranks.logs()
    ends = _kinds(ranks.events(), "round_end")
    assert sorted(e["rank"] for e in ends if e["outcome"] == "completed") == [0, 1]


def _rank_2_gone_between_rounds(tmp_path, codes, **gone):
    """Rank 0 raises in round 0, and rank 2 goes (``gone``) in its rank assignment for round 1,
    after round 0's iteration barrier released it: round 0's decision counted it in round 1.
    The job ends with ``codes``, ranks 0 and 1 as two."""
    ranks = launch(
        tmp_path, 3, wrapper=SLOW, fault="exception", fault_ranks=[0], init_pg=False, **gone
    )
    assert ranks.wait(90) == codes, ranks.logs()
    _finished_as_two(ranks)
    return ranks


def test_a_rank_dying_between_two_rounds_is_left_out_of_the_round_it_was_heading_into(tmp_path):
    """Rank 2 is SIGKILLed in its rank assignment for round 1. Its monitor leaves round 1 on its
    behalf, so the others restart at once, not after a heartbeat or progress timeout (here
    20 s and 10 s: no such fault may appear)."""
    ranks = _rank_2_gone_between_rounds(tmp_path, [0, 0, -9], die_in_assignment=2)
    faults = _monitor_faults_but_no_timeout(ranks)
    dead = [(f["origin_rank"], f["round"]) for f in faults if f["fault_kind"] == "dead"]
    assert dead == [(2, 1)], ranks.logs()  # one death, in the round it was heading into


def test_a_rank_leaving_between_two_rounds_leaves_the_round_it_was_heading_into(tmp_path):
    """Rank 2's rank assignment for round 1 raises: it leaves the job alive. It leaves round 1
    itself, as its monitor would for a death there, so the others restart at once, not after
    a heartbeat or progress timeout (here 20 s and 10 s: no such fault may appear)."""
    ranks = _rank_2_gone_between_rounds(tmp_path, [0, 0, 1], raise_in_assignment=2)
    assert ranks.result(2)["error"] == "RuntimeError"
    _monitor_faults_but_no_timeout(ranks)
    exits = [f for f in _kinds(ranks.events(), "fault") if f["fault_kind"] == "exit"]
    assert [(f["round"], f["rank"]) for f in exits] == [(1, 2)], ranks.logs()
    exit_fault = exits[0]  # built from the exception, as the rank's own faults are
    assert exit_fault["origin_rank"] == 2 and exit_fault["exc_type"].endswith("RuntimeError")
    assert exit_fault["signature"] and "RuntimeError" in exit_fault["traceback"]


def test_a_fault_that_reaches_ranks_creating_a_group_together_lets_them_finish_it(tmp_path):
    """Rank 2 raises while ranks 0 and 1 create a group of their own, whose aborts run only
    once they are inside that creation (rank 1's, which nothing holds up, maybe just after
    it); rank 1 enters it only after rank 0's abort came, so rank 0's creation then waits
    for it. Both can complete it, so the abort lets it end
    instead of cutting it halfway (which could leave one of them waiting for a connection
    the other never made, until gloo gave up at several times the group's timeout): both
    return from it, and all three finish in the next round."""
    ranks = launch(
        tmp_path, 3, wrapper=SLOW, fault="fault_while_peers_create", fault_ranks=[2],
        abort_once_creating=True, pg_timeout=60,
    )  # fmt: skip
    codes = ranks.wait(90)
    assert codes == [0, 0, 0], ranks.logs()
    assert (tmp_path / "abort-saw-creation-0").exists(), ranks.logs()  # came during it
    for r in (0, 1):
        assert (tmp_path / f"subgroup-{r}").exists(), ranks.logs()  # and let it end
    assert all(ranks.result(r)["world"] == 3 for r in range(3)), ranks.logs()


def test_a_rank_dying_before_init_process_group_does_not_hold_the_others_in_its_rendezvous(
    tmp_path,
):
    """Rank 1 is SIGKILLed before its ``init_process_group``: rank 0 waits in its rendezvous,
    a store read inside torch's group creation, for an address that never comes. The abort,
    once the creation's grace ran out, cuts that read short, so it restarts then (not after
    the 10 s soft and 20 s hard timeouts, which used to end every rank: no such fault may
    appear). Rank 2, restarted
    before it entered its own ``init_process_group``, names the next round's group as rank 0
    does: they finish as two."""
    ranks = launch(
        tmp_path,
        3,
        wrapper=SLOW,
        fault="sigkill_before_pg",
        fault_ranks=[1],
        pg_timeout=60,
        late_to_pg=[2],
    )
    codes = ranks.wait(90)
    assert codes == [0, -9, 0], ranks.logs()
    assert ranks.result(0)["world"] == 2 and ranks.result(2)["peers"] == [0, 2]
    faults = _monitor_faults_but_no_timeout(ranks)
    assert [f["origin_rank"] for f in faults if f["fault_kind"] == "dead"] == [1]


def test_a_rank_whose_monitor_thread_lost_its_store_connection_records_it_and_the_job_goes_on(
    tmp_path,
):
    """Rank 1 raises in round 0 after its monitor thread's store connection was closed, so
    round 1's monitor thread fails at once. That rank restarts then, and it puts the
    failure on record, which restarts rank 0 too (waiting in its rendezvous for rank 1,
    otherwise until the group's timeout, round after round); round 2 watches on a new
    connection, and both finish."""
    ranks = launch(
        tmp_path, 2, wrapper=SLOW, fault="monitor_connection_lost", fault_ranks=[1], pg_timeout=60
    )
    assert ranks.wait(60) == [0, 0], ranks.logs()
    _monitor_faults_but_no_timeout(ranks)  # restarted by the record, not a hang's timeout
    assert all(ranks.result(r)["world"] == 2 for r in range(2)), ranks.logs()
    lost = [
        e for e in _kinds(ranks.events(), "fault")
        if e["rank"] == 1 and "monitor thread lost its store connection" in e["message"]
    ]  # fmt: skip
    assert [(e["round"], e["fault_kind"]) for e in lost] == [(1, "exception")], ranks.logs()
    assert "DistNetworkError" in lost[0]["message"], lost


def test_a_lone_rank_whose_monitor_thread_lost_its_store_connection_goes_on_in_the_next_round(
    tmp_path,
):
    """The same for the only rank of a job (as one left alone after its peers left): it used
    to restart back to back, every round's monitor thread failing at once on the connection
    broken for good, with no fault on record and no end; now round 2 watches on a new one."""
    ranks = launch(tmp_path, 1, wrapper=SLOW, fault="monitor_connection_lost", fault_ranks=[0])
    assert ranks.wait(30) == [0], ranks.log(0)[-3000:]
    assert [e["round"] for e in _kinds(ranks.events(), "round_start")] == [0, 1, 2]
    assert ranks.result(0)["world"] == 1
