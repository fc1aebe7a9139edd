"""nvrx-report on a requeue for lost nodes that left the user something to do: SLURM refused
to release the requeued job (``held``), refused to exclude the lost node (``exclude_refused``,
``exclude_error``), or the lost node was left in because the job names it in ``--nodelist``
(``required``). The ``requeue`` event is written by the supervisor's own
``node_requeue.requeue_without``, against ``scontrol`` and ``srun`` programs on PATH that
refuse what the test says (``test_node_requeue._fake_scontrol``); the answer, the report's
first screen, must say each, in text and in HTML. The job's SLURM id is not its events' job
(``NVRX_JOB_ID`` was set): the commands the answer prints must name SLURM's.
"""

from __future__ import annotations

import json
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from test_node_requeue import _fake_scontrol
from test_report_cli import SCHEMA_PATH, check_schema
from test_report_fixtures import JOB, T0, Host, Proc
from test_report_node_loss import DECLARED, Job, _before_the_loss, _raises

from nvrx.report import Report, build, build_report
from nvrx.supervisor import node_requeue

#: ``srun`` as a script on PATH: no node runs the probe's no-op step (node-b is gone).
SRUN = "#!/bin/sh\nexit 1\n"
REASON = "node lost, no spare: 1 nodes left, below --min-nodes 2"
#: The job's SLURM id; its events' job is ``JOB``, its ``NVRX_JOB_ID``.
SLURM_JOB = "4242"
#: The fields of a ``requeue`` event the writer did not write before the report told them.
NEWER_FIELDS = ("slurm_job_id", "required", "exclude_refused")


