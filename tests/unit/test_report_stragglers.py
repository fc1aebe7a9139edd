"""nvrx-report on stragglers: the *Stragglers* section, and slow nodes in the exclusion advice.

A job of 2 nodes x 2 ranks under the Wrapper, one round that completes, written with the
real ``EventWriter``. The supervisor of slot 0 (it hosts the store) writes the
``straggler`` events, as the live path does: ``component`` supervisor, ``rank`` null.
Times are seconds after ``T0``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_report_cli import SCHEMA_PATH, check_schema
from test_report_fixtures import T0, Host, Proc

from nvrx.report import Report, build_report

HOSTS = {0: "node-a", 1: "node-b"}
SPARE = Host("node-c", 2)
HEADING = "Stragglers"
#: Node 1 (slot 1, ranks 2-3) as the supervisor names it: 35 % slower than the job.
SLOW_NODE: dict[str, Any] = {
    "of": "node", "who": 1, "node_rank": 1, "slot": 1, "straggler_host": "node-b",
    "ranks": [2, 3], "score": 0.741, "median_s": 1.35, "reference_s": 1.0,
    "slower_pct": 35.0, "window": 20, "threshold": 0.85, "source": "record_step",
}  # fmt: skip
#: Rank 3 alone, on node 1.
SLOW_RANK: dict[str, Any] = {
    "of": "rank", "who": 3, "node_rank": 1, "slot": 1, "straggler_host": "node-b",
    "score": 0.8, "median_s": 1.25, "reference_s": 1.0, "slower_pct": 25.0,
    "window": 20, "threshold": 0.85, "source": "section step",
}  # fmt: skip


class Job:
    """Two supervisors (slot = node rank) and their ranks; ``finish`` ends and reads it."""

    def __init__(self, log_dir: Path, spares: int = 0) -> None:
        self.dir = log_dir
        self.sup = {n: Proc(log_dir, Host(name, n), "supervisor") for n, name in HOSTS.items()}
        nnodes = len(HOSTS) + spares
        for sup in self.sup.values():
            sup.at(0.0, "supervisor_start", nnodes=nnodes, nproc_per_node=2, spare_nodes=spares)
        self.ranks = {
            r: Proc(log_dir, Host(HOSTS[r // 2], r // 2), "wrapper", rank=r) for r in range(4)
        }
        for r, p in self.ranks.items():
            self.sup[r // 2].at(0.5, "child_start", local_rank=r % 2, child_pid=100 + r, attempt=0)
            p.round(0).at(1.0, "round_start", world_size=4, initial_rank=r)
            p.at(1.01, "call_start", note="enter")

    def straggler(
        self, t: float, state: str, step: int, action: str = "report", **named: Any
    ) -> None:
        self.sup[0].at(t, "straggler", state=state, step=step, action=action, **named)

    def finish(self, t: float = 100.0) -> Report:
        for r, p in self.ranks.items():
            p.at(t, "call_end", duration_s=t - 1.0, outcome="completed")
            p.at(t, "round_end", outcome="completed")
            self.sup[r // 2].at(
                t + 0.1, "child_exit", local_rank=r % 2, child_pid=100 + r, exit_code=0
            )
        for sup in self.sup.values():
            sup.at(t + 0.2, "supervisor_end", exit_code=0, reason="completed")
        for p in [*self.sup.values(), *self.ranks.values()]:
            p.close()
        return build_report(self.dir, sacct=False, workers=1)


def _section(text: str) -> str:
    """The text of the section, up to the next heading."""
    assert f"\n{HEADING}\n" in text, text
    body = text.split(f"\n{HEADING}\n", 1)[1].split("\n", 1)[1]  # past the heading's underline
    return body.split("\n==", 1)[0]


def _answer(text: str) -> str:
    """The first screen, up to the summary."""
    return text.split("\nSummary\n", 1)[0]


def test_a_node_slow_to_the_end_is_in_the_section_and_excluded_as_slow(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, **SLOW_NODE)
    report = job.finish()

    [x] = report.stragglers
    assert (x.of, x.node, x.slot, x.host, x.ranks) == ("node", 1, 1, "node-b", [2, 3])
    assert (x.step, x.recovered, x.end_wall, x.end_reason) == (120, False, None, None)
    assert (x.action, x.slower_pct) == ("report", 35.0)
    text = report.to_text(width=None)
    section = _section(text)
    assert "node 1 (slot 1, ranks 2-3)" in section and "node-b" in section
    assert "(+40.0 s), step 120" in section  # the job began at T0, with its supervisors
    assert "end of job (still slow)" in section
    assert "35.0 % slower" in section
    assert "median 1.350 s vs reference 1.000 s over 20 steps" in section
    assert "from record_step" in section

    assert report.exclude == "node-b"
    [node] = report.suspects
    assert (node.host, node.node, node.suspect, node.slow, node.faults) == ("node-b", 1, True, 1, 0)
    why = ("slow, not failed: 35.0 % slower than the job (median 1.350 s vs reference 1.000 s "
           "over 20 steps); named slow at step 120, never recovered")  # fmt: skip
    assert node.evidence == [why]
    answer = _answer(text)
    assert "exclude next time: --exclude=node-b" in answer
    assert f"node-b (node 1): {why}" in answer
    assert "faults: none" in answer  # slowness is no fault

    suspects = text.split("\nSuspect nodes\n", 1)[1]
    header = suspects.split("\n", 3)[2].split()
    assert header[header.index("lost") + 1] == "slow"

    data = json.loads(report.to_text("json"))
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["stragglers"][0]["recovered"] is False
    assert data["stragglers"][0]["end_reason"] is None
    assert data["suspects"][0]["slow"] == 1
    assert f">{HEADING}<" in report.to_text("html")


@pytest.mark.parametrize(
    ("action", "said"),
    [("none", "none: exclude asked, no spare free"),
     ("store_host", "store_host: exclude asked, it hosts the job's store")],
)  # fmt: skip
def test_a_node_slow_to_the_end_that_stayed_is_excluded(tmp_path: Path, action: str, said: str) -> None:
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, action=action, **SLOW_NODE)
    report = job.finish()

    assert said in _section(report.to_text(width=None))
    assert report.exclude == "node-b"
    assert report.suspects[0].evidence[0].startswith("slow, not failed: 35.0 % slower")


def test_a_node_that_recovered_is_shown_until_then_and_not_excluded(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, **SLOW_NODE)
    job.straggler(70.0, "recovered", 180, **{**SLOW_NODE, "score": 0.97, "slower_pct": 3.0})
    report = job.finish()

    [x] = report.stragglers
    assert (x.recovered, x.end_step, x.slower_pct) == (True, 180, 35.0)  # as it was named
    assert x.end_reason == "recovered"
    section = _section(report.to_text(width=None))
    assert "recovered" in section and "(+70.0 s), step 180" in section
    assert "end of job" not in section
    assert report.exclude is None and report.suspects == []


def test_a_node_excluded_for_slowness_names_its_spare_and_is_excluded_as_slow(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path, spares=1)
    spare = Proc(tmp_path, SPARE, "supervisor")
    spare.at(0.0, "supervisor_start", nnodes=3, nproc_per_node=2, spare_nodes=1)
    job.straggler(40.0, "slow", 120, **SLOW_NODE)
    job.straggler(50.0, "slow", 140, action="exclude", **SLOW_NODE)  # asked to leave
    job.sup[0].at(
        52.0, "node_lost", lost_node=1, lost_slot=1, lost_host="node-b", silent_s=1.0,
        seen_by=0, action="spare", replaced_by=2, ranks=[2, 3],
    )  # fmt: skip
    spare.at(52.5, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.5)
    spare.close()
    report = job.finish()

    [x] = report.stragglers  # named twice, one row: the later naming asked to exclude it
    assert (x.action, x.replaced_by, x.step, x.recovered) == ("exclude", 2, 120, False)
    assert (x.end_reason, x.end_wall) == ("node left", x.replaced_wall)
    section = _section(report.to_text(width=None))
    assert "exclude: spare slot 2 took over" in section
    assert "left the job" in section and "(+52.5 s)" in section  # the spare's takeover
    assert report.exclude == "node-b"
    [node] = [n for n in report.suspects if n.host == "node-b"]
    assert node.evidence == [
        "slow, not failed: 35.0 % slower than the job (median 1.350 s vs reference 1.000 s "
        "over 20 steps); excluded for slowness at step 120, spare slot 2 took over",
        "left the job when excluded for slowness: not a failure",
    ]


def test_a_node_that_left_for_slowness_with_no_loss_recorded_is_slow_not_asked_out(
    tmp_path: Path,
) -> None:
    """A node excluded for slowness exits 10, as ``ExcludeThisNode`` does; with no loss of
    it recorded, its evidence is its slowness alone, not a rank's request."""
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, **SLOW_NODE)
    job.straggler(50.0, "slow", 140, action="exclude", **SLOW_NODE)
    job.sup[1].at(51.0, "supervisor_end", exit_code=10, reason="excluded for slowness")
    report = job.finish()
    assert report.exclude == "node-b"
    [node] = [n for n in report.suspects if n.host == "node-b"]
    assert len(node.evidence) == 1 and node.evidence[0].startswith("slow, not failed:"), node.evidence


