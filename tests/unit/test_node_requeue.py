"""``node_requeue``: the step's nodes as a survivor reads them from the step's own variables
(``SLURM_STEP_NODELIST``, ``SLURMD_NODENAME``); which nodes it asks about and which it counts
silent, given SLURM's answers (a real SLURM answers in ``tests/slurm/test_node_loss_slurm.py``);
and the requeue without several nodes."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.slurm import commands
from nvrx.slurm.nodelist import expand_nodelist
from nvrx.supervisor import node_requeue
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.job_end import JobEnd
from nvrx.supervisor.node_requeue import step_nodes
from nvrx.supervisor.requeue_ledger import RequeueLedger


@pytest.mark.parametrize(
    ("own", "nodelist", "nodes", "place"),
    [
        ("node2", "node[1-2]", ["node1", "node2"], 1),
        ("node1", "node[2,1]", ["node2", "node1"], 1),
        ("gpu-b", "gpu-a,gpu-b", ["gpu-a", "gpu-b"], 1),
        ("node1", "node[1-2]", ["node1", "node2"], 0),
        ("node3", "node[1-4]", ["node1", "node2", "node3", "node4"], 2),
        ("node1", "node1", ["node1"], 0),
    ],
)
def test_the_step_nodes_and_this_ones_place(own: str, nodelist: str, nodes: list[str], place: int) -> None:
    env = {"SLURMD_NODENAME": own, "SLURM_STEP_NODELIST": nodelist}
    assert step_nodes(env) == (nodes, place)


@pytest.mark.parametrize(
    "env",
    [
        {"SLURMD_NODENAME": "node3", "SLURM_STEP_NODELIST": "node[1-2]"},  # not one of them
        {"SLURMD_NODENAME": "node1", "SLURM_STEP_NODELIST": "node[1,1]"},  # one node twice
        {"SLURMD_NODENAME": "node2", "SLURM_STEP_NODELIST": "node[1-"},  # malformed
        {"SLURM_STEP_NODELIST": "node[1-2]"},  # not on a SLURM node
        {},  # not under SLURM
    ],
)
def test_no_step_is_read_from_variables_that_do_not_place_this_node(env: dict[str, str]) -> None:
    assert step_nodes(env) is None


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """SLURM's answers, given: the nodes that run a no-op step, whether the job runs and its
    batch host; the nodes asked, recorded."""
    seen: dict[str, Any] = {"answer": set(), "running": True, "batch": "node1", "asked": [], "error": None}

    def answers(job_id: str, node: str, **kw: Any) -> bool:
        seen["asked"].append(node)
        if seen["error"] == node:
            raise OSError(11, "Resource temporarily unavailable")
        return node in seen["answer"]

    monkeypatch.setattr(node_requeue.commands, "node_answers", answers)
    def show_job(job_id: str, env: Any = None) -> dict[str, str]:
        return {"JobState": "RUNNING" if seen["running"] else "CANCELLED", "BatchHost": seen["batch"]}

    monkeypatch.setattr(node_requeue.commands, "show_job", show_job)
    return seen


def _probe(
    own: str, nodelist: str, slot: int, silent: set[int], nslots: int = 0, claimed: bool = True
) -> node_requeue.StepAnswers | None:
    env = {"SLURMD_NODENAME": own, "SLURM_STEP_NODELIST": nodelist}
    nslots = nslots or len(expand_nodelist(nodelist))
    return node_requeue.probe_step_nodes("7", slot, nslots, silent, 0.0, claim=lambda: claimed, env=env)


def test_the_batch_host_and_the_silent_slots_nodes_are_asked_and_those_silent_counted(slurm) -> None:
    slurm["answer"] = {"node3", "node4"}
    answers = _probe("node3", "node[1-5]", 2, {0, 1, 4})
    assert answers is not None and not answers.batch_host_answered
    assert answers.silent == [(0, "node1"), (1, "node2"), (4, "node5")]
    assert sorted(slurm["asked"]) == ["node1", "node2", "node3", "node5"]  # not node4: it survived


def test_a_batch_host_that_answers_is_told_with_the_others(slurm) -> None:
    slurm["answer"] = {"node1", "node2"}
    answers = _probe("node2", "node[1-3]", 1, {0, 2})
    assert answers is not None and answers.batch_host_answered
    assert answers.silent == [(2, "node3")] and answers.answered == {"node1"}


def test_the_batch_host_is_the_one_slurm_names_not_the_steps_first_node(slurm) -> None:
    slurm["batch"], slurm["answer"] = "node3", {"node2", "node3"}
    answers = _probe("node2", "node[1-3]", 1, {0, 2})
    assert answers is not None and answers.batch_host_answered and answers.batch_host == "node3"
    assert answers.silent == [(0, "node1")] and slurm["asked"] == ["node2", "node3", "node1"]


def test_a_silent_batch_host_outside_the_step_is_unanswered_but_in_no_slot(slurm) -> None:
    slurm["batch"], slurm["answer"] = "login7", {"node2"}
    answers = _probe("node2", "node[1-2]", 1, {0})
    assert answers is not None and not answers.batch_host_answered
    assert answers.silent == [(0, "node1")] and answers.unanswered == ["login7", "node1"]


@pytest.mark.parametrize("batch", ["(null)", ""])
def test_a_job_without_a_batch_script_has_no_batch_host_to_lose(slurm, batch: str) -> None:
    slurm["batch"], slurm["answer"] = batch, {"node2"}
    answers = _probe("node2", "node[1-3]", 1, {0})
    assert answers is not None and answers.batch_host is None and answers.batch_host_answered
    assert answers.silent == [(0, "node1")] and slurm["asked"] == ["node2", "node1"]


def test_a_survivor_on_the_batch_host_tells_it_answered(slurm) -> None:
    slurm["answer"] = {"node1"}
    answers = _probe("node1", "node[1-3]", 0, {1, 2})
    assert answers is not None and answers.batch_host_answered
    assert answers.silent == [(1, "node2"), (2, "node3")]
    assert slurm["asked"] == ["node1", "node2", "node3"]  # its own node once


def test_a_job_whose_batch_flag_is_off_has_no_batch_host() -> None:
    assert node_requeue.batch_host({"BatchFlag": "0", "BatchHost": "node1"}) is None
    assert node_requeue.batch_host({"BatchFlag": "1", "BatchHost": "node1"}) == "node1"


@pytest.mark.parametrize(
    ("own", "slot", "answer", "running", "error"),
    [
        ("node2", 2, {"node2"}, True, None),  # slot 2 is not on the step's node 2
        ("node2", 1, {"node2"}, False, None),  # the job is no longer RUNNING
        ("node2", 1, {"node3"}, True, None),  # this node answers no more either
        ("node2", 1, {"node2"}, True, "node1"),  # a step could not be started here
        ("node2", 1, {"node2"}, True, "node2"),  # nor this node's
    ],
)
def test_nothing_is_counted_when_slurm_cannot_tell(
    slurm, own: str, slot: int, answer: set[str], running: bool, error: str | None
) -> None:
    slurm["answer"], slurm["running"], slurm["error"] = answer, running, error
    assert _probe(own, "node[1-3]", slot, {0}) is None


def test_a_survivor_that_does_not_get_the_claim_asks_about_no_other_node(slurm) -> None:
    slurm["answer"] = {"node2"}
    assert _probe("node2", "node[1-3]", 1, {0, 2}, claimed=False) is None
    assert slurm["asked"] == ["node2"]


def test_a_step_of_another_size_than_the_job_is_not_read_as_its_slots(slurm) -> None:
    slurm["answer"] = {"node2"}
    assert _probe("node2", "node[1-3]", 1, {0}, nslots=4) is None and slurm["asked"] == []


@pytest.mark.parametrize(
    ("batch", "answer", "running", "orphaned", "asked"),
    [
        ("node1", set(), True, "node1", ["node1"]),  # its batch script died with it
        ("node1", {"node1"}, True, None, ["node1"]),  # the script ends the job itself
        ("node1", set(), False, None, []),  # the job ended already
        ("(null)", set(), True, None, []),  # no batch script: what holds the allocation ends it
    ],
)
def test_a_job_is_orphaned_only_by_a_silent_batch_host_while_it_runs(
    slurm, batch: str, answer: set[str], running: bool, orphaned: str | None, asked: list[str]
) -> None:
    slurm["batch"], slurm["answer"], slurm["running"] = batch, answer, running
    assert node_requeue.orphaned_by("7") == orphaned and slurm["asked"] == asked


@pytest.mark.parametrize("orphaned", [None, "node1"], ids=["batch-host-answers", "batch-host-gone"])
def test_after_a_failover_the_store_host_ends_the_job_only_for_a_lost_batch_host(
    monkeypatch: pytest.MonkeyPatch, orphaned: str | None
) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    cancelled: list[list[str]] = []
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(node_requeue, "orphaned_by", lambda job_id: orphaned)
    monkeypatch.setattr(node_requeue.commands, "cancel", lambda ids, **kw: cancelled.append(list(ids)))
    control = SimpleNamespace(emit=lambda kind, **fields: events.append((kind, fields)), exit_code=ExitCode.OK)
    JobEnd(None, None, control, None, None, None, None, None, None)._end_orphaned_job()  # type: ignore[arg-type]
    if orphaned is None:
        assert events == cancelled == []
    else:
        assert [kind for kind, _ in events] == ["job_stop"] and "node1" in events[0][1]["reason"]
        assert cancelled == [["7"]]


def test_a_requeue_without_several_nodes_asks_them_at_once_and_excludes_the_silent_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    together = threading.Barrier(2, timeout=10)  # asked one after another, it would break

    def answers(job_id: str, node: str, **kw: Any) -> bool:
        together.wait()
        return node == "node2"

    monkeypatch.setattr(node_requeue.commands, "node_answers", answers)
    excluding: list[list[str]] = []
    monkeypatch.setattr(
        node_requeue, "requeue_excluding",
        lambda job_id, lost: excluding.append(list(lost)) or node_requeue.Requeued(list(lost)),
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    node_requeue.requeue_without(["node1", None, "node2"], None, lambda kind, **f: events.append(f))
    assert excluding == [["node1"]]
    assert events == [
        dict(cause="node_failure", count=None, excluded=["node1"], answered=["node2"], run=None,
             issued_by="nvrx", exclude_error=None, held=False, required=[], exclude_refused=[],
             slurm_job_id="7")
    ]  # fmt: skip
    node_requeue.requeue_without(["node1", "node3"], None, lambda kind, **f: events.append(f), probe=False)
    assert excluding[-1] == ["node1", "node3"] and events[-1]["answered"] == []


def test_nodes_are_asked_at_the_same_time(monkeypatch: pytest.MonkeyPatch) -> None:
    together = threading.Barrier(3, timeout=10)  # asked one after another, it would break

    def answers(job_id: str, node: str, **kw: Any) -> bool:
        together.wait()
        return node != "node2"

    monkeypatch.setattr(node_requeue.commands, "node_answers", answers)
    told = node_requeue._answers("7", ["node1", "node2", "node3"], {})
    assert told is not None and {n: yes for n, (yes, _) in told.items()} == {
        "node1": True, "node2": False, "node3": True
    }


def test_at_most_sixteen_nodes_are_asked_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    workers: list[int] = []
    real = node_requeue.ThreadPoolExecutor

    def pool(max_workers: int, prefix: str) -> Any:
        workers.append(max_workers)
        return real(max_workers, prefix)

    monkeypatch.setattr(node_requeue, "ThreadPoolExecutor", pool)
    monkeypatch.setattr(node_requeue.commands, "node_answers", lambda job_id, node, **kw: True)
    assert node_requeue._answers("7", [f"node{i}" for i in range(20)], {}) is not None
    assert node_requeue._answers("7", ["node1", "node2"], {}) is not None
    assert workers == [16, 2]


def test_a_requeue_excludes_every_node_when_slurm_cannot_be_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")

    def answers(job_id: str, node: str, **kw: Any) -> bool:
        if node == "node1":
            raise OSError(11, "Resource temporarily unavailable")
        return True

    monkeypatch.setattr(node_requeue.commands, "node_answers", answers)
    monkeypatch.setattr(node_requeue, "requeue_excluding", lambda job_id, lost: node_requeue.Requeued(list(lost)))
    events: list[dict[str, Any]] = []
    node_requeue.requeue_without(["node1", "node2"], None, lambda kind, **f: events.append(f))
    assert events == [dict(cause="node_failure", count=None, excluded=["node1", "node2"], answered=[],
                           run=None, issued_by="nvrx", exclude_error=None, held=False, required=[],
                           exclude_refused=[], slurm_job_id="7")]  # fmt: skip


def test_no_thread_to_ask_with_is_no_answer_and_a_probes_own_error_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_thread(self: Any, fn: Any, *args: Any) -> Any:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(node_requeue.ThreadPoolExecutor, "submit", no_thread)
        assert node_requeue._answers("7", ["node1", "node2"], {}) is None

    def broken(job_id: str, node: str, **kw: Any) -> bool:
        raise RuntimeError("a defect of the probe itself")

    monkeypatch.setattr(node_requeue.commands, "node_answers", broken)
    with pytest.raises(RuntimeError, match="a defect of the probe itself"):
        node_requeue._answers("7", ["node1", "node2"], {})


@pytest.mark.parametrize("refusal", ["not-requeued", "scontrol-failed"])
def test_the_answers_of_a_requeue_that_did_not_happen_are_node_probes(
    monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """A job that may not be requeued (or whose requeue failed) records no ``requeue``; what
    SLURM said of its lost nodes is then recorded as ``node_probe`` events, so the report
    still knows which of them lost only their supervisor."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(node_requeue.commands, "node_answers", lambda job_id, node, **kw: node == "node2")

    def requeue_excluding(job_id: str, lost: list[str]) -> node_requeue.Requeued | None:
        if refusal == "scontrol-failed":
            raise commands.SlurmCommandError(["scontrol", "requeuehold", "7"], 1, "Requested operation is presently disabled")
        return None

    monkeypatch.setattr(node_requeue, "requeue_excluding", requeue_excluding)
    events: list[tuple[str, dict[str, Any]]] = []
    node_requeue.requeue_without(["node1", "node2"], None, lambda kind, **f: events.append((kind, f)))
    assert [(kind, f["lost_host"], f["responding"]) for kind, f in events] == [
        ("node_probe", "node1", False), ("node_probe", "node2", True)
    ]  # fmt: skip
    assert {f["lost_slot"] for _, f in events} == {None}


