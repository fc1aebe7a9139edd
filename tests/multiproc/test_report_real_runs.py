"""nvrx-report on the logs of real runs: local supervisors running the demo job, and the Wrapper.

Each job runs once per module (they take tens of seconds; a job whose finished rank
died at exit runs once more, see ``_supervised_demo``); the tests then read
its log directory as a user would, with ``build_report`` and the ``nvrx-report``
command, and check the report against the faults that were injected.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers_inprocess import FAST, Ranks, free_port_pair
from helpers_inprocess import HERE as RANK_PROGRAM
from test_demo_generations import load_demo
from test_supervisor_local import DEMO, Job

from nvrx.events.reader import read_dir
from nvrx.report import Report, build_report

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))  # the report's own schema validator lives there
from test_report_cli import SCHEMA_PATH, check_schema  # noqa: E402

STEPS = 30
FAULT_STEP = 12
JOB_WAIT_S = 200
#: A test that runs a job (itself or by its fixture) may run it twice.
FIXTURE_RUN_S = 2 * JOB_WAIT_S + 80
ALREADY_FINISHED = load_demo().ALREADY_FINISHED


@dataclass
class Run:
    """A finished job: where its events are, how long it took, how it ended."""

    job_dir: Path
    elapsed_s: float  # measured around the whole job, from outside
    codes: list[int | None]
    output: str
    report: Report


def _supervised_demo(tmp: Path, fault: str, *options: str) -> Run:
    """2 local supervisors x 2 ranks of the demo job, with one fault injected.

    Rarely, gloo aborts a process at exit after training finished; the supervisor
    replaces it and the replacement finds the training done. That second fault is
    not the one injected, and the report rightly counts it: the job runs once more.
    """
    run = _supervised_demo_once(tmp / "run", fault, *options)
    if not _died_after_the_end(run):
        return run
    return _supervised_demo_once(tmp / "rerun", fault, *options)


def _died_after_the_end(run: Run) -> bool:
    """Whether a replacement found the training already finished (its predecessor died after)."""
    found, _ = read_dir(run.job_dir)
    return any(
        e["kind"] == "process_end" and e.get("reason") == ALREADY_FINISHED for e in found
    )


def _supervised_demo_once(tmp: Path, fault: str, *options: str) -> Run:
    """One run of the job in ``tmp``, a new directory."""
    tmp.mkdir()
    started = time.monotonic()
    job = Job(
        tmp, 2, 2,
        [sys.executable, str(DEMO), "--steps", str(STEPS), "--checkpoint-every", "5",
         "--step-time", "0.05", "--no-wrapper", "--fault", fault],
        "--max-restarts", "8", "--grace-period", "3", *options,
    )  # fmt: skip
    codes = job.wait(JOB_WAIT_S)
    elapsed = time.monotonic() - started
    job_dir = job.log_dir / job.job_id
    return Run(job_dir, elapsed, codes, job.output(), build_report(job_dir, sacct=False))


# The per-process story: each failed rank restarts alone and its peers fail in turn.
PER_PROCESS = ("--ft-restart-policy", "min-healthy")


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Rank 3 (node 1, local rank 1) SIGKILLs itself at step 12."""
    return _supervised_demo(tmp_path_factory.mktemp("kill"), f"kill:{FAULT_STEP}:3", *PER_PROCESS)


