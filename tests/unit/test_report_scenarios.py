"""nvrx.report on event logs written by the real EventWriter: what happened, and who was first."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from test_report_fixtures import JOB, T0, Host, Proc, write_standard_job

from nvrx.events import read_dir
from nvrx.report import build_report

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def standard(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    log_dir = tmp_path_factory.mktemp("logs") / JOB
    facts = write_standard_job(log_dir)
    return log_dir, facts


@pytest.fixture(scope="module")
def report(standard: tuple[Path, dict]):
    return build_report(standard[0], sacct=False)


def test_summary_counts_restarts_of_each_kind_and_goodput(report, standard) -> None:
    facts = standard[1]
    s = report.summary
    assert (s.job, s.nodes, s.ranks, s.rounds, s.runs) == (JOB, 2, 4, 4, 1)
    assert s.hosts == ["node-a", "node-b"]
    assert (s.restarts.in_process, s.restarts.process, s.restarts.requeue) == (3, 1, 0)
    assert s.wall_time_s == pytest.approx(facts["wall_s"], abs=1e-3)
    assert s.training_time_s == pytest.approx(facts["call_s"] / 4, abs=1e-3)
    assert s.goodput == pytest.approx(facts["call_s"] / (4 * facts["wall_s"]), abs=1e-4)
    assert s.interrupted_calls == 1
    assert (s.outcome, s.reason) == ("completed", "training completed")


def test_first_failing_rank_uses_store_origin_across_skewed_hosts(report) -> None:
    row = report.timeline[0]
    # Node-a's wall clock is 3 s behind: by wall clock rank 0's TimeoutError looks first.
    assert (row.first_rank, row.first_node, row.first_host) == (2, 1, "node-b")
    assert row.ordering == "store_origin"
    assert row.cause == "ValueError at train.py:12 in step"
    assert row.also_failed == [0]
    assert row.peer_notified == 2
    assert row.outcome == "restart"
    assert row.phases == {"abort": 0.1, "iteration_barrier": 0.6}
    assert row.restart_latency_s == 1.5


def test_killed_process_explains_its_round_and_is_restarted(report) -> None:
    row = report.timeline[1]
    assert (row.first_rank, row.first_host, row.cause, row.ordering) == (
        1,
        "node-a",
        "signal SIGKILL",
        "process_exit",
    )
    assert row.peer_notified == 3
    [p] = report.process_restarts
    assert (p.host, p.local_rank, p.rank, p.signal, p.decision) == (
        "node-a",
        1,
        1,
        "SIGKILL",
        "restart",
    )
    assert p.relaunch_s == pytest.approx(0.5, abs=1e-3)
    assert p.rejoin_wait_s == 1.5  # the longest wait of the survivors, its round's rejoin_wait


def test_hang_is_reported_with_its_stack(report) -> None:
    row = report.timeline[2]
    assert (row.first_rank, row.cause, row.ordering) == (3, "hang (soft timeout)", "hang")
    [hang] = report.hangs
    assert (hang.rank, hang.node, hang.host, hang.round, hang.timeout) == (
        3,
        1,
        "node-b",
        2,
        "soft",
    )
    assert "all_reduce_grads" in hang.stack


def test_failures_grouped_by_signature_with_one_traceback(report) -> None:
    by_sig = {f.signature: f for f in report.failures}
    assert set(by_sig) == {
        "ValueError at train.py:12 in step",
        "TimeoutError",
        "signal SIGKILL",
        "hang (soft timeout)",
    }
    value_error = by_sig["ValueError at train.py:12 in step"]
    assert (value_error.count, value_error.ranks, value_error.hosts, value_error.rounds) == (
        1,
        [2],
        ["node-b"],
        [0],
    )
    assert value_error.traceback.endswith("ValueError: bad batch 17\n")
    assert by_sig["signal SIGKILL"].ranks == [1]
    assert by_sig["hang (soft timeout)"].category == "hang"
    # The clean exits (code 0) at the end are not failures.
    assert not any(f.signature == "exit code 0" for f in report.failures)


def test_suspect_nodes_and_exclude_string(report) -> None:
    by_host = {n.host: n for n in report.suspects}
    b, a = by_host["node-b"], by_host["node-a"]
    assert (b.first_failures, b.hangs, b.deaths, b.faults) == (2, 1, 0, 2)
    assert (a.first_failures, a.deaths, a.faults) == (1, 1, 1)
    # node-b failed first twice, with signatures seen nowhere else; node-a once: not enough
    assert b.suspect and not a.suspect
    assert b.evidence == [
        "2 faults of its own seen on no other host: ValueError at train.py:12 in step, "
        "hang (soft timeout)"
    ]
    assert a.evidence == ["one fault of its own (signal SIGKILL): not enough to exclude"]
    assert report.exclude == "node-b"


def _two_host_round(log_dir: Path, with_votes: bool) -> None:
    a = Host("gpu01", 0, skew=-2.0, mono0=10.0)
    b = Host("gpu02", 1, skew=0.0, mono0=99999.0)
    p0 = Proc(log_dir, a, "wrapper", rank=0).round(0)
    p1 = Proc(log_dir, b, "wrapper", rank=1).round(0)
    p2 = Proc(log_dir, b, "wrapper", rank=2).round(0)
    for p in (p0, p1, p2):
        p.at(1.0, "round_start", world_size=3)
    p1.at(5.0, "fault", fault_kind="exception", exc_type="OSError", message="disk", origin_rank=1)
    p0.at(
        5.5, "fault", fault_kind="exception", exc_type="RuntimeError", message="nccl", origin_rank=0
    )
    if with_votes:
        p2.at(5.6, "fault", fault_kind="peer", origin_rank=1)
    for p in (p0, p1, p2):
        p.at(6.0, "round_end", outcome="restart")
        p.close()


def test_without_store_origin_cross_host_order_falls_back_to_wall_clock_and_says_so(
    tmp_path: Path,
) -> None:
    _two_host_round(tmp_path, with_votes=False)
    report = build_report(tmp_path, sacct=False)
    row = report.timeline[0]
    # gpu01's wall clock is 2 s behind, so its later fault looks first: the report must say how it ordered.
    assert (row.first_rank, row.ordering) == (0, "wall_clock")
    assert any("clock skew" in n for n in report.reading.notes)


def test_store_origin_beats_wall_clock(tmp_path: Path) -> None:
    _two_host_round(tmp_path, with_votes=True)
    row = build_report(tmp_path, sacct=False).timeline[0]
    assert (row.first_rank, row.first_host, row.ordering, row.also_failed) == (
        1,
        "gpu02",
        "store_origin",
        [0],
    )


def test_monotonic_order_within_one_host_survives_a_wall_clock_step(tmp_path: Path) -> None:
    h = Host("solo", 0, mono0=50.0)
    p0 = Proc(tmp_path, h, "wrapper", rank=0).round(0)
    p1 = Proc(tmp_path, h, "wrapper", rank=1).round(0)
    p0.at(3.0, "fault", fault_kind="exception", exc_type="KeyError", message="k")
    h.wall_step = (
        -10.0
    )  # NTP steps the wall clock back: rank 1's later fault gets an earlier wall time
    p1.at(3.5, "fault", fault_kind="exception", exc_type="IndexError", message="i")
    for p in (p0, p1):
        p.at(4.0, "round_end", outcome="restart")
        p.close()
    row = build_report(tmp_path, sacct=False).timeline[0]
    assert (row.first_rank, row.cause, row.ordering, row.also_failed) == (
        0,
        "KeyError",
        "monotonic",
        [1],
    )


def test_requeued_job_runs_are_kept_apart(tmp_path: Path) -> None:
    h = Host("n1", 0)
    for run, t0 in enumerate((0.0, 500.0)):
        sup = Proc(tmp_path, h, "supervisor")
        sup.at(t0, "supervisor_start", nnodes=1, nproc_per_node=1)
        w = Proc(tmp_path, h, "wrapper", rank=0).round(0)  # the round counter starts again at 0
        w.at(t0 + 1, "round_start", world_size=1)
        w.at(t0 + 2, "call_start")
        w.at(t0 + 3, "fault", fault_kind="exception", exc_type="ValueError", message=f"run {run}")
        w.at(t0 + 3, "round_end", outcome="restart")
        if run == 0:
            sup.at(t0 + 4, "requeue", cause="preemption", count=1)
        sup.at(
            t0 + 5,
            "supervisor_end",
            exit_code=0 if run else 1,
            reason="done" if run else "preempted",
        )
        sup.close()
        w.close()
    report = build_report(tmp_path, sacct=False)
    assert report.summary.runs == 2
    assert report.summary.restarts.requeue == 1
    assert [(r.run, r.round) for r in report.timeline] == [(0, 0), (1, 0)]
    assert (report.summary.outcome, report.summary.reason) == ("completed", "done")


def test_filters_keep_the_job_runs_apart(tmp_path: Path) -> None:
    """A requeued job's second run lands on another host; --rank and --since drop the
    supervisors' events, not the runs they start."""
    for run, (name, t0) in enumerate((("a", 0.0), ("b", 100.0))):
        h = Host(name, 0)
        sup = Proc(tmp_path, h, "supervisor")
        sup.at(t0, "supervisor_start", nnodes=1, nproc_per_node=1)
        w = Proc(tmp_path, h, "wrapper", rank=0).round(0)
        w.at(t0 + 1, "round_start", world_size=1)
        w.at(t0 + 5, "fault", fault_kind="exception", exc_type=("ValueError", "KeyError")[run])
        for p in (sup, w):
            p.close()
    expected = [(0, 0, "ValueError", "a"), (1, 0, "KeyError", "b")]
    for filters in ({}, {"rank": 0}, {"node": 0}, {"since": T0 + 1.0}):
        report = build_report(tmp_path, sacct=False, **filters)
        rows = [(r.run, r.round, r.cause, r.first_host) for r in report.timeline]
        assert (report.summary.runs, report.summary.restarts.requeue) == (2, 1), filters
        assert rows == expected, filters


