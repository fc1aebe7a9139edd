"""Stragglers while the job runs: this node's step times, and on the store's host, the job's.

Each supervisor keeps a window of step times (own work, ``record_step`` or the section
``--straggler-section``) per rank of its node, as the rank watch hands them over. Every
``PUBLISH_S`` it writes its ranks' window medians to the store in one key
(``node_keys.step_times``: one write per node, whatever its ranks), and reads the job's
exclusion list (``node_keys.STRAGGLERS``: one read). The supervisor that hosts the store
also reads every slot's medians, scores ranks and nodes against the job's fast ranks
(``nvrx.straggler``), and writes a ``straggler`` event for each rank or node named slow or
cleared. With ``--straggler-action exclude`` and a spare free, a node named slow is put on
the exclusion list; its own supervisor, reading it, leaves the job as ``ExcludeThisNode``
does (its slot is declared lost, a spare takes its node rank).

A slot whose medians stop changing for ``STALE_S`` (it ended, was lost, or its ranks
restart) is left out until they change again, so that a node gone does not hold the
scores of the others still. Store errors are logged and skipped: the scores are advice,
never a reason to stop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nvrx.straggler import Change, StepScores, node_scores_of, reference_of, scores_of

from . import node_keys
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .job_store import JobStore
from .node_control import NodeControl
from .store_link import StoreLinkError

log = logging.getLogger(__name__)

#: Seconds between two publications of a node's medians (and two scorings on the store's host).
PUBLISH_S = 0.5
#: A slot's medians unchanged this long are left out of the scores.
STALE_S = 5.0


@dataclass
class _Slot:
    """What the store's host last read of one slot."""

    payload: str
    changed: float  # time.monotonic() when it last changed


@dataclass
class _JobView:
    """The medians of every fresh slot, merged: per rank its median, steps and slot."""

    medians: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)  # slot -> node_rank, host


