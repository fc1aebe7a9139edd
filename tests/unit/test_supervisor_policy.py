"""Restart policy, exit statuses, exit codes, config and the signal pipe of the supervisor."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest

from nvrx.jobenv import JobEnv
from nvrx.signal_pipe import SignalPipe
from nvrx.supervisor.children import ExitStatus
from nvrx.supervisor.config import ConfigError, SupervisorConfig, local_job
from nvrx.supervisor.exit_codes import ExitCode, describe, for_signal
from nvrx.supervisor.job_restart import streak_of
from nvrx.supervisor.policy import Decision, LastFault, RestartPolicy, exit_signature, last_fault


class Budget:
    """The job-wide counter, as the store's atomic add keeps it."""

    def __init__(self) -> None:
        self.used = 0

    def spend(self) -> int:
        self.used += 1
        return self.used


def test_exit_status_from_returncode() -> None:
    killed = ExitStatus.from_returncode(-signal.SIGKILL)
    assert (
        killed.signal == signal.SIGKILL and killed.code is None and killed.signal_name == "SIGKILL"
    )
    assert str(killed) == "killed by SIGKILL"
    assert ExitStatus.from_returncode(3) == ExitStatus(3, None)


def test_completed_child_is_done_and_costs_nothing() -> None:
    budget = Budget()
    verdict = RestartPolicy(2, 3, budget.spend).decide(0, ExitStatus(0, None))
    assert verdict.decision is Decision.DONE and budget.used == 0


def test_exit_130_stops_the_job_without_spending_budget_and_says_it_did_not_complete() -> None:
    budget = Budget()
    verdict = RestartPolicy(2, 3, budget.spend).decide(0, ExitStatus(130, None))
    assert (verdict.decision, verdict.exit_code, budget.used) == (
        Decision.STOP, ExitCode.RANK_STOPPED, 0
    )  # fmt: skip


def test_budget_is_spent_then_exhausted() -> None:
    budget = Budget()
    policy = RestartPolicy(2, 0, budget.spend)
    first = policy.decide(0, ExitStatus(1, None))
    second = policy.decide(1, ExitStatus(None, signal.SIGKILL))
    third = policy.decide(0, ExitStatus(1, None))
    assert (first.decision, first.budget_left) == (Decision.RESTART, 1)
    assert (second.decision, second.budget_left) == (Decision.RESTART, 0)
    assert third.decision is Decision.GIVE_UP and third.exit_code == ExitCode.BUDGET_EXHAUSTED
    assert "--max-restarts" in third.reason
    named = RestartPolicy(0, 0, Budget().spend, budget_name="fork_and_monitor's max_restarts")
    assert "(fork_and_monitor's max_restarts)" in named.decide(0, ExitStatus(1, None)).reason


def test_loop_breaker_needs_the_same_signature_in_a_row() -> None:
    policy = RestartPolicy(100, 3, Budget().spend)
    assert policy.decide(0, ExitStatus(1, None)).decision is Decision.RESTART
    assert policy.decide(0, ExitStatus(1, None)).decision is Decision.RESTART
    # a different failure resets the streak
    assert policy.decide(0, ExitStatus(None, signal.SIGKILL)).decision is Decision.RESTART
    assert policy.decide(0, ExitStatus(1, None)).decision is Decision.RESTART
    assert policy.decide(0, ExitStatus(1, None)).decision is Decision.RESTART
    verdict = policy.decide(0, ExitStatus(1, None))
    assert verdict.decision is Decision.GIVE_UP and verdict.exit_code == ExitCode.LOOP_BREAKER
    assert "exit code 1" in verdict.reason and "3 times" in verdict.reason


def test_loop_breaker_counts_per_local_rank_and_uses_fault_signatures() -> None:
    policy = RestartPolicy(100, 2, Budget().spend)
    bug = LastFault("ValueError@train.py:10", "exception")
    other = LastFault("KeyError@train.py:20", "exception")
    assert policy.decide(0, ExitStatus(1, None), bug).decision is Decision.RESTART
    assert policy.decide(1, ExitStatus(1, None), bug).decision is Decision.RESTART
    assert policy.decide(0, ExitStatus(1, None), other).decision is Decision.RESTART
    verdict = policy.decide(1, ExitStatus(1, None), bug)
    assert verdict.decision is Decision.GIVE_UP and verdict.signature == "ValueError@train.py:10"