def test_faults_that_do_not_say_their_boot_are_ordered_by_wall_clock(tmp_path: Path) -> None:
    """Monotonic clocks of two hosts cannot be compared, even when the faults name no boot."""
    a, b = Host("a", 0, mono0=500.0), Host("b", 1, mono0=5.0)
    p0 = Proc(tmp_path, a, "wrapper", rank=0).round(0)
    p1 = Proc(tmp_path, b, "wrapper", rank=1).round(0)
    for p in (p0, p1):
        p.at(1.0, "round_start", world_size=2, boot=None)
    p0.at(10.0, "fault", fault_kind="exception", exc_type="ValueError", boot=None)
    p1.at(12.0, "fault", fault_kind="exception", exc_type="KeyError", boot=None)
    for p in (p0, p1):
        p.close()
    report = build_report(tmp_path, sacct=False)
    row = report.timeline[0]
    assert (row.first_rank, row.cause, row.ordering) == (0, "ValueError", "wall_clock")
    assert any("clock skew" in n for n in report.reading.notes)


def test_one_host_without_boot_is_not_said_to_be_ordered_by_monotonic_clock(
    tmp_path: Path,
) -> None:
    p0 = Proc(tmp_path, Host("solo", 0), "wrapper", rank=0).round(0)
    p0.at(10.0, "fault", fault_kind="exception", exc_type="ValueError", boot=None)
    p0.close()
    assert build_report(tmp_path, sacct=False).timeline[0].ordering == "wall_clock"


