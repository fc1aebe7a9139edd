"""Launcher-side monitoring with real supervisors and the two example scripts (gloo, no Wrapper).

Each test runs ``examples/ft_heartbeats.py`` or ``examples/ft_sections.py``
on 2 local nodes x 2 ranks under ``nvrx-supervise``. In the hang tests rank 1
(node 0) hangs once, a step ahead of its peers (which then wait for it in the
next all_reduce): its supervisor must declare it hung within the timeout plus
1 s, record its stack (the injected ``hang()`` frame) in a ``hang`` event and
in ``nvrx-report``, and every rank of both nodes must restart together, for one
unit of the budget; the job must complete. Computed timeouts are saved in the
checkpoints: the restarted processes must put them back in force. Then
workload control, non-retryable failures and job-wide restarts after an exception.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
from test_node_loss import kill_tree
from test_supervisor_local import REPO, Job, script

from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

HEARTBEATS = [sys.executable, str(REPO / "examples" / "ft_heartbeats.py")]
SECTIONS = [sys.executable, str(REPO / "examples" / "ft_sections.py")]
# A generous safety factor: computed timeouts must not fire on a busy 2-core machine.
COMMON = ("--max-restarts", "4", "--grace-period", "2", "--ft-safety-factor", "60")


def _run(tmp_path, command, *options):
    job = Job(tmp_path, 2, 2, [*command, "--step-time", "0.2"], *COMMON, *options)
    codes = job.wait(240)
    assert codes == [0, 0], job.output()
    return job


def _one_job_restart(job):
    decisions = job.events("restart_decision")
    assert [(d["scope"], d["decision"], d["budget_left"]) for d in decisions] == [("job", "restart", 3)], job.output()
    starts = sorted((e["global_rank"], e["attempt"]) for e in job.events("child_start"))
    assert starts == [(r, a) for r in range(4) for a in (0, 1)], job.output()


def _hang_of_rank_1(job, timeout):
    hangs = [e for e in job.events("hang") if e["rank"] == 1]
    assert len(hangs) == 1, job.output()
    hang = hangs[0]
    assert hang["timeout"] == timeout, hang
    assert hang["stale_s"] >= hang["limit_s"], hang  # never declared before its timeout ran out
    assert "in hang" in hang["stack"] and "ft_common.py" in hang["stack"], hang["stack"]
    return hang


def _report(job) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job.log_dir / job.job_id), "--format", "json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_a_missed_heartbeat_is_caught_and_computed_timeouts_survive_the_restart(tmp_path):
    job = _run(
        tmp_path, [*HEARTBEATS, "--calc-after", "3", "--hang", "1:8", "--checkpoint-dir", str(tmp_path / "ck")],
        "--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", "30",
    )  # fmt: skip
    hang = _hang_of_rank_1(job, "heartbeat")
    _one_job_restart(job)
    sets = {(e["rank"], e["source"]): e["timeouts"] for e in job.events("timeouts_set")}
    computed = sets[(1, "computed")]
    assert computed["heartbeat"] < 30 and "heartbeat" in computed["computed"], sets
    assert hang["limit_s"] == computed["heartbeat"]  # the computed timeout caught the hang
    assert sets[(1, "restored")] == computed, sets  # the restarted process restored it
    assert sets[(0, "restored")] == sets[(0, "computed")], sets
    report = _report(job)
    failures = {f["signature"]: f for f in report["failures"]}
    assert 1 in failures["hang (heartbeat timeout)"]["ranks"], failures
    assert "signal SIGKILL" not in failures, failures  # the hang explains the kill
    stacks = [h["stack"] for h in report["hangs"] if h["rank"] == 1]
    assert stacks and "in hang" in stacks[0], report["hangs"]


@pytest.mark.parametrize(
    ("where", "timeout", "options"),
    [
        ("step", "section", ("--ft-rank-section-timeouts", "step:4,checkpoint:30", "--ft-rank-out-of-section-timeout", "30")),
        ("outside", "out_of_section", ("--ft-rank-section-timeouts", "step:30,checkpoint:30", "--ft-rank-out-of-section-timeout", "4")),
    ],
)  # fmt: skip
def test_a_hang_in_a_section_or_outside_every_section_is_caught(tmp_path, where, timeout, options):
    job = _run(
        tmp_path, [*SECTIONS, "--hang", f"1:6:{where}", "--checkpoint-dir", str(tmp_path / "ck")], *options
    )  # fmt: skip
    hang = _hang_of_rank_1(job, timeout)
    assert hang["limit_s"] == 4, hang
    assert hang["section"] == ("step" if where == "step" else None), hang
    _one_job_restart(job)
    report = _report(job)
    assert any(h["rank"] == 1 and "in hang" in (h["stack"] or "") for h in report["hangs"]), report["hangs"]


@pytest.mark.parametrize(
    ("fault", "options"),
    [
        (["--fail", "1:6"], ()),
        (["--hang", "1:6"], ("--ft-rank-heartbeat-timeout", "5")),
    ],
    ids=["exception", "hang"],
)
def test_any_failed_restarts_every_rank_of_every_node_once(tmp_path, fault, options):
    # 2 nodes x 2 ranks, no Wrapper: the default policy (auto) restarts the job as a whole.
    job = Job(
        tmp_path, 2, 2, [*HEARTBEATS, *fault, "--checkpoint-dir", str(tmp_path / "ck")],
        *COMMON, *options,
    )  # fmt: skip
    assert job.wait(240) == [0, 0], job.output()
    decisions = job.events("restart_decision")
    assert len(decisions) == 1, job.output()  # one decision for the job, not one per rank
    assert decisions[0]["scope"] == "job" and decisions[0]["decision"] == "restart"
    assert decisions[0]["budget_left"] == 3  # --max-restarts 4: one unit spent
    starts = sorted((e["global_rank"], e["attempt"]) for e in job.events("child_start"))
    assert starts == [(r, a) for r in range(4) for a in (0, 1)], job.output()
    phases = [(e["node"], e["phase"]) for e in job.events("job_restart")]
    for node in (0, 1):
        assert [p for n, p in phases if n == node] == ["stopping", "ready", "started"], phases
    # no process of the old epoch is left to meet a new one: every old child ended, then every
    # slot was ready, before any slot started its children again (one host: one clock)
    walls = {(e["node"], e["phase"]): e["wall"] for e in job.events("job_restart") if e["epoch"] == 1}
    ready = [walls[(node, "ready")] for node in (0, 1)]
    started = [walls[(node, "started")] for node in (0, 1)]
    old_ends = [e["wall"] for e in job.events("child_exit") if e["attempt"] == 0]
    new_starts = [e["wall"] for e in job.events("child_start") if e["attempt"] == 1]
    assert len(old_ends) == len(new_starts) == 4, job.output()
    assert max(old_ends) < max(ready) < min(started) and max(ready) < min(new_starts), walls
    # the claimer names the failure it saw first (peers fail at nearly the same moment)
    causes = [e["cause"] for e in job.events("job_restart") if e.get("cause")]
    assert causes and all(c == causes[0] for c in causes), causes  # one announced cause
    cause = causes[0]
    assert cause["rank"] in range(4) and cause["node"] == cause["rank"] // 2, cause
    assert cause["signature"] == decisions[0]["signature"], cause
    # the report tells it as one job-wide restart, caused by that failure
    summary = (report := _report(job))["summary"]
    assert summary["ranks"] == 4 and summary["restarts"]["job_wide"] == 1, summary
    assert summary["training_time_s"] > 0 and summary["goodput"] > 0, summary
    rows = [(r["outcome"], r["cause"], r["first_rank"], r["first_node"]) for r in report["timeline"]]
    (first, last) = rows
    assert last == ("completed", None, None, None), rows
    assert first[0] == "restart" and first[2:] == (cause["rank"], cause["node"]), rows
    # The report names the rank's own exception (from its files) where the supervisor could
    # only see how the process ended: an exit code, or SIGABRT when torch aborts at exit.
    told = cause["signature"]
    by_end = told.startswith(("exit code", "signal "))
    assert first[1] == told or (by_end and first[1].startswith("RuntimeError at ")), rows


def test_ranks_stopped_between_their_saves_resume_the_examples_from_one_step(tmp_path):
    # A job-wide restart can stop rank 0 after its save of step 5 and rank 1 before its own:
    # the example's ranks must agree on step 0, or they run different numbers of all_reduces.
    ck = tmp_path / "ck"
    ck.mkdir()
    saved = {"rank0.json": 5, "rank0.prev.json": 0, "rank1.json": 0}
    for name, step in saved.items():
        (ck / name).write_text(json.dumps({"step": step, "weights": [0.0] * 4, "ft": {}}))
    job = Job(tmp_path, 1, 2, [*HEARTBEATS, "--steps", "12", "--checkpoint-dir", str(ck)], *COMMON)
    assert job.wait(240) == [0], job.output()
    assert not job.events("restart_decision"), job.output()
    steps = {path.name: json.loads(path.read_text())["step"] for path in ck.glob("*.json")}
    assert steps == {"rank0.json": 10, "rank0.prev.json": 5, "rank1.json": 10, "rank1.prev.json": 5}, steps


def _stops(job):
    return {e["node"]: e["reason"] for e in job.events("job_stop")}


def test_shutdown_workload_stops_every_node_with_exit_0(tmp_path):
    job = Job(tmp_path, 2, 1, [*HEARTBEATS, "--control", "1:3:ShutdownWorkload", "--steps", "400"], *COMMON)
    assert job.wait(240) == [0, 0], job.output()
    [control] = job.events("workload_control")
    assert (control["rank"], control["action"]) == (1, "ShutdownWorkload")
    assert control["description"] == "asked by rank 1 at step 3"
    stops = _stops(job)
    assert "rank 1 asked to shut the workload down: asked by rank 1 at step 3" in stops[1], stops
    assert "node 1 stopped the job" in stops[0], stops
    assert not job.events("restart_decision"), job.output()  # a stop, not a failure


def test_exclude_this_node_takes_the_node_out_as_a_lost_node(tmp_path):
    # 2 nodes, no spare: the job cannot go on without node 1, so it stops as for a lost node.
    job = Job(tmp_path, 2, 1, [*HEARTBEATS, "--control", "1:3:ExcludeThisNode", "--steps", "400"], *COMMON)
    codes = job.wait(240)
    assert codes == [8, 10], job.output()  # node 0: node lost, no spare; node 1: excluded
    [control] = job.events("workload_control")
    assert (control["rank"], control["action"]) == (1, "ExcludeThisNode")
    [lost] = job.events("node_lost")
    assert (lost["lost_slot"], lost["seen_by"], lost["action"]) == (1, 1, "stop"), lost
    assert lost["silent_s"] == 0.0  # declared by itself, not after --node-timeout


def test_exclude_this_node_with_a_spare_restarts_the_job_on_the_spare(tmp_path):
    # 2 nodes + 1 spare: node 1 leaves, the spare takes its node rank, and, as the ranks of a
    # plain script cannot go on without it, every rank restarts with the spare's, at full size.
    job = Job(
        tmp_path, 3, 1, [*HEARTBEATS, "--control", "1:3:ExcludeThisNode", "--steps", "30",
                         "--step-time", "0.2", "--checkpoint-dir", str(tmp_path / "ck")],
        *COMMON, "--spare-nodes", "1",
    )  # fmt: skip
    codes = job.wait(240)
    assert codes == [0, 10, 0], job.output()  # node 1 excluded; node 0 and the spare finish
    [lost] = job.events("node_lost")
    assert (lost["lost_slot"], lost["action"], lost["replaced_by"]) == (1, "spare", 2), lost
    [takeover] = job.events("node_takeover")
    assert (takeover["node"], takeover["node_rank"]) == (2, 1), takeover
    causes = [e["cause"] for e in job.events("job_restart") if e.get("cause")]
    lost_cause = {"rank": 1, "node": 1, "signature": "node lost", "streak": [None, 0]}  # none yet
    assert causes and all(c == lost_cause for c in causes), causes
    assert not [d for d in job.events("restart_decision")], job.output()  # no budget spent
    done = [e for e in job.events("child_exit") if e["exit_code"] == 0]
    assert sorted((e["node"], e["global_rank"]) for e in done) == [(0, 0), (2, 1)], job.output()
    assert "rank 1: done" in job.output() and "rank 0: done" in job.output()


def test_a_frozen_node_of_a_plain_script_is_replaced_and_every_rank_restarts(tmp_path):
    # Node 1 freezes (its sockets stay open: rank 0 blocks in all_reduce, it does not fail);
    # its peers declare it lost after --node-timeout, the spare takes its node rank, and the
    # declaring slot restarts every rank of the job with the spare's.
    job = Job(
        tmp_path, 3, 1, [*HEARTBEATS, "--steps", "40", "--step-time", "0.2",
                         "--checkpoint-dir", str(tmp_path / "ck")],
        *COMMON, "--spare-nodes", "1", "--node-timeout", "3", "--node-heartbeat", "0.5",
    )  # fmt: skip
    try:
        wait_until("a checkpoint of rank 1", (tmp_path / "ck" / "rank1.json").exists, 120, state=job.output)
        job.wait_for_beat(1)
        frozen = psutil.Process(job.procs[1].pid)
        for proc in [frozen, *frozen.children(recursive=True)]:
            proc.suspend()
        codes = [job.procs[slot].wait(200) for slot in (0, 2)]
    finally:
        kill_tree(job.procs[1].pid)
        job.wait(10)
    assert codes == [0, 0], job.output()
    [lost] = job.events("node_lost")
    assert (lost["lost_slot"], lost["action"], lost["replaced_by"]) == (1, "spare", 2), lost
    causes = [e["cause"] for e in job.events("job_restart") if e.get("cause")]
    lost_cause = {"rank": 1, "node": 1, "signature": "node lost", "streak": [None, 0]}  # none yet
    assert causes and all(c == lost_cause for c in causes), causes
    assert not job.events("restart_decision"), job.output()  # a node loss spends no budget
    starts = sorted((e["node"], e["global_rank"], e["attempt"]) for e in job.events("child_start"))
    assert [x for x in starts if x[0] == 0] == [(0, 0, 0), (0, 0, 1)], starts  # restarted once
    # the spare runs rank 1 (started at its takeover, and again by the restart if that came later)
    assert {(n, r) for n, r, a in starts if n != 0 and a > 0} == {(2, 1)}, starts
    started = [e["node"] for e in job.events("job_restart") if e["phase"] == "started"]
    assert sorted(started) == [0, 2], started  # one job-wide restart, the spare in it
    assert "rank 1: done" in job.output() and "rank 0: done" in job.output()
    [loss] = _report(job)["node_losses"]  # over when that restart started the spare's rank too
    assert loss["recovered_wall"] == max(e["wall"] for e in job.events("job_restart") if e["phase"] == "started")
    assert loss["recovery_s"] > 0 and loss["world_size"] == 2, loss


HANG_IGNORING_SIGTERM = """\
from nvrx.fault_tolerance import RankMonitorClient
client = RankMonitorClient()
client.init_workload_monitoring()
for _ in range(3):
    client.send_heartbeat()