def _failover(job: Job, t: float) -> None:
    """The store, hosted by slot 0, fails over to slot 1: its scoring moves there."""
    job.sup[1].at(
        t, "store_failover", epoch=1, old_store="node-a:29503", new_store="node-b:29503",
        successor=1, lost_slot=0, duration_s=2.0,
    )  # fmt: skip


def test_a_node_still_slow_at_a_store_failover_ends_there_and_is_not_excluded(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, **SLOW_NODE)
    _failover(job, 60.0)  # the new scorer starts afresh: no recovered ever comes
    report = job.finish()

    [x] = report.stragglers
    assert (x.end_reason, x.recovered, x.end_step) == ("store failover", False, None)
    assert x.end_wall is not None and x.start_wall is not None
    assert x.end_wall - x.start_wall == pytest.approx(20.0)
    section = _section(report.to_text(width=None))
    assert "unknown: the store failed over at" in section and "(+60.0 s)" in section
    assert "(still slow)" not in section
    assert report.exclude is None and report.suspects == []
    data = json.loads(report.to_text("json"))
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["stragglers"][0]["end_reason"] == "store failover"


@pytest.mark.parametrize("loss_first", [True, False], ids=["loss-first", "failover-first"])
def test_a_slow_store_host_lost_with_its_store_ends_at_the_failover_in_either_order(
    tmp_path: Path, loss_first: bool
) -> None:
    """Slot 0, the store host, named slow (it stays: it hosts the store), is lost and the
    store fails over: its row ends with the scoring it hosted, not as a node that left slow,
    whichever event a survivor wrote first (before: the order decided the advice)."""
    job = Job(tmp_path)
    host = {**SLOW_NODE, "who": 0, "node_rank": 0, "slot": 0, "straggler_host": "node-a", "ranks": [0, 1]}
    job.straggler(40.0, "slow", 120, action="store_host", **host)
    job.sup[1].at(
        60.0 if loss_first else 60.2, "node_lost", lost_node=0, lost_slot=0, lost_host="node-a",
        silent_s=3.0, seen_by=1, action="shrink", ranks=[0, 1],
    )  # fmt: skip
    _failover(job, 60.1)
    report = job.finish()

    [x] = report.stragglers
    assert (x.slot, x.end_reason) == (0, "store failover"), x
    a = [n for n in report.suspects if n.host == "node-a"]
    assert not [w for n in a for w in n.evidence if w.startswith("slow")], a