def test_a_node_the_job_asked_for_by_name_is_not_excluded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ExcNodeList took a node of the job's ReqNodeList (sbatch --nodelist), and the
    requeued job could never start (PENDING, Reason=BadConstraints, on SLURM 22.05). The
    node left in is told (``required``): the requeued job waits for it."""
    info = {"JobState": "RUNNING", "Requeue": "1", "ExcNodeList": "node7", "ReqNodeList": "node[1-2]"}
    monkeypatch.setattr(node_requeue.commands, "show_job", lambda job_id, **kw: info)
    # scontrol's expansion, as tests/slurm/test_nodelist_scontrol.py shows ours is
    monkeypatch.setattr(node_requeue.commands, "show_hostnames", lambda nodes, **kw: expand_nodelist(nodes))
    ran: list[list[str]] = []
    monkeypatch.setattr(node_requeue.commands, "run_command", lambda argv, **kw: ran.append(list(argv)))
    assert node_requeue.requeue_excluding("7", ["node2", "node3"]) == node_requeue.Requeued(
        ["node7", "node3"], required=["node2"]
    )
    assert ran == [
        ["scontrol", "requeuehold", "7"], ["scontrol", "update", "JobId=7", "ExcNodeList=node7,node3"],
        ["scontrol", "release", "7"],
    ]  # fmt: skip


def test_lost_nodes_given_as_an_iterator_are_excluded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the lost nodes were read twice (the ones the job asked for, then the rest), and
    an iterator, which the signature allows, was spent by the first: nothing was excluded."""
    info = {"JobState": "RUNNING", "Requeue": "1", "ExcNodeList": "(null)", "ReqNodeList": "(null)"}
    monkeypatch.setattr(node_requeue.commands, "show_job", lambda job_id, **kw: info)
    monkeypatch.setattr(node_requeue.commands, "show_hostnames", lambda nodes, **kw: expand_nodelist(nodes))
    ran: list[list[str]] = []
    monkeypatch.setattr(node_requeue.commands, "run_command", lambda argv, **kw: ran.append(list(argv)))
    assert node_requeue.requeue_excluding("7", iter(["node2", "", "node3"])) == node_requeue.Requeued(
        ["node2", "node3"]
    )
    assert ["scontrol", "update", "JobId=7", "ExcNodeList=node2,node3"] in ran