def test_collateral_failures_spend_budget_but_never_break_the_loop() -> None:
    budget = Budget()
    policy = RestartPolicy(100, 2, budget.spend)
    peer = LastFault("PeerLost@train.py:5", "peer")
    for _ in range(5):
        assert policy.decide(0, ExitStatus(1, None), peer).decision is Decision.RESTART
    assert budget.used == 5


def test_a_job_wide_streak_is_the_jobs_whichever_local_rank_fails_first() -> None:
    # job-wide restarts: each decision starts from the streak the one before announced
    policy = RestartPolicy(100, 3, Budget().spend)
    first = policy.decide(0, ExitStatus(3, None), None, (None, 0))
    assert (first.decision, first.streak) == (Decision.RESTART, ("exit code 3", 1))
    second = policy.decide(1, ExitStatus(3, None), None, first.streak)
    assert (second.decision, second.streak) == (Decision.RESTART, ("exit code 3", 2))
    third = policy.decide(0, ExitStatus(3, None), None, second.streak)
    assert third.decision is Decision.GIVE_UP and third.exit_code == ExitCode.LOOP_BREAKER
    assert third.reason == "loop breaker: the job failed with exit code 3 3 times in a row"
    # the local ranks' own streaks are not touched by job-wide decisions
    assert policy.streak(0) == (None, 0) and policy.streak(1) == (None, 0)


def test_a_collateral_failure_carries_the_job_wide_streak_before_it_on() -> None:
    policy = RestartPolicy(100, 3, Budget().spend)
    peer = LastFault("PeerLost@train.py:5", "peer")
    verdict = policy.decide(0, ExitStatus(1, None), peer, ("exit code 3", 2))
    assert (verdict.decision, verdict.streak) == (Decision.RESTART, ("exit code 3", 2))
    verdict = policy.decide(1, ExitStatus(3, None), None, verdict.streak)
    assert verdict.decision is Decision.GIVE_UP


@pytest.mark.parametrize(
    "announcement, streak",
    [
        ('{"rank": 1, "signature": "exit code 3", "streak": ["exit code 3", 2]}', ("exit code 3", 2)),
        ('{"rank": 1, "signature": "exit code 3"}', (None, 0)),  # an older version's
        ('{"streak": ["exit code 3", true]}', (None, 0)),
        ('{"streak": ["exit code 3", 0]}', (None, 0)),
        ('{"streak": [3, 2]}', (None, 0)),
        ('["exit code 3", 2]', (None, 0)),
        ("not json", (None, 0)),
        (None, (None, 0)),  # no announcement
    ],
)
def test_a_job_wide_restart_reads_the_streak_its_predecessor_announced(announcement, streak) -> None:
    assert streak_of(announcement) == streak


def test_policy_rejects_negative_limits() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(-1, 3, Budget().spend)
    with pytest.raises(ValueError, match="loop_breaker"):
        RestartPolicy(1, -2, Budget().spend)


def test_exit_signature_names_code_or_signal() -> None:
    assert exit_signature(ExitStatus(4, None)) == "exit code 4"
    assert exit_signature(ExitStatus(None, signal.SIGSEGV)) == "signal SIGSEGV"


def test_last_fault_reads_only_that_pids_files_and_skips_bad_lines(tmp_path) -> None:
    mine = tmp_path / "wrapper-n0-p4242-abcd.jsonl"
    lines = [
        json.dumps({"kind": "fault", "signature": "A@x.py:1", "fault_kind": "exception"}),
        "{torn",
        json.dumps({"kind": "fault", "signature": "B@x.py:2", "fault_kind": "peer"}),
        json.dumps({"kind": "progress", "step": 3}),
    ]
    mine.write_text("\n".join(lines) + "\n")
    (tmp_path / "wrapper-n0-p999-abcd.jsonl").write_text(
        json.dumps({"kind": "fault", "signature": "C"}) + "\n"
    )
    record = last_fault(tmp_path, 4242)
    # read in the vocabulary whatever version wrote it: "B@x.py:2" is "B at x.py:2"
    assert record == LastFault("B at x.py:2", "peer") and record.collateral
    assert last_fault(tmp_path, 1) is None
    assert last_fault(tmp_path / "missing", 4242) is None