if RANK == 1 and RESTART == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
client.shutdown_workload_monitoring()
"""


def test_a_hung_rank_that_ignores_the_termination_signal_is_killed_after_the_grace_period(tmp_path):
    # only the hang watch ends it (min-healthy: no job-wide restart stops the others)
    grace = 2.0
    job = Job(tmp_path, 1, 2, script(tmp_path, HANG_IGNORING_SIGTERM),
              "--ft-restart-policy", "min-healthy", "--ft-rank-termination-signal", "SIGTERM",
              "--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", "2",
              "--grace-period", str(grace), "--max-restarts", "1")  # fmt: skip
    assert job.wait(120) == [0], job.output()
    [hang] = job.events("hang")
    assert hang["rank"] == 1, hang
    [killed] = [e for e in job.events("child_exit") if e["global_rank"] == 1 and e["attempt"] == 0]
    assert killed["signal"] == "SIGKILL", killed  # SIGTERM, ignored, then SIGKILL
    assert killed["wall"] - hang["wall"] >= grace, (hang, killed)  # not at once
    again = [e for e in job.events("child_exit") if e["global_rank"] == 1 and e["attempt"] == 1]
    assert [e["exit_code"] for e in again] == [0], job.output()


def test_a_non_retryable_failure_stops_the_job_at_its_first_occurrence(tmp_path):
    patterns = tmp_path / "patterns.txt"
    patterns.write_text("# errors a restart will not fix\nNo such file or directory\ninjected failure on rank\n")
    job = Job(
        tmp_path, 2, 1, [*HEARTBEATS, "--fail", "1:3", "--steps", "400"], *COMMON,
        "--ft-non-retryable-exception-file", str(patterns),
    )  # fmt: skip
    codes = job.wait(240)
    assert codes == [11, 11], job.output()
    [event] = job.events("non_retryable")
    assert event["global_rank"] == 1 and event["pattern"] == "injected failure on rank"
    assert event["line"] == "RuntimeError: injected failure on rank 1 at step 3"
    assert event["source"] == "error file"  # written by torch's @record in the example
    # no process restarts. Node 0's rank fails too (its peer is gone); its supervisor may
    # decide a restart before node 1's stop reaches it, and the stop then wins
    assert {(e["node"], e["attempt"]) for e in job.events("child_start")} == {(0, 0), (1, 0)}, job.output()
    assert all(d["node"] == 0 for d in job.events("restart_decision")), job.output()
    assert not [e for e in job.events("job_restart") if e["phase"] == "started"], job.output()
    stops = _stops(job)
    assert "'injected failure on rank'" in stops[1] and "node 1 stopped the job" in stops[0], stops
    report = _report(job)
    assert "injected failure on rank" in report["summary"]["reason"], report["summary"]
