"""Faults the report must not hold against a healthy node: without a supervisor, the node
agent of host a writes the faults of host b's ranks when b goes silent (``rank_host``), and
filed under a they made the report advise excluding the healthy watcher; ranks that die of
one exception on every host are a code bug, no node's."""

from __future__ import annotations

import json
from pathlib import Path

from test_report_fixtures import USER_TRACEBACK, Host, Proc

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


FOLLOW_ON_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/train.py", line 30, in train\n'
    "    all_reduce(g)\n"
    "torch.distributed.DistBackendError: NCCL error: remote process exited or there was a "
    "network error\n"
)
CUDA_TRACEBACK = USER_TRACEBACK.rsplit("\n", 2)[0] + (
    "\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
)
OOM_TRACEBACK = USER_TRACEBACK.rsplit("\n", 2)[0] + (
    "\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
)
NCCL_CUDA_TRACEBACK = FOLLOW_ON_TRACEBACK.rsplit("\n", 2)[0] + (
    "\ntorch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
    "unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n"
)


def _ranks_exit_with(log_dir: Path, exits: dict[int, str]) -> None:
    """Supervisors only (no Wrapper), 2 nodes x 2 ranks: each rank of ``exits`` exits 1
    twice, its error file holding the last line of its traceback (``exits``: rank ->
    traceback)."""
    hosts = {0: Host("a", 0), 1: Host("b", 1)}
    sup = {n: Proc(log_dir, h, "supervisor") for n, h in hosts.items()}
    for proc in sup.values():
        proc.at(0, "supervisor_start", nnodes=2, nproc_per_node=2)
    pids = {r: 100 + r for r in range(4)}
    for r in range(4):
        sup[r // 2].at(0.5, "child_start", local_rank=r % 2, child_pid=pids[r], global_rank=r, attempt=0)
    for i, t in enumerate((20, 40)):
        for r, tb in exits.items():
            name = f"err{r}{i}.json"
            message = tb.strip().rsplit("\n", 1)[1]
            (log_dir / name).write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": tb}}}))
            h, at = r // 2, t + (1 if tb is FOLLOW_ON_TRACEBACK else 0)
            sup[h].at(at, "child_exit", local_rank=r % 2, child_pid=pids[r], exit_code=1, global_rank=r,
                      attempt=i, runtime_s=10, error_file=name)  # fmt: skip
            sup[h].at(at + 0.1, "restart_decision", local_rank=r % 2, decision="restart", reason="x",
                      budget_left=3, global_rank=r, scope="rank")  # fmt: skip
            pids[r] += 1000
            sup[h].at(at + 0.5, "child_start", local_rank=r % 2, child_pid=pids[r], global_rank=r,
                      attempt=i + 1)  # fmt: skip
    for proc in sup.values():
        proc.at(90, "supervisor_end", exit_code=0, reason="completed")
        proc.close()


def _ranks_exit_with_an_exception(log_dir: Path, on_hosts: tuple[int, ...]) -> None:
    """Local rank 0 of each host in ``on_hosts`` exits with the same ValueError, twice."""
    _ranks_exit_with(log_dir, {2 * h: USER_TRACEBACK for h in on_hosts})


def test_a_code_bug_that_ends_ranks_on_every_host_excludes_no_host(tmp_path: Path) -> None:
    """Their deaths count under the exception their error files name, as the failures table
    groups them: seen on both hosts, it is no node's own (it was 'exit code 1', seen on
    neither host, and both were advised for exclusion)."""
    _ranks_exit_with_an_exception(tmp_path, on_hosts=(0, 1))
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.exclude is None, [s.evidence for s in report.suspects]
    assert {tuple(s.signatures) for s in report.suspects} == {("ValueError at train.py:12 in step",)}


def test_one_ranks_repeated_exception_on_one_host_is_not_enough_to_exclude_it(tmp_path: Path) -> None:
    _ranks_exit_with_an_exception(tmp_path, on_hosts=(0,))
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.exclude is None
    [a] = [s for s in report.suspects if s.host == "a"]
    assert "not enough to exclude" in a.evidence[0]


def test_ranks_that_left_while_the_others_completed_make_a_completed_job(tmp_path: Path) -> None:
    """No supervisor: rank 0 left the job (``wrapper_end`` outcome ``left``), ranks 1 and 2
    restarted without it and completed; it was reported as an error."""
    host = Host("a", 0)
    ranks = {r: Proc(tmp_path, host, "wrapper", rank=r) for r in range(3)}
    for r, proc in ranks.items():
        proc.round(0).at(1, "round_start", world_size=3, initial_rank=r)
        proc.at(1.1, "call_start", note="x")
    ranks[0].at(10, "fault", fault_kind="exception", origin_rank=0, message="boom", signature="ValueError")
    for r in (1, 2):
        ranks[r].at(10.5, "fault", fault_kind="peer", origin_rank=0, message="peer")
        ranks[r].at(10.6, "call_end", duration_s=9, outcome="restart")
        ranks[r].at(10.7, "round_end", outcome="restart")
        ranks[r].round(1).at(12, "round_start", world_size=2, initial_rank=r)
        ranks[r].at(50, "round_end", outcome="completed")
        ranks[r].at(50.2, "wrapper_end", outcome="completed", rounds=2)
    ranks[0].at(11, "round_end", outcome="terminated")
    ranks[0].at(60.1, "wrapper_end", outcome="left", rounds=1)
    for proc in ranks.values():
        proc.close()
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.summary.outcome == "completed", report.summary.reason
    assert report.summary.reason == "wrapper ends: completed: 2, left: 1"


def test_a_ranks_repeated_device_error_still_counts_against_its_node(tmp_path: Path) -> None:
    """Its error file names the GPU (CUDA): a rank is tied to its device, so one rank's
    repeated exception of it is no code bug that could raise anywhere."""
    _ranks_exit_with(tmp_path, {0: CUDA_TRACEBACK})
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.exclude == "a", [s.evidence for s in report.suspects]


def test_deaths_that_followed_another_ranks_failure_are_not_their_nodes_own(tmp_path: Path) -> None:
    """Rank 0 on a raises twice; ranks 2 and 3 on b die each time of the broken collective
    (a follow-on fault): b, healthy, is not advised for exclusion."""
    _ranks_exit_with(tmp_path, {0: USER_TRACEBACK, 2: FOLLOW_ON_TRACEBACK, 3: FOLLOW_ON_TRACEBACK})
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.exclude is None, [(s.host, s.evidence) for s in report.suspects]


def test_the_node_filter_keeps_a_silent_hosts_faults_its_watcher_wrote(tmp_path: Path) -> None:
    _two_hosts_lost_watched_by_a(tmp_path, named=True)
    report = build_report(tmp_path, sacct=False, workers=1, node=1)
    assert [(f.signature, f.hosts) for f in report.failures] == [("unresponsive (no heartbeat)", ["b"])]


def test_one_ranks_repeated_out_of_memory_is_the_workloads_not_its_nodes(tmp_path: Path) -> None:
    """CUDA ran out of memory: the word names the device, but the size of the work would
    exhaust any node's."""
    _ranks_exit_with(tmp_path, {0: OOM_TRACEBACK})
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.exclude is None, [s.evidence for s in report.suspects]


def test_an_nccl_error_of_the_device_is_no_follow_on_fault(tmp_path: Path) -> None:
    """NCCL's "unhandled cuda error": a CUDA call of its own failed, on this node's GPU. Its
    peers on a fail at the same line as a follow-on (the same signature): seen there, it is
    not "seen on another host"."""
    _ranks_exit_with(
        tmp_path,
        {2: NCCL_CUDA_TRACEBACK, 3: NCCL_CUDA_TRACEBACK, 0: FOLLOW_ON_TRACEBACK, 1: FOLLOW_ON_TRACEBACK},
    )
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.exclude == "b", [(s.host, s.evidence) for s in report.suspects]


def test_nccls_unhandled_cuda_error_is_no_proof_of_bad_hardware(tmp_path: Path) -> None:
    """NCCL ran out of memory (its "unhandled cuda error" says so) on one rank: not
    enough to advise its node (it was a "device or driver fault"); the same error on every
    host advises none."""
    oom = NCCL_CUDA_TRACEBACK.replace(
        "(run with NCCL_DEBUG=INFO for details)", "Last error: Cuda failure 'out of memory'"
    )
    _ranks_exit_with(tmp_path / "once", {2: oom})
    assert build_report(tmp_path / "once", sacct=False, workers=1).exclude is None
    _ranks_exit_with(tmp_path / "everywhere", {0: NCCL_CUDA_TRACEBACK, 2: NCCL_CUDA_TRACEBACK})
    assert build_report(tmp_path / "everywhere", sacct=False, workers=1).exclude is None