def test_last_fault_ignores_a_fault_recovered_in_process(tmp_path) -> None:
    """A SIGKILL in round 2 must not inherit the signature of round 1's exception."""
    path = tmp_path / "wrapper-n0-p4242-abcd.jsonl"
    lines = [
        {"kind": "round_start", "round": 0},
        {"kind": "fault", "signature": "E@train.py:9", "fault_kind": "exception", "round": 0},
        {"kind": "round_start", "round": 1},
        {"kind": "call_start", "round": 1},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert last_fault(tmp_path, 4242) is None
    with path.open("a") as fh:
        fh.write(
            json.dumps({"kind": "fault", "signature": "F@train.py:3", "fault_kind": "exception"})
        )
        fh.write("\n")
    assert last_fault(tmp_path, 4242) == LastFault("F at train.py:3", "exception")


def test_exit_codes_are_described() -> None:
    assert for_signal(signal.SIGTERM) == 143
    assert "SIGTERM" in describe(143)
    assert "budget" in describe(ExitCode.BUDGET_EXHAUSTED)
    assert describe(99) == "unknown exit code 99"


def test_exit_6_names_every_wait_that_ends_with_it() -> None:
    """A job-wide restart's wait for a stuck store host ends in it too, with node liveness:
    the description names the settings that wait adds up, not --finish-timeout alone."""
    text = describe(ExitCode.PEER_LOST)
    assert "--finish-timeout" in text and "grace_period + store_timeout" in text
    assert "--grace-period + --store-timeout + --node-timeout" in text


def _config(**overrides) -> SupervisorConfig:
    """Node 1 of two, two ranks each; an override of a ``JobEnv`` field goes to the job."""
    job_fields = {f.name for f in dataclasses.fields(JobEnv)}
    job = {"nproc_per_node": 2, "nnodes": 2, "node_rank": 1}
    job.update({k: v for k, v in overrides.items() if k in job_fields})
    settings = {k: v for k, v in overrides.items() if k not in job_fields}
    return SupervisorConfig(**{"command": ["python", "train.py"], **settings}, job=local_job(**job))


def test_child_env_follows_the_contract(tmp_path) -> None:
    cfg = _config(master_port=31000, store_port=31001, job_id="j7", log_dir=str(tmp_path))
    env = cfg.child_env(1, 2, base={"PATH": "/bin", "RANK": "99"})
    assert env["PATH"] == "/bin"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "1",
        "4",
        "2",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "31000")
    assert (env["NVRX_STORE_HOST"], env["NVRX_STORE_PORT"]) == ("127.0.0.1", "31001")
    assert (env["NVRX_JOB_ID"], env["NVRX_LOG_DIR"]) == ("j7", str(tmp_path))
    assert (env["NVRX_NODE_RANK"], env["NVRX_NNODES"], env["NVRX_NPROC_PER_NODE"]) == (
        "1",
        "2",
        "2",
    )
    assert (env["NVRX_RESTART_COUNT"], env["NVRX_SUPERVISED"]) == ("2", "1")
    assert cfg.events_dir == tmp_path / "j7"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"command": []}, "no training command"),
        ({"nproc_per_node": 0}, "--nproc-per-node must be >= 1, got 0"),
        ({"node_rank": 2}, "--node-rank must be in 0..1"),
        ({"store_port": 29500, "master_port": 29500}, "must differ"),
        ({"store_port": 70000}, "--store-port must be in 1..65535, got 70000"),
        ({"max_restarts": -1}, "--max-restarts must be >= 0, got -1"),
        ({"grace_period": -1.0}, "--grace-period"),
        ({"job_id": "a/b"}, "--job-id"),
    ],
)
def test_bad_config_names_the_option_and_value(overrides, fragment) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _config(**overrides)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"max_restarts": -1}, "fork_and_monitor's max_restarts must be >= 0, got -1"),
        ({"loop_breaker": -2}, "fork_and_monitor's loop_breaker must be >= 0"),
        ({"grace_period": -1.0}, "fork_and_monitor's grace_period must be in 0..86400 seconds, got -1"),
        ({"store_timeout": 0.0}, "fork_and_monitor's store_timeout must be > 0"),
        ({"finish_timeout": 0.0}, "fork_and_monitor's finish_timeout must be > 0"),
    ],
)
def test_a_bad_fork_and_monitor_argument_is_named_as_its_keyword(overrides, fragment) -> None:
    """fork_and_monitor (no node liveness) has keywords, not nvrx-supervise's flags: a bad
    value names the keyword the caller gave."""
    with pytest.raises(ConfigError, match=fragment) as caught:
        _config(node_liveness=False, **overrides)
    assert "--" not in str(caught.value)