def _lost_and_requeued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuses: str = "", reqnodes: str = "",
    runs_again: bool = False, older: bool = False,
) -> Report:  # fmt: skip
    """node-b is lost and the job, which has no spare, stops; slot 0's supervisor requeues
    it with ``requeue_without`` (node-b probed first, silent), SLURM refusing ``refuses``
    and the job naming ``reqnodes`` in ``--nodelist``. ``runs_again``: run 1 starts later,
    on node-a and node-c. ``older``: the event as an older writer wrote it, without
    ``NEWER_FIELDS``."""
    _fake_scontrol(tmp_path, monkeypatch, refuses, reqnodes)
    srun = tmp_path / "bin" / "srun"
    srun.write_text(SRUN)
    srun.chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", SLURM_JOB)
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    job.node_lost("stop", slurm_state={"State": "MIXED", "Reason": "none"})
    job.sup[0].at(DECLARED + 0.001, "job_stop", reason=REASON, exit_code=8)

    def emit(kind: str, **fields: Any) -> None:
        dropped = NEWER_FIELDS if older else ()
        job.sup[0].at(DECLARED + 0.5, kind, **{k: v for k, v in fields.items() if k not in dropped})

    node_requeue.requeue_without(["node-b"], None, emit)
    job.sup[0].at(DECLARED + 1.0, "supervisor_end", exit_code=8, reason=REASON)
    if runs_again:
        job.others += [job.sup[1], *job.ranks.values()]
        job.hosts[1] = "node-c"
        job.sup[1] = Proc(job.dir, Host("node-c", 1), "supervisor")
        for sup in job.sup.values():
            sup.at(40.0, "supervisor_start", nnodes=2, nproc_per_node=2, spare_nodes=0)
        for rank in range(4):
            job.start_rank(40.5, rank, rank // 2, rank // 2)
        job.round_start(45.0, 0, [0, 1, 2, 3])
        job.complete(60.0, [0, 1, 2, 3])
    return job.close()


def _answers(report: Report) -> tuple[str, str]:
    """The answer (the first screen) of the text report and of the HTML page (its text)."""
    text, page = report.to_text(width=None), report.to_text("html")
    return text[: text.index("Summary\n")], unescape(page[: page.index("<h2>Summary</h2>")])


def test_a_requeued_job_slurm_did_not_release_is_told_held_with_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``held`` was in the event only; the report said nothing, and the job waited
    held for ever unless someone read the supervisor's log. The command names the SLURM job,
    not the events' job (``NVRX_JOB_ID``), which SLURM does not know."""
    report = _lost_and_requeued(tmp_path, monkeypatch, refuses="release")
    for answer in _answers(report):
        assert "requeued for lost nodes (run 0):" in answer, answer
        assert (
            "  HELD: SLURM refused to release the requeued job: it waits held until released. "
            f"To let it start, run:\n      scontrol release {SLURM_JOB}" in answer
        ), answer
        assert f"nvrx report: job {JOB}" in answer and f"release {JOB}" not in answer
    (q,) = report.node_requeues
    assert (q.held, q.excluded, q.exclude_refused, q.required) == (True, ["node7", "node-b"], [], [])


def test_a_held_job_that_ran_again_is_not_told_to_be_released_nor_to_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1 is in the events: the job was released, and the node it named did come back."""
    report = _lost_and_requeued(tmp_path, monkeypatch, "release", "node-a,node-b", runs_again=True)
    text, _ = _answers(report)
    assert "held: SLURM refused to release the requeued job; run 1 started once it was released" in text
    assert (
        "node-b not excluded: the job names it in --nodelist, so run 1 could start only with it. "
        "Leave it out of --nodelist next time" in text
    ), text
    assert "scontrol release" not in text and "waits" not in text


def test_a_lost_node_slurm_refused_to_exclude_is_named_with_slurms_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``exclude_error`` was in the event only, and no event said which nodes SLURM
    had refused: the report said nothing of a next run that may land on node-b again."""
    report = _lost_and_requeued(tmp_path, monkeypatch, refuses="update")
    said = (
        f"SLURM refused to exclude node-b (scontrol update JobId={SLURM_JOB} ExcNodeList=node7,node-b "
        "exited 1: scontrol: error: Access/permission denied for update): the next run may land "
        "on it"
    )
    for answer in _answers(report):
        assert "requeued for lost nodes (run 0):" in answer and said in answer, answer
        assert "HELD" not in answer
    (q,) = report.node_requeues
    assert (q.excluded, q.exclude_refused, q.held) == (["node7"], ["node-b"], False)


def test_a_lost_node_the_job_names_in_its_nodelist_is_waited_for_and_still_advised_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node-b did not answer, but the job names it in ``--nodelist``: the requeue leaves it
    in ExcNodeList's stead, and the requeued job waits for it. Before: only the log said
    so, and the event could not tell it (node-b was neither excluded nor answered). Its
    loss still counts against it: the advice to exclude it stands, and nothing claims the
    requeue excluded it."""
    report = _lost_and_requeued(tmp_path, monkeypatch, reqnodes="node-a,node-b")
    (q,) = report.node_requeues
    assert (q.excluded, q.required, q.answered) == (["node7"], ["node-b"], [])
    for answer in _answers(report):
        assert (
            "node-b not excluded: the job names it in --nodelist, so the requeued job waits "
            "pending while it is down. To run without it, cancel the job and submit it again "
            f"with a --nodelist that leaves it out. To cancel it, run:\n      scancel {SLURM_JOB}"
            in answer
        ), answer
        assert "exclude next time: --exclude=node-b" in answer
    (node_b,) = report.suspects
    assert node_b.suspect and node_b.evidence == [
        "lost: silent 3.0 s to the job, SLURM MIXED when declared (SLURM notices a dead node later)"
    ]


def test_in_markdown_the_commands_to_run_are_code_blocks_not_part_of_the_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the command sat indented in the paragraph that asks for it, where Markdown
    runs it into the words around it (an indented line cannot start a code block there)."""
    report = _lost_and_requeued(tmp_path, monkeypatch, refuses="release", reqnodes="node-a,node-b")
    markdown = report.to_text("markdown")
    answer = markdown[: markdown.index("## Summary")]
    blocks = answer.split("\n\n")
    assert blocks[2:6] == [
        "requeued for lost nodes (run 0):\\\n"  # a hard line break: a viewer would join them
        "\u00a0\u00a0HELD: SLURM refused to release the requeued job: it waits held until "
        "released. To let it start, run:",
        f"```\nscontrol release {SLURM_JOB}\n```",
        "\u00a0\u00a0node-b not excluded: the job names it in --nodelist, so the requeued job waits "
        "pending while it is down. To run without it, cancel the job and submit it again with a "
        "--nodelist that leaves it out. To cancel it, run:",
        f"```\nscancel {SLURM_JOB}\n```",
    ], answer


def test_a_requeue_slurm_did_all_of_asks_nothing_and_is_in_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = _lost_and_requeued(tmp_path, monkeypatch)
    for answer in _answers(report):
        assert "requeued for lost nodes" not in answer and "not excluded" not in answer, answer
    data = json.loads(json.dumps(report.to_dict()))
    check_schema(data, json.loads(SCHEMA_PATH.read_text()))
    (q,) = data["node_requeues"]
    assert q == {
        "run": 0, "wall": q["wall"], "slurm_job_id": SLURM_JOB, "excluded": ["node7", "node-b"],
        "answered": [], "required": [],
        "exclude_refused": [], "exclude_error": None, "held": False,
    }  # fmt: skip


def test_an_older_writers_event_names_no_job_to_release_rather_than_the_wrong_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event written before ``slurm_job_id`` was: the events' job may be ``NVRX_JOB_ID``,
    so the command says what to put in, and no node is named that the event did not name."""
    report = _lost_and_requeued(tmp_path, monkeypatch, refuses="update release", older=True)
    for answer in _answers(report):
        assert "run:\n      scontrol release <SLURM job id>" in answer, answer
        assert "SLURM refused to exclude the lost nodes (scontrol update" in answer, answer
        assert f"release {JOB}" not in answer
    (q,) = report.node_requeues
    assert (q.slurm_job_id, q.held, q.exclude_refused) == (None, True, [])


def test_requeues_of_other_causes_or_made_by_slurm_are_not_requeues_for_lost_nodes(
    tmp_path: Path,
) -> None:
    """The ``requeue`` events of ``preemption.PreemptionHandler``, as it writes them: nvrx's
    after a preemption warning, and the one node 0 records when run 1 starts for a requeue
    SLURM made itself for a node failure (it names no nodes). Neither is one to tell."""
    job = Job(tmp_path / "job", {0: "node-a", 1: "node-b"}, nnodes=2, spares=0)
    _before_the_loss(job)
    job.sup[0].at(20.0, "requeue", cause="preemption", count=1, run=0, issued_by="nvrx")
    for sup in job.sup.values():
        sup.at(40.0, "supervisor_start", nnodes=2, nproc_per_node=2, spare_nodes=0)
    job.sup[0].at(40.1, "requeue", cause="node_failure", count=2, run=0, issued_by="slurm")
    report = job.close()
    assert report.node_requeues == []
    assert "requeued for lost nodes" not in report.to_text(width=None)


def _requeue_by(proc: Proc, t: float, lost: str) -> None:
    """``proc``'s supervisor requeues the job without ``lost`` at ``t``, then ends."""
    node_requeue.requeue_without([lost], None, lambda kind, **fields: proc.at(t, kind, **fields))
    proc.at(t + 0.5, "supervisor_end", exit_code=8, reason=REASON)


def _runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: dict[int, str], then: dict[int, str],
    spares: int | None = None,
) -> Job:  # fmt: skip
    """Run 0 on the slots and hosts of ``first`` (slot 2's supervisor, when there is one,
    starting last); slot 1's node is lost and the job stops; run 1 on those of ``then``
    (slot 2's, when there is one, starting first), ``spares`` of them spares (all but two
    by default), the others running two ranks each. SLURM refuses to release each requeue."""
    _fake_scontrol(tmp_path, monkeypatch, "release")
    srun = tmp_path / "bin" / "srun"
    srun.write_text(SRUN)
    srun.chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", SLURM_JOB)
    job = Job(tmp_path / "job", {0: first[0], 1: first[1]}, nnodes=len(first), spares=0)
    if 2 in first:
        job.hosts[2] = first[2]
        job.sup[2] = Proc(job.dir, Host(first[2], 2), "supervisor")
        job.sup[2].at(0.2, "supervisor_start", nnodes=3, nproc_per_node=2, spare_nodes=1)
    _before_the_loss(job)
    job.node_lost("stop", slurm_state={"State": "MIXED", "Reason": "none"})
    job.sup[0].at(DECLARED + 0.001, "job_stop", reason=REASON, exit_code=8)
    job.others += [*job.sup.values(), *job.ranks.values()]
    job.hosts = dict(then)
    job.sup = {slot: Proc(job.dir, Host(host, slot), "supervisor") for slot, host in then.items()}
    spares = len(then) - 2 if spares is None else spares
    for slot in sorted(then, reverse=True):
        job.sup[slot].at(40.0 - slot / 10, "supervisor_start", nnodes=len(then), nproc_per_node=2,
                         spare_nodes=spares)  # fmt: skip
    world = 2 * (len(then) - spares)
    for rank in range(world):
        job.start_rank(40.5, rank, rank // 2, rank // 2)
    job.round_start(45.0, 0, list(range(world)))
    return job


def test_a_requeue_by_a_slot_that_started_only_in_a_later_run_is_filed_under_that_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 0 ran on two nodes and slot 0 requeued it without node-b; run 1 got three (the job
    asked for 2 to 3), so slot 2 started in run 1 only, and before slots 0 and 1 did. In run 1
    node-a was lost and slot 2 requeued the job without it, SLURM refusing to release it.
    Before: slot 2's events were filed by its own starts alone, its first one taken for run
    0's, so its requeue was told as run 0's, and run 1's looked released by itself."""
    job = _runs_on(tmp_path, monkeypatch, {0: "node-a", 1: "node-b"},
                   {0: "node-a", 1: "node-c", 2: "node-d"})  # fmt: skip
    _requeue_by(job.others[0], DECLARED + 0.5, "node-b")
    _requeue_by(job.sup[2], 60.0, "node-a")
    report = job.close()
    assert [(q.run, q.excluded, q.held) for q in report.node_requeues] == [
        (0, ["node7", "node-b"], True), (1, ["node7", "node-a"], True)
    ]
    for answer in _answers(report):
        assert "requeued for lost nodes (run 1):\n  HELD: SLURM refused" in answer, answer
        assert f"scontrol release {SLURM_JOB}" in answer
    slot_2 = build_report(job.dir, sacct=False, node=2)  # its events, all runs' starts read
    assert [(q.run, q.excluded) for q in slot_2.node_requeues] == [(1, ["node7", "node-a"])]


@pytest.mark.parametrize(
    "build", [{}, {"node": 2}, {"since": T0 + DECLARED + 0.2}], ids=["all", "node-2", "since"]
)
def test_a_requeue_by_a_slot_that_started_last_in_a_run_it_alone_missed_after_stays_in_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build: dict[str, Any]
) -> None:
    """Run 0 ran on three nodes, slot 2's supervisor starting last; it requeued the job
    without node-b. Run 1 got two. Slot 2's start, later than every start of run 0 by the
    slots that ran in both, is still run 0's: the run went on until their files' last events,
    which count whatever ``--node`` or ``--since`` keep (here, none of those files' events)."""
    job = _runs_on(tmp_path, monkeypatch, {0: "node-a", 1: "node-b", 2: "node-c"},
                   {0: "node-a", 1: "node-c"})  # fmt: skip
    _requeue_by(job.others[2], DECLARED + 0.5, "node-b")
    for sup in job.sup.values():
        sup.at(60.0, "supervisor_end", exit_code=0, reason="all children ended")
    report = job.close(**build)
    assert [(q.run, q.excluded, q.held) for q in report.node_requeues] == [
        (0, ["node7", "node-b"], True)
    ]


