"""nvrx-report's *Steps lost per restore*: each round that restored the training state.

Jobs under the in-process Wrapper, one host, written with the real ``EventWriter``:
ranks restore from their kept state (``state_restored``) or load a checkpoint
(``checkpoint``, action=load) in the round after a fault, and report their steps
(``progress``). Times are seconds after ``T0``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_report_cli import SCHEMA_PATH, check_schema
from test_report_fixtures import T0, USER_TRACEBACK, Host, Proc, write_standard_job

from nvrx.report import Report, build_report, summarize, typed_events

HOST = Host("node-a", 0)
HEADING = "Steps lost per restore"


@pytest.fixture(autouse=True, params=["records", "dicts"])
def fold_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: rank files decoded into typed records (with msgspec), and as dicts."""
    if request.param == "records" and not typed_events.RECORD_TYPES:
        pytest.skip("msgspec is not installed (pip install 'nvrx[fast]')")
    if request.param == "dicts":
        monkeypatch.setattr(summarize, "decode_records", lambda data: None)
    return request.param


class Job:
    """``n`` ranks of the Wrapper on one host, round by round."""

    def __init__(self, log_dir: Path, n: int) -> None:
        self.dir = log_dir
        self.ranks = [Proc(log_dir, HOST, "wrapper", rank=r) for r in range(n)]

    def start(self, rnd: int, t: float) -> None:
        for r, p in enumerate(self.ranks):
            p.round(rnd).at(t, "round_start", world_size=len(self.ranks), initial_rank=r)
            p.at(t + 0.01, "call_start", note="enter")

    def progress(self, t: float, steps: range) -> None:
        """Every rank reports each of ``steps``, 0.1 s apart from ``t`` on."""
        for i, step in enumerate(steps):
            for p in self.ranks:
                p.at(t + 0.1 * i, "progress", step=step, loss=1.0 / step)

    def fault(self, t: float, rank: int) -> None:
        """``rank`` raises; the others stop for it; the round ends in a restart."""
        for r, p in enumerate(self.ranks):
            if r == rank:
                p.at(t, "fault", fault_kind="exception", exc_type="ValueError",
                     message="bad batch 17", traceback=USER_TRACEBACK)  # fmt: skip
            else:
                p.at(t + 0.05, "fault", fault_kind="peer", origin_rank=rank)
            p.at(t + 0.5, "round_end", outcome="restart", restart_latency_s=0.5)

    def restored(self, t: float, sources: dict[int, str], step: int | None, newest: int | None) -> None:
        for r, source in sources.items():
            self.ranks[r].at(
                t, "state_restored", source=source, step=step, newest_step=newest, duration_s=0.01
            )

    def close(self, t: float) -> Report:
        for p in self.ranks:
            p.at(t, "call_end", duration_s=1.0)
            p.at(t + 0.01, "round_end", outcome="success")
            p.close()
        return build_report(self.dir, sacct=False, workers=1)


def _facts(report: Report) -> list[tuple[Any, ...]]:
    return [
        (x.run, x.round, x.sources, x.restored, x.step, x.newest_step, x.steps_lost)
        for x in report.restores
    ]


def _section(text: str) -> str:
    """The text of the section, up to the next heading's underline."""
    assert HEADING in text, text
    body = text.split(HEADING, 1)[1].split("\n", 2)[2]  # past the heading's own underline
    return body.split("\n==", 1)[0]


def test_two_in_process_restarts_from_memory_and_a_peer(tmp_path: Path) -> None:
    """Round 1: three ranks restore step 4 from memory, the replacement from a peer; rank 2
    had kept step 5: 1 step lost. Round 2: every rank restores the newest step kept: none."""
    job = Job(tmp_path, 4)
    job.start(0, 1.0)
    job.progress(1.1, range(1, 6))
    job.fault(2.0, rank=1)
    job.start(1, 3.0)
    job.restored(3.1, {0: "memory", 1: "peer", 2: "memory", 3: "memory"}, step=4, newest=5)
    job.progress(3.2, range(5, 9))
    job.fault(4.0, rank=2)
    job.start(2, 5.0)
    job.restored(5.1, dict.fromkeys(range(4), "memory"), step=8, newest=8)
    job.progress(5.2, range(9, 11))
    report = job.close(6.0)

    assert _facts(report) == [
        (0, 1, {"memory": 3, "peer": 1}, True, 4, 5, 1),
        (0, 2, {"memory": 4}, True, 8, 8, 0),
    ]
    first = report.restores[0]
    assert first.wall == pytest.approx(T0 + 3.1)
    assert first.first_rank == 1 and first.cause == report.timeline[0].cause is not None
    assert report.restores[1].first_rank == 2
    section = _section(report.to_text(width=None))
    assert "memory (3 ranks), peer (1 rank)" in section
    assert f"{first.cause} (round 0, rank 1)" in section
    assert "2 restores: 1 step lost in all, at most 1 in one restore" in section
    page = report.to_text("html")
    assert HEADING in page and "memory (3 ranks), peer (1 rank)" in page
    check_schema(json.loads(json.dumps(report.to_dict())), json.loads(SCHEMA_PATH.read_text()))