def test_signal_pipe_carries_signal_numbers_to_the_loop() -> None:
    pipe = SignalPipe([signal.SIGUSR1, signal.SIGUSR2]).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert pipe.read() == [signal.SIGUSR1, signal.SIGUSR2]
        assert pipe.read() == []
    finally:
        pipe.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_loop_breaker_reads_old_spellings_but_an_old_line_less_signature_is_another_failure(
    tmp_path,
) -> None:
    """Logs of an older nvrx say "signal:SIGKILL" and "pkg.E@train.py:step". The first is
    the same failure as "signal SIGKILL"; the second names no line, so it is not the same
    string as the new "pkg.E at train.py:9 in step" and the streak starts again."""
    path = tmp_path / "wrapper-n0-p77-abcd.jsonl"
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 9, in step\n'
        "    raise E()\n"
        "pkg.E: boom\n"
    )
    old = {"kind": "fault", "signature": "pkg.E@train.py:step", "fault_kind": "exception"}
    new = {"kind": "fault", "exc_type": "pkg.E", "traceback": traceback, "fault_kind": "exception"}
    policy = RestartPolicy(100, 2, Budget().spend)
    path.write_text(json.dumps(old) + "\n")
    first = last_fault(tmp_path, 77)
    assert first == LastFault("pkg.E at train.py in step", "exception")
    assert policy.decide(0, ExitStatus(1, None), first).decision is Decision.RESTART
    path.write_text(json.dumps(new) + "\n")
    second = last_fault(tmp_path, 77)
    assert second == LastFault("pkg.E at train.py:9 in step", "exception")
    # the line is known only in the new spelling: a different signature, the streak restarts
    assert policy.decide(0, ExitStatus(1, None), second).decision is Decision.RESTART
    verdict = policy.decide(0, ExitStatus(1, None), second)
    assert verdict.decision is Decision.GIVE_UP and verdict.signature == second.signature
    killed = ExitStatus(None, signal.SIGKILL)
    assert policy.decide(1, killed).signature == "signal SIGKILL"
    # "signal:SIGKILL" and "signal SIGKILL" are one failure: two in a row break the loop
    for spelling in ("signal:SIGKILL", "signal SIGKILL"):
        path.write_text(json.dumps({"kind": "fault", "signature": spelling}) + "\n")
        verdict = policy.decide(2, killed, last_fault(tmp_path, 77))
    assert verdict.decision is Decision.GIVE_UP and verdict.signature == "signal SIGKILL"


def _fault_event(**fields) -> dict:
    event = {"v": 1, "kind": "fault", "wall": 1000.0, "mono": 5.0, "boot": "b", "host": "h1"}
    event.update(pid=77, component="monitor", job="7", node=0, rank=0, round=0, **fields)
    return event


@pytest.mark.parametrize(
    "fields",
    [
        {"fault_kind": "hang_soft"},
        {"fault_kind": "signal"},
        {"fault_kind": "signal", "message": "SIGTERM"},
        {"fault_kind": "dead", "signature": "dead"},
        {"fault_kind": "exception", "exc_type": "builtins.OSError"},
        {"fault_kind": "exception", "signature": "exit:\u00b2"},
        {},
        {"fault_kind": "exception", "signature": 5},
        {"fault_kind": "exception", "signature": ["a"], "exc_type": "KeyError"},
    ],
)
def test_loop_breaker_and_report_give_a_fault_one_signature(tmp_path, fields) -> None:
    from nvrx.report import build_report

    (tmp_path / "monitor-n0-p77-abcd.jsonl").write_text(json.dumps(_fault_event(**fields)) + "\n")
    record = last_fault(tmp_path, 77)
    [failure] = build_report(tmp_path, sacct=False, workers=1).failures
    assert record is not None and record.signature == failure.signature


