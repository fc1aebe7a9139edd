"""The report does not depend on the order in which files and partial summaries are merged.

Worker processes finish in any order, and each merges its chunk of files in its
own order. Here the rank files of a job are shuffled, cut into chunks, and the
chunks' summaries merged as a random tree; every such report must be the one
read in file order. The tied job is made of ties: faults at the same instant
(one rank's own fault and its monitor's, two hosts' first faults, one signature
on two hosts with different details) and two hangs of one round at one time.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_report_fixtures import HANG_STACK, JOB, Host, Proc, write_standard_job
from test_report_output_files import _death_job
from test_report_vocabulary import _demo_like_job

from nvrx.report import build as build_module
from nvrx.report import build_report
from nvrx.report.build import aggregate_files, run_starts_of
from nvrx.report.job_summary import JobSummary
from nvrx.report.summarize import Filters, summarize_file

SHUFFLES = 12


def _tied_job(log_dir: Path) -> None:
    a, b = Host("node-a", 0, mono0=100.0), Host("node-b", 1, mono0=900.0)
    ranks = {r: Proc(log_dir, (a, b)[r // 2], "wrapper", rank=r) for r in range(4)}
    monitors = {r: Proc(log_dir, (a, b)[r // 2], "monitor", rank=r) for r in (0, 1, 3)}
    for p in ranks.values():
        p.round(0).at(1.0, "round_start", world_size=4)
    # rank 0: its own exception and its monitor's hang fault at one instant of one boot
    ranks[0].at(5.0, "fault", fault_kind="exception", exc_type="ValueError", message="own")
    monitors[0].round(0).at(5.0, "fault", fault_kind="hang_soft", traceback=HANG_STACK)
    # ranks 1 (node-a) and 2 (node-b): one signature at one wall time, different details
    ranks[1].at(5.0, "fault", fault_kind="exception", exc_type="KeyError", message="on a")
    ranks[2].at(5.0, "fault", fault_kind="exception", exc_type="KeyError", message="on b")
    for p in ranks.values():
        p.at(6.0, "round_end", outcome="restart")
        p.round(1).at(7.0, "round_start", world_size=4)
    # round 1: no fault; two ranks on two hosts hang at one time
    monitors[1].round(1).at(20.0, "hang", timeout="soft", stack=HANG_STACK)
    monitors[3].round(1).at(20.0, "hang", timeout="hard", stack="Thread 0x1:\n")
    for p in [*ranks.values(), *monitors.values()]:
        p.close()


def _shuffled(seed: int) -> Callable[..., JobSummary]:
    """``build._aggregate`` that merges the rank files in an order drawn from ``seed``."""

    def aggregate(files: list[Path], filters: Filters, workers: int, progress: object) -> JobSummary:
        rng = random.Random(seed)
        node_files = [p for p in files if build_module._node_file(p)]
        rank_files = [p for p in files if not build_module._node_file(p)]
        summaries = [summarize_file(p, filters) for p in node_files]
        job = JobSummary.starting(run_starts_of(summaries))
        for summary in summaries:
            job.add(summary)
        rng.shuffle(rank_files)
        k = rng.randint(1, len(rank_files))
        parts = [aggregate_files(rank_files[i::k], filters, job.run_starts) for i in range(k)]
        rng.shuffle(parts)
        while len(parts) > 1:  # a random merge tree
            i = rng.randrange(len(parts) - 1)
            left, right = parts.pop(i), parts.pop(i)
            left.merge(right)
            parts.insert(i, left)
        job.merge(parts[0])
        return job

    return aggregate


def _as_json(log_dir: Path) -> dict[str, Any]:
    data = build_report(log_dir, sacct=False, workers=1).to_dict()
    data.pop("generated_at")
    return json.loads(json.dumps(data, sort_keys=True, default=str))


@pytest.mark.parametrize(
    "make",
    [_tied_job, write_standard_job, _demo_like_job, _death_job],
    ids=["tied", "standard", "demo", "death"],
)
def test_any_merge_order_gives_the_same_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[Path], Any]
) -> None:
    log_dir = tmp_path / JOB
    make(log_dir)
    in_file_order = _as_json(log_dir)
    for seed in range(SHUFFLES):
        monkeypatch.setattr(build_module, "_aggregate", _shuffled(seed))
        shuffled = _as_json(log_dir)
        differ = sorted(k for k in in_file_order if in_file_order[k] != shuffled[k])
        assert not differ, f"seed {seed}: {differ}"


def test_the_tied_job_breaks_ties_by_wall_host_and_pid(tmp_path: Path) -> None:
    _tied_job(tmp_path / JOB)
    report = build_report(tmp_path / JOB, sacct=False, workers=1)
    first, second = report.timeline
    # same wall time on both hosts: the lower host; on it rank 0's faults tie, "ValueError" first
    assert (first.first_rank, first.first_host, first.cause) == (0, "node-a", "ValueError")
    assert (second.first_rank, second.first_host, second.ordering) == (1, "node-a", "hang")
    key_error = next(f for f in report.failures if f.signature == "KeyError")
    assert (key_error.count, key_error.message) == (2, "on a")