def test_a_checkpoint_load_after_a_fault_loses_the_steps_since_the_checkpoint(
    tmp_path: Path,
) -> None:
    """No kept state: rank 0 saves step 10, reaches 17 and fails; round 1 loads step 10
    (7 lost), reaches 13 and fails; round 2 loads step 10 again: 3 lost, not the 7 that
    round 1 had lost already. The load at the job's start is no restore."""
    job = Job(tmp_path, 2)
    job.start(0, 1.0)
    job.ranks[0].at(1.05, "checkpoint", path="/ckpt/c.pt", step=0, action="load")
    job.progress(1.1, range(1, 18))
    job.ranks[0].at(2.05, "checkpoint", path="/ckpt/c.pt", step=10, action="save")
    job.fault(3.0, rank=0)
    for rnd, t, reached in ((1, 4.0, 13), (2, 6.0, 12)):
        job.start(rnd, t)
        job.ranks[0].at(t + 0.1, "checkpoint", path="/ckpt/c.pt", step=10, action="load")
        job.progress(t + 0.2, range(11, reached + 1))
        if rnd == 1:
            job.fault(t + 1.0, rank=1)
    report = job.close(8.0)

    assert _facts(report) == [
        (0, 1, {"checkpoint": 1}, True, 10, 17, 7),
        (0, 2, {"checkpoint": 1}, True, 10, 13, 3),
    ]
    section = _section(report.to_text(width=None))
    assert "checkpoint (1 rank)" in section
    assert "2 restores: 10 steps lost in all, at most 7 in one restore" in section


def test_a_checkpoint_callback_restore_and_a_restore_of_nothing(tmp_path: Path) -> None:
    """Round 1: no rank had kept anything; the checkpoint callback restored step 10 after
    progress to 12 (2 lost). Round 2: nothing restored after progress to 11: all 11 lost."""
    job = Job(tmp_path, 2)
    job.start(0, 1.0)
    job.progress(1.1, range(1, 13))
    job.fault(3.0, rank=0)
    job.start(1, 4.0)
    job.restored(4.1, {0: "checkpoint", 1: "checkpoint"}, step=10, newest=None)
    job.progress(4.2, range(11, 12))
    job.fault(5.0, rank=1)
    job.start(2, 6.0)
    job.restored(6.1, {0: "none", 1: "none"}, step=None, newest=None)
    job.progress(6.2, range(1, 3))
    report = job.close(7.0)

    assert _facts(report) == [
        (0, 1, {"checkpoint": 2}, True, 10, 12, 2),
        (0, 2, {"none": 2}, False, None, 11, 11),
    ]
    section = _section(report.to_text(width=None))
    assert "checkpoint (2 ranks)" in section
    assert "nothing restored: started from step 0" in section
    assert "2 restores: 13 steps lost in all, at most 11 in one restore" in section


def test_a_job_without_restores_has_no_such_section(tmp_path: Path) -> None:
    write_standard_job(tmp_path)
    report = build_report(tmp_path, sacct=False, workers=1)
    assert report.restores == []
    assert HEADING not in report.to_text(width=None)


def test_a_checkpoint_load_in_a_requeued_run_counts_the_steps_of_the_run_before(
    tmp_path: Path,
) -> None:
    """Run 0 saves step 5 and reaches 7 before SLURM requeues the job; run 1's first round
    loads step 5: 2 lost. A restore after a requeue follows no fault of a round."""
    sup = Proc(tmp_path, HOST, "supervisor")
    first = Job(tmp_path, 1)
    sup.at(0.0, "supervisor_start", nnodes=1, nproc_per_node=1, spare_nodes=0)
    first.start(0, 1.0)
    first.progress(1.1, range(1, 8))
    first.ranks[0].at(1.55, "checkpoint", path="/ckpt/c.pt", step=5, action="save")
    for p in first.ranks:
        p.close()
    sup.at(10.0, "supervisor_start", nnodes=1, nproc_per_node=1, spare_nodes=0)
    sup.close()
    second = Job(tmp_path, 1)
    second.start(0, 11.0)
    second.ranks[0].at(11.1, "checkpoint", path="/ckpt/c.pt", step=5, action="load")
    second.progress(11.2, range(6, 9))
    report = second.close(12.0)

    assert _facts(report) == [(1, 0, {"checkpoint": 1}, True, 5, 7, 2)]
    assert report.restores[0].cause is None
    section = _section(report.to_text(width=None))
    assert "job requeued (run 1)" in section
    assert "1 restore: 2 steps lost in all, at most 2 in one restore" in section
