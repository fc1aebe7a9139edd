"""nvrx-report on the job's output files: only what the events cannot tell is a failure.

Live ranks print tracebacks and stack dumps all the time (a hang's dump, a
logged exception they recovered from, a peer's diagnostic), and the lines of
several processes interleave. None of that is a failure; a traceback of a
process that ended with no event saying why is, attributed to its rank when
the output's prefixes allow it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report_fixtures import JOB, Host, Proc, write_standard_job

from nvrx.report import build_report
from nvrx.report.output_scan import FATAL, MAX_TASKS, STACK_DUMP, TRACEBACK, scan_lines

# What live processes print, interleaved: the demo's progress lines, a faulthandler dump of a
# rank that is not dead (dump_traceback on request), a traceback that a rank logged and
# recovered from whose exception line comes after another process's torch log line, and
# torch's own per-rank warnings.
LIVE_OUTPUT = """\
[demo] rank 0/4 pid 100 starts at step 0
Thread 0x00007f1c2a5fe700 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/home/u/train_demo.py", line 187 in wait_in_slices

Current thread 0x00007f1c3b9e4740 (most recent call first):
  File "/home/u/train_demo.py", line 187 in wait_in_slices
  File "/home/u/train_demo.py", line 314 in train_loop
[demo] rank 2/4 pid 102 starts at step 10
Traceback (most recent call last):
  File "/home/u/train_demo.py", line 314, in train_loop
    trainer.step(step)
  File "/home/u/train_demo.py", line 187, in wait_in_slices
    work.wait(timedelta(seconds=slice_s))
[rank0]:[W1122 14:47:02.029418 ProcessGroupGloo.cpp:2417] Warning: Connection closed by peer
[demo] rank 1/4 pid 101 starts at step 10
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
[rank2]:[W1122 14:47:02.031 ProcessGroupGloo.cpp:2417] Warning: Connection closed by peer
Traceback (most recent call last):
  File "/home/u/train_demo.py", line 314, in train_loop
    trainer.step(step)