#: ``scontrol`` as a script on PATH: it writes each command line it gets to $SCONTROL_LOG,
#: shows job 7 RUNNING and requeueable with node7 excluded already and the nodes of
#: $SCONTROL_REQNODES asked for by name, expands a list of names joined by commas, and
#: refuses each subcommand named in $SCONTROL_REFUSES.
SCONTROL = """#!/bin/sh
echo "$*" >> "$SCONTROL_LOG"
case "$1 $2" in
  "show job") echo "JobId=7 JobState=RUNNING Requeue=1 ExcNodeList=node7 ReqNodeList=${SCONTROL_REQNODES:-(null)}"; exit 0 ;;
  "show hostnames") echo "$3" | tr ',' ' '; exit 0 ;;
esac
case " $SCONTROL_REFUSES " in
  *" $1 "*) echo "scontrol: error: Access/permission denied for $1" >&2; exit 1 ;;
esac
exit 0
"""


def _fake_scontrol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuses: str, reqnodes: str = ""
) -> None:
    """``SCONTROL`` first on PATH, for job 7, its log in ``tmp_path``."""
    program = tmp_path / "bin" / "scontrol"
    program.parent.mkdir()
    program.write_text(SCONTROL)
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SCONTROL_LOG", str(tmp_path / "scontrol.log"))
    monkeypatch.setenv("SCONTROL_REFUSES", refuses)
    monkeypatch.setenv("SCONTROL_REQNODES", reqnodes)
    monkeypatch.setenv("SLURM_JOB_ID", "7")