def test_worker_processes_file_the_rounds_of_a_slot_of_a_later_run_only_under_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1 got three training nodes: slot 2, which started in run 1 only (before slots 0
    and 1), runs ranks 4 and 5, and rank 4 raises. Read by worker processes, which are
    handed the runs' ends with their starts, the report is the one read in one process:
    round 0 of run 1 failed first on rank 4."""
    job = _runs_on(tmp_path, monkeypatch, {0: "node-a", 1: "node-b"},
                   {0: "node-a", 1: "node-c", 2: "node-d"}, spares=0)  # fmt: skip
    _requeue_by(job.others[0], DECLARED + 0.5, "node-b")
    _raises(job, 4, 50.0, "ValueError", "bad batch")
    alone = job.close(workers=1).to_dict()
    assert [(row["run"], row["first_rank"]) for row in alone["timeline"]] == [(0, 2), (1, 4)]
    dealt: list[int] = []
    chunks = build._chunks
    monkeypatch.setattr(build, "_chunks", lambda *a: dealt.append(a[2]) or chunks(*a))
    monkeypatch.setattr(build, "PARALLEL_MIN_FILES", 1)  # these few files go to workers
    workers = build_report(job.dir, sacct=False, workers=2).to_dict()
    assert dealt  # read in worker processes
    alone.pop("generated_at"), workers.pop("generated_at")
    assert workers == alone