def test_a_decision_belongs_to_the_exit_before_it(tmp_path: Path) -> None:
    """Two failed exits of one slot; only the second was followed by a decision and a
    replacement: the first exit gets none of them. No Wrapper: nobody waited for a rejoin
    (the supervisor's own ``rejoin`` tells the time since the exit, not a wait)."""
    h = Host("solo", 0)
    sup = Proc(tmp_path, h, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1)
    sup.at(10.0, "child_exit", local_rank=0, child_pid=5, exit_code=1, runtime_s=10.0)
    sup.at(20.0, "child_exit", local_rank=0, child_pid=6, exit_code=2, runtime_s=9.0)
    sup.at(20.1, "restart_decision", local_rank=0, decision="restart", reason="exit code 2")
    sup.at(20.5, "child_start", local_rank=0, child_pid=7, attempt=1)
    sup.at(21.0, "rejoin", local_rank=0, wait_s=0.4)
    sup.close()
    rows = build_report(tmp_path, sacct=False).process_restarts
    assert [(p.exit_code, p.decision, p.relaunch_s, p.rejoin_wait_s) for p in rows] == [
        (1, None, None, None),
        (2, "restart", pytest.approx(0.5), None),
    ]


def test_node_ranks_sharing_a_host_keep_their_own_slots(tmp_path: Path) -> None:
    """Two local "nodes" on one host, their local rank 0 exiting 4 ms apart: each exit
    keeps the decision of its own node (a real flake of the plain supervisor run)."""
    nodes = [Host("vm", 0), Host("vm", 1)]
    for host in nodes:
        host.name, host.boot = "vm", "boot-vm"
    sups = [Proc(tmp_path, h, "supervisor") for h in nodes]
    for sup in sups:
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=1)
    sups[1].at(10.000, "child_exit", local_rank=0, child_pid=21, exit_code=1, runtime_s=10.0)
    sups[0].at(10.004, "child_exit", local_rank=0, child_pid=11, exit_code=1, runtime_s=10.0)
    sups[1].at(10.010, "restart_decision", local_rank=0, decision="restart", reason="exit code 1")
    sups[0].at(10.011, "restart_decision", local_rank=0, decision="restart", reason="exit code 1")
    for sup in sups:
        sup.close()
    rows = build_report(tmp_path, sacct=False).process_restarts
    assert [(p.node, p.rank, p.decision) for p in rows] == [(1, 1, "restart"), (0, 0, "restart")]


