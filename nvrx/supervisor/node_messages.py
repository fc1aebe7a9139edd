"""What a supervisor does with the node messages of its node agent.

``node_silent``: declare the slot lost (``NodeRoles.declare``) and stop the
job when no spare is left below ``--min-nodes``; the same report comes from a job-wide
restart for a slot that beats on but never became ready (``JobRestart``, ``cause``
``never_ready``: its supervisor is stuck), so that both take one path; ``fenced``: this node was
declared lost while it stalled, so its children end now; the values of the sealed
chains the slot watches (``NodeRoles.on_chain_value``: one that does not unseal is
recorded and watched past), an assignment: this spare takes over a lost node rank and
starts its children as replacements (restart count 1), which rejoin the running job; ``all_done``: a spare that
was never needed leaves; ``all_ended`` (node 0): every other slot has ended, whenever
that came (the wait at the end of node 0's run reads the flag).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nvrx import jobenv
from nvrx.store.sealed_keys import ChainValue

from . import node_keys, node_requeue, store_failover
from .config import ALL_DONE_KEY, ALL_ENDED_KEY
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .job_restart import JobRestart
from .job_store import JobStore
from .local_ranks import LocalRanks
from .node_control import NodeControl
from .store_link import StoreLinkError

log = logging.getLogger(__name__)


class NodeMessages:
    """Acts on the node messages of the node agent: lost slots, fencing, take-overs, the job's end."""

    def __init__(
        self,
        store: JobStore,
        course: CourseTracker,
        control: NodeControl,
        ranks: LocalRanks,
        job_restart: JobRestart,
        requeue: node_requeue.Requeue,
    ) -> None:
        self.store, self.course, self.control, self.ranks = store, course, control, ranks
        self.job_restart, self.requeue = job_restart, requeue
        self.all_ended = False  # (node 0) every other slot has ended

    def on_message(self, message: dict[str, Any]) -> bool:
        """Act on ``message`` when it is about nodes; False when it is not."""
        try:
            return self._dispatch(message)
        except StoreLinkError as exc:  # the store's loss reaches the main loop as its own message
            log.warning("store failed while handling %s: %s", message, exc)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.control.request_stop(
                f"cannot handle node message {message}: {type(exc).__name__}: {exc}",
                ExitCode.INTERNAL,
                broadcast=True,
            )
        return True

    def _dispatch(self, message: dict[str, Any]) -> bool:
        event, key, roles = message.get("event"), message.get("key"), self.store.roles
        if event == "node_silent":
            self._node_silent(message)
        elif event == "fenced":
            self.fenced()
        elif roles is not None and (
            seen := roles.on_chain_value(key, str(message.get("value", "")))
        ) is not None:
            self._on_chain(*seen)
        else:
            return False
        return True

    def _on_chain(self, base: str, seen: ChainValue) -> None:
        """A watched sealed chain holds a value (one rejected was recorded and watched past)."""
        roles, payload = self.store.roles, seen.payload
        if payload is None or roles is None:
            return
        if base == node_keys.assign(roles.slot):
            self._take_over(payload)
        elif base == ALL_DONE_KEY:
            if self.course.state is Course.SPARE:  # every training node finished: no rank to take
                self.course.to(Course.FINISHING)
        elif base == ALL_ENDED_KEY:
            self.all_ended = True

    def _node_silent(self, message: dict[str, Any]) -> None:
        if self.fence_if_superseded():
            return  # the others see this store host as lost: its silent peers moved on
        assert self.store.roles is not None
        try:
            loss = self.store.roles.declare(message)
        except StoreLinkError as exc:
            log.warning("could not declare slot %s lost: %s", message.get("slot"), exc)
            return
        if loss is not None and loss.action == "stop":
            self.control.request_stop(loss.reason, ExitCode.NODE_LOST, broadcast=True)
            self.requeue([loss.host])
        try:
            if loss is not None:
                self.job_restart.slot_lost(job_stops=self.course.stopping)
            if loss is not None and loss.action == "spare":
                self.job_restart.restart_for_lost_node(loss.node_rank)
        except StoreLinkError as exc:
            self.control.store_unavailable(exc)

    def fenced(self) -> None:
        """This node was declared lost while it stalled: its children end now, without grace."""
        roles = self.store.roles
        if roles is None or roles.left or self.course.stopping:
            return  # it is leaving by itself (its own claim) or already stopping
        self.control.request_stop(
            f"this node was declared lost by the others ({self._why_fenced()}); the job goes on "
            "without it",
            ExitCode.FENCED,
            broadcast=False,
        )
        self.control.kill_at = time.monotonic()  # the job has moved on: no grace

    def _why_fenced(self) -> str:
        """What the others waited for, as far as this node can tell: its silence; in a
        job-wide restart also its readiness (``JobRestart.ready_limit``), whose wait ended
        first when its node agent beat on while this supervisor stalled."""
        config, restart = self.store.config, self.job_restart
        silent = f"it was silent longer than --node-timeout {config.node_timeout:g} s"
        if restart.pending is None:
            return silent
        return (
            f"{silent}, or not ready for job-wide restart {restart.pending} within "
            f"--grace-period + --store-timeout + --node-timeout ({restart.ready_limit():g} s) "
            "of the others: this supervisor stalled"
        )

    def fence_if_superseded(self) -> bool:
        """A store host whose store was replaced while it stalled: the job went on without it."""
        store = self.store
        if store.service is None or not store_failover.superseded(
            store.config.events_dir, store.epoch
        ):
            return False
        self.fenced()
        return True

    def _take_over(self, value: str | None) -> None:
        roles = self.store.roles
        assert roles is not None
        if self.course.stopping or roles.node_rank is not None:
            return
        assignment = roles.take_over(value)
        log.warning("spare slot %d takes over node rank %d", roles.slot, roles.node_rank)
        if self.job_restart.pending is not None:
            return  # a job-wide restart is under way: its go starts this node's ranks with all
        if self.course.state is Course.SPARE:
            self.course.to(Course.TRAINING)
        for local_rank in range(self.store.config.nproc_per_node):
            self.ranks.restarts[local_rank] = 1  # a replacement: it rejoins the running job
            fresh = bool(assignment.get("fresh"))
            self.control.start_child(local_rank, jobenv.FRESH_START if fresh else jobenv.TAKEOVER)
