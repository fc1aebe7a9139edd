"""A job leaves its records and nothing else: in ``/dev/shm``, in its job directory.

A 2-node x 2-rank Wrapper job (``examples/train_demo.py``) under local supervisors
ends three ways: it finishes, it is cancelled (SIGTERM to every supervisor, as
``scancel`` through ``srun``), or every process of it is SIGKILLed at once (as when
SLURM kills a job's cgroup). ``/dev/shm`` is listed before and after; the job's
directory after. Records are the events (``*.jsonl``), each rank start's files under
``ranks/`` (its error file and routed streams) and the job's secret (kept for a
requeued run). A killed job also leaves its store's snapshot: the store host cannot
tell its own kill from the loss of its node, after which a successor needs that file;
the job's next run starts without it and removes it.

A Wrapper job without a supervisor, killed the same way (its ranks and their monitors),
leaves nothing in ``/dev/shm`` either, and its node agent, whose session the kill did
not reach, ends by itself, saying why in its log beside the events.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
from helpers_wrapper_paths import launch, node_agents
from test_supervisor_local import REPO, Job
from test_wrapper import FAST

from nvrx.supervisor.job_secret import SECRET_FILE
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

DEMO = [sys.executable, str(REPO / "examples" / "train_demo.py")]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _new_shm(before: set[str]) -> set[str]:
    """What appeared in ``/dev/shm`` since ``before``, once what the processes of tests
    running beside this one hold for a moment (a ``multiprocessing`` semaphore) had time to
    go."""
    new: set[str] = set()

    def settled() -> bool:
        new.clear()
        new.update(_shm() - before)
        return not new

    try:
        wait_until("no new entry in /dev/shm", settled, 60)
    except AssertionError:
        pass
    return new


def _not_records(job_dir: Path, killed: bool = False) -> list[str]:
    """Files and empty directories under ``job_dir`` that are not records."""
    found = []
    for root, dirs, files in os.walk(job_dir):
        here = Path(root).relative_to(job_dir)
        found += [f"{here / d}/ (empty)" for d in dirs if not os.listdir(Path(root, d)) and not killed]
        for name in files:
            path = here / name
            if name.endswith(".jsonl") or path.parts[0] == "ranks" or str(path) == SECRET_FILE:
                continue
            if killed and path.parts[0] == "store" and name.startswith("snapshot-run"):
                continue
            found.append(str(path))
    return found


def _job_tree(job: Job) -> list[psutil.Process]:
    procs = []
    for proc in job.procs:
        parent = psutil.Process(proc.pid)
        procs += [parent, *parent.children(recursive=True)]
    return procs


def _run(tmp_path: Path, end: str) -> tuple[Job, list[int | None]]:
    command = [*DEMO, "--steps", "400" if end != "finished" else "20", "--step-time", "0.05",
               "--run-dir", str(tmp_path / "run")]  # fmt: skip
    job = Job(tmp_path, 2, 2, command, "--max-restarts", "2")
    if end != "finished":
        wait_until("every rank to train", lambda: len(job.events("child_start")) == 4, 120)
        job.wait_for_beat(1)
        if end == "cancelled":
            for proc in job.procs:
                os.kill(proc.pid, signal.SIGTERM)
        else:
            for proc in _job_tree(job):
                proc.kill()
    return job, job.wait(120)


@pytest.mark.parametrize("end", ["finished", "cancelled", "killed"])
def test_a_supervised_job_leaves_only_its_records(tmp_path, end) -> None:
    before = _shm()
    job, codes = _run(tmp_path, end)
    expected = {"finished": [0, 0], "cancelled": [143, 143], "killed": [-9, -9]}[end]
    assert codes == expected, job.output()
    assert _new_shm(before) == set()
    job_dir = job.log_dir / job.job_id
    assert (job_dir / SECRET_FILE).exists() and list(job_dir.glob("*.jsonl"))
    assert _not_records(job_dir, killed=end == "killed") == [], job.output()


def test_a_killed_wrapper_job_without_a_supervisor_leaves_nothing_and_its_agent_ends(tmp_path):
    before = _shm()
    ranks = launch(tmp_path, 2, wrapper=FAST, scenario="no_hang_protection", fault_ranks=[0, 1],
                   block_s=120, hosts=["a", "a"])  # fmt: skip
    try:
        wait_until("both ranks in their function", lambda: len(list(tmp_path.glob("entered-0-*"))) == 2, 60)
        wait_until("the host's node agent", lambda: len(node_agents(tmp_path / "logs")) == 1, 60)
        [agent] = node_agents(tmp_path / "logs")
        for proc in ranks.procs:
            rank = psutil.Process(proc.pid)
            for member in [rank, *rank.children(recursive=True)]:
                if member.pid != agent.pid:
                    member.kill()
        assert psutil.wait_procs([agent], timeout=60)[1] == [], "the node agent outlived its job"
        assert _new_shm(before) == set()
        [log] = tmp_path.glob("logs/*/node_agent-a.log")  # no monitor log file: beside the events
        said = log.read_text()
        assert "node agent of host a serving" in said and "the job is gone" in said, said
    finally:
        ranks.kill()
        for agent in node_agents(tmp_path / "logs"):
            agent.kill()
