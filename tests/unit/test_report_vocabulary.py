"""One failure, one row, one spelling: the report reads every producer's signatures (old ones too)
in the vocabulary of nvrx.events.failures, and a fault that two components saw counts once."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report_fixtures import HANG_STACK, Host, Proc

from nvrx.report import build_report

INJECTED_TB = (
    "Traceback (most recent call last):\n"
    '  File "/opt/nvrx/nvrx/inprocess/call_wrapper.py", line 516, in _round\n'
    "    ret = fn()\n"
    '  File "/home/u/train_demo.py", line 259, in step\n'
    "    self.injector.at_step(step)\n"
    '  File "/home/u/fault_injection.py", line 94, in at_step\n'
    "    raise InjectedFault(msg)\n"
    "fault_injection.InjectedFault: injected exception at step 15 on rank 2\n"
)
INJECTED = "fault_injection.InjectedFault at fault_injection.py:94 in at_step"


def _demo_like_job(log_dir: Path) -> None:
    """The demo's three faults as an older nvrx wrote them: an exception (store's "@"
    signature), a SIGKILLed rank (the monitor's "dead", the supervisor's "signal:SIGKILL")
    and a hang (the monitor's "hang_soft" fault next to its hang event)."""
    hosts = {0: Host("vm-a", 0), 1: Host("vm-b", 1)}
    sup = {n: Proc(log_dir, h, "supervisor") for n, h in hosts.items()}
    for s in sup.values():
        s.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2)
    ranks = {r: Proc(log_dir, hosts[r // 2], "wrapper", rank=r) for r in range(4)}

    def round_of(rnd: int, t: float, faulty: int, peers_end: float) -> None:
        for p in ranks.values():
            p.round(rnd).at(t, "round_start", world_size=4)
            p.at(t + 0.1, "call_start")
        for r, p in ranks.items():
            if r != faulty:
                p.at(peers_end, "fault", fault_kind="peer", origin_rank=faulty)
                p.at(peers_end + 0.5, "round_end", outcome="restart")

    round_of(0, 1.0, 2, 10.2)
    ranks[2].at(
        10.0,
        "fault",
        fault_kind="exception",
        origin_rank=2,
        exc_type="fault_injection.InjectedFault",
        message="injected exception at step 15 on rank 2",
        traceback=INJECTED_TB,
        signature="fault_injection.InjectedFault@fault_injection.py:at_step",
    )
    ranks[2].at(10.5, "round_end", outcome="restart")

    round_of(1, 12.0, 1, 20.3)
    ranks[1].close()  # SIGKILLed inside the function: no last word
    monitor = Proc(log_dir, hosts[0], "monitor", rank=1).round(1)
    monitor.at(
        20.1, "fault", fault_kind="dead", origin_rank=1, message="rank 1 died", signature="dead"
    )
    sup[0].at(20.2, "child_exit", local_rank=1, child_pid=5, signal="SIGKILL", runtime_s=20.0)
    sup[0].at(
        20.2, "restart_decision", local_rank=1, decision="restart", signature="signal:SIGKILL"
    )
    sup[0].at(20.4, "child_start", local_rank=1, child_pid=6, attempt=1)
    ranks[1] = Proc(log_dir, hosts[0], "wrapper", rank=1)

    round_of(2, 22.0, 3, 45.3)
    hang_monitor = Proc(log_dir, hosts[1], "monitor", rank=3).round(2)
    hang_monitor.at(45.0, "hang", timeout="soft", stack=HANG_STACK)
    hang_monitor.at(
        45.0,
        "fault",
        fault_kind="hang_soft",
        origin_rank=3,
        signature="hang_soft",
        traceback=HANG_STACK,
    )
    ranks[3].at(45.4, "round_end", outcome="restart")

    for p in ranks.values():
        p.round(3).at(47.0, "round_start", world_size=4)
        p.at(60.0, "round_end", outcome="completed")
        p.at(60.1, "wrapper_end", outcome="completed", rounds=4)
    for s in sup.values():
        for local in (0, 1):
            s.at(60.5, "child_exit", local_rank=local, child_pid=10 + local, exit_code=0)
        s.at(60.7, "supervisor_end", exit_code=0, reason="all children exited 0")
    for p in [*ranks.values(), *sup.values(), monitor, hang_monitor]:
        p.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("vocab") / "demo"
    _demo_like_job(log_dir)
    return build_report(log_dir, sacct=False)


def test_each_fault_is_one_row_of_its_own_kind(report) -> None:
    rows = [(f.signature, f.category, f.count, f.ranks, f.rounds) for f in report.failures]
    assert sorted(rows) == sorted(
        [
            (INJECTED, "exception", 1, [2], [0]),
            ("signal SIGKILL", "signal", 1, [1], [1]),  # the monitor's "dead" and the supervisor's
            (
                "hang (soft timeout)",
                "hang",
                1,
                [3],
                [2],
            ),  # the "hang_soft" fault and the hang event
        ]
    )


def test_the_timeline_speaks_the_same_vocabulary(report) -> None:
    causes = [(row.round, row.cause, row.first_rank) for row in report.timeline]
    assert causes == [
        (0, INJECTED, 2),
        (1, "signal SIGKILL", 1),
        (2, "hang (soft timeout)", 3),
        (3, None, None),
    ]
    # the event's own fault kind stays what its writer said
    assert [row.fault_kind for row in report.timeline[:3]] == ["exception", "dead", "hang_soft"]
    # a node's incidents count each fault once, whoever reported it
    assert {n.host: (n.faults, n.hangs, n.deaths) for n in report.suspects} == {
        "vm-a": (1, 0, 1),
        "vm-b": (2, 1, 0),
    }
    signatures = {sig for node in report.suspects for sig in node.signatures}
    assert signatures == {INJECTED, "signal SIGKILL", "hang (soft timeout)"}
    text = report.to_text("table")
    for old in ("hang_soft ", "signal:SIGKILL", "@fault_injection.py", "dead "):
        assert old not in text, old


def test_a_dead_rank_no_supervisor_saw_keeps_its_kind(tmp_path: Path) -> None:
    h = Host("solo", 0)
    rank = Proc(tmp_path, h, "wrapper", rank=0).round(0)
    rank.at(1.0, "round_start", world_size=2)
    monitor = Proc(tmp_path, h, "monitor", rank=0).round(0)
    monitor.at(5.0, "fault", fault_kind="dead", origin_rank=0, signature="dead")
    for p in (rank, monitor):
        p.close()
    report = build_report(tmp_path, sacct=False)
    assert [(f.signature, f.category, f.ranks) for f in report.failures] == [
        ("dead process", "dead", [0])
    ]
    assert report.timeline[0].cause == "dead process"


def _rows(report) -> list[tuple[str, int, list[int], list[int]]]:
    return sorted((f.signature, f.count, f.ranks, f.rounds) for f in report.failures)


def _one_rank_in_its_call(tmp_path: Path) -> tuple[Proc, Proc, Proc]:
    """One host, one rank: its supervisor, its Wrapper in round 0's call, and its monitor."""
    h = Host("solo", 0)
    sup = Proc(tmp_path, h, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1)
    rank = Proc(tmp_path, h, "wrapper", rank=0).round(0)
    rank.at(1.0, "round_start", world_size=1)
    rank.at(1.1, "call_start")
    return sup, rank, Proc(tmp_path, h, "monitor", rank=0).round(0)


def test_a_death_after_a_hang_is_one_row_beside_the_hang(tmp_path: Path) -> None:
    """The monitor reports a hang, then the rank dead; its supervisor saw the SIGKILL: two
    failures (the hang, the death), not three (hang, dead process, signal SIGKILL)."""
    sup, rank, monitor = _one_rank_in_its_call(tmp_path)
    monitor.at(10.0, "hang", timeout="soft", stack=HANG_STACK)
    monitor.at(10.0, "fault", fault_kind="hang_soft", signature="hang_soft")
    monitor.at(15.0, "fault", fault_kind="dead", signature="dead")
    sup.at(15.1, "child_exit", local_rank=0, child_pid=50, signal="SIGKILL", runtime_s=15.0)
    for p in (sup, rank, monitor):
        p.close()
    report = build_report(tmp_path, sacct=False)
    assert _rows(report) == [("hang (soft timeout)", 1, [0], [0]), ("signal SIGKILL", 1, [0], [0])]


@pytest.mark.parametrize(
    "fault",
    [
        {"fault_kind": "dead", "signature": "dead"},  # the monitor's "dead"
        {"fault_kind": "signal", "signature": "signal:SIGKILL"},  # the end's own signature
    ],
    ids=["dead", "same_signature"],
)
@pytest.mark.parametrize(("gap", "count"), [(29.0, 1), (31.0, 2)])
def test_a_death_a_monitor_reported_within_30_s_is_counted_once(
    tmp_path: Path, fault: dict[str, str], gap: float, count: int
) -> None:
    """docs/report.md: "a process death that a monitor already reported as a fault event
    (same signature, same host, within 30 s) is counted once": the monitor's fault, then the
    supervisor's SIGKILL of the same rank ``gap`` s later: one failure at 29 s, two at 31 s."""
    sup, rank, monitor = _one_rank_in_its_call(tmp_path)
    monitor.at(10.0, "fault", origin_rank=0, **fault)
    sup.at(10.0 + gap, "child_exit", local_rank=0, child_pid=50, signal="SIGKILL", runtime_s=gap)
    for p in (sup, rank, monitor):
        p.close()
    report = build_report(tmp_path, sacct=False)
    assert sum(f.count for f in report.failures) == count
    if count == 1:
        assert _rows(report) == [("signal SIGKILL", 1, [0], [0])]


def test_a_dead_rank_no_supervisor_saw_stays_when_another_death_is_merged(tmp_path: Path) -> None:
    a, b = Host("a", 0), Host("b", 1)
    sup = Proc(tmp_path, a, "supervisor")
    sup.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=1)
    rank = Proc(tmp_path, a, "wrapper", rank=0).round(0)
    rank.at(1.0, "round_start", world_size=2)
    rank.at(1.1, "call_start")
    monitor = Proc(tmp_path, a, "monitor", rank=0).round(0)
    monitor.at(20.0, "fault", fault_kind="dead")
    sup.at(20.2, "child_exit", local_rank=0, child_pid=50, signal="SIGKILL", runtime_s=20.0)
    # rank 1's monitor, on the other host, with no round and no supervisor of its own
    other = Proc(tmp_path, b, "monitor", rank=1)
    other.at(30.0, "fault", fault_kind="dead", signature="dead")
    for p in (sup, rank, monitor, other):
        p.close()
    report = build_report(tmp_path, sacct=False)
    assert _rows(report) == [("dead process", 1, [1], []), ("signal SIGKILL", 1, [0], [0])]


def test_a_hang_is_left_out_only_for_a_hang_fault_of_its_rank(tmp_path: Path) -> None:
    h = Host("solo", 0)
    rank = Proc(tmp_path, h, "wrapper", rank=0).round(0)
    rank.at(1.0, "round_start", world_size=1)
    rank.at(5.0, "fault", fault_kind="exception", exc_type="ValueError", message="bad")
    monitor = Proc(tmp_path, h, "monitor", rank=0).round(0)
    monitor.at(8.0, "hang", timeout="soft")
    for p in (rank, monitor):
        p.close()
    report = build_report(tmp_path, sacct=False)
    assert _rows(report) == [("ValueError", 1, [0], [0]), ("hang (soft timeout)", 1, [0], [0])]
