"""Stragglers named while the job runs, with real supervisors and ``examples/ft_heartbeats.py``.

2 local nodes x 2 ranks; each rank records the time of its step's compute (not of its wait
in the all_reduce) through ``RankMonitorClient.timed_step``. ``--slow STEP:FACTOR`` slows the
compute of the ranks whose supervisor was started with ``FT_EXAMPLE_SLOW_NODE=1``: one node
30 % slower from step 50 must be named by a ``straggler`` event within 30 steps, and no
other; a healthy job and a job whose every rank turns 2x slower must name no one. With
``--straggler-action exclude`` and a spare, the slow node leaves, the spare takes its place
and its ranks' step times are back to the job's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_supervisor_local import REPO, Job

pytestmark = pytest.mark.timeout(300)

HEARTBEATS = [sys.executable, str(REPO / "examples" / "ft_heartbeats.py")]
COMMON = ("--max-restarts", "4", "--grace-period", "2", "--ft-safety-factor", "60")
SLOW = {"FT_EXAMPLE_SLOW_NODE": "1"}
SLOW_FROM = 50


def _job(tmp_path, nnodes: int, steps: int, slow: str | None, node_env, *options: str) -> Job:
    command = [*HEARTBEATS, "--steps", str(steps), "--step-time", "0.2", "--checkpoint-every", "10",
               "--checkpoint-dir", str(tmp_path / "ck")]  # fmt: skip
    if slow is not None:
        command += ["--slow", slow]
    return Job(tmp_path, nnodes, 2, command, *COMMON, *options, node_env=node_env)


def _stragglers(job: Job) -> list[tuple]:
    return [(e["of"], e["who"], e["state"]) for e in job.events("straggler")]


def test_a_node_30_percent_slower_is_named_within_30_steps(tmp_path):
    job = _job(tmp_path, 2, 110, f"{SLOW_FROM}:1.3", {1: SLOW})
    assert job.wait(240) == [0, 0], job.output()
    named = [e for e in job.events("straggler") if e["state"] == "slow"]
    nodes = [e for e in named if e["of"] == "node"]
    assert [(e["who"], e["ranks"], e["action"]) for e in nodes] == [(1, [2, 3], "report")], named
    assert {e["who"] for e in named if e["of"] == "rank"} <= {2, 3}, named  # nobody on node 0
    node = nodes[0]
    assert node["step"] <= SLOW_FROM + 30, node  # steps its ranks had made (from 0) when named
    assert 20 <= node["slower_pct"] <= 45, node  # 30 % slower compute, measured as such
    assert node["score"] < node["threshold"] and node["source"] == "record_step", node
    report = _report(job)  # the report names it too, slow until the end, not failed
    [row] = [r for r in report["stragglers"] if r["of"] == "node"]
    assert (row["slot"], row["recovered"], row["step"]) == (1, False, node["step"]), row
    suspects = {s["node"]: s for s in report["suspects"]}
    assert suspects[1]["slow"] == 1 and suspects[1]["faults"] == 0, suspects
    assert any("slow, not failed" in line for line in suspects[1]["evidence"]), suspects[1]


def _report(job: Job) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job.log_dir / job.job_id), "--format", "json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    ("slow", "node_env"),
    [(None, {}), (f"{SLOW_FROM}:2.0", {0: SLOW, 1: SLOW})],
    ids=["healthy", "whole-job-2x-slower"],
)
def test_a_healthy_job_or_one_slowing_down_as_a_whole_names_no_one(tmp_path, slow, node_env):
    job = _job(tmp_path, 2, 110, slow, node_env)
    assert job.wait(240) == [0, 0], job.output()
    assert _stragglers(job) == []


def test_excluding_a_slow_node_hands_its_place_to_a_spare(tmp_path):
    # named by step 80, node 1's ranks then train 60 steps and more on the spare: over twice
    # the steps a verdict takes to change there, were they not judged afresh
    job = _job(tmp_path, 3, 140, f"{SLOW_FROM}:1.3", {1: SLOW}, "--spare-nodes", "1",
               "--straggler-action", "exclude")  # fmt: skip
    assert job.wait(280) == [0, 10, 0], job.output()  # node 1 left; node 0 and the spare finish
    [node] = [e for e in job.events("straggler") if e["of"] == "node" and e["state"] == "slow"]
    assert (node["who"], node["action"]) == (1, "exclude"), node
    [lost] = job.events("node_lost")
    assert (lost["lost_slot"], lost["action"], lost["replaced_by"]) == (1, "spare", 2), lost
    # the ranks it held, named slow there, run on the spare at the job's pace: judged afresh
    # there, nothing is said of them; their rows end when their node left
    named = {e["who"] for e in job.events("straggler") if e["of"] == "rank" and e["slot"] == 1}
    assert named == {2, 3} and not [e for e in job.events("straggler") if e["slot"] == 2], job.events("straggler")
    rows = [r for r in _report(job)["stragglers"] if r["of"] == "rank"]
    assert sorted((r["who"], r["end_reason"]) for r in rows) == [(2, "node left"), (3, "node left")], rows