def test_filters_rank_node_since(report, standard) -> None:
    log_dir = standard[0]
    only_rank2 = build_report(log_dir, sacct=False, rank=2)
    assert only_rank2.summary.ranks == 1
    assert only_rank2.reading.events_used < only_rank2.reading.events
    assert {f.signature for f in only_rank2.failures} == {"ValueError at train.py:12 in step"}
    node_b = build_report(log_dir, sacct=False, node=1)
    assert node_b.summary.hosts == ["node-b"]
    late = build_report(log_dir, sacct=False, since=T0 + 40.0)
    assert [r.round for r in late.timeline] == [2, 3]
    # an event at T itself is kept ("at or after T"), one just before it is not
    at = min(e["wall"] for e in read_dir(log_dir)[0] if e["wall"] >= T0 + 40.0)
    kept = build_report(log_dir, sacct=False, since=at).reading.events_used
    assert kept == build_report(log_dir, sacct=False, since=at - 1e-6).reading.events_used
    assert kept > build_report(log_dir, sacct=False, since=at + 1e-6).reading.events_used


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_synthetic_logs", REPO / "bench" / "gen_synthetic_logs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_synthetic_job_report_matches_ground_truth_serial_and_parallel(tmp_path: Path) -> None:
    gen = _generator()
    truth = gen.generate(tmp_path / "job", ranks=96, rounds=8, ranks_per_node=8, job="4242", seed=3)
    serial = build_report(tmp_path / "job", sacct=False, workers=1)
    parallel = build_report(
        tmp_path / "job", sacct=False, workers=2
    )  # 96 rank files: worker processes
    a, b = serial.to_dict(), parallel.to_dict()
    a.pop("generated_at"), b.pop("generated_at")
    assert a == b
    s = serial.summary
    assert (s.ranks, s.nodes, s.rounds) == (96, 12, 8)
    assert s.restarts.in_process == 7 and s.restarts.process == len(truth.killed)
    for row in serial.timeline[:-1]:
        assert row.first_rank == truth.roots[row.round], row
        assert row.peer_notified == 95
    assert serial.reading.events == truth.events
    assert s.training_time_s * s.ranks == pytest.approx(truth.call_s, rel=1e-6)
    assert [(h.round, h.rank) for h in serial.hangs] == [truth.hang]