@pytest.fixture(scope="module")
def raised(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Rank 2 (node 1, local rank 0) raises ``InjectedFault`` at step 12."""
    return _supervised_demo(tmp_path_factory.mktemp("exc"), f"exception:{FAULT_STEP}:2", *PER_PROCESS)


def _check_time_accounting(run: Run, checkpointed: bool = False) -> None:
    """Times add up; ``checkpointed``: the demo saved every 10 steps and failed at step 12,
    so the fault threw work away."""
    s = run.report.summary
    assert s.ranks == 4
    assert 0 < s.wall_time_s <= run.elapsed_s, (s.wall_time_s, run.elapsed_s)
    assert 0 < s.training_time_s <= s.wall_time_s
    assert s.training_time_s * s.ranks <= s.ranks * s.wall_time_s
    assert s.goodput is not None and 0 < s.goodput <= 1
    ledger = s.time_ledger  # goodput is the training kept: lost work since a checkpoint is not
    assert s.goodput == pytest.approx(ledger.training_s / s.wall_time_s)
    assert ledger.training_s == pytest.approx(
        s.training_time_s - ledger.lost_work_s - ledger.detection_s
    )
    parts = [
        ledger.startup_s, ledger.training_s, ledger.lost_work_s, ledger.detection_s,
        ledger.restart_s, ledger.rejoin_wait_s, ledger.requeue_wait_s, ledger.other_s,
    ]  # fmt: skip
    assert min(parts) >= 0 and math.fsum(parts) == pytest.approx(s.wall_time_s), ledger
    if checkpointed:
        assert ledger.lost_work_known and ledger.lost_work_s > 0, ledger


def _cli_json(job_dir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "nvrx.report.cli", str(job_dir), "--format", "json", "--no-sacct"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(FIXTURE_RUN_S)
@pytest.mark.parametrize("which", ["killed", "raised"])
def test_what_live_ranks_print_is_not_a_failure(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The job's own output as its slurm-<id>.out: the peers' tracebacks (printed by processes
    whose peer fault explains their end) and torch's log lines add no failure to the events'."""
    run: Run = request.getfixturevalue(which)
    out = tmp_path / "slurm-1.out"
    out.write_text(run.output)
    report = build_report(run.job_dir, sacct=False, slurm_output=[out])
    assert report.log_findings == [], [(f.signature, f.printed_by) for f in report.log_findings]
    assert [f.signature for f in report.failures] == [f.signature for f in run.report.failures]


# -- a SIGKILLed rank under the supervisors --------------------------------------------


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_sigkill_names_the_killed_rank_and_its_node(killed: Run) -> None:
    assert killed.codes == [0, 0], killed.output
    r = killed.report
    assert [(row.round, row.outcome) for row in r.timeline] == [(0, "restart"), (1, "completed")]
    first = r.timeline[0]
    assert (first.first_rank, first.first_node, first.cause) == (3, 1, "signal SIGKILL")
    assert first.ordering == "process_exit"
    assert first.peer_notified == 3  # ranks 0-2 stopped only because rank 3 died
    assert [(f.signature, f.ranks, f.nodes) for f in r.failures] == [("signal SIGKILL", [3], [1])]


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_sigkill_counts_one_process_restart_and_the_job_completes(killed: Run) -> None:
    s = killed.report.summary
    assert (s.restarts.process, s.restarts.in_process, s.restarts.requeue) == (1, 0, 0)
    assert s.processes_relaunched == 4  # without the Wrapper, every rank is relaunched
    assert (s.runs, s.rounds, s.nodes) == (1, 2, 2)
    assert s.outcome == "completed"
    why = {p.rank: p.explained_by for p in killed.report.process_restarts}
    assert why == {0: "peer", 1: "peer", 2: "peer", 3: None}
    suspect = {n.node: (n.first_failures, n.deaths) for n in killed.report.suspects}
    assert suspect == {1: (1, 1)}
    assert killed.report.exclude is None  # one host: nothing to compare it with


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_sigkill_time_accounting_is_consistent_with_the_wall_time(killed: Run) -> None:
    _check_time_accounting(killed, checkpointed=True)


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_cli_json_of_a_real_run_follows_the_schema(killed: Run) -> None:
    data = _cli_json(killed.job_dir)
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["summary"]["restarts"]["process"] == 1
    assert data["timeline"][0]["first_rank"] == 3 and data["timeline"][0]["first_node"] == 1
    assert data["timeline"][0]["outcome_from"] == "inferred"


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_table_output_tells_the_story(killed: Run) -> None:
    text = killed.report.to_text("table")
    assert "rank 3 on" in text and "(node 1)" in text
    assert "signal SIGKILL" in text
    assert "process restarts          1 (4 processes relaunched, peers included)" in text


# -- the same kill under the default policy: one job-wide restart ---------------------------


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_a_kill_under_the_default_policy_is_one_job_wide_restart(tmp_path: Path) -> None:
    run = _supervised_demo(tmp_path, f"kill:{FAULT_STEP}:3")
    assert run.codes == [0, 0], run.output
    r, s = run.report, run.report.summary
    assert (s.restarts.job_wide, s.restarts.process, s.restarts.in_process) == (1, 0, 0)
    assert s.processes_relaunched == 4 and (s.rounds, s.ranks) == (2, 4)
    first, last = r.timeline
    assert (first.outcome, first.cause, first.first_rank, first.first_node) == ("restart", "signal SIGKILL", 3, 1)
    assert first.ordering == "job_restart" and first.outcome_from == "job_restart"
    assert first.peer_notified == 3 and first.restart_latency_s is not None
    assert last.outcome == "completed"
    # the killed rank's end is the failure; its peers' ends are the restart's, not failures
    assert [(f.signature, f.ranks, f.nodes) for f in r.failures] == [("signal SIGKILL", [3], [1])]
    why = {p.rank: p.explained_by for p in r.process_restarts}
    assert why[3] is None and {why[0], why[1], why[2]} <= {"peer", "job_restart"}, why
    assert {n.node: (n.first_failures, n.deaths) for n in r.suspects} == {1: (1, 1)}
    _check_time_accounting(run, checkpointed=True)
    assert "job-wide restarts         1" in r.to_text("table")


# -- an exception under the supervisors --------------------------------------------------


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_exception_names_its_rank_node_and_signature(raised: Run) -> None:
    assert raised.codes == [0, 0], raised.output
    r = raised.report
    assert [(row.round, row.outcome) for row in r.timeline] == [(0, "restart"), (1, "completed")]
    first = r.timeline[0]
    assert (first.first_rank, first.first_node, first.fault_kind) == (2, 1, "exception")
    assert first.ordering == "monotonic"  # one host boot: monotonic clocks decide
    # the demo writes "InjectedFault@fault_injection.py:87"; the report reads it (with its
    # traceback) in the failure vocabulary's spelling
    assert first.cause is not None and first.cause.startswith(
        "fault_injection.InjectedFault at fault_injection.py:"
    )
    assert first.cause.endswith(" in at_step")
    assert first.also_failed == []
    (failure,) = r.failures  # the rank's exit and its peers' exits are not failures of their own
    assert failure.signature == first.cause and failure.ranks == [2] and failure.nodes == [1]
    assert failure.exc_type is not None and failure.exc_type.endswith("InjectedFault")
    assert failure.message == f"injected exception at step {FAULT_STEP} on rank 2"
    assert failure.traceback is not None and "raise InjectedFault" in failure.traceback


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_exception_counts_one_process_restart(raised: Run) -> None:
    s = raised.report.summary
    assert (s.restarts.process, s.restarts.in_process, s.restarts.requeue) == (1, 0, 0)
    assert s.outcome == "completed" and s.reason == "all children ended"
    why = {p.rank: p.explained_by for p in raised.report.process_restarts}
    assert why == {0: "peer", 1: "peer", 2: "fault", 3: "peer"}
    _check_time_accounting(raised, checkpointed=True)
    check_schema(raised.report.to_dict(), json.loads(SCHEMA_PATH.read_text()))


# -- damaged and partial logs of a real run ---------------------------------------------


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _copy_events(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for path in src.glob("*.jsonl"):
        shutil.copy(path, dst / path.name)
    return dst


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_damaged_real_logs_still_tell_the_story(killed: Run, tmp_path: Path) -> None:
    job_dir = _copy_events(killed.job_dir, tmp_path / killed.job_dir.name)
    app = sorted(job_dir.glob("app-n1-*.jsonl"))[-1]
    whole = app.read_bytes()
    app.write_bytes(whole[: len(whole) - 25])  # torn last line, as a kill mid-write leaves it
    with open(sorted(job_dir.glob("supervisor-n0-*.jsonl"))[0], "a") as fh:
        fh.write("not json at all\n[1, 2, 3]\n")
    (job_dir / "store-garbage.jsonl").write_bytes(b"\x00\xff\xfe binary\n")
    before = _digest(job_dir)
    report = build_report(job_dir, sacct=False)
    assert _digest(job_dir) == before  # the report never changes the logs
    assert report.reading.skipped_count >= 4, report.reading.skipped
    first = report.timeline[0]
    assert (first.first_rank, first.first_node, first.cause) == (3, 1, "signal SIGKILL")
    assert report.summary.restarts.process == 1
    assert report.summary.outcome == "completed"


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_logs_cut_short_after_the_kill_read_as_an_unfinished_job(
    killed: Run, tmp_path: Path
) -> None:
    """The logs as they were a moment after the kill: no end events, a job still running."""
    kill = next(p.wall for p in killed.report.process_restarts if p.signal == "SIGKILL" and p.wall)
    job_dir = tmp_path / killed.job_dir.name
    job_dir.mkdir()
    for path in killed.job_dir.glob("*.jsonl"):
        lines = [
            line
            for line in path.read_text().splitlines(keepends=True)
            if json.loads(line)["wall"] <= kill + 0.5
        ]
        (job_dir / path.name).write_text("".join(lines))
    report = build_report(job_dir, sacct=False)
    s = report.summary
    assert s.outcome == "unfinished", (s.outcome, s.reason)
    assert report.timeline[0].first_rank == 3 and report.timeline[0].first_node == 1
    assert report.timeline[-1].outcome == "unfinished"
    assert s.goodput is not None and 0 < s.goodput <= 1


@pytest.mark.timeout(FIXTURE_RUN_S)
def test_logs_of_one_node_only(killed: Run, tmp_path: Path) -> None:
    """Node 1's files lost: the report says what node 0 saw, and invents no failure."""
    job_dir = tmp_path / killed.job_dir.name
    job_dir.mkdir()
    for path in killed.job_dir.glob("*-n0-*.jsonl"):
        shutil.copy(path, job_dir / path.name)
    report = build_report(job_dir, sacct=False)
    assert report.summary.nodes == 1
    assert report.summary.processes_relaunched == 2
    assert report.summary.restarts.process == 0  # node 0's ranks only stopped because of a peer
    assert report.failures == []
    assert report.summary.outcome == "completed"


# -- the in-process Wrapper ----------------------------------------------------------------


def _launch_nodes(tmp: Path, nnodes: int, nproc: int, **params: object) -> Ranks:
    """Like ``helpers_inprocess.launch``, with ranks spread over ``nnodes`` simulated nodes."""
    port = free_port_pair()
    ranks = Ranks(tmp)
    (tmp / "params.json").write_text(json.dumps(params))
    world = nnodes * nproc
    for rank in range(world):
        env = dict(os.environ)
        for name in ("NVRX_STORE_HOST", "NVRX_STORE_PORT", "NVRX_SUPERVISED", "NVRX_RESTART_COUNT"):
            env.pop(name, None)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % nproc),
            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            NVRX_NODE_RANK=str(rank // nproc), NVRX_NNODES=str(nnodes),
            NVRX_LOG_DIR=str(tmp / "logs"), NVRX_JOB_ID="inproc",
            TORCH_CPP_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        with open(tmp / f"rank-{rank}.log", "wb") as out:
            ranks.procs.append(
                subprocess.Popen(
                    [sys.executable, str(RANK_PROGRAM), str(tmp)],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )
            )  # fmt: skip
    return ranks


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """4 ranks on 2 simulated nodes; rank 2 (node 1) raises in round 0; the Wrapper restarts all."""
    tmp = tmp_path_factory.mktemp("inproc")
    started = time.monotonic()
    ranks = _launch_nodes(tmp, 2, 2, wrapper=FAST, fault="exception", fault_ranks=[2])
    codes = ranks.wait(90)
    elapsed = time.monotonic() - started
    job_dir = tmp / "logs" / "inproc"
    return Run(job_dir, elapsed, codes, ranks.logs(), build_report(job_dir, sacct=False))


@pytest.mark.timeout(150)
def test_in_process_restart_is_counted_and_rank_2_named(in_process: Run) -> None:
    assert in_process.codes == [0, 0, 0, 0], in_process.output
    r = in_process.report
    s = r.summary
    assert (s.restarts.in_process, s.restarts.process, s.restarts.requeue) == (1, 0, 0)
    assert [(row.round, row.outcome, row.outcome_from) for row in r.timeline] == [
        (0, "restart", "wrapper"),
        (1, "completed", "wrapper"),
    ]
    first = r.timeline[0]
    assert (first.first_rank, first.first_node, first.fault_kind) == (2, 1, "exception")
    # Peers blocked in a gloo collective may raise their own "connection closed" before the
    # Wrapper aborts them: those are later faults of other ranks, never the first.
    assert set(first.also_failed) <= {0, 1, 3}
    assert first.peer_notified + len(first.also_failed) == 3
    # the failure vocabulary's spelling: type as Python prints it, innermost user frame
    assert first.cause is not None and first.cause.startswith(
        "RuntimeError at helpers_inprocess.py:"
    )
    assert first.restart_latency_s is not None and first.restart_latency_s >= 0
    assert {"abort", "iteration_barrier"} <= set(first.phases)
    (injected,) = [f for f in r.failures if f.message == "injected fault on rank 2"]
    assert (injected.signature, injected.count) == (first.cause, 1)
    assert injected.ranks == [2] and injected.nodes == [1] and injected.rounds == [0]
    assert s.outcome == "completed" and s.reason == "all 4 ranks completed"


@pytest.mark.timeout(60)
def test_in_process_time_accounting_and_json(in_process: Run) -> None:
    _check_time_accounting(in_process)
    assert not any("call_start/call_end" in note for note in in_process.report.reading.notes)
    data = _cli_json(in_process.job_dir)
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["summary"]["restarts"]["in_process"] == 1
    assert data["timeline"][0]["first_rank"] == 2 and data["timeline"][0]["first_node"] == 1


@pytest.mark.timeout(120)
def test_an_array_elements_slurm_output_file_is_found_from_its_supervisors_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor that runs as element 3 of job array 4242 (SLURM_ARRAY_JOB_ID and
    SLURM_ARRAY_TASK_ID; no other SLURM variable, so that it runs as a local job) records
    both in its ``supervisor_start``: the report reads the element's slurm-4242_3.out from
    there, not element 7's."""
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    array = {"SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "3"}
    job = Job(tmp_path, 1, 1, [sys.executable, "-c", "pass"], node_env={0: array})
    assert job.wait(90) == [0], job.output()
    own, other = tmp_path / "slurm-4242_3.out", tmp_path / "slurm-4242_7.out"
    for path in (own, other):
        path.write_text("starting\n")
    (start,) = job.events("supervisor_start")
    assert (start["slurm_array_job_id"], start["slurm_array_task_id"]) == ("4242", "3")
    report = build_report(job.log_dir / job.job_id, sacct=False)
    assert report.slurm.output_files == [str(own.resolve())]