def test_a_store_failover_told_by_each_survivor_ends_only_what_was_open_at_the_first(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, **SLOW_RANK)
    _failover(job, 60.0)
    job.straggler(61.0, "slow", 180, **SLOW_RANK)  # named afresh by the new scorer
    # The same failover (its epoch), as another survivor tells it later.
    job.sup[0].at(
        61.5, "store_failover", epoch=1, old_store="node-a:29503", new_store="node-b:29503",
        successor=1, lost_slot=0, duration_s=2.5,
    )  # fmt: skip
    report = job.finish()

    first, second = report.stragglers
    assert (first.end_reason, second.end_reason) == ("store failover", None)
    assert "end of job (still slow)" in _section(report.to_text(width=None))


def test_a_node_excluded_for_slowness_before_a_store_failover_is_still_excluded(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path)
    job.straggler(40.0, "slow", 120, **SLOW_NODE)
    job.straggler(50.0, "slow", 140, action="exclude", **SLOW_NODE)
    _failover(job, 60.0)
    report = job.finish()

    [x] = report.stragglers
    assert (x.end_reason, x.action, x.recovered) == ("store failover", "exclude", False)
    assert report.exclude == "node-b"
    [node] = report.suspects
    assert node.slow == 1
    assert node.evidence[0].endswith("excluded for slowness at step 120")


@pytest.mark.parametrize(("takeover", "left_s"), [(True, 52.5), (False, 52.0)])
def test_a_rank_going_on_on_a_spare_did_not_recover_but_left_with_its_node(
    tmp_path: Path, takeover: bool, left_s: float
) -> None:
    """It left at the spare's takeover, else when its node was declared lost."""
    job = Job(tmp_path, spares=1)
    spare = Proc(tmp_path, SPARE, "supervisor")
    spare.at(0.0, "supervisor_start", nnodes=3, nproc_per_node=2, spare_nodes=1)
    job.straggler(30.0, "slow", 90, **{**SLOW_RANK, "who": 2})  # on slot 1
    job.sup[0].at(
        52.0, "node_lost", lost_node=1, lost_slot=1, lost_host="node-b", silent_s=1.0,
        seen_by=0, action="spare", replaced_by=2, ranks=[2, 3],
    )  # fmt: skip
    if takeover:
        spare.at(52.5, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.5)
    spare.close()
    # Rank 2 goes on on the spare (slot 2), at the pace of the job: not node-b recovering.
    on_spare = {**SLOW_RANK, "who": 2, "slot": 2, "straggler_host": "node-c", "score": 0.97}
    job.straggler(70.0, "recovered", 180, **on_spare)
    report = job.finish()

    [x] = report.stragglers
    assert (x.of, x.who, x.slot, x.host) == ("rank", 2, 1, "node-b")
    assert (x.end_reason, x.recovered, x.end_step) == ("node left", False, None)
    assert x.end_wall is not None and x.start_wall is not None
    assert x.end_wall - x.start_wall == pytest.approx(left_s - 30.0)
    section = _section(report.to_text(width=None))
    assert "left with its node" in section and f"(+{left_s:.1f} s)" in section
    assert "recovered" not in section
    data = json.loads(report.to_text("json"))
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    assert (data["stragglers"][0]["end_reason"], data["stragglers"][0]["recovered"]) == (
        "node left",
        False,
    )


