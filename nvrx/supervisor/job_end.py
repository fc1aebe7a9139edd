"""How a supervisor ends its part of the job.

A training node reports its children done; the last one sets ``all_done``,
which lets idle spares leave. Every slot claims its own end when it leaves,
so that nobody declares it lost once it is gone. Node 0 hosts the store, so it
waits until every other slot has ended (left, or been declared lost) before
it takes the store down, at most ``--finish-timeout`` (``fork_and_monitor``'s
``finish_timeout``, where the messages name that: ``SupervisorConfig.setting``;
``SIGNALLED_WAIT_S`` once a stop signal came: the others received it too). SLURM's warning may reach it while it waits:
it still decides for the job then (``on_warning``), since the nodes that still train
checkpoint and wait for its decision.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from collections.abc import Callable

from nvrx.slurm import commands
from nvrx.store.service import PROGRESS_EVERY_S

from . import node_requeue
from .config import StopRequest
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .job_restart import JobRestart
from .job_store import JobStore
from .node_control import NodeControl
from .node_messages import NodeMessages
from .stop_flag import StopFlag
from .store_link import StoreLinkError

log = logging.getLogger(__name__)

#: Waits for one batch of the supervisor's inputs: ``poll(selector, timeout) -> store messages``.
Poll = Callable[[selectors.BaseSelector, float | None], list[dict]]


#: Exit codes of a job that is over for good: after a store failover whose batch script died
#: with its node, nvrx ends its SLURM job, which would otherwise hold the allocation until its
#: time limit. Not a requeue (75, 8), nor a signal (SLURM ends that job itself).
FINAL_EXITS = (
    ExitCode.OK,
    ExitCode.RANK_STOPPED,
    ExitCode.BUDGET_EXHAUSTED,
    ExitCode.LOOP_BREAKER,
    ExitCode.NON_RETRYABLE,
    ExitCode.AFTER_COMPLETION,
)

#: How long the store host, stopped by a signal, still waits for the other slots to end
#: (at least; their children's ``--grace-period`` and a little more when longer): a cancelled
#: job's supervisors all receive it at once and end within their children's grace; past it
#: the host takes its store down whoever is left.
SIGNALLED_WAIT_S = 10.0


class JobEnd:
    """The end of a supervisor's run: report done, leave, and (the store host) wait for the others."""

    def __init__(
        self,
        store: JobStore,
        course: CourseTracker,
        control: NodeControl,
        messages: NodeMessages,
        job_restart: JobRestart,
        requeue: node_requeue.Requeue,
        selector: Callable[[], selectors.BaseSelector],
        poll: Poll,
        on_warning: Callable[[], bool],
    ) -> None:
        self.store, self.course, self.control = store, course, control
        self.messages, self.job_restart, self.requeue = messages, job_restart, requeue
        self.selector, self.poll = selector, poll
        #: decides on SLURM's warning (or another node's flag) if one is pending: True if it did
        self.on_warning = on_warning
        #: (the store host) a stop another node asked for while this one waited for the others
        self.stop_request: StopRequest | None = None
        #: (the store host) every slot ended: the job is over, its store's files serve nobody
        self.over = False
        self._signal_seen: float | None = None

    def finish(self) -> None:
        """All local children ended: report this node done; node 0 keeps the store up until
        every other supervisor (spares too) has left or been declared lost."""
        store, control = self.store, self.control
        cfg, link, roles = store.config, store.link, store.roles
        if link is None or link.lost is not None or roles is None:
            self.on_warning()  # a warning with the last exit, which the store host left to here
            return
        if control.exit_code == ExitCode.FENCED:
            return  # the job went on without this node: nothing of it counts, nobody waits for it
        if control.exit_code == ExitCode.EXCLUDED:
            self._leave_as_lost()  # a rank asked to exclude this node (``workload_control``)
            return
        try:
            if control.node_rank is not None:
                roles.node_done()
        except StoreLinkError as exc:
            log.warning("could not report node %d done: %s", cfg.node_rank, exc)
            self.on_warning()  # a warning with the last exit is decided all the same
            return
        if store.service is not None and cfg.nnodes > 1:  # the store host
            self._wait_for_other_nodes(time.monotonic() + cfg.finish_timeout)
            self.read_stop()
            # not after a stop for lost nodes: the "lost" may be a majority cut off from this
            # host, electing a successor from the snapshot
            ended = control.exit_code in FINAL_EXITS or control.signalled is not None
            self.over = self.messages.all_ended and ended
            if store.epoch > 0 and control.exit_code in FINAL_EXITS:
                self._end_orphaned_job()

    def _end_orphaned_job(self) -> None:
        """Under SLURM, after a failover the batch script may have died with the lost store
        host's node (it runs there under the sbatch templates): end the job if it did."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            return
        try:
            host = node_requeue.orphaned_by(job_id)
            if host is None:
                return
            self.control.emit(
                "job_stop",
                reason=f"the batch host {host} was lost; nvrx ends the job in SLURM after its "
                "training ended",
                exit_code=int(self.control.exit_code),
            )
            node_requeue.end_orphaned_job(job_id, host)
        except (commands.SlurmCommandError, OSError) as exc:
            log.error("could not end job %s: %s", job_id, exc)

    def _wait_for_other_nodes(self, deadline: float) -> None:
        """Wait for the other slots to end; every ``PROGRESS_EVERY_S`` a log line names them.
        A warning that comes meanwhile is decided on at once (the others await the decision)."""
        selector = self.selector()
        start = time.monotonic()
        note = start + PROGRESS_EVERY_S
        try:
            deadline = self._after_warning(deadline)
            while not self._other_nodes_done(selector, self._signalled_deadline(deadline), note):
                deadline = self._after_warning(deadline)
                if time.monotonic() >= note:
                    self._note_waiting(start)
                    note = time.monotonic() + PROGRESS_EVERY_S
        finally:
            selector.close()

    def _after_warning(self, deadline: float) -> float:
        """Decide on a pending warning; the wait's deadline, with the others given time to
        leave after a decision (the decision's wait is not theirs to make up)."""
        if not self.on_warning():
            return deadline
        leave = max(SIGNALLED_WAIT_S, self.store.config.grace_period + 2.0)
        return max(deadline, time.monotonic() + leave)

    def _signalled_deadline(self, deadline: float) -> float:
        """A stop signal shortens the wait to ``SIGNALLED_WAIT_S`` from when it was seen."""
        if self.control.signalled is None:
            return deadline
        if self._signal_seen is None:
            self._signal_seen = time.monotonic()
        wait = max(SIGNALLED_WAIT_S, self.store.config.grace_period + 2.0)
        return min(deadline, self._signal_seen + wait)

    def _note_waiting(self, start: float) -> None:
        cfg, roles = self.store.config, self.store.roles
        slots = [] if roles is None else roles.running_slots()
        others = [s for s in slots if s != cfg.node_rank]
        log.warning(
            "still waiting for node slot(s) %s to finish, %.0f s of %s %g s",
            ", ".join(map(str, others)) or "(unknown)",
            time.monotonic() - start, cfg.setting("finish_timeout"), cfg.finish_timeout,
        )  # fmt: skip

    def _other_nodes_done(
        self, selector: selectors.BaseSelector, deadline: float, wake: float | None = None
    ) -> bool:
        """One wait for the other nodes' end, until ``deadline`` or ``wake`` at most; True
        when waiting is over (done, lost, signalled, late)."""
        control = self.control
        remaining = deadline - time.monotonic()
        if self.messages.all_ended:
            return True
        if remaining <= 0:
            self.read_stop()  # another node's failure, taken or on its way, says why the job ends
            failed = self.stop_request is not None and self.stop_request.exit_code != ExitCode.OK
            if control.signalled is None and not failed:
                self._give_up_waiting()
            return True
        wait = remaining if wake is None else min(remaining, max(0.0, wake - time.monotonic()))
        for message in self.poll(selector, wait):
            if message.get("event") == "lost":
                return True
            if not self.messages.on_message(message):
                self._on_control_value(message)
        return self.messages.all_ended

    def _on_control_value(self, message: dict) -> None:
        """As the main loop takes them: a stop another node asked for; a forged stop value,
        recorded and watched past (the real one may follow it); the node agent's report of
        a forged value of this slot, recorded."""
        store = self.store
        if message.get("event") == "rejected":
            if store.rejected is not None:
                size = int(message.get("value_bytes") or 0)
                store.rejected(str(message.get("key")), str(message.get("reason")), size)
            return
        flag, link = store.stop, store.link
        if not StopFlag.owns(message.get("key")) or flag is None:
            return
        key, value = str(message["key"]), str(message.get("value", ""))
        verdict = flag.on_value(key, value, ExitCode.OK)
        if verdict.request is not None:
            self._take_stop(verdict.request)
            return
        if store.rejected is not None:
            store.rejected(key, str(verdict.rejected), len(value.encode(errors="replace")))
        try:
            if link is not None:
                flag.watch(link)
        except StoreLinkError as exc:
            log.warning("could not watch the stop flag on: %s", exc)

    def _take_stop(self, request: StopRequest) -> None:
        """Another node stopped the job: its exit code is this one's, unless this node
        stopped already. The chain may hold this node's own request (a stop with exit 0: a
        rank asked to shut the workload down): nobody else stopped it, its reason stands."""
        control = self.control
        if request.node == self.store.config.node_rank or self.stop_request is not None:
            return
        if control.exit_code == ExitCode.OK:
            reason = request.told
            recorded = self.course.stopping and control.stop_reason == reason  # taken as it trained
            self.stop_request, control.exit_code = request, request.exit_code
            control.stop_reason = reason
            if not recorded:
                control.emit("job_stop", reason=reason, exit_code=int(request.exit_code))

    def read_stop(self) -> None:
        """(The store host, its wait over, or a warning to decide on) read the stop flag once:
        a node writes its stop before it ends, but the watch may bring this node the end of
        the last slot (all ended) before that slot's stop, and the wait ends at the first; a
        warning decided before the stop came through the watch would requeue a job stopped
        for good."""
        if self.control.exit_code != ExitCode.OK:
            return
        request = self.another_nodes_stop(ExitCode.OK)
        if request is not None:
            self._take_stop(request)

    def another_nodes_stop(self, default_exit: int) -> StopRequest | None:
        """The stop another node wrote into the chain, read from the store now (the watch may
        not have brought it yet); None where there is none, this node's own is there, or the
        store cannot tell. ``default_exit``: the exit code of a request that names none."""
        flag, link = self.store.stop, self.store.link
        if flag is None or link is None or link.lost is not None:
            return None
        try:
            request = flag.read(link, default_exit)
        except StoreLinkError as exc:
            log.warning("could not read whether another node stopped the job: %s", exc)
            return None
        if request is None or request.node == self.store.config.node_rank:
            return None
        return request

    def _give_up_waiting(self) -> None:
        control = self.control
        config = self.store.config
        reason = f"other nodes did not finish within {config.setting('finish_timeout')} {config.finish_timeout:g} s"
        if control.exit_code == ExitCode.OK:
            control.exit_code, control.stop_reason = ExitCode.PEER_LOST, reason
        if not self.course.stopping:
            self.course.to(Course.STOPPING)
            control.stop_reason = reason
        control.emit("job_stop", reason=reason, exit_code=int(control.exit_code))

    def leave_job(self) -> None:
        """Claim this slot's end, so that nobody declares it lost once it is gone."""
        link, roles = self.store.link, self.store.roles
        if roles is None or link is None or link.lost is not None:
            return
        if not link.ready:  # it never reached the store: a claim would wait for it in vain
            return
        if self.control.exit_code == ExitCode.EXCLUDED:
            return  # it declared itself lost
        try:
            if not roles.leave():
                log.warning("this node had been declared lost by the others before it ended")
        except StoreLinkError as exc:
            log.warning("could not record that node %d left: %s", self.store.config.node_rank, exc)

    def _leave_as_lost(self) -> None:
        """An excluded node declares its own slot lost once its children ended."""
        link, roles = self.store.link, self.store.roles
        if roles is None or link is None or not roles.enabled:
            return
        try:
            loss = roles.declare({"slot": roles.slot, "silent_s": 0.0, "cause": "excluded"})
        except StoreLinkError as exc:
            log.warning("could not declare this excluded node lost: %s", exc)
            return
        if loss is not None and loss.action == "stop":  # tell the others, as _node_silent does
            request = StopRequest(loss.reason, int(ExitCode.NODE_LOST), self.store.config.node_rank)
            try:
                if self.store.stop is not None:
                    self.store.stop.write(link, request)
                else:
                    log.warning("could not tell the other nodes to stop: the job's secret is unknown")
            except StoreLinkError as exc:
                log.warning("could not tell the other nodes to stop: %s", exc)
            self.requeue([loss.host], probe=False)  # a rank asked to exclude it: no question
        try:
            if loss is not None:  # (this node stops, excluded; the job goes on unless told)
                self.job_restart.slot_lost(job_stops=loss.action == "stop")
            if loss is not None and loss.action == "spare":  # the others restart with the spare
                self.job_restart.restart_for_lost_node(loss.node_rank, leaving=True)
        except StoreLinkError as exc:
            log.warning("could not announce the job-wide restart: %s", exc)
