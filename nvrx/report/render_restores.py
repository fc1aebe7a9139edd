"""The report's *Steps lost per restore* section: each round that restored the training state."""

from __future__ import annotations

from .model import ReportData, Restore
from .restores import totals
from .text_doc import Doc, when

#: How the steps lost are counted (``restores``), printed under the table.
LOSS_RULE = (
    "newest step before: the newest step any rank had kept, or had reported (progress) since "
    "the previous restore; steps lost = newest step before - step restored"
)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def sources_text(sources: dict[str, int]) -> str:
    """'memory (3 ranks), peer (1 rank)'."""
    return ", ".join(f"{source} ({_plural(n, 'rank')})" for source, n in sources.items()) or "-"


def _after(x: Restore) -> str:
    """The fault the restore follows: the first fault of the round before, or a requeue."""
    if x.round == 0:
        return f"job requeued (run {x.run})"
    if x.cause is None:
        return "-"
    who = f", rank {x.first_rank}" if x.first_rank is not None else ""
    return f"{x.cause} (round {x.round - 1}{who})"


def _step(x: Restore) -> str:
    if not x.restored:
        return "nothing restored: started from step 0"
    return str(x.step) if x.step is not None else "? (no step told)"


def _count(value: int | None) -> str:
    return str(value) if value is not None else "?"


def total_line(restores: list[Restore]) -> str:
    """'3 restores: 8 steps lost in all, at most 7 in one restore'."""
    lost, most, unknown = totals(restores)
    text = f"{_plural(len(restores), 'restore')}: {_plural(lost, 'step')} lost in all"
    text += f", at most {most} in one restore"
    if unknown:
        text += f"; steps lost not known for {unknown} (no step restored or reached told)"
    return text


def restores_section(doc: Doc, r: ReportData) -> None:
    """One row per round that restored the training state; nothing when none did."""
    if not r.restores:
        return
    doc.heading("Steps lost per restore")
    many_runs = r.summary.runs > 1
    rows = [
        ([str(x.run)] if many_runs else [])
        + [
            str(x.round),
            when(x.wall),
            _after(x),
            sources_text(x.sources),
            _step(x),
            _count(x.newest_step),
            _count(x.steps_lost),
        ]
        for x in r.restores
    ]
    headers = (["run"] if many_runs else []) + [
        "round",
        "restored (UTC)",
        "after the fault",
        "restored from",
        "step restored",
        "newest step before",
        "steps lost",
    ]
    doc.table(rows, headers)
    doc.text(total_line(r.restores))
    doc.text(LOSS_RULE)