class StepTimes:
    """This node's windows of step times, their publication, and the job's scorer."""

    def __init__(
        self, store: JobStore, course: CourseTracker, control: NodeControl
    ) -> None:
        self.store, self.course, self.control = store, course, control
        cfg = store.config
        self.rule = cfg.straggler_rule
        self.action = cfg.straggler_action
        self.source = f"section {cfg.straggler_section}" if cfg.straggler_section else "record_step"
        self.local = StepScores(self.rule)  # this node's ranks' windows
        self.counts: dict[int, int] = {}  # steps recorded per rank of this node
        self.judged = StepScores(self.rule)  # the scorer's verdicts (store's host)
        self._last_steps: dict[tuple[int, int], int] = {}  # (slot, rank): steps at the last evaluation
        self._slots: dict[int, _Slot] = {}
        self._excluded: set[int] = set()  # slots put on the exclusion list
        self._next = time.monotonic() + PUBLISH_S

    def record(self, rank: int | None, seconds: Sequence[float]) -> None:
        """Rank ``rank`` of this node made ``len(seconds)`` steps that took ``seconds``."""
        if rank is None:
            return
        for value in seconds:
            self.local.record(rank, value)
        self.counts[rank] = self.counts.get(rank, 0) + len(seconds)

    def timeout(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to the next publication, once any step time came."""
        if not self.counts:
            return timeout
        wait = max(0.0, self._next - time.monotonic())
        return wait if timeout is None else min(timeout, wait)

    def check(self) -> None:
        """Publish, score and act when due."""
        now = time.monotonic()
        if not self.counts or now < self._next or not self.store.usable:
            return
        self._next = now + PUBLISH_S
        try:
            self._publish()
            if self.store.service is not None:
                self._score(now)
            self._leave_if_excluded()
        except StoreLinkError as exc:
            log.warning("straggler scores skipped: %s", exc)

    # -- every node ---------------------------------------------------------------
    def _publish(self) -> None:
        medians = self.local.medians()
        if not medians:
            return
        cfg = self.store.config
        payload = {
            "node_rank": self.control.node_rank,
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "ranks": {str(r): [self.counts[r], m] for r, m in sorted(medians.items())},
        }
        self.store.link.set(node_keys.step_times(cfg.node_rank), json.dumps(payload))  # type: ignore[union-attr]

    def _leave_if_excluded(self) -> None:
        if self.course.state is not Course.TRAINING:
            return
        raw = self.store.link.get(node_keys.STRAGGLERS)  # type: ignore[union-attr]
        slot = self.store.config.node_rank
        if raw is None or slot not in json.loads(raw).get("exclude", []):
            return
        self.control.request_stop(
            "named a straggler: its ranks' steps were slower than the job's fast ranks "
            "(--straggler-action exclude)",
            ExitCode.EXCLUDED,
            False,
        )

    # -- the store's host ---------------------------------------------------------
    def _score(self, now: float) -> None:
        view = self._read_slots(now)
        counted = {(view.slot_of[r], r): steps for r, steps in view.steps.items()}
        advance = min((n - self._last_steps.get(k, 0) for k, n in counted.items()), default=0)
        scores = scores_of(view.medians)
        if advance <= 0 or not scores:
            return
        self._last_steps.update(counted)
        node_scores = node_scores_of(scores, view.slot_of)
        changes = self.judged.evaluate(scores, "rank", advance)
        changes += self.judged.evaluate(node_scores, "node", advance)
        for change in changes:
            self._tell(change, view)

    def _read_slots(self, now: float) -> _JobView:
        view = _JobView()
        link = self.store.link
        for slot in range(self.store.config.nnodes):
            raw = link.get(node_keys.step_times(slot))  # type: ignore[union-attr]
            if raw is None:
                continue
            seen = self._slots.get(slot)
            if seen is None or seen.payload != raw:
                seen = self._slots[slot] = _Slot(raw, now)
            if now - seen.changed > STALE_S:
                continue
            node = json.loads(raw)
            view.nodes[slot] = node
            for rank, (steps, median) in node["ranks"].items():
                view.medians[int(rank)], view.steps[int(rank)] = median, steps
                view.slot_of[int(rank)] = slot
        return view

    def _tell(self, change: Change, view: _JobView) -> None:
        """One ``straggler`` event for ``change``; the exclusion list, when asked for."""
        reference = reference_of(view.medians)
        if change.of == "node":
            slot = int(change.who)
            ranks = sorted(r for r, s in view.slot_of.items() if s == slot)
            median = statistics.median(view.medians[r] for r in ranks)
        else:
            slot, ranks, median = view.slot_of[change.who], [change.who], view.medians[change.who]
        action = "report"
        if change.of == "node" and self.action == "exclude" and change.state == "slow":
            action = "exclude" if self._exclude(slot) else "none"
        node = view.nodes.get(slot, {})
        self.control.emit(
            "straggler", of=change.of, state=change.state, who=change.who,
            node_rank=node.get("node_rank"), slot=slot, straggler_host=node.get("host"),
            ranks=ranks, score=round(change.score, 4), median_s=median, reference_s=reference,
            slower_pct=round(100 * (median / reference - 1), 1) if reference > 0 else None,
            step=min(view.steps[r] for r in ranks), window=self.rule.window,
            threshold=self.rule.threshold, action=action, source=self.source,
        )  # fmt: skip

    def _exclude(self, slot: int) -> bool:
        """Put ``slot`` on the exclusion list if a spare is free to take its place."""
        if slot in self._excluded:
            return True
        cfg, link = self.store.config, self.store.link
        free = [
            spare
            for spare in range(cfg.active_nodes, cfg.nnodes)
            if link.add(node_keys.claim(spare), 0) == 0  # type: ignore[union-attr]
            and link.add(node_keys.spare_taken(spare), 0) == 0  # type: ignore[union-attr]
        ]
        if not free:
            return False
        self._excluded.add(slot)
        link.set(node_keys.STRAGGLERS, json.dumps({"exclude": sorted(self._excluded)}))  # type: ignore[union-attr]
        return True


__all__ = ["PUBLISH_S", "STALE_S", "StepTimes"]