@pytest.mark.parametrize(
    ("refuses", "excluded", "held"),
    [
        ("", ["node7", "node1"], False),
        ("update", ["node7"], False),  # the nodes it excluded before, not node1
        ("release", ["node7", "node1"], True),
        ("update release", ["node7"], True),
    ],
)
def test_a_job_held_for_requeue_counts_as_requeued_whatever_slurm_says_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    refuses: str, excluded: list[str], held: bool,
) -> None:  # fmt: skip
    """Before: a refused ``scontrol update`` after ``requeuehold`` logged "could not requeue"
    and recorded no ``requeue`` nor ledger entry, though SLURM had requeued the job; a
    refused ``release`` left the job held without a word of how to let it start. The event
    names the SLURM job it requeued, which the commands that let it start take: the events'
    job is ``NVRX_JOB_ID`` when one is set."""
    _fake_scontrol(tmp_path, monkeypatch, refuses)
    monkeypatch.setenv("NVRX_JOB_ID", "mine")
    preemption = SimpleNamespace(run_index=2, ledger=RequeueLedger(tmp_path / "requeues.json"))
    events: list[tuple[str, dict[str, Any]]] = []
    node_requeue.requeue_without(
        ["node1"], preemption, lambda kind, **f: events.append((kind, f)), probe=False  # type: ignore[arg-type]
    )
    assert (tmp_path / "scontrol.log").read_text().splitlines()[-3:] == [
        "requeuehold 7", "update JobId=7 ExcNodeList=node7,node1", "release 7"
    ]  # fmt: skip
    assert [kind for kind, _ in events] == ["requeue"]
    fields = events[0][1]
    assert (fields["count"], fields["run"], fields["excluded"], fields["held"]) == (1, 2, excluded, held)
    if "update" in refuses:  # which nodes SLURM refused, and why
        assert "scontrol update JobId=7 ExcNodeList=node7,node1 exited 1" in fields["exclude_error"]
        assert fields["exclude_refused"] == ["node1"]
    else:
        assert fields["exclude_error"] is None and fields["exclude_refused"] == []
    assert fields["required"] == [] and fields["slurm_job_id"] == "7"
    assert [(e["cause"], e["run"]) for e in preemption.ledger.entries()] == [("node_failure", 2)]
    said = [r.getMessage() for r in caplog.records]
    assert not any("could not requeue" in line for line in said)
    assert any("`scontrol release 7`" in line for line in said) == held


def test_a_requeue_with_no_node_to_add_leaves_the_exclusions_unasked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lost node1 was asked for by name, so nothing is to be excluded. Before: the
    unchanged list was sent all the same, and SLURM's refusal of it was told as "its next
    run may land on : SLURM did not exclude them", with an ``exclude_error``."""
    _fake_scontrol(tmp_path, monkeypatch, "update", reqnodes="node1")
    events: list[tuple[str, dict[str, Any]]] = []
    node_requeue.requeue_without(["node1"], None, lambda kind, **f: events.append((kind, f)), probe=False)
    assert (tmp_path / "scontrol.log").read_text().splitlines()[-2:] == ["requeuehold 7", "release 7"]
    assert [(kind, f["excluded"], f["exclude_error"], f["held"], f["required"]) for kind, f in events] == [
        ("requeue", ["node7"], None, False, ["node1"])
    ]  # fmt: skip
    assert not any("may land on" in r.getMessage() for r in caplog.records)
