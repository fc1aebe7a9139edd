"""SLURM's job records read for what they are: a RESIZING record is not a run."""

from __future__ import annotations

from nvrx.report.model import SlurmContext, SlurmRow
from nvrx.report.slurm_context import runs, sacct_requeues


def _row(state: str, nodes: str = "node[1-2]") -> SlurmRow:
    return SlurmRow("7", "train", state, "0:0", "00:01:00", nodes, None, None)


def test_a_resized_allocation_is_not_a_requeue() -> None:
    # a --no-kill job lost node2: the old allocation's record says RESIZING, the job ran on
    ctx = SlurmContext(available=True, job=[_row("RESIZING"), _row("COMPLETED", "node[1,3]")])
    assert sacct_requeues(ctx) == 0
    assert [r.node_list for r in runs(ctx)] == ["node[1,3]"]


def test_each_requeued_run_counts() -> None:
    ctx = SlurmContext(
        available=True,
        job=[_row("REQUEUED"), _row("RESIZING"), _row("REQUEUED"), _row("COMPLETED")],
    )
    assert sacct_requeues(ctx) == 2
    assert [r.state for r in runs(ctx)] == ["REQUEUED", "REQUEUED", "COMPLETED"]


def test_no_accounting_no_runs() -> None:
    assert runs(SlurmContext(available=False, job=[_row("COMPLETED")])) == []
    assert sacct_requeues(SlurmContext()) == 0
