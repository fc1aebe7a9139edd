"""How a supervisor ends its part of the job (a mixin of ``Supervisor``).

A training node reports its children done; the last one sets ``all_done``,
which lets idle spares leave. Every slot claims its own end when it leaves,
so that nobody declares it lost once it is gone. Node 0 hosts the store, so it
waits until every other slot has ended (left, or been declared lost) before
it takes the store down, at most ``--finish-timeout``.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from typing import Any

from nvrx.slurm import commands
from nvrx.store.service import PROGRESS_EVERY_S

from . import node_requeue
from .config import STOP_KEY, StopRequest
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .store_link import StoreLinkError

log = logging.getLogger(__name__)


class JobEnd:
    """The end of a supervisor's run; expects the attributes and methods of ``Supervisor``."""

    config: Any
    link: Any
    roles: Any
    service: Any
    exit_code: int
    course: CourseTracker
    stop_reason: str | None
    _signalled: int | None
    _all_ended: bool
    _epoch: int

    def _finish(self) -> None:
        """All local children ended: report this node done; node 0 keeps the store up until
        every other supervisor (spares too) has left or been declared lost."""
        cfg = self.config
        link = self.link
        if link is None or link.lost is not None or self.roles is None:
            return
        if self.exit_code == ExitCode.FENCED:
            return  # the job went on without this node: nothing of it counts, nobody waits for it
        if self.exit_code == ExitCode.EXCLUDED:
            self._leave_as_lost()  # a rank asked to exclude this node (``workload_control``)
            return
        try:
            if self.node_rank is not None:
                self.roles.node_done()
        except StoreLinkError as exc:
            log.warning("could not report node %d done: %s", cfg.node_rank, exc)
            return
        if self.service is not None and cfg.nnodes > 1:  # the store host
            self._wait_for_other_nodes(time.monotonic() + cfg.finish_timeout)
            if self._epoch > 0 and self.exit_code == ExitCode.OK:
                self._end_orphaned_job()

    def _end_orphaned_job(self) -> None:
        """Under SLURM, after a failover the batch script is gone (it ran on node 0): end the job."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            return
        self._emit(
            "job_stop",
            reason="the batch host was lost; nvrx ends the job in SLURM after its training ended",
            exit_code=int(self.exit_code),
        )
        try:
            node_requeue.end_orphaned_job(job_id)
        except (commands.SlurmCommandError, OSError) as exc:
            log.error("could not end job %s: %s", job_id, exc)

    def _wait_for_other_nodes(self, deadline: float) -> None:
        """Wait for the other slots to end; every ``PROGRESS_EVERY_S`` a log line names them."""
        selector = self._make_selector()
        start = time.monotonic()
        note = start + PROGRESS_EVERY_S
        try:
            while not self._other_nodes_done(selector, deadline, note):
                if time.monotonic() >= note:
                    self._note_waiting(start)
                    note = time.monotonic() + PROGRESS_EVERY_S
        finally:
            selector.close()

    def _note_waiting(self, start: float) -> None:
        slots = [] if self.roles is None else self.roles.running_slots()
        others = [s for s in slots if s != self.config.node_rank]
        log.warning(
            "still waiting for node slot(s) %s to finish, %.0f s of --finish-timeout %g s",
            ", ".join(map(str, others)) or "(unknown)",
            time.monotonic() - start, self.config.finish_timeout,
        )  # fmt: skip

    def _other_nodes_done(
        self, selector: selectors.BaseSelector, deadline: float, wake: float | None = None
    ) -> bool:
        """One wait for the other nodes' end, until ``deadline`` or ``wake`` at most; True
        when waiting is over (done, lost, signalled, late)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if self.exit_code == ExitCode.OK:
                self.exit_code = ExitCode.PEER_LOST
            reason = f"other nodes did not finish within --finish-timeout {self.config.finish_timeout:g} s"
            if not self.course.stopping:
                self.course.to(Course.STOPPING)
                self.stop_reason = reason
            self._emit("job_stop", reason=reason, exit_code=int(self.exit_code))
            return True
        if self._all_ended:
            return True
        wait = remaining if wake is None else min(remaining, max(0.0, wake - time.monotonic()))
        for message in self._poll_once(selector, wait):
            if message.get("event") == "lost":
                return True
            if self._on_node_message(message):
                continue
            if message.get("key") == STOP_KEY and self.exit_code == ExitCode.OK:
                self.exit_code = StopRequest.decode(message.get("value"), ExitCode.OK).exit_code
        return self._all_ended or self._signalled is not None

    def _leave_job(self) -> None:
        """Claim this slot's end, so that nobody declares it lost once it is gone."""
        if self.roles is None or self.link is None or self.link.lost is not None:
            return
        if not self.link.ready:  # it never reached the store: a claim would wait for it in vain
            return
        if self.exit_code == ExitCode.EXCLUDED:
            return  # it declared itself lost
        try:
            if not self.roles.leave():
                log.warning("this node had been declared lost by the others before it ended")
        except StoreLinkError as exc:
            log.warning("could not record that node %d left: %s", self.config.node_rank, exc)

    # provided by Supervisor
    node_rank: int | None

    def _make_selector(self) -> selectors.BaseSelector:
        raise NotImplementedError

    def _poll_once(self, selector: selectors.BaseSelector, timeout: float | None) -> list[dict]:
        raise NotImplementedError

    def _on_node_message(self, message: dict[str, Any]) -> bool:
        raise NotImplementedError

    def _emit(self, kind: str, **fields: object) -> None:
        raise NotImplementedError
