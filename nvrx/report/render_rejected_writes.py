"""The report's *Rejected writes* section: control values in the store the job did not write."""

from __future__ import annotations

from .model import ReportData
from .text_doc import Doc, when


def rejected_writes_section(doc: Doc, r: ReportData) -> None:
    """One row per rejected value; nothing when there was none."""
    if not r.rejected_writes:
        return
    doc.heading("Rejected writes")
    rows = [
        [when(x.wall), str(x.run), x.key or "-", str(x.value_bytes or 0), x.reason or "-"]
        for x in r.rejected_writes
    ]
    doc.table(rows, ["when (UTC)", "run", "key", "bytes", "why"])
    doc.text(
        "values of the job's control keys without a valid seal: not acted on; something that "
        "is not this job reaches its store (docs/security.md)"
    )


__all__ = ["rejected_writes_section"]