[rank0]:[W1122 14:47:03.1 socket.cpp:464] [c10d] The server socket has failed to listen
[demo] finished 60 steps at world size 4
"""


def _death_job(log_dir: Path) -> None:
    """2 nodes x 2 ranks under supervisors; rank 3 (node 1, local rank 1) exits with code 1 in
    round 0 and writes no fault event; its peers restart and the job completes."""
    hosts = {0: Host("gpu-a", 0), 1: Host("gpu-b", 1)}
    sup = {n: Proc(log_dir, h, "supervisor") for n, h in hosts.items()}
    for s in sup.values():
        s.at(0.0, "supervisor_start", nnodes=2, nproc_per_node=2, command="python train.py")
    ranks = {r: Proc(log_dir, hosts[r // 2], "wrapper", rank=r) for r in range(4)}
    for p in ranks.values():
        p.round(0).at(1.0, "round_start", world_size=4)
        p.at(1.1, "call_start")
    ranks[3].close()  # its events stop here: the process died with no last word
    sup[1].at(10.0, "child_exit", local_rank=1, child_pid=4242, exit_code=1, runtime_s=9.5)
    sup[1].at(10.1, "restart_decision", local_rank=1, decision="restart", reason="exit code 1")
    sup[1].at(10.5, "child_start", local_rank=1, child_pid=4343, attempt=1)
    for r in (0, 1, 2):
        ranks[r].at(10.2, "call_end", duration_s=9.1, outcome="fault")
        ranks[r].at(10.2, "fault", fault_kind="peer", origin_rank=3, message="rank 3 died")
        ranks[r].at(10.3, "round_end", outcome="restart")
    ranks[3] = Proc(log_dir, hosts[1], "wrapper", rank=3)
    for p in ranks.values():
        p.round(1).at(12.0, "round_start", world_size=4)
        p.at(12.1, "call_start")
        p.at(20.0, "call_end", duration_s=7.9, outcome="completed")
        p.at(20.1, "round_end", outcome="completed")
        p.at(20.2, "wrapper_end", outcome="completed", rounds=2)
        p.close()
    for s in sup.values():
        s.at(21.0, "supervisor_end", exit_code=0, reason="all children exited 0")
        s.close()


DEATH_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/home/u/train.py", line 40, in <module>',
    "    main()",
    '  File "/home/u/train.py", line 22, in main',
    "    load(shard)",
    "OSError: [Errno 5] Input/output error: '/data/shard-7'",
]
DEATH_SIGNATURE = "OSError at train.py:22 in main"


def _interleave(prefix: str) -> str:
    """The dying rank's traceback (each line behind ``prefix``), interleaved with a live rank's."""
    lines = ["0: [demo] rank 0 step 5"]
    for i, line in enumerate(DEATH_TRACEBACK):
        lines.append(prefix + line)
        if i == 1:
            lines.append("0: [rank0]:[W1122 14:47:02.029 ProcessGroupGloo.cpp:2417] Warning: x")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def standard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log_dir = tmp_path_factory.mktemp("std") / JOB
    write_standard_job(log_dir)
    return log_dir


@pytest.fixture(scope="module")
def death_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log_dir = tmp_path_factory.mktemp("death") / JOB
    _death_job(log_dir)
    return log_dir


def test_scanner_files_lines_by_process_and_rejects_log_lines_as_exceptions() -> None:
    items = list(scan_lines(LIVE_OUTPUT.splitlines(keepends=True), "out"))
    kinds = [(i.what, i.signature) for i in items]
    # One dump (two threads), one traceback whose exception line came 3 lines late, and the
    # last traceback is cut short: never "[rank0] at ..." from torch's log line.
    assert kinds == [
        (STACK_DUMP, "stack dump"),
        (TRACEBACK, "RuntimeError at train_demo.py:187 in wait_in_slices"),
    ]
    assert not any(s.startswith("[rank") for _, s in kinds)


def test_live_ranks_tracebacks_and_stack_dumps_are_not_failures(
    standard_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text(LIVE_OUTPUT)
    report = build_report(standard_dir, sacct=False, slurm_output=[out])
    assert report.log_findings == []
    assert all(f.source == "events" for f in report.failures)
    assert any(
        "2 traceback(s)/stack dump(s)" in n and "live processes" in n for n in report.reading.notes
    ), report.reading.notes


def test_live_ranks_output_is_not_blamed_for_another_ranks_death(
    death_dir: Path, tmp_path: Path
) -> None:
    # Rank 3 died unexplained, but what is printed here comes from node 0 (srun --label 0).
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text("".join(f"0: {line}\n" for line in LIVE_OUTPUT.splitlines()))
    report = build_report(death_dir, sacct=False, slurm_output=[out])
    assert report.log_findings == []


@pytest.mark.parametrize(
    ("prefix", "ranks", "nodes", "hosts", "printed_by"),
    [
        ("1: ", [3], [1], ["gpu-b"], "rank 3 (node 1 on gpu-b), which ended (exit code 1)"),
        ("[rank3]:", [3], [1], ["gpu-b"], "rank 3 (node 1 on gpu-b), which ended (exit code 1)"),
        ("", [], [], [], "unknown process (no srun --label or [rankN] prefix)"),
    ],
    ids=["srun-label", "torch-prefix", "no-prefix"],
)
def test_traceback_of_a_rank_that_died_without_an_event_is_reported(
    death_dir: Path,
    tmp_path: Path,
    prefix: str,
    ranks: list[int],
    nodes: list[int],
    hosts: list[str],
    printed_by: str,
) -> None:
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text(_interleave(prefix))
    report = build_report(death_dir, sacct=False, slurm_output=[out])
    [finding] = report.log_findings
    assert finding.signature == DEATH_SIGNATURE
    assert (finding.ranks, finding.nodes, finding.hosts) == (ranks, nodes, hosts)
    assert finding.printed_by.startswith(printed_by), finding.printed_by
    if not ranks:
        assert "rank 3 (node 1 on gpu-b): exit code 1" in finding.printed_by
    failure = next(f for f in report.failures if f.source == "slurm_output")
    assert (failure.signature, failure.ranks, failure.nodes) == (DEATH_SIGNATURE, ranks, nodes)
    assert failure.traceback.endswith("Input/output error: '/data/shard-7'")
    # Attributed, the traceback is the cause of the death the events saw: one failure, one row.
    # Unattributed, it may be anyone's: the death keeps its row.
    from_events = [f.signature for f in report.failures if f.source == "events"]
    assert from_events == ([] if ranks else ["exit code 1"])


def test_srun_fatal_lines_name_their_node(death_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text("srun: error: gpu-b: task 1: Killed\n0: Segmentation fault (core dumped)\n")
    report = build_report(death_dir, sacct=False, slurm_output=[out])
    by_sig = {f.signature: f for f in report.log_findings}
    assert set(by_sig) == {"signal SIGKILL", "signal SIGSEGV"}
    killed = by_sig["signal SIGKILL"]
    assert (killed.nodes, killed.hosts) == ([1], ["gpu-b"])
    assert "srun task 1" in killed.printed_by
    assert (by_sig["signal SIGSEGV"].nodes, by_sig["signal SIGSEGV"].hosts) == ([0], ["gpu-a"])


def _scan(*lines: str) -> list[tuple[str, str]]:
    return [(i.what, i.signature) for i in scan_lines([f"{line}\n" for line in lines], "out")]


def test_a_log_line_inside_a_traceback_does_not_end_it() -> None:
    lines = ["Traceback (most recent call last):", '  File "train.py", line 3, in f']
    assert _scan(*lines, "Epoch: 3 loss 0.5", "ValueError: boom") == [
        (TRACEBACK, "ValueError at train.py:3 in f")
    ]


@pytest.mark.parametrize(("foreign", "found"), [(200, True), (201, False)])
def test_up_to_200_lines_of_other_processes_are_passed_over_inside_a_traceback(
    foreign: int, found: bool
) -> None:
    """docs/report.md: an unindented line inside a traceback "is passed over, up to 200 such
    lines": with 200 of them the traceback is still read, with 201 it is given up."""
    lines = ["Traceback (most recent call last):", '  File "train.py", line 3, in f']
    epochs = [f"Epoch: {i} loss 0.5" for i in range(foreign)]
    read = _scan(*lines, *epochs, "ValueError: boom")
    assert read == ([(TRACEBACK, "ValueError at train.py:3 in f")] if found else [])