def _supervised_wrapper_job(tmp_path: Path, nranks: int) -> tuple[Proc, list[Proc]]:
    """A supervisor of ``nranks`` Wrapper ranks, in round 0 from 1 s; its local rank 0 (pid 10)
    dies at 5 s and is replaced (pid 20)."""
    h = Host("solo", 0)
    sup = Proc(tmp_path, h, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=nranks)
    ranks = [Proc(tmp_path, h, "wrapper", rank=r).round(0) for r in range(nranks)]
    for p in ranks:
        p.at(1.0, "round_start", world_size=nranks)
    sup.at(5.0, "child_exit", local_rank=0, child_pid=10, exit_code=1, runtime_s=5.0)
    sup.at(5.1, "restart_decision", local_rank=0, decision="restart", reason="exit code 1")
    sup.at(5.2, "child_start", local_rank=0, child_pid=20, attempt=1)
    return sup, ranks


def test_only_a_replaced_process_tells_how_long_its_peers_waited_for_it(tmp_path: Path) -> None:
    """Two processes end in round 0 of a Wrapper job, whose restart waited 2 s for rejoins:
    the one replaced gets that wait, the one not replaced (stopped) gets none."""
    sup, ranks = _supervised_wrapper_job(tmp_path, 3)
    sup.at(5.3, "child_exit", local_rank=1, child_pid=11, exit_code=1, runtime_s=5.3)
    sup.at(5.4, "restart_decision", local_rank=1, decision="stop", reason="budget spent")
    ranks[2].at(7.5, "restart_phase", phase="rejoin_wait", duration_s=2.0, ok=True)
    for p in (sup, *ranks):
        p.close()
    rows = build_report(tmp_path, sacct=False).process_restarts
    assert [(p.local_rank, p.decision, p.rejoin_wait_s) for p in rows] == [
        (0, "restart", 2.0),
        (1, "stop", None),
    ]


def test_a_death_before_its_rounds_round_start_is_that_rounds_in_every_table(
    tmp_path: Path,
) -> None:
    """Round 1's first event (8 s) comes before its first round_start (10 s); a process
    that dies in between (9 s) died in round 1: the timeline explains round 1 by it, and its
    row in Process restarts gets round 1's rejoin_wait (3 s), not round 0's (2 s)."""
    sup, ranks = _supervised_wrapper_job(tmp_path, 2)
    ranks[1].at(7.0, "restart_phase", phase="rejoin_wait", duration_s=2.0, ok=True)
    ranks[1].round(1).at(8.0, "restart_phase", phase="initial_barrier", duration_s=0.5, ok=True)
    sup.at(9.0, "child_exit", local_rank=1, child_pid=11, exit_code=1, runtime_s=9.0)
    sup.at(9.1, "restart_decision", local_rank=1, decision="restart", reason="exit code 1")
    sup.at(9.2, "child_start", local_rank=1, child_pid=21, attempt=1)
    ranks[0].round(1).at(10.0, "round_start", world_size=2)
    ranks[0].at(12.0, "restart_phase", phase="rejoin_wait", duration_s=3.0, ok=True)
    for p in ranks:
        p.round(2).at(13.0, "round_start", world_size=2)
    for p in (sup, *ranks):
        p.close()
    report = build_report(tmp_path, sacct=False)
    late = next(p for p in report.process_restarts if p.local_rank == 1)
    [row] = [r for r in report.timeline if r.ordering == "process_exit" and r.first_rank == 1]
    assert row.round == 1
    assert late.rejoin_wait_s == row.phases["rejoin_wait"] == 3.0
    first = next(p for p in report.process_restarts if p.local_rank == 0)
    assert first.rejoin_wait_s == report.timeline[0].phases["rejoin_wait"] == 2.0


