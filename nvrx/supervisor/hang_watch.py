"""The supervisor's watch of its ranks' heartbeats, one part of the supervisor.

Launcher-side hang detection (``nvrx.fault_tolerance``): a child that uses
``RankMonitorClient`` reports heartbeats and sections over ``rank_watch``;
when one of its timeouts passes, the supervisor records a ``hang`` event with
the rank's stack, sends the configured termination signal to the child's
process group (SIGKILL after the grace period if it still runs), and the
restart policy decides as for any failure.

The Wrapper's monitor processes beat to a socket the supervisor binds for them
(``nvrx.node_agent.rank_wire``), not to the store (a beat costs the store nothing); the
node's agent reads it (``nvrx.node_agent.supervised.NodeDuty``) in the loop it runs
without a supervisor too (``rank_wire.BeatLoop``). When the agent tells of a rank whose monitor
stayed silent beyond its ``heartbeat_timeout``, the supervisor has the agent take the
rank out of its round (an ``unresponsive`` fault, as the node agent does for a rank
without a supervisor) and kills it and its monitor.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import time
from collections.abc import Callable
from typing import Any

from nvrx import jobenv, monitor_boot, processes
from nvrx.events.failures import UNRESPONSIVE, UNRESPONSIVE_SIGNATURE, hang_signature
from nvrx.node_agent.rank_wire import Beat, BeatSocket

from .children import ExitStatus
from .course import CourseTracker
from .job_restart import JobRestart
from .job_store import JobStore
from .local_ranks import LocalRanks
from .node_control import NodeControl
from .policy import LastFault
from .rank_watch import Hang, RankWatch
from .step_times import StepTimes
from .store_link import StoreLinkError
from .workload_control import WorkloadControl

log = logging.getLogger(__name__)

LISTEN, CONNECTION = "ft-listen", "ft"
#: The selector data of every descriptor ``HangWatch.on_ready`` reads.
WATCHED = (LISTEN, CONNECTION)


class HangWatch:
    """Owns the rank watch and the beat socket (which the node agent reads), and the kills
    they call for."""

    def __init__(
        self,
        store: JobStore,
        course: CourseTracker,
        control: NodeControl,
        ranks: LocalRanks,
        wrapper_pids: set[int],
        workload: WorkloadControl,
        job_restart: JobRestart,
        store_lost: Callable[[str], bool],
        step_times: StepTimes,
    ) -> None:
        self.store, self.course, self.control = store, course, control
        self.ranks = ranks
        self.wrapper_pids = wrapper_pids  # processes whose monitor beat: Wrapper ranks
        self.workload, self.job_restart, self.store_lost = workload, job_restart, store_lost
        self.step_times = step_times
        self.watch: RankWatch | None = None
        self.beat_socket: BeatSocket | None = None
        self._hang_kills: dict[int, float] = {}  # child pid -> when SIGKILL follows
        self._hung: dict[int, LastFault] = {}  # child pid -> the hang that ended it

    def start(self) -> str:
        """Open the sockets, before any child starts: each one is told where they are.
        Returns their private directory (owner-only, removed at the end)."""
        self.watch = RankWatch()
        self.beat_socket = BeatSocket(os.path.join(self.watch.directory, "beats.sock"))
        return self.watch.directory

    @property
    def beats_fd(self) -> int | None:
        """The beat socket's descriptor, for the node agent; kept open here (never read), so
        that a monitor's beat finds the socket even between two agents."""
        return None if self.beat_socket is None else self.beat_socket.fileno()

    def child_env(self, env: dict[str, str]) -> None:
        """What a child needs to reach this supervisor's watch."""
        if self.watch is not None:
            env[jobenv.FT_SOCKET] = self.watch.path
            env[jobenv.FT_CONFIG] = self.store.config.ft.to_json()
            if self.store.config.straggler_section:
                env[jobenv.STRAGGLER_SECTION] = self.store.config.straggler_section
        if self.beat_socket is not None:
            env[jobenv.RANK_BEATS] = self.beat_socket.path

    def register(self, selector: selectors.BaseSelector) -> None:
        """Register the watch's descriptors with the main loop's ``selector``."""
        if self.watch is None:
            return
        selector.register(self.watch.fileno(), selectors.EVENT_READ, LISTEN)
        for fd in self.watch.connection_fds():
            selector.register(fd, selectors.EVENT_READ, CONNECTION)

    def on_ready(self, selector: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        """Read the watch's descriptor ``key`` that ``selector`` found readable."""
        assert self.watch is not None
        if key.data == LISTEN:
            while (fd := self.watch.accept()) is not None:
                selector.register(fd, selectors.EVENT_READ, CONNECTION)
            return
        for what, watched, detail in self.watch.read(key.fd):
            ids = {"rank": watched.rank, "local_rank": watched.local_rank, "child_pid": watched.pid}
            if what in ("init", "timeouts"):
                self.control.emit("timeouts_set", **ids, source=detail, timeouts=watched.timeouts.to_dict())
            elif what == "control":
                self.workload.on_control(watched, detail)
            elif what == "steps":
                self.step_times.record(watched.rank, detail)
            if what == "init":  # a new process of the rank: its first steps warm up
                self.step_times.restart(watched.rank)
                if watched.pid is not None:
                    self.ranks.told(watched.pid, training=True)
            elif what == "end":
                selector.unregister(key.fd)
                log.info("local rank %s stopped being monitored (%s)", watched.local_rank, detail)

    def timeout(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to the next hang deadline or pending kill."""
        if self.watch is None:
            return timeout
        deadlines = (self.watch.next_deadline(), *self._hang_kills.values())
        times = [t for t in deadlines if t is not None]
        if not times:
            return timeout
        wait = max(0.0, min(times) - time.monotonic())
        return wait if timeout is None else min(timeout, wait)

    def check(self) -> None:
        """Act on the hangs that are due, and on the kills they scheduled."""
        if self.watch is None:
            return
        now = time.monotonic()
        for hang in self.watch.due(now):
            self._on_hang(hang)
        for pid, when in list(self._hang_kills.items()):
            children = self.ranks.children.values()
            child = next((c for c in children if c.pid == pid and c.running), None)
            if child is None:
                del self._hang_kills[pid]
            elif now >= when:
                log.warning("hung local rank %d still runs: SIGKILL", child.local_rank)
                child.signal_group(signal.SIGKILL)
                del self._hang_kills[pid]

    def _on_hang(self, hang: Hang) -> None:
        if self.course.stopping or self.job_restart.pending is not None:
            return  # its children are being stopped anyway
        child = self.ranks.children.get(hang.local_rank)
        if child is None or not child.running or hang.attempt not in (None, child.attempt):
            return  # an earlier attempt's connection, or the child ended meanwhile
        if hang.timeout == "section":
            message = f"section {hang.section!r} open for {hang.stale_s:.1f} s (timeout {hang.limit_s:g} s)"
        else:  # only a section timeout has a section
            message = f"no {hang.timeout.replace('_', ' ')} for {hang.stale_s:.1f} s (timeout {hang.limit_s:g} s)"
        log.warning("local rank %d hung: %s", hang.local_rank, message)
        assert self.watch is not None
        child.signal_group(signal.SIGCONT)  # a stopped process cannot dump its stack
        stack = self.watch.stack(hang)
        ids = {"rank": hang.rank, "local_rank": hang.local_rank, "child_pid": child.pid}
        self.control.emit(
            "hang", **ids, timeout=hang.timeout, section=hang.section, limit_s=hang.limit_s,
            stale_s=round(hang.stale_s, 3), stack=stack, message=message,
        )  # fmt: skip
        # The hang event alone tells the report (its stack, and why this child ended).
        self._hung[child.pid] = LastFault(hang_signature(hang.timeout), f"hang_{hang.timeout}")
        term = self.store.config.ft.rank_termination_signal
        child.signal_group(term)
        if term != signal.SIGKILL:
            self._hang_kills[child.pid] = time.monotonic() + self.store.config.grace_period
        if self.job_restart.job_wide(child.key):
            # Its peers wait for it in a collective: restart the job now, before their own
            # deadlines pass and each of them is declared hung in turn.
            try:
                self.job_restart.failure(
                    hang.local_rank, ExitStatus(None, int(term)), self._hung[child.pid]
                )
            except StoreLinkError as exc:
                self.control.store_unavailable(exc)

    def on_message(self, message: dict[str, Any]) -> bool:
        """What the node's agent tells of the rank beats
        (``nvrx.node_agent.supervised.NodeDuty``); whether ``message`` was one of those."""
        event = message.get("event")
        if event == "wrapper_pid":
            pid = int(message["pid"])
            if any(child.pid == pid for child in self.ranks.running()):  # not one reaped since
                self.wrapper_pids.add(pid)
                self.ranks.told(pid, training=False)
            return True
        if event == "rank_in_round":
            self.ranks.told(int(message["pid"]), training=True)
            return True
        if event != "rank_silent":
            return False
        beat, silent_s = Beat(**message["beat"]), float(message["silent_s"])
        child = self.ranks.children.get(beat.local_rank)
        if child is None or not child.running or child.attempt != beat.attempt:
            return True  # a child that ended is no silent rank
        link = self.store.link
        if self.course.stopping or self.job_restart.pending is not None:
            return True  # its children are being stopped anyway
        if link is None or link.lost is not None:
            return True  # the store is gone: the children are stopped for a failover
        try:
            self._on_silent_rank(beat, silent_s)
        except StoreLinkError as exc:
            if link.lost is not None:  # the store is gone: fail over, as its ``lost`` does
                self.store_lost(link.lost)
            else:
                self.control.store_unavailable(exc)
        return True

    def _on_silent_rank(self, beat: Beat, silent_s: float) -> None:
        """The rank leaves its round (its peers restart without waiting for it), then its
        process and its frozen monitor are killed: the policy restarts it like a dead one."""
        rank = beat.rank if beat.rank >= 0 else beat.initial_rank  # no rank number known yet
        message = f"no heartbeat for {silent_s:.1f} s"
        log.warning(
            "rank %d (local rank %d, pid %d) sent no heartbeat for %.1f s: unresponsive",
            rank, beat.local_rank, beat.pid, silent_s,
        )  # fmt: skip
        assert self.store.link is not None
        self.store.link.leave_silent(beat.initial_rank, self.store.config.world_size, message)
        child = self.ranks.children[beat.local_rank]  # running: ``on_message`` checked it
        self.control.emit(
            "fault", fault_kind=UNRESPONSIVE, origin_rank=rank, rank=rank,
            round=beat.round if beat.round >= 0 else None,  # a common field: None, never -1
            local_rank=beat.local_rank, child_pid=child.pid, message=message,
            signature=UNRESPONSIVE_SIGNATURE, detected_mono=time.monotonic(),
            detection_s=silent_s,  # the rank stopped beating that long before: its onset
            rank_node=self.control.node_rank,  # a spare's event names its slot: the node it holds
        )  # fmt: skip
        if _is_monitor(beat.monitor_pid):
            processes.signal_group(beat.monitor_pid, signal.SIGKILL)
        self._hung[child.pid] = LastFault(UNRESPONSIVE_SIGNATURE, UNRESPONSIVE)
        child.signal_group(signal.SIGKILL)

    def hang_fault(self, pid: int) -> LastFault | None:
        """The hang that ended child ``pid``, when the watch declared one."""
        return self._hung.pop(pid, None) if self.watch is not None else None

    def close(self) -> None:
        if self.beat_socket is not None:
            self.beat_socket.close()
        if self.watch is not None:
            self.watch.close()


def _is_monitor(pid: int) -> bool:
    """Whether ``pid`` still runs a Wrapper's monitor program (not a process that reused the pid)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return monitor_boot.PROGRAM.encode() in f.read()
    except OSError:
        return False
