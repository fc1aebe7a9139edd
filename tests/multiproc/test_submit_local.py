"""``nvrx.submit`` on submitit's local executor (no SLURM): results, and a warning that requeues.

Real processes: submitit's local controller, the node task, ``nvrx-supervise``
and its children. The local controller sends the warning signal
``signal_delay_s`` before ``timeout_min`` and reruns the task when it exits 144,
which is how submitit emulates a requeue without SLURM.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from submitit.helpers import Checkpointable

from nvrx.events import read_dir
from nvrx.submission.job import JobFailed
from nvrx.submission.submit import Executor, submit
from nvrx.supervisor.exit_codes import ExitCode
from tests.support.ports import free_ports


def rank_and_value(value: int) -> tuple[int, int, str]:
    return int(os.environ["RANK"]), value, os.environ["NVRX_SUPERVISED"]


def train_until_warned(ckpt_dir: str, steps_after_resume: int) -> dict:
    """Train until the warning, checkpoint; once resumed, finish a few steps later."""
    import nvrx

    rank = int(os.environ["RANK"])
    path = Path(ckpt_dir) / f"rank{rank}.json"
    start = json.loads(path.read_text())["step"] if path.exists() else 0
    if start:
        nvrx.record_checkpoint(path, start, action="load")
    step = start
    while not (start and step >= start + steps_after_resume):
        if nvrx.preemption_requested():
            path.write_text(json.dumps({"step": step}))
            nvrx.record_checkpoint(path, step)
            return {"rank": rank, "stopped_at": step}
        step += 1
        time.sleep(0.05)
    return {"rank": rank, "resumed_from": start, "final": step}


class CountsSteps(Checkpointable):
    """Trains without ever looking at the warning; its state (the step) is what it checkpoints."""

    def __init__(self) -> None:
        self.step = 0
        self.runs = 0

    def __call__(self, steps_after_resume: int) -> dict:
        self.runs += 1
        start = self.step
        while self.runs == 1 or self.step < start + steps_after_resume:
            self.step += 1
            time.sleep(0.05)
        return {"rank": int(os.environ["RANK"]), "runs": self.runs, "resumed_from": start,
                "final": self.step}  # fmt: skip


class RefusesRequeue(CountsSteps):
    def __submitit_checkpoint__(self, steps_after_resume: int) -> None:
        return None  # submitit's way to say: do not requeue


def _warned_run_exits(events: list[dict]) -> list[dict]:
    """The child exits of the first run of a local job (the supervisor of its first task)."""
    first = next(e["pid"] for e in events if e["kind"] == "supervisor_start")  # by wall time
    return [e for e in events if e["kind"] == "child_exit" and e["pid"] == first]


@pytest.mark.timeout(120)
def test_local_submit_returns_every_rank_and_takes_the_ports_it_is_given(tmp_path: Path) -> None:
    master, store = free_ports(2)
    job = submit(
        rank_and_value, args=(7,), folder=tmp_path, cluster="local", nproc_per_node=2,
        timeout_min=2, supervise_args=["--master-port", str(master), f"--store-port={store}"],
    )  # fmt: skip
    assert job.results(timeout=100) == [(0, 7, "1"), (1, 7, "1")]
    events, _ = read_dir(job.log_dir)
    [start] = [e for e in events if e["kind"] == "supervisor_start"]
    assert start["store"].endswith(f":{store}"), start  # not the ports of the job id
    assert job.result() == (0, 7, "1")
    assert job.log_dir == tmp_path / "nvrx_logs" / job.job_id
    # submitit's files of the job, the return values among them, are the user's alone
    assert stat.S_IMODE(job.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(job.job.paths.result_pickle.stat().st_mode) == 0o600
    summary = job.report(sacct=False).to_dict()["summary"]
    assert summary["outcome"] == "completed"
    assert summary["restarts"]["requeue"] == 0


@pytest.mark.timeout(180)
def test_local_warning_checkpoints_requeues_and_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # the warning comes 35 s before the 1-minute limit, i.e. ~25 s after the start: time for
    # the ranks of a loaded machine to start and take a step first
    job = submit(
        train_until_warned,
        args=(str(ckpt), 5),
        folder=tmp_path,
        cluster="local",
        nproc_per_node=2,
        timeout_min=1,
        signal_delay_s=35,
    )
    results = job.results(timeout=150)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["resumed_from"] > 0, result  # the second run started from the checkpoint
        assert result["final"] == result["resumed_from"] + 5
    events, _ = read_dir(job.log_dir)
    kinds = [e["kind"] for e in events]
    assert kinds.count("preempt_signal") == 1
    requeues = [e for e in events if e["kind"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["count"] == 1
    assert [e["action"] for e in events if e["kind"] == "checkpoint"].count("save") == 2
    summary = job.report(sacct=False).to_dict()["summary"]
    assert summary["restarts"]["requeue"] == 1


@pytest.mark.timeout(180)
def test_local_checkpointable_is_checkpointed_requeued_and_resumed(tmp_path: Path) -> None:
    """submitit's Checkpointable: on the warning rank 0's state is checkpointed, every rank
    stops at once (exit 0, not killed at the end of the window), and the requeued run of
    every rank starts from that state."""
    job = submit(
        CountsSteps(),
        args=(5,),
        folder=tmp_path,
        cluster="local",
        nproc_per_node=2,
        timeout_min=1,
        signal_delay_s=40,  # the warning ~20 s after the start
    )
    results = job.results(timeout=150)
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["runs"] == 2, result
        assert result["resumed_from"] > 0 and result["final"] == result["resumed_from"] + 5
    assert results[0]["resumed_from"] == results[1]["resumed_from"]  # rank 0's checkpoint
    events, _ = read_dir(job.log_dir)
    assert [e["count"] for e in events if e["kind"] == "requeue"] == [1]
    stopped = _warned_run_exits(events)
    assert [(e["exit_code"], e["signal"]) for e in stopped] == [(0, None), (0, None)]
    saves = [e for e in events if e["kind"] == "checkpoint" and e["action"] == "save"]
    assert [e["rank"] for e in saves] == [0]
    assert job.report(sacct=False).to_dict()["summary"]["restarts"]["requeue"] == 1


@pytest.mark.timeout(150)
def test_local_checkpoint_returning_none_ends_the_job_unrequeued(tmp_path: Path) -> None:
    job = submit(
        RefusesRequeue(),
        args=(5,),
        folder=tmp_path,
        cluster="local",
        timeout_min=1,
        signal_delay_s=50,
    )
    with pytest.raises(JobFailed, match="checkpoint returned None"):
        job.result(timeout=120)
    events, _ = read_dir(job.log_dir)
    assert not [e for e in events if e["kind"] == "requeue"]
    stops = [e["reason"] for e in events if e["kind"] == "job_stop"]
    assert stops == ["not requeued: the submitted callable's checkpoint returned None (no requeue)"]
    assert [(e["exit_code"], e["signal"]) for e in _warned_run_exits(events)] == [(0, None)]
    assert len({e["pid"] for e in events if e["kind"] == "supervisor_start"}) == 1  # one run


def fails_on_rank_1() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("bad batch")


@pytest.mark.timeout(150)
def test_a_failed_job_names_its_node_exit_code_and_events_folder(tmp_path: Path) -> None:
    job = submit(
        fails_on_rank_1, folder=tmp_path, cluster="local", nproc_per_node=2, timeout_min=2,
        supervise_args=["--max-restarts", "0"],
    )  # fmt: skip
    with pytest.raises(JobFailed) as failed:
        job.results(timeout=120)
    message = str(failed.value)
    assert f"on node 0 of job {job.job_id} exited {int(ExitCode.BUDGET_EXHAUSTED)}" in message
    assert str(job.log_dir) in message, message
    assert "rank 1 failed:\nTraceback" in message and "ValueError: bad batch" in message
    outcome = job.report(sacct=False).to_dict()["summary"]["outcome"]
    assert outcome == f"failed (exit code {int(ExitCode.BUDGET_EXHAUSTED)})"


def trains_then_returns_a_lock(runs: str) -> dict:
    with open(runs, "a") as fh:
        fh.write("ran\n")  # the expensive training
    return {"model": "ok", "lock": threading.Lock()}


@pytest.mark.timeout(150)
def test_an_unpicklable_result_fails_the_job_once_saying_why(tmp_path: Path) -> None:
    """Before: the rank exited 1, the supervisor re-ran the finished training until its loop
    breaker, and JobFailed did not say why."""
    runs = tmp_path / "runs"
    job = submit(
        trains_then_returns_a_lock, args=(str(runs),), folder=tmp_path / "jobs", cluster="local",
        timeout_min=2,
    )  # fmt: skip
    with pytest.raises(JobFailed) as failed:
        job.result(timeout=120)
    message = str(failed.value)
    assert f"exited {int(ExitCode.RANK_STOPPED)}" in message, message
    assert "rank 0 failed:\ncannot pickle the return value of rank 0 (dict)" in message, message
    assert runs.read_text() == "ran\n"  # trained once


@pytest.mark.timeout(150)
def test_a_module_only_the_submitter_imports_and_the_nodes_own_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callable and the class of its result come from a folder only the submitter's
    sys.path has; the node's setup sets its own PYTHONPATH. Before: the node task could not
    unpickle the result (ModuleNotFoundError), and the node's PYTHONPATH was replaced."""
    source = tmp_path / "src_only"
    source.mkdir()
    module = f"nvrx_local_metrics_{os.getpid()}"
    (source / f"{module}.py").write_text(
        "import os\n"
        "class Metrics:\n"
        "    def __init__(self, loss):\n"
        "        self.loss = loss\n"
        "        self.pythonpath = os.environ.get('PYTHONPATH', '')\n"
        "def train():\n"
        "    return Metrics(0.25)\n"
    )
    monkeypatch.syspath_prepend(str(source))
    metrics = __import__(module)
    job = submit(
        metrics.train, folder=tmp_path / "jobs", cluster="local", timeout_min=2,
        local_setup=["export PYTHONPATH=/opt/node-only-libs"],
    )  # fmt: skip
    result = job.result(timeout=120)
    assert isinstance(result, metrics.Metrics) and result.loss == 0.25
    paths = result.pythonpath.split(os.pathsep)
    assert paths[0] == str(source) and paths[-1] == "/opt/node-only-libs", paths


@pytest.mark.timeout(150)
def test_local_map_array_runs_one_job_per_element(tmp_path: Path) -> None:
    executor = Executor(tmp_path, cluster="local", nproc_per_node=2, timeout_min=2)
    jobs = executor.map_array(rank_and_value, [3, 4])
    assert len(jobs) == 2 and jobs[0].job_id != jobs[1].job_id
    assert [job.results(timeout=120) for job in jobs] == [
        [(0, 3, "1"), (1, 3, "1")],
        [(0, 4, "1"), (1, 4, "1")],
    ]
    for job in jobs:
        assert job.log_dir == tmp_path / "nvrx_logs" / job.job_id
        events, _ = read_dir(job.log_dir)
        assert {e["job"] for e in events} == {job.job_id}  # each job's events in its own dir
        summary = job.report(sacct=False).to_dict()["summary"]
        assert summary["outcome"] == "completed"
