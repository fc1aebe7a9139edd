"""Without a supervisor, the node agent of host a writes the faults of host b's ranks when
b goes silent (``rank_host``): the report files them under b, not under the healthy
watcher, which it would otherwise advise to exclude."""

from __future__ import annotations

from pathlib import Path

from test_report_fixtures import Host, Proc

from nvrx.report import build_report


def _two_hosts_lost_watched_by_a(log_dir: Path, named: bool) -> None:
    hosts = {0: Host("a", 0), 1: Host("b", 1), 2: Host("c", 2)}
    agent = Proc(log_dir, hosts[0], "node_agent")
    ranks = {r: Proc(log_dir, hosts[r // 2], "wrapper", rank=r) for r in range(6)}

    def round_(n: int, t: float, alive: tuple[int, ...]) -> None:
        for r in alive:
            ranks[r].round(n).at(t, "round_start", world_size=len(alive), initial_rank=r)
            ranks[r].at(t + 0.1, "call_start", note="x")

    def host_silent(t: float, rnd: int, lost: tuple[int, ...], others: tuple[int, ...]) -> None:
        for r in lost:
            place = {"rank_host": hosts[r // 2].name, "rank_node": r // 2} if named else {}
            agent.at(t, "fault", rank=r, round=rnd, fault_kind="unresponsive", origin_rank=r,
                     message="its host sent no heartbeat for 10.0 s", signature="unresponsive",
                     detection_s=10.0, **place)  # fmt: skip
        for r in others:
            ranks[r].at(t + 0.5, "fault", fault_kind="peer", origin_rank=lost[0], message="peer")
            ranks[r].at(t + 0.6, "call_end", duration_s=10, outcome="restart")
            ranks[r].at(t + 0.7, "round_end", outcome="restart")

    round_(0, 1, (0, 1, 2, 3, 4, 5))
    host_silent(20, 0, (2, 3), (0, 1, 4, 5))
    round_(1, 30, (0, 1, 4, 5))
    host_silent(60, 1, (4, 5), (0, 1))
    round_(2, 70, (0, 1))
    for r in (0, 1):
        ranks[r].at(90, "call_end", duration_s=20, outcome="completed")
        ranks[r].at(90.1, "round_end", outcome="completed")
        ranks[r].at(90.2, "wrapper_end", outcome="completed", rounds=3)
    for proc in [agent, *ranks.values()]:
        proc.close()


def test_a_silent_hosts_faults_written_by_its_watcher_are_filed_under_it(tmp_path: Path) -> None:
    _two_hosts_lost_watched_by_a(tmp_path, named=True)
    report = build_report(tmp_path, sacct=False, workers=1)
    assert [(row.first_host, row.first_node) for row in report.timeline[:2]] == [("b", 1), ("c", 2)]
    assert "a" not in {s.host for s in report.suspects}
    assert report.exclude is None or "a" not in report.exclude
