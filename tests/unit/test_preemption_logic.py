"""Preemption handling without SLURM: classification, flag, children, ledger, local requeue."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from nvrx import checkpoint_flag
from nvrx.events import EventWriter, read_dir
from nvrx.processes import signal_from_name
from nvrx.slurm import commands
from nvrx.supervisor.children import Child, stop_children
from nvrx.supervisor.preemption import (
    EXIT_REQUEUED,
    SUBMITIT_LOCAL_REQUEUE_EXIT,
    PreemptionHandler,
    capped_requeues,
)
from nvrx.supervisor.requeue_ledger import RequeueLedger, WarningOutcome, write_checkpoint_record
from nvrx.supervisor.warning_cause import classify, parse_duration, window_s
from tests.support.waiting import wait_until


def _no_children(exit_by: float) -> None:
    """The stop of a node without children."""


# A child that trains until the flag appears, then "checkpoints" (writes its step) and exits 0.
TRAINER = """
import os, sys, time
from nvrx import checkpoint_flag
out = sys.argv[1]
step = 0
while not checkpoint_flag.preemption_requested():
    step += 1
    time.sleep(0.02)
info = checkpoint_flag.preemption_info()
with open(out, "w") as fh:
    fh.write(f"{step} {info['cause']}")
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:01:00", 60.0),
        ("1:30", 90.0),
        ("2-03:04:05", 2 * 86400 + 3 * 3600 + 4 * 60 + 5.0),
        # the rest of sbatch's --time formats
        ("90", 5400.0),
        ("1-00", 86400.0),
        ("1-02:30", 86400 + 2 * 3600 + 30 * 60.0),
        ("2:00:00", 7200.0),
        ("1-", None),
        ("1:2:3:4", None),
        ("UNLIMITED", None),
        ("", None),
        (None, None),
        ("junk", None),
    ],
)
def test_parse_duration(text: str | None, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_classify_by_preempt_time_and_time_left() -> None:
    # slurmctld sets PreemptTime once a job is chosen for preemption
    assert classify(
        {"PreemptTime": "2026-01-01T00:00:00", "TimeLimit": "00:01:00", "RunTime": "00:00:55"}, 50
    ) == ("preemption")
    # warning 50 s before a 1-minute limit, seen 20 s in: 40 s left <= 50 s
    assert (
        classify({"PreemptTime": "None", "TimeLimit": "00:01:00", "RunTime": "00:00:20"}, 50)
        == "time_limit"
    )
    # slurmctld may warn up to 60 s early: 2 s into a 1-minute job is still the time limit
    assert (
        classify({"PreemptTime": "None", "TimeLimit": "00:01:00", "RunTime": "00:00:02"}, 50)
        == "time_limit"
    )
    # 5 minutes limit, warned 10 s in: far more time left than the warning delay
    assert (
        classify({"PreemptTime": "None", "TimeLimit": "00:05:00", "RunTime": "00:00:10"}, 50)
        == "preemption"
    )
    # delay unknown: submitit's elapsed-versus-limit rule
    assert classify({"TimeLimit": "01:00:00", "RunTime": "00:55:00"}, None) == "time_limit"
    assert classify({"TimeLimit": "01:00:00", "RunTime": "00:10:00"}, None) == "preemption"
    # no time limit: a warning can only be a preemption (or a manual signal)
    assert classify({"TimeLimit": "UNLIMITED", "RunTime": "00:10:00"}, 90) == "preemption"
    assert classify(None, 90) == "unknown"


@pytest.mark.parametrize("run_time", ["00:00:59", "00:01:00", "00:01:05"])
def test_a_time_limit_window_is_never_under_one_second(run_time: str) -> None:
    info = {"TimeLimit": "00:01:00", "RunTime": run_time}
    assert window_s(info, "time_limit", 90, None) == 1.0


@pytest.mark.parametrize(("given", "window"), [(0.0, 1.0), (0.5, 1.0), (1.2, 1.0), (2.0, 1.5)])
def test_a_short_preemption_window_is_never_under_one_second(given: float, window: float) -> None:
    assert window_s(None, "preemption", 90, given) == window
    assert window_s(None, "time_limit", given, None) == window


def test_signal_from_name() -> None:
    assert signal_from_name("USR2") == signal.SIGUSR2
    assert signal_from_name("sigusr1") == signal.SIGUSR1
    assert signal_from_name(str(int(signal.SIGHUP))) == signal.SIGHUP
    with pytest.raises(ValueError, match="NVRX_PREEMPT_SIGNAL='NOPE' is not a signal name"):
        signal_from_name("NOPE", "NVRX_PREEMPT_SIGNAL")


def test_flag_path_agrees_between_supervisor_and_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(checkpoint_flag.PREEMPT_FLAG_ENV, raising=False)
    env = {"NVRX_LOG_DIR": str(tmp_path), "NVRX_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}
    assert checkpoint_flag.flag_path(env) == tmp_path / "42" / "preempt" / "r2.flag"
    handler = PreemptionHandler(tmp_path / "42", 0, 1, job_id="42", run_index=2, export_env=False)
    assert handler.flag_path == checkpoint_flag.flag_path(env)
    # the explicit variable wins
    assert checkpoint_flag.flag_path({**env, "NVRX_PREEMPT_FLAG": "/x/y.flag"}) == Path("/x/y.flag")


def test_preemption_requested_follows_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "r0.flag"
    monkeypatch.setenv(checkpoint_flag.PREEMPT_FLAG_ENV, str(flag))
    assert not checkpoint_flag.preemption_requested()
    assert checkpoint_flag.preemption_info() is None
    checkpoint_flag.write_flag(flag, {"cause": "preemption"})
    assert checkpoint_flag.preemption_requested()
    assert checkpoint_flag.preemption_info() == {"cause": "preemption"}
    for unreadable in ("{not json", "[1, 2]", b"\xff\xfe{"):  # requested, nothing known
        if isinstance(unreadable, bytes):
            flag.write_bytes(unreadable)
        else:
            flag.write_text(unreadable)
        assert checkpoint_flag.preemption_requested()
        assert checkpoint_flag.preemption_info() == {}


def _spawn_trainers(tmp_path: Path, n: int) -> tuple[list[Child], list[Path]]:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    outs = [tmp_path / f"ckpt{i}.txt" for i in range(n)]
    env = dict(os.environ)  # carries NVRX_PREEMPT_FLAG exported by the handler
    children = [
        Child.spawn([sys.executable, str(script), str(out)], env, i, 0)
        for i, out in enumerate(outs)
    ]
    return children, outs


def test_local_requeue_checkpoints_children_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the handler exports its flag: set first, so that monkeypatch takes it away (or puts
    # back the one there was) after the test; delenv of a missing variable restores nothing
    monkeypatch.setenv(checkpoint_flag.PREEMPT_FLAG_ENV, "")
    monkeypatch.delenv(checkpoint_flag.PREEMPT_FLAG_ENV)
    job_dir = tmp_path / "job"
    writer = EventWriter(job_dir, "supervisor", {"job": "local", "node": 0})
    handler = PreemptionHandler(
        job_dir, 0, 1, slurm=False, local_requeue=True, preempt_window_s=30, writer=writer
    )
    assert os.environ[checkpoint_flag.PREEMPT_FLAG_ENV] == str(handler.flag_path)
    handler.start()
    children, outs = _spawn_trainers(tmp_path, 2)
    try:
        assert not handler.pending
        handler.on_signal(signal.SIGUSR2)
        assert handler.pending
        decision = handler.act(lambda exit_by: stop_children(children, 5.0, exit_by))
    finally:
        for child in children:
            child.kill_group()
            child.wait(5)
    assert decision.requeued and decision.exit_code == SUBMITIT_LOCAL_REQUEUE_EXIT
    assert decision.requeue_count == 1
    assert not handler.pending
    # both children saw the flag, checkpointed and exited cleanly (not killed)
    for child, out in zip(children, outs, strict=True):
        assert child.status is not None and child.status.code == 0
        step, cause = out.read_text().split()
        assert int(step) >= 0 and cause == "time_limit"  # submitit's local executor's warning
    assert RequeueLedger(job_dir / "preempt" / "requeues.json").count() == 1
    events, _ = read_dir(job_dir)
    kinds = [e["kind"] for e in events]
    assert kinds == ["preempt_signal", "requeue"]
    assert events[0]["signal"] == "SIGUSR2"
    assert events[0]["decided_by"] == "no SLURM" and events[0]["RunTime"] is None
    assert events[1]["count"] == 1
    # a second act() returns the same decision without doing anything again
    assert handler.act(lambda exit_by: pytest.fail("stopped twice")) is decision
    # the next local run uses a fresh flag (run index from the ledger)
    again = PreemptionHandler(job_dir, 0, 1, slurm=False, local_requeue=True, export_env=False)
    assert again.run_index == 1 and not again.flag_path.exists()


def test_stubborn_child_is_ended_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(checkpoint_flag.PREEMPT_FLAG_ENV, raising=False)
    handler = PreemptionHandler(
        tmp_path / "job", 0, 1, slurm=False, preempt_window_s=1.5, export_env=False
    )
    # ignores the flag and SIGTERM: only the group SIGKILL ends it
    stubborn = Child.spawn(
        [
            sys.executable,
            "-c",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)",
        ],
        dict(os.environ),
        0,
        0,
    )
    try:
        handler.on_signal(signal.SIGUSR2)
        started = time.monotonic()
        decision = handler.act(lambda exit_by: stop_children([stubborn], 1.0, exit_by))
        took = time.monotonic() - started
    finally:
        stubborn.kill_group()
        stubborn.wait(5)
    assert stubborn.status is not None and stubborn.status.signal == signal.SIGKILL
    assert not decision.requeued
    assert decision.exit_code == 128 + signal.SIGUSR2
    assert "not running under SLURM" in decision.reason
    assert took < 60  # bounded: window + SIGTERM grace, never the child's 120 s


def _warned(
    job_dir: Path, before: list[str], cap: int, cause: str
) -> tuple[WarningOutcome, RequeueLedger]:
    """Node 0 of a one-node job without SLURM, whose ledger holds requeues of the causes
    ``before``, acts on a warning of ``cause`` under a cap of ``cap`` time-limit requeues."""
    ledger = RequeueLedger(job_dir / "preempt" / "requeues.json")
    for run, earlier in enumerate(before):
        ledger.append(earlier, run)
    handler = PreemptionHandler(
        job_dir, 0, 1, slurm=False, local_requeue=True, max_time_limit_requeues=cap,
        export_env=False,
    )  # fmt: skip
    handler.on_signal(signal.SIGUSR2)
    return handler.act(_no_children, cause=cause), ledger


def test_time_limit_requeues_are_capped(tmp_path: Path) -> None:
    decision, ledger = _warned(tmp_path / "job", ["time_limit", "preemption"], 1, "time_limit")
    assert not decision.requeued
    assert "1 time-limit requeue(s) already used" in decision.reason
    assert ledger.count() == 2  # nothing added
    # preemptions are not capped
    assert _warned(tmp_path / "job2", [], 0, "preemption")[0].requeued


def test_preemptions_and_other_requeues_leave_the_time_limit_cap_untouched(tmp_path: Path) -> None:
    decision, ledger = _warned(tmp_path / "job", ["preemption", "node_failure"], 1, "time_limit")
    assert decision.requeued, decision.reason
    assert ledger.count("time_limit") == 1 and ledger.count() == 3


@pytest.mark.parametrize(
    ("before", "cause"),
    [(["unknown"], "time_limit"), (["time_limit"], "unknown"), (["unknown"], "unknown")],
)
def test_requeues_of_unknown_cause_count_against_the_time_limit_cap(
    tmp_path: Path, before: list[str], cause: str
) -> None:
    """A warning nvrx cannot tell from a time limit is capped with the time limits. Before:
    its requeues counted against nothing, so a job warned that way requeued for ever."""
    decision, ledger = _warned(tmp_path / "job", before, 1, cause)
    assert not decision.requeued
    assert "1 time-limit requeue(s) already used" in decision.reason
    assert "unknown cause count as time limits" in decision.reason
    assert ledger.count() == 1


def test_submitits_local_warning_is_a_capped_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under submitit's local executor (SUBMITIT_EXECUTOR=local) the warning comes only before
    its time limit: it is one, and max_time_limit_requeues caps it. Before: its cause was
    "unknown", never capped, and a local job outliving its limit was re-run for ever."""
    monkeypatch.delenv(checkpoint_flag.PREEMPT_FLAG_ENV, raising=False)
    env = {"SUBMITIT_EXECUTOR": "local", "NVRX_MAX_TIME_LIMIT_REQUEUES": "1"}
    outcomes = []
    writer = EventWriter(tmp_path / "job", "supervisor", {"job": "local", "node": 0})
    for _ in range(2):  # each run of the local task: a fresh supervisor, the same job folder
        handler = PreemptionHandler.from_env(0, 1, job_dir=tmp_path / "job", env=env, writer=writer)
        handler.start()
        handler.on_signal(signal.SIGUSR2)
        outcomes.append(handler.act(_no_children))
    assert [o.cause for o in outcomes] == ["time_limit", "time_limit"]
    assert [o.requeued for o in outcomes] == [True, False]
    assert outcomes[0].exit_code == SUBMITIT_LOCAL_REQUEUE_EXIT
    assert "1 time-limit requeue(s) already used" in outcomes[1].reason
    # without SLURM and without submitit's local executor, nothing tells what it was
    handler = PreemptionHandler.from_env(0, 1, job_dir=tmp_path / "other", env={}, writer=writer)
    handler.on_signal(signal.SIGUSR2)
    assert handler.act(_no_children).cause == "unknown"


def _two_local_nodes(job_dir: Path) -> list[PreemptionHandler]:
    """The handlers of a two-node job without SLURM (submitit's local requeue); node 0 started."""
    handlers = [
        PreemptionHandler(
            job_dir, k, 2, slurm=False, local_requeue=True, preempt_window_s=20, export_env=False
        )
        for k in range(2)
    ]
    handlers[0].start()
    return handlers


def test_nodes_share_node0_decision(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    handlers = _two_local_nodes(job_dir)
    decisions: dict[int, object] = {}

    def run(k: int) -> None:
        handlers[k].on_signal(signal.SIGUSR2)
        decisions[k] = handlers[k].act(_no_children)

    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert decisions[0] == decisions[1]
    assert decisions[0].requeued  # type: ignore[attr-defined]
    assert (job_dir / "preempt" / "r0.decision").exists()
    assert json.loads((job_dir / "preempt" / "r0.flag").read_text())["run"] == 0


def test_a_node_whose_children_stopped_on_the_flag_still_takes_part(tmp_path: Path) -> None:
    """Node 1 never got the signal: the flag node 0 raised is its warning, with node 0's cause."""
    job_dir = tmp_path / "job"
    handlers = _two_local_nodes(job_dir)
    assert not handlers[1].adopt_flag()  # no flag yet
    decisions: dict[int, object] = {}

    def node0() -> None:
        handlers[0].on_signal(signal.SIGUSR2)
        decisions[0] = handlers[0].act(_no_children, cause="preemption")

    thread = threading.Thread(target=node0)
    thread.start()
    flag = job_dir / "preempt" / "r0.flag"
    wait_until("node 0 to raise the flag", flag.exists, 30, interval=0.02)
    assert handlers[1].adopt_flag() and handlers[1].pending
    assert not handlers[1].adopt_flag()  # once
    decisions[1] = handlers[1].act(_no_children)
    thread.join(60)
    assert decisions[0] == decisions[1]
    assert decisions[1].cause == "preemption" and decisions[1].requeued  # type: ignore[attr-defined]


def test_a_flag_left_by_an_earlier_run_is_not_adopted(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    flag = job_dir / "preempt" / "r0.flag"
    checkpoint_flag.write_flag(flag, {"cause": "preemption", "deadline_wall": time.time() - 60})
    handler = PreemptionHandler(job_dir, 1, 2, slurm=False, export_env=False)
    assert not handler.adopt_flag() and not handler.pending


def test_bad_arguments_name_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="node_rank=2 must be in 0..1"):
        PreemptionHandler(tmp_path, 2, 2, slurm=False, export_env=False)
    with pytest.raises(ValueError, match="job_id is needed"):
        PreemptionHandler(tmp_path, 0, 1, slurm=True, export_env=False)
    handler = PreemptionHandler(tmp_path, 0, 1, slurm=False, export_env=False)
    with pytest.raises(ValueError, match="cause must be one of"):
        handler.act(_no_children, cause="meteor")
    assert EXIT_REQUEUED == 75


def _ignored_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn line for pid {pid}")


def test_supervised_children_ignore_the_warning_signal(tmp_path: Path) -> None:
    """SLURM signals every process of a step: children must survive USR2 and see the flag instead."""
    child = Child.spawn(
        [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), 0, 0
    )
    try:
        # wait until the child runs Python (exec done), then look at its signal dispositions
        wait_until(
            "the child to exec Python",
            lambda: b"python" in Path(f"/proc/{child.pid}/cmdline").read_bytes(),
            30,
            interval=0.01,
        )
        assert _ignored_signals(child.pid) & (1 << (signal.SIGUSR2 - 1))
        os.kill(child.pid, signal.SIGUSR2)
        assert child.wait(0.5) is None  # still running
    finally:
        child.kill_group()
        child.wait(5)
    assert child.status is not None and child.status.signal == signal.SIGKILL


def test_after_losing_node_0_the_store_host_decides_without_waiting_for_lost_nodes(
    tmp_path: Path,
) -> None:
    """Slot 0 was lost and slot 1 hosts the store now: slot 1 decides and requeues, and
    waits only for the nodes still in the job, not until the warning's deadline."""
    job_dir = tmp_path / "job"
    handlers = [
        PreemptionHandler(
            job_dir, k, 3, slurm=False, local_requeue=True, preempt_window_s=60, export_env=False
        )
        for k in range(3)
    ]
    decisions: dict[int, object] = {}

    def run(k: int) -> None:
        handlers[k].on_signal(signal.SIGUSR2)
        decisions[k] = handlers[k].act(
            _no_children, cause="preemption", decider=k == 1, running=lambda: [1, 2]
        )

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert time.monotonic() - started < 30  # not the 60 s window spent waiting for slot 0
    assert decisions[1] == decisions[2] and decisions[1].requeued  # type: ignore[attr-defined]
    assert not (job_dir / "preempt" / "r0.node0.done").exists()
    assert RequeueLedger(job_dir / "preempt" / "requeues.json").count() == 1


def test_a_slurm_requeue_of_an_array_element_gets_its_cause_from_sacct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An array element's sacct JobID is <array>_<index>; its SLURM_JOB_ID is JobIDRaw."""
    rows = [
        {"JobID": "4242_1", "JobIDRaw": "4243", "State": "PREEMPTED"},
        {"JobID": "4242_1.batch", "JobIDRaw": "4243.batch", "State": "CANCELLED"},
        {"JobID": "4242_1", "JobIDRaw": "4243", "State": "RUNNING"},
    ]

    def sacct_rows(job_id: str, fields: tuple[str, ...], **kwargs: object) -> list[dict]:
        assert job_id == "4243"
        return [{f: row[f] for f in fields} for row in rows]

    monkeypatch.setattr(commands, "sacct_rows", sacct_rows)
    job_dir = tmp_path / "4242_1"
    writer = EventWriter(job_dir, "supervisor", {"job": "4242_1", "node": 0})
    handler = PreemptionHandler(
        job_dir, 0, 1, job_id="4243", run_index=1, writer=writer, export_env=False
    )
    handler.start()
    assert [e["cause"] for e in handler.ledger.entries()] == ["preemption"]
    events, _ = read_dir(job_dir)
    assert [(e["kind"], e["cause"], e["issued_by"]) for e in events] == [
        ("requeue", "preemption", "slurm")
    ]


def test_a_refusing_checkpoint_record_stops_scontrol_requeue_and_a_stale_one_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 reads rank 0's checkpoint record before ``scontrol requeue``; a record left over
    from an earlier run with the same index is removed when the run starts."""
    requeued: list[str] = []
    monkeypatch.setattr(commands, "requeue", lambda job_id, **kwargs: requeued.append(job_id))
    monkeypatch.setattr(commands, "show_job", lambda job_id, **kwargs: None)

    def warned(job_dir: Path, refusal: str | None) -> WarningOutcome:
        writer = EventWriter(job_dir, "supervisor", {"job": "4242", "node": 0})
        handler = PreemptionHandler(
            job_dir, 0, 1, job_id="4242", preempt_window_s=1, writer=writer, export_env=False
        )
        write_checkpoint_record(handler.flag_path, False, "left over")
        handler.start()
        if refusal is not None:  # what rank 0 records when its checkpoint returned None
            write_checkpoint_record(handler.flag_path, False, refusal)
        handler.on_signal(signal.SIGUSR2)
        return handler.act(_no_children, cause="preemption")

    decision = warned(tmp_path / "refused", "the checkpoint returned None")
    assert not decision.requeued and requeued == []
    assert decision.reason == "not requeued: the checkpoint returned None"
    assert warned(tmp_path / "stale", None).requeued and requeued == ["4242"]


def test_a_node_stopped_in_the_window_takes_the_deciders_word_else_its_signal(tmp_path: Path) -> None:
    """A node other than the decider that got a stop signal while it waited still takes the
    decision where one came (the decider got the same scancel, or none); where none came in
    time, it exits with its signal's code, not as if nothing had stopped it."""
    node1 = _two_local_nodes(tmp_path / "job")[1]
    node1.on_signal(signal.SIGUSR2)
    stopped = lambda: int(signal.SIGTERM)  # noqa: E731
    late = node1._await_decision("preemption", time.time(), stopped)
    assert (late.requeued, late.exit_code) == (False, 128 + signal.SIGTERM)
    assert late.reason == "not requeued: stopped by SIGTERM during the warning"
    decided = WarningOutcome("preemption", True, 75, "requeued", 1)
    node1._decision_path().parent.mkdir(parents=True, exist_ok=True)
    node1._decision_path().write_text(json.dumps(decided.to_dict()))
    assert node1._await_decision("preemption", time.time() + 60, stopped) == decided


def test_an_unreadable_ledger_counts_every_earlier_run_and_is_kept_not_overwritten(tmp_path: Path) -> None:
    """Before: an unreadable ledger counted no requeue (the time-limit cap was bypassed) and
    the next requeue wrote over it with one entry."""
    path = tmp_path / "requeues.json"
    path.write_text('[{"cause": "time_limit", "run": 0}, {"cause": "time_li')  # a torn write
    ledger = RequeueLedger(path, runs_before=2)  # the third run of the job
    assert ledger.count("time_limit") == 2 and ledger.count("preemption") == 2
    assert ledger.append("time_limit", 2) == 3
    assert (tmp_path / "requeues.json.unreadable").read_text().endswith('"time_li')
    assert [e["cause"] for e in ledger.entries()] == [None, None, "time_limit"]
    assert ledger.count("time_limit") == 3 and ledger.count("preemption") == 2


def test_slurms_own_requeues_of_unknown_cause_leave_the_time_limit_cap_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 2 of a job SLURM requeued twice itself (node failures, a manual requeue), with
    accounting off: the ledger records both as unknown, issued by SLURM. They are no time
    limits nvrx was warned of, so the first time-limit warning is requeued under a cap of 2.
    Before: they counted against the cap, and the job was not requeued."""

    def no_sacct(*args: object, **kwargs: object) -> list[dict]:
        raise commands.SlurmCommandError(["sacct"], 1, "Slurm accounting storage is disabled")

    requeued: list[str] = []
    monkeypatch.setattr(commands, "sacct_rows", no_sacct)
    monkeypatch.setattr(commands, "show_job", lambda job_id, **kwargs: None)
    monkeypatch.setattr(commands, "requeue", lambda job_id, **kwargs: requeued.append(job_id))
    handler = PreemptionHandler(
        tmp_path / "job", 0, 1, job_id="55", run_index=2, slurm=True,
        max_time_limit_requeues=2, export_env=False,
    )  # fmt: skip
    handler.start()
    entries = handler.ledger.entries()
    assert [(e["cause"], e["issued_by"]) for e in entries] == [("unknown", "slurm")] * 2
    handler.on_signal(signal.SIGUSR2)
    decision = handler.act(_no_children, cause="time_limit")
    assert decision.requeued, decision.reason
    assert requeued == ["55"]
    # nvrx's own requeues after warnings of unknown cause still count
    assert capped_requeues([*entries, {"cause": "unknown", "issued_by": "nvrx"}]) == 1
    assert capped_requeues([{"cause": None}, {"cause": "time_limit", "issued_by": "slurm"}]) == 2


@pytest.mark.parametrize(
    ("run_time", "cause"),
    [
        ("00:08:50", "time_limit"),  # 70 s left at the look, 100 at the warning
        ("00:07:40", "preemption"),  # 140 s left at the look, 170 at the warning: over 90+60+5
    ],
)
def test_a_warning_acted_on_after_a_delay_counts_the_time_left_at_the_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_time: str, cause: str
) -> None:
    """A warning that reached nvrx-srun before srun ran is acted on 30 s after it came, and
    slurmctld's RunTime is read then. Before: the time left at that look was taken as left at
    the warning, so a time limit's deadline came 30 s before the limit's margin, and a
    preemption (more time left than the delay allows) counted as a time limit."""
    info = {"PreemptTime": "None", "TimeLimit": "00:10:00", "RunTime": run_time}
    monkeypatch.setattr(commands, "show_job", lambda job_id, **kwargs: dict(info))
    monkeypatch.setattr(commands, "requeue", lambda job_id, **kwargs: None)
    writer = EventWriter(tmp_path, "supervisor", {"job": "4242", "node": 0})
    handler = PreemptionHandler(
        tmp_path, 0, 1, job_id="4242", signal_delay_s=90, preempt_window_s=20, writer=writer,
        export_env=False,
    )  # fmt: skip
    warned = time.time() - 30.0
    handler.warned_at(warned)
    before = time.time()
    assert handler.act(_no_children).requeued
    after = time.time()
    flag = json.loads(handler.flag_path.read_text())
    assert flag["cause"] == cause
    if cause == "time_limit":  # 70 s left at the look, less the margin (10 s)
        assert before + 60.0 <= flag["deadline_wall"] <= after + 60.0
    else:  # a preemption's window (20 s, less its margin) counts from the signal
        assert flag["deadline_wall"] == pytest.approx(warned + window_s(None, cause, 90, 20), abs=1e-6)


def test_the_flag_and_error_file_paths_children_get_are_absolute(tmp_path, monkeypatch) -> None:
    """A relative log directory (the default ``./nvrx_logs``): a rank that changes directory
    (Hydra, say) still finds its checkpoint flag and writes its error file where the
    supervisor reads them."""
    from nvrx.jobenv import JobEnv

    monkeypatch.chdir(tmp_path)
    handler = PreemptionHandler("logs/7", 0, 1, slurm=False, export_env=False)
    assert handler.flag_path.is_absolute()
    assert handler.flag_path.is_relative_to(tmp_path)
    job = JobEnv.local(nnodes=1, node_rank=0, nproc_per_node=1, job_id="7", log_dir="logs")
    assert job.job_dir == tmp_path / "logs" / "7"


def test_a_time_limit_without_scontrol_leaves_the_signals_delay_not_the_preemption_window() -> None:
    """``NVRX_PREEMPT_WINDOW_S`` is for preemptions: a time-limit warning with nothing from
    scontrol (submitit's local executor) leaves the signal's delay (less the margin)."""
    assert window_s(None, "time_limit", 90, 300) == 80.0
    assert window_s(None, "preemption", 90, 300) == 290.0


@pytest.mark.timeout(60)
def test_a_node_waits_for_a_decider_still_stopping_its_children_and_asking_slurm(tmp_path: Path) -> None:
    """The warning's window is over (20 s ago): the decider may still be stopping its
    children and asking SLURM to requeue, which takes up to ``DECISION_WAIT_S`` past the
    deadline. Its decision, written a moment later, is this node's (it gave up 15 s past
    the deadline, and exited otherwise than the decider)."""
    handlers = _two_local_nodes(tmp_path / "job")
    node1 = handlers[1]
    node1._created_wall = time.time() - 60  # its supervisor started before the warning
    flag = tmp_path / "job" / "preempt" / "r0.flag"
    checkpoint_flag.write_flag(flag, {"cause": "preemption", "deadline_wall": time.time() - 20, "run": 0})
    assert node1.adopt_flag()
    decided = WarningOutcome("preemption", True, 75, "requeued", 1)

    def decide_late() -> None:  # once node 1 stopped its children and waits for the word
        wait_until("node 1 to report its children done", node1._done_path(1).exists, 30, interval=0.01)
        node1._decision_path().parent.mkdir(parents=True, exist_ok=True)
        node1._decision_path().write_text(json.dumps(decided.to_dict()))

    late = threading.Thread(target=decide_late)
    late.start()
    try:
        assert node1.act(_no_children) == decided
    finally:
        late.join()


@pytest.mark.timeout(60)
def test_a_stopped_node_waits_for_the_decision_only_a_little_longer(tmp_path: Path, monkeypatch) -> None:
    """Its stop signal came (SLURM's SIGKILL follows within its KillWait): with no decision
    it ends on its own terms ``STOPPED_WAIT_S`` later, not at the far deadline."""
    from nvrx.supervisor import preemption as preemption_module

    monkeypatch.setattr(preemption_module, "STOPPED_WAIT_S", 0.3)
    node1 = _two_local_nodes(tmp_path / "job")[1]
    node1.on_signal(signal.SIGUSR2)
    begun = time.monotonic()
    outcome = node1._await_decision("preemption", time.time() + 45, lambda: int(signal.SIGTERM))
    assert time.monotonic() - begun < 20
    assert (outcome.requeued, outcome.exit_code) == (False, 128 + signal.SIGTERM)
