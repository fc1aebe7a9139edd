"""Stragglers while the job runs, a node's part: its ranks' step times, published per node.

Each supervisor keeps a window of step times (own work: ``record_step``, ``timed_step``,
or the section ``--straggler-section``) per rank of its node, as the rank watch hands
them over; a rank's window starts afresh with each new process of it (its first steps
warm up). Every ``PUBLISH_S`` it writes its ranks' window medians to the store in one key
(``node_keys.step_times``: one write per node, whatever its ranks) and reads the job's
exclusion list (``node_keys.STRAGGLERS``: one read); the supervisor that hosts the store
then judges the job (``straggler_judge``). A slot on the exclusion list leaves the job as
``ExcludeThisNode`` does (its slot is declared lost, a spare takes its node rank) while a
spare is still free; without one it stays and says so.

Store errors and unreadable values are logged and skipped: the scores are advice, never
a reason to stop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Sequence

from nvrx.straggler import StepScores

from . import node_keys
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .job_store import JobStore
from .node_control import NodeControl
from .store_link import StoreLinkError
from .straggler_judge import StragglerJudge

log = logging.getLogger(__name__)

#: Seconds between two publications of a node's medians (and two looks of the judge).
PUBLISH_S = 0.5


class StepTimes:
    """This node's windows of step times, their publication, and its leaving when excluded."""

    def __init__(self, store: JobStore, course: CourseTracker, control: NodeControl) -> None:
        self.store, self.course, self.control = store, course, control
        self.local = StepScores(store.config.straggler_rule)  # this node's ranks' windows
        self.counts: dict[int, int] = {}  # steps recorded per rank of this node
        self.judge = StragglerJudge(store, control)  # looks only where the store is hosted
        self._next = time.monotonic() + PUBLISH_S
        self._stays = False  # listed for exclusion, but no spare was free: said once
        cfg = store.config
        if cfg.straggler_action == "exclude" and not cfg.spare_nodes and cfg.node_rank == 0:
            log.warning("--straggler-action exclude without --spare-nodes: a slow node is only named")

    def record(self, rank: int | None, seconds: Sequence[float]) -> None:
        """Rank ``rank`` of this node made ``len(seconds)`` steps that took ``seconds``."""
        if rank is None:
            return
        for value in seconds:
            self.local.record(rank, value)
        self.counts[rank] = self.counts.get(rank, 0) + len(seconds)

    def restart(self, rank: int | None) -> None:
        """A new process of ``rank`` began: its window starts afresh (its count goes on)."""
        if rank is not None:
            self.local.forget(rank)

    def timeout(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to the next publication or look, once there is one to make."""
        if self._idle:
            return timeout
        wait = max(0.0, self._next - time.monotonic())
        return wait if timeout is None else min(timeout, wait)

    def check(self) -> None:
        """Publish, judge and leave when due."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + PUBLISH_S
        if not self.store.usable or self._idle:
            return
        try:
            if self.counts:
                self._publish()
            if self.store.service is not None:
                self.judge.look(now)
            if self.counts:
                self._leave_if_excluded()
        except StoreLinkError as exc:  # a lost store comes through the link's own event
            log.warning("straggler scores skipped: %s", exc)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("straggler scores skipped: unreadable value in the store (%s)", exc)

    @property
    def _idle(self) -> bool:
        """Nothing to publish (no rank recorded a step) and no job to judge (no store here)."""
        return not self.counts and self.store.service is None

    def _publish(self) -> None:
        medians = self.local.medians()
        if not medians:
            return
        payload = {
            "node_rank": self.control.node_rank,
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "ranks": {str(r): [self.counts[r], m] for r, m in sorted(medians.items())},
        }
        self.store.set_sealed(node_keys.step_times(self.store.config.node_rank), json.dumps(payload))

    def _leave_if_excluded(self) -> None:
        if self.course.state is not Course.TRAINING:
            return
        slot = self.store.config.node_rank
        # every node reads the list: the store's host, which wrote it, tells a forged one
        raw = self.store.get_sealed(node_keys.STRAGGLERS, tell=self.store.service is not None)
        if raw is None or slot not in json.loads(raw).get("exclude", []):
            return
        # a spare taken meanwhile (a node lost): leaving now would shrink the job
        roles = self.store.roles
        if roles is None or not roles.free_spares():
            if not self._stays:
                log.warning("named a straggler and asked to leave, but no spare is free: staying")
            self._stays = True
            return
        self.control.request_stop(
            "named a straggler: its ranks' steps were slower than the job's fast ranks "
            "(--straggler-action exclude)",
            ExitCode.EXCLUDED,
            False,
        )


__all__ = ["PUBLISH_S", "StepTimes"]