def test_a_rank_its_supervisor_found_unresponsive_and_killed_is_reported_unresponsive(tmp_path: Path) -> None:
    """The supervisor's ``unresponsive`` fault, then the SIGKILL it sent: one failure, told as
    what it was (before: the kill's ``signal SIGKILL`` took its place)."""
    d = tmp_path / JOB
    hosts = {0: Host("node-a", 0), 1: Host("node-b", 1)}
    sups = {n: Proc(d, h, "supervisor") for n, h in hosts.items()}
    for sup in sups.values():
        sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2, command="x", store="node-a:1")
    ranks = {r: Proc(d, hosts[r // 2], "wrapper", rank=r) for r in range(4)}
    for r, proc in ranks.items():
        sups[r // 2].at(0.5, "child_start", local_rank=r % 2, child_pid=100 + r, attempt=0, global_rank=r)
        proc.round(0).at(1.0, "round_start", world_size=4, active_world_size=4, active_rank=r, initial_rank=r)
        proc.at(1.1, "call_start", note="x")
    ranks[3].close()  # frozen: it writes nothing more
    sups[1].at(30.0, "fault", fault_kind="unresponsive", origin_rank=3, rank=3, round=0, local_rank=1,
               child_pid=103, message="no heartbeat for 20.0 s", signature="unresponsive (no heartbeat)",
               detected_mono=hosts[1].mono0 + 30.0)  # fmt: skip
    sups[1].at(30.2, "child_exit", local_rank=1, child_pid=103, exit_code=None, signal="SIGKILL",
               runtime_s=29.7, global_rank=3, attempt=0)  # fmt: skip
    for r in (0, 1, 2):
        ranks[r].at(30.5, "fault", fault_kind="peer", origin_rank=3, message="rank 3 left")
        ranks[r].at(30.9, "round_end", outcome="restart", duration_s=30)
    for proc in [*sups.values(), *ranks.values()]:
        proc.close()
    report = build_report(d, sacct=False)
    [row] = report.timeline
    assert (row.first_rank, row.first_host, row.cause) == (3, "node-b", "unresponsive (no heartbeat)")
    assert [(f.signature, f.count) for f in report.failures] == [("unresponsive (no heartbeat)", 1)]


def test_a_restart_phase_that_failed_is_marked_failed(tmp_path: Path) -> None:
    """docs/report.md: "A phase that failed is marked ``FAILED``": one rank's
    ``iteration_barrier`` of round 0 ends with ``ok`` false; its cell in the phase table of
    the restart timeline says so (the slowest rank's time, then FAILED), no other does."""
    h = Host("solo", 0)
    ranks = [Proc(tmp_path, h, "wrapper", rank=r) for r in range(2)]
    for p in ranks:
        p.round(0).at(1.0, "round_start", world_size=2)
        p.at(1.1, "call_start")
    ranks[1].at(5.0, "fault", fault_kind="exception", exc_type="ValueError", message="bad")
    ranks[0].at(5.1, "fault", fault_kind="peer", origin_rank=1)
    for r, p in enumerate(ranks):
        p.at(5.2, "restart_phase", phase="abort", duration_s=0.1, ok=True)
        p.at(5.5, "restart_phase", phase="iteration_barrier", duration_s=0.2 + r, ok=r != 0)
        p.at(6.0, "round_end", outcome="restart")
    for p in ranks:
        p.round(1).at(7.0, "round_start", world_size=2)
        p.at(7.5, "restart_phase", phase="iteration_barrier", duration_s=0.4, ok=True)
        p.at(9.0, "round_end", outcome="completed")
    for p in ranks:
        p.close()
    report = build_report(tmp_path, sacct=False)
    assert [(row.round, row.failed_phases) for row in report.timeline] == [
        (0, ["iteration_barrier"]),
        (1, []),
    ]
    assert report.to_dict()["timeline"][0]["failed_phases"] == ["iteration_barrier"]
    text = report.to_text("table", width=None)
    table = text.split("Phase latency per round (slowest rank):", 1)[1].strip("\n")
    table = table.split("\n\n", 1)[0]
    header, _, *rows = table.splitlines()
    assert header.split() == ["round", "detection", "abort", "iteration_barrier"]
    assert [row.split() for row in rows] == [
        ["0", "-", "0.100", "s", "1.200", "s", "FAILED"],
        ["1", "-", "-", "0.400", "s"],
    ]
    markdown = report.to_text("markdown")
    assert "| 1.200 s FAILED " in markdown and markdown.count("FAILED") == 1