def test_odd_numbers_in_output_lines_are_not_read_as_numbers() -> None:
    assert _scan("9" * 5000 + ": hello", "[rank" + "9" * 5000 + "]: hello") == []
    assert _scan("srun: error: n1: task 0: Exited with exit code " + "9" * 5000) == []
    assert _scan("srun: error: n1: task \u00b2: Killed") == []


def test_a_wide_task_range_names_at_most_max_tasks_tasks() -> None:
    [item] = scan_lines(["srun: error: n1: tasks 0-9999999,5-7: Killed\n"], "out")
    assert item.srun_tasks == tuple(range(MAX_TASKS))
    # a bound of more digits than any task number has is not read (nor built as a range)
    [item] = scan_lines(["srun: error: n1: tasks 0-999999999999,5-7: Killed\n"], "out")
    assert item.srun_tasks == (5, 6, 7)
    [item] = scan_lines(["srun: error: n1: tasks 3-5,9,7-6: Killed\n"], "out")
    assert item.srun_tasks == (3, 4, 5, 9)


def test_only_slurms_out_of_memory_lines_are_slurms() -> None:
    assert (
        _scan("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB") == []
    )
    assert _scan("RuntimeError: CUDA error: out of memory") == []
    oom = [(FATAL, "slurm: out of memory")]
    assert _scan("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=7.0.") == oom
    assert _scan("slurmstepd: error: Detected 2 oom_kill events in StepId=7.batch.") == oom
    assert _scan("Memory cgroup out of memory: Killed process 4242 (python)") == oom
    [item] = scan_lines(["srun: error: gpu-b: task 1: Out Of Memory\n"], "out")
    assert (item.signature, item.srun_tasks) == ("slurm: out of memory", (1,))


OOM_KILL = "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=777.0 cgroup.\n"


def test_an_oom_kill_is_the_cause_of_the_sigkill_no_event_explains(
    standard_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 of the standard job is SIGKILLed with no fault event: SLURM's OOM line says why.
    A live rank's own "CUDA out of memory" is not SLURM's."""
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text("[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n" + OOM_KILL)
    report = build_report(standard_dir, sacct=False, slurm_output=[out])
    [finding] = report.log_findings
    assert (finding.signature, finding.ranks, finding.hosts) == (
        "slurm: out of memory",
        [1],
        ["node-a"],
    )
    signatures = {f.signature: f.source for f in report.failures}
    assert signatures["slurm: out of memory"] == "slurm_output"
    assert "signal SIGKILL" not in signatures  # one failure, one row


def test_an_oom_kill_is_no_failure_when_the_events_explain_every_end(
    death_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / f"slurm-{JOB}.out"
    out.write_text(OOM_KILL)  # rank 3 ended with exit code 1, not killed
    report = build_report(death_dir, sacct=False, slurm_output=[out])
    assert report.log_findings == []
