"""``nvrx.submit`` on submitit's local executor (no SLURM): results, and a warning that requeues.

Real processes: submitit's local controller, the node task, ``nvrx-supervise``
and its children. The local controller sends the warning signal
``signal_delay_s`` before ``timeout_min`` and reruns the task when it exits 144,
which is how submitit emulates a requeue without SLURM.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nvrx.events import read_dir
from nvrx.submission.submit import submit


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


@pytest.mark.timeout(120)
def test_local_submit_returns_every_rank(tmp_path: Path) -> None:
    job = submit(
        rank_and_value, args=(7,), folder=tmp_path, cluster="local", nproc_per_node=2, timeout_min=2
    )
    assert job.results(timeout=100) == [(0, 7, "1"), (1, 7, "1")]
    assert job.result() == (0, 7, "1")
    assert job.log_dir == tmp_path / "nvrx_logs" / job.job_id
    summary = job.report(sacct=False).to_dict()["summary"]
    assert summary["outcome"] == "completed"
    assert summary["restarts"]["requeue"] == 0


@pytest.mark.timeout(180)
def test_local_warning_checkpoints_requeues_and_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # the warning comes 45 s before the 1-minute limit, i.e. ~15 s after the start
    job = submit(
        train_until_warned,
        args=(str(ckpt), 5),
        folder=tmp_path,
        cluster="local",
        nproc_per_node=2,
        timeout_min=1,
        signal_delay_s=45,
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
