"""What a supervisor does with the node messages of its store agent (a mixin of ``Supervisor``).

``node_silent``: declare the slot lost (``NodeRoles.declare``) and stop the
job when no spare is left below ``--min-nodes``; ``fenced``: this node was
declared lost while it stalled, so its children end now; an assignment: this
spare takes over a lost node rank and starts its children as replacements
(restart count 1), which rejoin the running job; ``all_done``: a spare that
was never needed leaves; ``all_ended`` (node 0): every other slot has ended, whenever
that came (the wait at the end of node 0's run reads the flag).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from nvrx import jobenv
from nvrx.slurm import commands

from . import node_keys, node_requeue, store_failover
from .config import ALL_DONE_KEY, ALL_ENDED_KEY
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .store_link import StoreLinkError

log = logging.getLogger(__name__)


class NodeMessages:
    """Handles node messages; expects the attributes and methods of ``Supervisor``."""

    roles: Any
    service: Any
    preemption: Any
    _epoch: int
    config: Any
    restarts: dict[int, int]
    course: CourseTracker
    _all_ended: bool
    _kill_at: float | None

    def _on_node_message(self, message: dict[str, Any]) -> bool:
        """Act on ``message`` when it is about nodes; False when it is not."""
        try:
            return self._dispatch(message)
        except StoreLinkError as exc:  # the store's loss reaches the main loop as its own message
            log.warning("store failed while handling %s: %s", message, exc)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.request_stop(
                f"cannot handle node message {message}: {type(exc).__name__}: {exc}",
                ExitCode.INTERNAL,
                broadcast=True,
            )
        return True

    def _dispatch(self, message: dict[str, Any]) -> bool:
        event, key = message.get("event"), message.get("key")
        if event == "node_silent":
            self._node_silent(message)
        elif event == "fenced":
            self._fenced()
        elif self.roles is not None and key == node_keys.assign(self.roles.slot):
            self._take_over(message.get("value"))
        elif key == ALL_DONE_KEY:
            if self.course.state is Course.SPARE:  # every training node finished: no rank to take
                self.course.to(Course.FINISHING)
        elif key == ALL_ENDED_KEY:
            self._all_ended = True
        else:
            return False
        return True

    def _node_silent(self, message: dict[str, Any]) -> None:
        if self._fence_if_superseded():
            return  # the others see this store host as lost: its silent peers moved on
        try:
            loss = self.roles.declare(message)
        except StoreLinkError as exc:
            log.warning("could not declare slot %s lost: %s", message.get("slot"), exc)
            return
        if loss is not None and loss.action == "stop":
            self.request_stop(loss.reason, ExitCode.NODE_LOST, broadcast=True)
            self._requeue_without(loss.host)
        try:
            if loss is not None and loss.action == "spare":
                self._restart_for_lost_node(loss.node_rank)
        except StoreLinkError as exc:
            self._store_unavailable(exc)

    def _requeue_without(self, host: str | None) -> None:
        """Under SLURM, the job that stopped for a lost node runs again on other nodes."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id or not host:
            return
        try:
            excluded = node_requeue.requeue_excluding(job_id, [host])
        except (commands.SlurmCommandError, OSError) as exc:
            log.error("could not requeue job %s without %s: %s", job_id, host, exc)
            return
        if excluded is None:
            return
        count = None
        if self.preemption is not None:  # the next run's node 0 then knows who requeued, and why
            run = self.preemption.run_index
            count = self.preemption.ledger.append("node_failure", run, issued_by="nvrx")
        self._emit("requeue", cause="node_failure", count=count, excluded=excluded)

    def _fenced(self) -> None:
        if self.roles is None or self.roles.left or self.course.stopping:
            return  # it is leaving by itself (its own claim) or already stopping
        self.request_stop(
            "this node was declared lost by the others (it was silent longer than "
            f"--node-timeout {self.config.node_timeout:g} s); the job goes on without it",
            ExitCode.FENCED,
            broadcast=False,
        )
        self._kill_at = time.monotonic()  # the job has moved on: no grace

    def _fence_if_superseded(self) -> bool:
        """A store host whose store was replaced while it stalled: the job went on without it."""
        if self.service is None or not store_failover.superseded(
            self.config.events_dir, self._epoch
        ):
            return False
        self._fenced()
        return True

    def _take_over(self, value: str | None) -> None:
        if self.course.stopping or self.roles.node_rank is not None:
            return
        assignment = self.roles.take_over(value)
        log.warning("spare slot %d takes over node rank %d", self.roles.slot, self.roles.node_rank)
        if self._job_restart is not None:
            return  # a job-wide restart is under way: its go starts this node's ranks with all
        if self.course.state is Course.SPARE:
            self.course.to(Course.TRAINING)
        for local_rank in range(self.config.nproc_per_node):
            self.restarts[local_rank] = 1  # a replacement: it rejoins the running job
            fresh = bool(assignment.get("fresh"))
            self._start_child(local_rank, jobenv.FRESH_START if fresh else jobenv.TAKEOVER)

    # provided by Supervisor
    _job_restart: int | None

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        raise NotImplementedError

    def _start_child(self, local_rank: int, flag: str | None = None) -> None:
        raise NotImplementedError

    def _emit(self, kind: str, **fields: object) -> None:
        raise NotImplementedError