def test_what_was_slow_on_a_node_a_spare_took_over_ends_there_and_its_ranks_start_afresh(
    tmp_path: Path,
) -> None:
    """Node 1 and its rank 2, named slow on slot 1 (node-b); slot 1 is lost (action spare,
    not an exclusion) and spare slot 2 (node-c) takes node rank 1 over, where rank 2 is
    named slow again. Slot 1's rows end when it left; node-b, still slow then, is advised
    out for it (before: both rows ran to the end of the job and rank 2's new naming on
    node-c was dropped)."""
    job = Job(tmp_path, spares=1)
    spare = Proc(tmp_path, SPARE, "supervisor")
    spare.at(0.0, "supervisor_start", nnodes=3, nproc_per_node=2, spare_nodes=1)
    job.straggler(30.0, "slow", 90, **SLOW_NODE)
    job.straggler(30.0, "slow", 90, **{**SLOW_RANK, "who": 2})
    job.sup[0].at(
        52.0, "node_lost", lost_node=1, lost_slot=1, lost_host="node-b", silent_s=1.0,
        seen_by=0, action="spare", replaced_by=2, ranks=[2, 3],
    )  # fmt: skip
    job.sup[0].at(52.2, "node_probe", lost_slot=1, lost_host="node-b", responding=True, probe_s=0.3)
    spare.at(52.5, "node_takeover", node_rank=1, lost_slot=1, wait_s=0.5)
    spare.close()
    job.straggler(70.0, "slow", 60, **{**SLOW_RANK, "who": 2, "slot": 2, "straggler_host": "node-c"})
    report = job.finish()

    rows = [(x.of, x.who, x.host, x.end_reason, x.end_wall) for x in report.stragglers]
    assert rows == [
        ("node", 1, "node-b", "node left", T0 + 52.5),
        ("rank", 2, "node-b", "node left", T0 + 52.5),
        ("rank", 2, "node-c", None, None),
    ], report.to_text(width=None)
    [b] = [n for n in report.suspects if n.host == "node-b"]
    assert b.slow == 1 and any("still slow when it left the job" in w for w in b.evidence), b.evidence
    assert report.exclude is not None and "node-b" in report.exclude.split(",")


def test_a_rank_named_alone_is_in_the_section_and_not_excluded(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.straggler(30.0, "slow", 90, **SLOW_RANK)
    report = job.finish()

    [x] = report.stragglers
    assert (x.of, x.who, x.node, x.recovered) == ("rank", 3, 1, False)
    section = _section(report.to_text(width=None))
    assert "rank 3 (node 1)" in section and "25.0 % slower" in section
    assert "from section step" in section
    assert report.exclude is None and report.suspects == []


def test_a_job_without_stragglers_has_no_section_and_no_new_advice(tmp_path: Path) -> None:
    report = Job(tmp_path).finish()

    assert report.stragglers == []
    text = report.to_text(width=None)
    assert f"\n{HEADING}\n" not in text
    assert report.exclude is None and report.suspects == []
    assert "exclude next time: nothing (no node-level faults)" in _answer(text)
    assert json.loads(report.to_text("json"))["stragglers"] == []


def test_a_node_listed_for_exclusion_that_stayed_and_recovered_is_not_excluded(tmp_path: Path) -> None:
    """Listed (a spare was free at its naming), it stayed (none was free when it read the
    list) and recovered: nothing holds it against its node."""
    job = Job(tmp_path, spares=1)
    job.straggler(40.0, "slow", 120, action="exclude", **SLOW_NODE)
    job.straggler(70.0, "recovered", 180, **{**SLOW_NODE, "score": 0.97, "slower_pct": 3.0})
    report = job.finish()
    [x] = report.stragglers
    assert (x.action, x.end_reason) == ("exclude", "recovered")
    assert report.exclude is None
