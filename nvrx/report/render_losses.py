"""The report's *Lost nodes* section: each node its peers declared lost, and what followed."""

from __future__ import annotations

from .model import NodeLoss, ReportData
from .node_loss import EXCLUDED, NEVER_READY
from .text_doc import Doc, ranks_text, secs, when

#: How "trained again after" is measured, printed under the table.
RECOVERY_RULE = (
    "trained again after: from the node's last heartbeat to the first round_start of the "
    "job at its size before the loss (a spare took over), or of its next round (it shrank); "
    "without the Wrapper, to the last node starting its children in the first job-wide "
    "restart after the declaration that every training node started"
)


def _node(loss: NodeLoss) -> str:
    slot = f"slot {loss.slot}" if loss.slot is not None else "slot ?"
    if loss.node is None:
        return f"spare ({slot})"
    return f"node rank {loss.node} ({slot})"


def how_lost(loss: NodeLoss) -> str:
    """Why its peers declared it lost (``cause``), in words: its silence, a job-wide restart
    it never became ready for while its node beat on, or its own exclusion."""
    if loss.cause == NEVER_READY:
        return "never ready for a job-wide restart (its supervisor stalled while its node beat)"
    if loss.cause == EXCLUDED:
        return "excluded: it left the job itself"
    return f"silent {secs(loss.silent_s)}" if loss.silent_s is not None else "silent"


def detection(loss: NodeLoss) -> str:
    """How the loss was found: why it was declared lost, who saw it, and SLURM's view of the node."""
    parts = [how_lost(loss)]
    if loss.seen_by is not None:
        parts.append(f"seen by slot {loss.seen_by}")
    text = ", ".join(parts)
    if loss.slurm_state:
        state = loss.slurm_state.get("State") or "?"
        reason = loss.slurm_state.get("Reason")
        text += f"; SLURM: {state}" + (f" ({reason})" if reason else "")
    return text


def recovery(loss: NodeLoss) -> str:
    """How long until every rank trained again (``RECOVERY_RULE``), or why it is not known."""
    if loss.after_run_end:
        return "- (declared after its run ended)"
    if loss.recovery_s is not None:
        size = f", world size {loss.world_size}" if loss.world_size is not None else ""
        return f"{secs(loss.recovery_s)} ({when(loss.recovered_wall)}{size})"
    if loss.action == "stop":
        return "never (job stopped)"
    if loss.action == "none":
        return "- (no ranks lost)"
    return "not seen in the events"


def node_losses_section(doc: Doc, r: ReportData) -> None:
    """One row per lost node; nothing when no node was lost."""
    if not r.node_losses:
        return
    doc.heading("Lost nodes")
    many_runs = r.summary.runs > 1
    rows = [
        ([str(x.run)] if many_runs else [])
        + [
            when(x.last_seen_wall),
            _node(x),
            x.host or "-",
            ranks_text(x.ranks),
            detection(x),
            recovery(x),
            x.outcome + (f" ({secs(x.takeover_s)} after)" if x.takeover_s is not None else ""),
        ]
        for x in r.node_losses
    ]
    headers = (["run"] if many_runs else []) + [
        "last seen (UTC)",
        "node",
        "host",
        "ranks",
        "detected",
        "trained again after",
        "what happened",
    ]
    doc.table(rows, headers)
    doc.text(RECOVERY_RULE)
