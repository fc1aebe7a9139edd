"""Stragglers while the job runs, the job's part: the store's host judges every rank and node.

Every look (each ``step_times.PUBLISH_S``), the supervisor that hosts the store reads each
slot's medians (``node_keys.step_times``), scores each rank as the job's reference step
time over its own median, and each node the same way among the nodes by the median of
its ranks' medians (``nvrx.straggler``), and writes a ``straggler`` event for each rank or node named slow or
cleared. A verdict changes only after it held for ``rule.confirm`` steps and ``rule.looks``
looks: one look after many steps (the first, or a fast job) never names anyone alone. A
change whose telling meets a store error (listing a node for exclusion) is taken back and
made again at the next look, so its event is neither lost nor written twice.

A rank counts only while its step count moves: one whose count stood still for
``STALE_S`` (or ``STALE_STEPS`` of the slowest median, where steps are long: ended, lost,
left inactive, restarting) is left out until it moves again, so
that it neither holds the others' verdicts nor sets the reference. The steps a look
counts are the fewest any counted rank made since the last look; a rank first seen
counts from there, and a rank seen on another slot than before (a spare took its node
over) is judged afresh.

With ``--straggler-action exclude``, a node named slow is put on the exclusion list
(``node_keys.STRAGGLERS``) while more spares are free than nodes already listed and not
yet gone; the store's host never lists its own slot (its leaving would move the store).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nvrx.straggler import (
    Change,
    StepScores,
    node_medians_of,
    node_scores_of,
    reference_of,
    scores_of,
)

from . import node_keys
from .job_store import JobStore
from .node_control import NodeControl
from .store_link import StoreLinkError

#: Least seconds a rank's step count may stand still before it is left out of the scores;
#: more where steps are long (``STALE_STEPS`` of the job's slowest median).
STALE_S, STALE_STEPS = 5.0, 3


@dataclass
class _Count:
    """One rank's step count as the judge last saw it, and when it last moved."""

    steps: int
    moved: float  # time.monotonic()
    counted: int  # its steps at the last look that judged


@dataclass
class _View:
    """The ranks counted at one look: their medians, step counts, slots; the slots' nodes."""

    medians: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)


class StragglerJudge:
    """The store's host's scores of the running job; see the module."""

    def __init__(self, store: JobStore, control: NodeControl) -> None:
        self.store, self.control = store, control
        cfg = store.config
        self.rule, self.action = cfg.straggler_rule, cfg.straggler_action
        self.source = f"section {cfg.straggler_section}" if cfg.straggler_section else "record_step"
        self.verdicts = StepScores(self.rule)
        self._counts: dict[tuple[int, int], _Count] = {}  # (slot, rank)
        self._slot_of: dict[int, int] = {}  # rank -> the slot it was last judged on
        self._excluded: set[int] = set()

    def look(self, now: float) -> None:
        """Read every slot's medians, judge, and tell what changed."""
        view = self._read(now)
        self._follow_moves(view)
        scores = scores_of(view.medians)
        if not scores:
            return
        keys = [(view.slot_of[r], r) for r in view.steps]
        advance = min(view.steps[k[1]] - self._counts[k].counted for k in keys)
        if advance <= 0:
            return
        for key in keys:
            self._counts[key].counted = view.steps[key[1]]
        changes = self.verdicts.evaluate(scores, "rank", advance)
        changes += self.verdicts.evaluate(node_scores_of(view.medians, view.slot_of), "node", advance)
        for i, change in enumerate(changes):
            try:
                self._tell(change, view)
            except StoreLinkError:  # told at the next look: none is lost, none told twice
                for untold in changes[i:]:
                    self.verdicts.take_back(untold)
                raise

    def _follow_moves(self, view: _View) -> None:
        """A rank now on another slot (a spare took its node over) is judged afresh there:
        what was said of it on its old node is not said of the new one."""
        for rank, slot in view.slot_of.items():
            if self._slot_of.setdefault(rank, slot) != slot:
                self.verdicts.reset("rank", rank)
                self._slot_of[rank] = slot

    def _read(self, now: float) -> _View:
        view = _View()
        for slot in range(self.store.config.nnodes):
            raw = self.store.get_sealed(node_keys.step_times(slot))
            if raw is not None:
                self._take(slot, json.loads(raw), now, view)
        stale = max(STALE_S, STALE_STEPS * max(view.medians.values(), default=0.0))
        for rank, median in list(view.medians.items()):
            if median <= 0 or now - self._counts[(view.slot_of[rank], rank)].moved > stale:
                del view.medians[rank], view.steps[rank], view.slot_of[rank]
        return view

    def _take(self, slot: int, node: dict[str, Any], now: float, view: _View) -> None:
        """Add slot ``slot``'s published ranks to ``view``."""
        view.nodes[slot] = node
        for rank_text, (steps, median) in node["ranks"].items():
            rank, steps = int(rank_text), int(steps)
            seen = self._counts.get((slot, rank))
            if seen is None:
                seen = self._counts[(slot, rank)] = _Count(steps, now, steps)
            elif seen.steps != steps:
                seen.steps, seen.moved = steps, now
            view.medians[rank], view.steps[rank] = float(median), steps
            view.slot_of[rank] = slot

    def _tell(self, change: Change, view: _View) -> None:
        """One ``straggler`` event for ``change``; the exclusion list, when asked for."""
        if change.of == "node":  # judged among the nodes
            slot = int(change.who)
            ranks = sorted(r for r, s in view.slot_of.items() if s == slot)
            nodes = node_medians_of(view.medians, view.slot_of)
            reference, median = reference_of(nodes), nodes[slot]
        else:
            slot, ranks = view.slot_of[change.who], [change.who]
            reference, median = reference_of(view.medians), view.medians[change.who]
        action = "report"
        if change.of == "node" and self.action == "exclude" and change.state == "slow":
            action = self._exclude(slot, view)
        node = view.nodes.get(slot, {})
        self.control.emit(
            "straggler", of=change.of, state=change.state, who=change.who,
            node_rank=node.get("node_rank"), slot=slot, straggler_host=node.get("host"),
            ranks=ranks, score=round(change.score, 4), median_s=median, reference_s=reference,
            slower_pct=round(100 * (median / reference - 1), 1),
            step=min(view.steps[r] for r in ranks), window=self.rule.window,
            threshold=self.rule.threshold, action=action, source=self.source,
        )  # fmt: skip

    def _exclude(self, slot: int, view: _View) -> str:
        """List ``slot`` for exclusion if a spare is free for it and it is not this slot: the
        event's action, ``exclude``, ``store_host`` (this slot) or ``none`` (no spare free)."""
        if slot in self._excluded:
            return "exclude"
        if slot == self.store.config.node_rank:
            return "store_host"
        pending = {s for s in self._excluded if s in view.slot_of.values()}  # not gone yet
        roles = self.store.roles
        if roles is None or roles.free_spares() <= len(pending):
            return "none"
        listed = json.dumps({"exclude": sorted(self._excluded | {slot})})
        self.store.set_sealed(node_keys.STRAGGLERS, listed)
        self._excluded.add(slot)
        return "exclude"


__all__ = ["STALE_S", "STALE_STEPS", "StragglerJudge"]
