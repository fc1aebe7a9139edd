"""The demo job with the in-process Wrapper under 2 local supervisors x 2 ranks (issue 4).

Two real jobs of ``examples/train_demo.py`` under ``nvrx-supervise``, each run
once per module:

* ``killed``: rank 2 SIGKILLs itself. Its supervisor starts a replacement
  process; the three peers restart in-process (same pids), wait for it, and
  the job finishes with all 4 ranks.
* ``raised_and_hung``: rank 1 raises, later rank 3 hangs in ``time.sleep``.
  Both cost an in-process restart only: no process ends before the job does.

After each fault the ranks resume from the step they kept in memory, the replacement
of the killed rank from a peer's: no step they finished is trained again, where the
file checkpoint (every 5 steps) would lose up to 4.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_supervisor_local import DEMO, Job, _alive

from nvrx.report import Report, build_report

STEPS = 40
KILLED_RANK = 2  # node 1, local rank 0
KILL_STEP = 12
RAISE_RANK, RAISE_STEP = 1, 8  # resumes from step 7 kept in memory (the file has step 5)
HANG_RANK, HANG_STEP = 3, 22  # resumes from step 21 (the file has step 20)


@dataclass
class DemoRun:
    codes: list[int | None]
    output: str
    events: list[dict]
    report: Report
    job_dir: Path

    def of(self, kind: str, component: str | None = None) -> list[dict]:
        return [
            e
            for e in self.events
            if e["kind"] == kind and (component is None or e["component"] == component)
        ]

    def pids_of_rank(self) -> dict[int, set[int]]:
        """Pids that wrote training-side events (app, wrapper), per rank."""
        pids: dict[int, set[int]] = defaultdict(set)
        for e in self.events:
            if e["component"] in ("app", "wrapper") and e["rank"] is not None:
                pids[e["rank"]].add(e["pid"])
        return dict(pids)

    def child_starts(self) -> dict[int, list[dict]]:
        """Supervisor ``child_start`` events per global rank, in order."""
        starts: dict[int, list[dict]] = defaultdict(list)
        for e in sorted(self.of("child_start", "supervisor"), key=lambda e: e["wall"]):
            starts[e["global_rank"]].append(e)
        return dict(starts)


def _run_demo(tmp: Path, faults: str, *demo_args: str) -> DemoRun:
    """The demo job (Wrapper on, its default) with ``faults`` in NVRX_DEMO_FAULTS."""
    command = [
        sys.executable, str(DEMO), "--steps", str(STEPS), "--checkpoint-every", "5",
        "--step-time", "0.05", "--soft-timeout", "5", "--hard-timeout", "15", *demo_args,
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setitem(os.environ, "NVRX_DEMO_FAULTS", faults)
        job = Job(tmp, 2, 2, command, "--max-restarts", "8", "--grace-period", "3")
    codes = job.wait(240)
    job_dir = job.log_dir / job.job_id
    return DemoRun(
        codes, job.output(), job.events(component=None), build_report(job_dir, sacct=False),
        job_dir,
    )  # fmt: skip


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    return _run_demo(tmp_path_factory.mktemp("kill"), f"kill:{KILL_STEP}:{KILLED_RANK}")


@pytest.fixture(scope="module")
def raised_and_hung(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    faults = f"exception:{RAISE_STEP}:{RAISE_RANK},hang:{HANG_STEP}:{HANG_RANK}"
    return _run_demo(tmp_path_factory.mktemp("exc_hang"), faults)


def same_state_on_every_rank(progress: list[dict], ranks: int, from_round: int) -> None:
    """After each step of the rounds from ``from_round`` on, every rank's model and optimizer
    state has one digest: a rank that restored from memory or received the state from a
    peer holds the same bits as the others."""
    digests: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    for e in progress:
        if e["round"] is not None and e["round"] >= from_round:
            digests[(e["round"], e["step"])][e["rank"]] = e["state_digest"]
    assert digests
    for (rnd, step), by_rank in digests.items():
        assert len(by_rank) == ranks and len(set(by_rank.values())) == 1, (rnd, step, by_rank)


def _completed_at_full_size(run: DemoRun) -> None:
    assert run.codes == [0, 0], run.output
    final = {e["rank"] for e in run.of("progress", "app") if e["step"] == STEPS}
    assert final == {0, 1, 2, 3}, run.output
    assert f"finished {STEPS} steps at world size 4" in run.output
    assert not run.of("ranks_terminated")
    assert {e["outcome"] for e in run.of("wrapper_end", "wrapper")} == {"completed"}
    assert len(run.of("wrapper_end", "wrapper")) == 4  # a killed process writes none


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["killed", "raised_and_hung"])
def test_the_demo_gives_its_groups_a_timeout_below_the_hard_timeout(
    which: str, request: pytest.FixtureRequest
) -> None:
    """The demo follows docs/abort.md: its gloo groups time out before the Wrapper's hard
    timeout, so the Wrapper has no advice to give (its warning names the logger)."""
    run: DemoRun = request.getfixturevalue(which)
    assert "WARNING nvrx.inprocess.round_run" in run.output  # the Wrapper's warnings reach it
    assert "nvrx.inprocess.gloo_abort" not in run.output


# -- a SIGKILLed child: one process restart, the peers restart in-process -------------


@pytest.mark.timeout(300)
def test_killed_child_is_replaced_and_the_job_completes_with_all_4_ranks(killed: DemoRun) -> None:
    _completed_at_full_size(killed)
    exits = killed.of("child_exit", "supervisor")
    dead = [e for e in exits if e["signal"] is not None or e["exit_code"] != 0]
    assert [(e["global_rank"], e["signal"]) for e in dead] == [(KILLED_RANK, "SIGKILL")]
    restarts = [e for e in killed.of("restart_decision") if e["decision"] == "restart"]
    assert [(e["node"], e["local_rank"], e["signature"]) for e in restarts] == [
        (1, 0, "signal SIGKILL")
    ]
    starts = killed.child_starts()
    assert [e["attempt"] for e in starts[KILLED_RANK]] == [0, 1]
    # the replacement ran to the end: it exited 0 like everyone else
    replacement = starts[KILLED_RANK][1]["child_pid"]
    assert any(e["child_pid"] == replacement and e["exit_code"] == 0 for e in exits)


@pytest.mark.timeout(60)
def test_peers_of_the_killed_child_restart_in_process_only(killed: DemoRun) -> None:
    starts = killed.child_starts()
    pids = killed.pids_of_rank()
    peers = [r for r in range(4) if r != KILLED_RANK]
    for rank in peers:
        assert len(starts[rank]) == 1, starts[rank]  # never restarted by its supervisor
        assert pids[rank] == {starts[rank][0]["child_pid"]}, (rank, pids[rank])
    assert pids[KILLED_RANK] == {e["child_pid"] for e in starts[KILLED_RANK]}

    death = [e for e in killed.of("fault", "monitor") if e["fault_kind"] == "dead"]
    assert [e["rank"] for e in death] == [KILLED_RANK]
    kill_round = death[0]["round"]
    for rank in peers:
        ends = [
            (e["round"], e["outcome"])
            for e in killed.of("round_end", "wrapper")
            if e["rank"] == rank
        ]
        assert ends == [(kill_round, "restart"), (kill_round + 1, "completed")], (rank, ends)
        rejoined = [e for e in killed.of("rejoin", "wrapper") if e["rank"] == rank]
        assert [e["rank_rejoined"] for e in rejoined] == [KILLED_RANK]

    # the replacement joined the peers' next round instead of starting a new generation
    replacement = starts[KILLED_RANK][1]["child_pid"]
    rounds = [e["round"] for e in killed.of("round_start", "wrapper") if e["pid"] == replacement]
    assert rounds == [kill_round + 1]
    assert [e["pid"] for e in killed.of("rejoin", "wrapper") if e.get("rank_rejoined") is None] == [
        replacement
    ]


@pytest.mark.timeout(60)
def test_report_counts_one_process_restart_and_one_in_process_round(killed: DemoRun) -> None:
    s = killed.report.summary
    assert (s.restarts.process, s.restarts.in_process, s.restarts.requeue) == (1, 1, 0)
    assert s.processes_relaunched == 1  # only the killed rank; its peers stayed
    assert s.outcome == "completed"
    first = killed.report.timeline[0]
    # the peers waited for the restart instead of reporting their failed collective as a fault
    assert (first.first_rank, first.first_node, first.fault_kind) == (KILLED_RANK, 1, "dead")
    # the replacement's row tells how long its peers waited for it, as the phases do
    (row,) = killed.report.process_restarts
    # the peers' waits, in the round they were in (the replacement's own wait for admission,
    # before it had a round, is not theirs: it may be the longest)
    waits = [
        e["duration_s"] for e in killed.events
        if e.get("phase") == "rejoin_wait" and e.get("round") is not None
    ]  # fmt: skip
    assert row.rejoin_wait_s == first.phases["rejoin_wait"] == max(waits), killed.output


@pytest.mark.timeout(60)
def test_every_fault_resumes_the_same_training_as_if_none_had_happened(
    killed: DemoRun, raised_and_hung: DemoRun
) -> None:
    # The demo's training is deterministic: a restore that was not bit-exact on some rank
    # (the replacement's state from a peer, or a survivor's from memory) changes the
    # averaged gradients, and so every rank's last loss.
    def last_losses(run: DemoRun) -> dict[int, float]:
        return {e["rank"]: e["loss"] for e in run.of("progress", "app") if e["step"] == STEPS}

    assert last_losses(killed) == last_losses(raised_and_hung)
    assert len(last_losses(killed)) == 4


@pytest.mark.timeout(60)
def test_the_replacement_takes_the_kept_state_from_a_peer_and_no_step_is_lost(
    killed: DemoRun,
) -> None:
    restores = [e for e in killed.of("state_restored") if e["round"] > 0]
    assert sorted((e["rank"], e["source"], e["step"]) for e in restores) == [
        (r, "peer" if r == KILLED_RANK else "memory", KILL_STEP - 1) for r in range(4)
    ]
    assert {e["newest_step"] for e in restores} == {KILL_STEP - 1}
    assert not [e for e in killed.of("checkpoint", "app") if e["action"] == "load"]
    (row,) = killed.report.restores
    assert (row.sources, row.step, row.steps_lost) == ({"memory": 3, "peer": 1}, KILL_STEP - 1, 0)
    same_state_on_every_rank(killed.of("progress", "app"), 4, from_round=0)


@pytest.mark.timeout(600)  # its own demo run, and the killed one's where not run yet
def test_without_kept_state_a_fault_resumes_from_the_file_checkpoint(
    tmp_path: Path, killed: DemoRun
) -> None:
    """``--no-kept-state``: every rank loads the last file checkpoint (step 5) after the
    exception at step 8 and trains steps 6 and 7 again, to the same end."""
    run = _run_demo(tmp_path, f"exception:{RAISE_STEP}:{RAISE_RANK}", "--no-kept-state")
    _completed_at_full_size(run)
    assert not run.of("state_restored")
    loads = [(e["rank"], e["step"]) for e in run.of("checkpoint", "app") if e["action"] == "load"]
    assert sorted(loads) == [(r, 5) for r in range(4)], loads
    trained = Counter((e["rank"], e["step"]) for e in run.of("progress", "app"))
    assert {step for (_, step), n in trained.items() if n > 1} == {6, 7}, trained
    assert trained[(RAISE_RANK, RAISE_STEP)] == 1  # the step it raised in did not finish
    last = {e["rank"]: e["loss"] for e in run.of("progress", "app") if e["step"] == STEPS}
    assert last == {e["rank"]: e["loss"] for e in killed.of("progress", "app") if e["step"] == STEPS}


# -- an exception and a hang: in-process restarts only ----------------------------------


@pytest.mark.timeout(300)
def test_exception_and_hang_restart_in_process_without_any_process_restart(
    raised_and_hung: DemoRun,
) -> None:
    run = raised_and_hung
    _completed_at_full_size(run)
    starts = run.child_starts()
    assert {r: [e["attempt"] for e in s] for r, s in starts.items()} == {r: [0] for r in range(4)}
    exits = run.of("child_exit", "supervisor")
    assert sorted((e["global_rank"], e["exit_code"], e["signal"]) for e in exits) == [
        (r, 0, None) for r in range(4)
    ]
    assert not [e for e in run.of("restart_decision") if e["decision"] == "restart"]
    pids = run.pids_of_rank()
    assert {r: pids[r] for r in range(4)} == {r: {starts[r][0]["child_pid"]} for r in range(4)}

    for rank in range(4):
        ends = [
            (e["round"], e["outcome"]) for e in run.of("round_end", "wrapper") if e["rank"] == rank
        ]
        assert ends == [(0, "restart"), (1, "restart"), (2, "completed")], (rank, ends)
        restores = [
            (e["round"], e["source"], e["step"], e["newest_step"])
            for e in run.of("state_restored")
            if e["rank"] == rank
        ]
        assert restores == [
            (0, "none", None, None),
            (1, "memory", RAISE_STEP - 1, RAISE_STEP - 1),
            (2, "memory", HANG_STEP - 1, HANG_STEP - 1),
        ], (rank, restores)  # the step before the fault, not the file's
        assert not [e for e in run.of("checkpoint", "app") if e["action"] == "load"]
    same_state_on_every_rank(run.of("progress", "app"), 4, from_round=0)
    rows = [(r.round, r.sources, r.step, r.steps_lost) for r in run.report.restores]
    assert rows == [
        (1, {"memory": 4}, RAISE_STEP - 1, 0),
        (2, {"memory": 4}, HANG_STEP - 1, 0),
    ], run.report.to_text()

    s = run.report.summary
    assert (s.restarts.in_process, s.restarts.process, s.restarts.requeue) == (2, 0, 0)
    assert s.processes_relaunched == 0


@pytest.mark.timeout(60)
def test_exception_is_recorded_with_its_rank_and_message(raised_and_hung: DemoRun) -> None:
    raised = [
        e
        for e in raised_and_hung.of("fault", "wrapper")
        if (e.get("exc_type") or "").endswith("InjectedFault")
    ]
    assert [(e["rank"], e["round"]) for e in raised] == [(RAISE_RANK, 0)]
    assert raised[0]["message"] == f"injected exception at step {RAISE_STEP} on rank {RAISE_RANK}"
    assert raised_and_hung.report.timeline[0].first_rank == RAISE_RANK


@pytest.mark.timeout(60)
def test_hang_event_has_the_stack_of_the_function_that_slept(raised_and_hung: DemoRun) -> None:
    # Peers waiting for the hung rank keep showing progress (the demo waits for its
    # collectives in slices), so only the hung rank times out, and its stack is written.
    hangs = raised_and_hung.of("hang", "monitor")
    assert [(e["rank"], e["round"], e["timeout"]) for e in hangs] == [(HANG_RANK, 1, "soft")]
    stack = hangs[0]["stack"]
    assert "fault_injection.py" in stack and " in sleep_forever" in stack, stack
    assert " in at_step" in stack and "train_demo.py" in stack
    row = raised_and_hung.report.timeline[1]
    assert (row.first_rank, row.fault_kind) == (HANG_RANK, "hang_soft")


# -- a silent rank: its supervisor, which collects the node's heartbeats, finds it --------

SILENT_RANK, SILENT_STEP = 1, 10  # node 0, local rank 1


@pytest.fixture(scope="module")
def silenced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    tmp = tmp_path_factory.mktemp("silent")
    try:
        yield _run_demo(tmp, f"silent:{SILENT_STEP}:{SILENT_RANK}")
    finally:  # a run that went wrong must not leave the frozen processes behind
        for pids in tmp.glob("logs/*/run/silenced.pids"):
            for pid in map(int, pids.read_text().split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_rank_whose_monitor_falls_silent_is_found_by_its_supervisor_and_replaced(
    silenced: DemoRun,
) -> None:
    # The rank and its monitor process are frozen (SIGSTOP): no heartbeat reaches the
    # supervisor of node 0, which takes the rank out of its round, kills it, and starts a
    # replacement that rejoins; no monitor of a peer watches heartbeats in the store.
    run = silenced
    _completed_at_full_size(run)
    silent = [e for e in run.of("fault") if e["fault_kind"] == "unresponsive"]
    assert [(e["component"], e["node"], e["rank_node"], e["origin_rank"]) for e in silent] == [
        ("supervisor", 0, 0, SILENT_RANK)
    ], silent
    assert silent[0]["message"].startswith("no heartbeat for "), silent
    assert float(silent[0]["message"].split()[3]) >= 10.0  # the demo's heartbeat_timeout
    exits = [e for e in run.of("child_exit", "supervisor") if e["global_rank"] == SILENT_RANK]
    assert [e["signal"] for e in exits][0] == "SIGKILL", exits
    restarts = [e for e in run.of("restart_decision") if e["decision"] == "restart"]
    assert [(e["node"], e["local_rank"], e["signature"]) for e in restarts] == [
        (0, 1, "unresponsive (no heartbeat)")
    ]
    starts = run.child_starts()
    assert [e["attempt"] for e in starts[SILENT_RANK]] == [0, 1]
    replacement = starts[SILENT_RANK][1]["child_pid"]
    rejoined = [e["pid"] for e in run.of("rejoin", "wrapper") if e.get("rank_rejoined") is None]
    assert rejoined == [replacement]
    assert run.report.summary.restarts.process == 1
    # the frozen rank and its frozen monitor were both ended, by the supervisor, not by this
    # test's clean-up (which runs after)
    frozen = [int(p) for p in (run.job_dir / "run" / "silenced.pids").read_text().split()]
    assert len(frozen) == 2 and not _alive(set(frozen)), frozen
