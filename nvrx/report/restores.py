"""The training steps each restore lost: one ``Restore`` per round that restored the state.

After a fault, a round begins by restoring the training state: from the kept state in
memory or a peer's (``KeptState.restore_agreed`` writes ``state_restored``), or from a
checkpoint (the kept state's checkpoint callback, or the application's own load: a
``checkpoint`` event with ``action=load``). The first round of the job restores nothing
lost, so only later rounds count; the first round of a later job run (a requeue) does.

Steps lost = the newest step reached before the restore - the step restored (0 when
nothing was). The newest step reached is the highest of the newest step any rank had kept
(``newest_step``), the ``progress`` steps since the previous restore (the job's start for
the first), and the step that restore resumed from; never below the step restored.
Progress before the previous restore is not counted again: that restore lost it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .merging import max_opt
from .model import Restore, RoundRow
from .parts import RoundState

if TYPE_CHECKING:
    from .job_summary import JobSummary

#: How the sources are listed; a source unknown here comes after them.
SOURCE_ORDER = ("memory", "peer", "checkpoint", "none")
#: The source of a rank that loaded a checkpoint itself (``checkpoint`` event, action=load).
CHECKPOINT = "checkpoint"
NONE = "none"


def _source_key(source: str) -> tuple[int, str]:
    order = SOURCE_ORDER.index(source) if source in SOURCE_ORDER else len(SOURCE_ORDER)
    return order, source


def rank_sources(state: RoundState) -> dict[str, int]:
    """Ranks per source of the round's restores, in ``SOURCE_ORDER``. A rank whose kept
    state held nothing (``none``), or that wrote no ``state_restored``, and that loaded a
    checkpoint, restored from the checkpoint."""
    by_rank: dict[int | None, str] = {}
    for source in sorted(state.restored_by, key=_source_key):
        for rank in state.restored_by[source]:
            by_rank.setdefault(rank, source)
    for rank in state.loaded_ranks:
        if by_rank.get(rank, NONE) == NONE:
            by_rank[rank] = CHECKPOINT
    counts: dict[str, int] = {}
    for source in by_rank.values():
        counts[source] = counts.get(source, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: _source_key(kv[0])))


def _is_restore(key: tuple[int, int], state: RoundState) -> bool:
    return key != (0, 0) and bool(state.restored_by or state.loaded_ranks)


def _restore(
    key: tuple[int, int], state: RoundState, reached: int | None, before: RoundRow | None
) -> Restore:
    """The restore of round ``key``, the newest step reached since the previous one being
    ``reached``; ``before``: the timeline's row of the round it follows."""
    sources = rank_sources(state)
    restored = any(source != NONE for source in sources)
    step = None
    if restored:  # the kept state's step where it told one, else the checkpoint loaded
        step = state.restored_step if state.restored_step is not None else state.loaded_step
    base = step if restored else 0
    newest = max_opt(reached, state.kept_newest)
    if newest is not None and base is not None:
        newest = max(newest, base)  # a step restored was reached, even where no event said so
    return Restore(
        run=key[0],
        round=key[1],
        wall=state.restored_wall,
        cause=before.cause if before is not None else None,
        first_rank=before.first_rank if before is not None else None,
        sources=sources,
        restored=restored,
        step=step,
        newest_step=newest,
        steps_lost=newest - base if newest is not None and base is not None else None,
    )


def build_restores(job: JobSummary, timeline: list[RoundRow]) -> list[Restore]:
    """Every restore of the job, in order of run and round."""
    rows = {(t.run, t.round): t for t in timeline}
    restores: list[Restore] = []
    reached: int | None = None  # the newest step reached since the previous restore
    for key in sorted(job.rounds):
        state = job.rounds[key]
        if _is_restore(key, state):
            restore = _restore(key, state, reached, rows.get((key[0], key[1] - 1)))
            restores.append(restore)
            reached = restore.step if restore.restored else 0
        reached = max_opt(reached, state.progress_step)
    return restores


def totals(restores: list[Restore]) -> tuple[int, int, int]:
    """(steps lost in all, most lost by one restore, restores whose loss is not known)."""
    known = [x.steps_lost for x in restores if x.steps_lost is not None]
    return sum(known), max(known, default=0), len(restores) - len(known)