def test_a_hang_fault_breaks_the_loop_as_a_hang_not_as_its_exit_code(tmp_path) -> None:
    (tmp_path / "monitor-n0-p77-abcd.jsonl").write_text(
        json.dumps({"kind": "fault", "fault_kind": "hang_soft"}) + "\n"
    )
    policy = RestartPolicy(100, 2, Budget().spend)
    killed = ExitStatus(None, signal.SIGKILL)
    assert policy.decide(0, killed, last_fault(tmp_path, 77)).decision is Decision.RESTART
    verdict = policy.decide(0, killed, last_fault(tmp_path, 77))
    assert verdict.decision is Decision.GIVE_UP and verdict.signature == "hang (soft timeout)"


def test_last_fault_skips_lines_nested_too_deep_and_odd_numbers(tmp_path) -> None:
    path = tmp_path / "app-n0-p77-abcd.jsonl"
    deep = b"[" * 5000 + b"]" * 5000
    odd = {"kind": "fault", "fault_kind": "exception", "signature": "exit:\u00b2"}
    path.write_bytes(json.dumps(odd).encode() + b"\n" + deep + b"\n")
    assert last_fault(tmp_path, 77) == LastFault("exit code unknown", "exception")
    fifo = tmp_path / "app-n0-p78-abcd.jsonl"
    os.mkfifo(fifo)  # never ends a read: passed over
    assert last_fault(tmp_path, 78) is None


def _fault(rank: int, rnd: int, wall: float, kind: str, signature: str) -> dict:
    return {"kind": "fault", "rank": rank, "node": 0, "host": "h", "round": rnd, "wall": wall,
            "fault_kind": kind, "signature": signature}  # fmt: skip


def test_a_wrapper_that_gave_up_is_blamed_on_its_last_rounds_first_fault_of_this_run(
    tmp_path,
) -> None:
    """The run before a requeue reached round 7; this run's Wrapper gave up in round 2. The
    line names this run's round-2 fault, neither the earlier run's nor a RestartAbort
    (``exit``) or a peer's collateral error."""
    import json

    from nvrx.supervisor.policy import Verdict, last_round_fault, root_cause_line

    lines = {
        "wrapper-n0-p1-a.jsonl": [_fault(0, 7, 100.0, "exception", "KeyError at old.py:1 in f")],
        "wrapper-n0-p2-b.jsonl": [
            _fault(1, 1, 205.0, "exception", "RuntimeError at train.py:9 in step"),
            _fault(1, 2, 210.0, "exception", "RuntimeError at train.py:9 in step"),
            _fault(1, 3, 212.0, "exit", "nvrx.inprocess.exception.RestartAbort at x.py:1 in f"),
        ],
        "wrapper-n0-p3-c.jsonl": [
            _fault(0, 2, 210.1, "peer", "DistNetworkError at y.py:1 in g"),
            _fault(0, 2, 209.9, "hang_soft", "hang_soft"),
        ],
    }
    for name, events in lines.items():
        (tmp_path / name).write_text("".join(json.dumps(e) + "\n" for e in events))
    fault = last_round_fault(tmp_path, since=200.0)
    assert fault is not None and (fault["rank"], fault["round"], fault["signature"]) == (
        0, 2, "hang_soft"
    )  # fmt: skip
    assert last_round_fault(tmp_path)["signature"] == "KeyError at old.py:1 in f"
    verdict = Verdict(Decision.STOP, "a rank stopped the job", "RestartAbort", exit_code=12)
    line = root_cause_line(verdict, 1, 0, tmp_path, fault)
    assert line.startswith("root cause: rank 0 on node 0 (h): hang_soft (a rank stopped the job)")
    assert line.endswith(f"nvrx-report {tmp_path} tells the rest")


def test_the_report_knows_the_supervisors_exit_codes() -> None:
    from nvrx.report import job_facts, suspects

    assert job_facts.RANK_STOPPED_EXIT == ExitCode.RANK_STOPPED
    assert suspects.EXCLUDED_EXIT == ExitCode.EXCLUDED
