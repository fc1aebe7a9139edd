"""The monitor process program: hangs, a dead rank, unresponsive peers.

Started by ``monitor_process.MonitorProcess`` (through ``nvrx.monitor_boot``,
which calls ``main``), one per rank, it reads the rank's ``ProgressBoard`` and acts:

* soft timeout (no progress for ``soft_timeout`` in user code): dump the
  rank's stack (faulthandler, through a pipe), record a ``hang_soft`` fault so
  every rank restarts;
* hard timeout (in user code only after a soft one; between rounds, from
  ``finalize`` to the rank assignment, alone, counted from the limit of a wait for
  the rank's peers: ``hang_verdict``): record ``hang_hard``, SIGCONT+SIGTERM, wait
  ``termination_grace_time``, SIGKILL; then leave the round on the rank's behalf
  (the next one where the round's iteration barrier had released it into it, as
  for a death);
* the rank's process died (pidfd, no polling): leave the round on its behalf, or
  the next one where the round's iteration barrier had released it into it
  (``rounds.place_in_next_round``);
* heartbeats: to one party of the rank's node, which alone talks to the store
  for the node's ranks and takes out a rank whose monitor stopped beating for
  ``heartbeat_timeout``: under a supervisor (``NVRX_RANK_BEATS``), to the
  supervisor (``nvrx.node_agent.rank_wire``); without one, to its host's node agent
  (``agent_link``, ``nvrx.node_agent``). No heartbeat reaches the store from a rank.

The program imports no torch: its link to the store is nvrx's own client (``monitor_store``).
Under a supervisor, unless it hosts the store, it says it watches at once and makes
the link meanwhile: a ``hang`` event and a dead rank's ``fault`` event are written
when seen; store records (and a hard hang's termination) wait for the link, beating
meanwhile. A link that fails, or a supervisor gone meanwhile (no socket takes a beat
where its socket was), ends the program, with a ``process_end`` event.

When the rank's monitor hosts the store (standalone, ``tcp_store_host_rank``)
the store service is its child and serves until every rank passed the
termination barrier, even after the rank died. It exits when the board's
shutdown flag is set or its rank is gone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import signal
import sys
import time
from typing import Any

from nvrx import events, processes
from nvrx.events.failures import FaultRecord, announce_leave, emit_fault
from nvrx.node_agent import rank_wire

from . import monitor_store, monitor_target
from .logging import setup_monitor_logging
from .monitor_process import STACK_SIGNAL, MonitorConfig
from .progress_watchdog import (
    FLAG_BETWEEN,
    FLAG_KEEPING,
    FLAG_SHUTDOWN,
    FLAG_TIMEOUTS_OFF,
    FLAG_USER,
    ProgressBoard,
    released_into_next,
)

log = logging.getLogger(__name__)

#: Longest wait for room in the supervisor's queue of beats for the last one, the ``bye``.
BYE_WAIT_S = 2.0


def last_progress(info: dict[str, float]) -> float:
    """When a board read (``ProgressBoard.read``) last saw progress: the watchdog's stamp,
    or, in user code, the older of it and the last ``ping()`` once one came (between
    rounds a ``ping()``, of a user thread, says nothing of the main thread's progress)."""
    if info["manual"] <= 0 or int(info["flags"]) & FLAG_BETWEEN:
        return info["auto"]
    return min(info["auto"], info["manual"])


def hang_verdict(
    info: dict[str, float], now: float, soft_s: float, hard_s: float, soft_fired: bool
) -> str | None:
    """What the timeouts make of a board read at ``now``: ``"soft"``, ``"hard"`` or None.

    In user code (``FLAG_USER``) a soft timeout after ``soft_s`` without progress, a hard
    one after ``hard_s`` once the soft one fired. Between rounds (``FLAG_BETWEEN``) a hard
    one alone (every rank restarts already), after ``hard_s`` without progress counted from
    the later of the last progress and the limit of a wait for peers the rank is in
    (``ProgressBoard.waiting``: a barrier's own timeout ends such a wait first). Nothing
    while ``disable_hang_protection()`` is active, nor outside these phases.
    """
    flags = int(info["flags"])
    if flags & FLAG_TIMEOUTS_OFF:
        return None
    last = last_progress(info)
    if flags & FLAG_USER:
        stale = now - last
        if stale > hard_s and soft_fired:  # escalate: never hard before soft
            return "hard"
        return "soft" if stale > soft_s and not soft_fired else None
    if flags & FLAG_BETWEEN and now - max(last, info["wait_until"]) > hard_s:
        return "hard"
    return None


class _Monitor:
    """The watch loop of one rank (see the module docstring)."""

    def __init__(self, cfg: MonitorConfig, early: Any = None) -> None:
        self.cfg = cfg
        self.service: Any = None
        if isinstance(early, BaseException):
            raise early  # launching the store it hosts failed
        self.board = ProgressBoard(cfg.board_path)
        beats_path = rank_wire.socket_path()
        self.sender = rank_wire.BeatSender(beats_path) if beats_path else None
        # Beats through the store, or a store to host, need the link before the watch.
        beside = self.sender is not None and not cfg.host_store
        if not beside:  # now: beside the start of a store service launched by the boot
            monitor_store.preload()
        agents = None
        if self.sender is None:  # the Wrapper alone: beats go to the host's node agent
            from . import agent_link as agents  # not under a supervisor, which reads them
        if early is not None:
            self.service = early.wait_started()
        elif cfg.host_store:
            from nvrx.store.service import StoreService

            self.service = StoreService(
                cfg.store_host or "127.0.0.1", int(cfg.store_port or 0), node=None
            ).start()
        if self.service is not None:
            cfg.store_port = self.service.port
        context = cfg.events_context or events.context_from_env()
        self.writer = events.EventWriter(cfg.events_dir or events.job_log_dir(), "monitor", context)
        self.round, self.place = -1, (-1, 0)  # the rank's round, its place there
        self._view: tuple[int, Any] | None = None  # (round, the store view of that round)
        self.soft_fired, self.next_hb = False, 0.0
        self.child = rank_wire.child_of_supervisor()
        self.link = monitor_store.StoreLink(functools.partial(monitor_store.connect, cfg))
        (self.link.start if beside else self.link.make)()
        self.host = None if agents is None else agents.AgentLink(cfg, self.link.get)

    def _round_store(self) -> Any:
        """The store view of the current round; waits for the link to the store, beating."""
        self.link.wait(self._beat_now, self.cfg.heartbeat_interval)
        if self._view is None or self._view[0] != self.round:
            self._view = (self.round, self.link.rounds.round_store(self.link.get(), self.round))
        return self._view[1]

    # -- what the board says ---------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(self.board.read()["rank"])

    def _sync_round(self, info: dict[str, float]) -> None:
        round_ = int(info["round"])
        if round_ == self.round or round_ < 0:
            return
        self.round = round_
        self.soft_fired = False
        self.next_hb = 0.0  # the next look beats: its agent learns of the round at once
        self.writer.update(round=round_, rank=int(info["rank"]) if info["rank"] >= 0 else None)
        ws, rank = int(info["world_size"]), int(info["rank"])
        self.place = (rank, ws)  # this rank in the round, for beats outside the watch loop

    def _stack(self) -> str:
        return monitor_target.dump_stack(self.cfg.target_pid, self.cfg.stack_fd, STACK_SIGNAL)

    # -- leaving the round on a rank's behalf ------------------------------------------
    def _leave(self, rank: int, world_size: int, record: FaultRecord, initial: int | None) -> None:
        """Leave the round for ``rank`` (``initial``: its initial rank, None when unknown)."""
        if self.round < 0:
            log.error("rank %s left before its first round: nothing to register", rank)
            return
        log.info("leaving round %d on behalf of rank %s (%s)", self.round, rank, record.kind)
        announce_leave(self.writer.emit, rank, record)  # now, even while the link is made
        store = self._round_store()
        self.link.rounds.proxy_leave(store, self.link.get(), rank, world_size, record)
        if initial is None:
            log.warning(
                "rank %s published no state in round %d: the store host waits for it at the "
                "termination barrier until barrier_timeout", rank, self.round,
            )  # fmt: skip
            return
        self._arrive_for(initial)

    def _arrive_for(self, initial: int) -> None:
        """``initial`` is out of this generation: the store host need not wait for it at the end."""
        generation, size = self.board.generation(), self.cfg.initial_world_size
        self.link.rounds.arrive_one(self.link.get(), "termination", generation, initial, size)

    def _keep_store(self) -> None:
        """The rank is gone but hosts the store: serve until every rank passed the termination barrier."""
        if self.service is None:
            return
        log.info("rank gone; keeping the store until the other ranks finish")
        from nvrx.store.host_ring import HostsBeating

        try:
            cfg, generation, store = self.cfg, self.board.generation(), self.link.get()
            if not self.link.rounds.keep_until_terminated(
                store, generation, cfg.initial_world_size, cfg.keeper_timeout, HostsBeating(store)
            ):
                log.warning(
                    "stopping the store without the termination barrier: no host beat for "
                    "%g s", cfg.keeper_timeout,
                )  # fmt: skip
        except Exception as exc:
            log.warning("stopping the store without the termination barrier: %r", exc)

    # -- heartbeats --------------------------------------------------------------------
    def _heartbeat(self, now: float, info: dict[str, float]) -> None:
        if int(info["flags"]) & FLAG_KEEPING:
            self._stop_beating()  # the rank left the job: its bye, once
            return
        if now < self.next_hb:
            return
        self.next_hb = now + self.cfg.heartbeat_interval
        beat = self._beat(int(info["rank"]), int(info["world_size"]))
        if self.host is not None:
            self.host.beat(beat)
        elif self.sender is not None:
            self.sender.send(beat)

    def _stop_beating(self, failed: bool = False) -> None:
        """Beating ends (``failed``: not on purpose: the node agent finds the rank silent)."""
        if self.host is not None:
            host, self.host = self.host, None
            host.end(failed)

    def _beat_now(self) -> None:
        """A beat to the supervisor while a fault waits for the link or the store;
        ``SupervisorGone`` when its socket is gone: it ended, or died."""
        if self.sender is not None and not self.sender.send(self._beat(*self.place)):
            if self.sender.listener_gone:  # else the monitor could wait for a link for minutes
                raise rank_wire.SupervisorGone(f"no supervisor at {self.sender.path} any more")

    def _link_made(self) -> bool:
        """Whether the link is there, waited for (beating); False: failed, or supervisor gone."""
        with contextlib.suppress(monitor_store.StoreUnavailable, rank_wire.SupervisorGone):
            self._round_store()
        return self.link.made

    def _beat(self, rank: int, world_size: int, bye: bool = False) -> rank_wire.Beat:
        cfg = self.cfg
        return rank_wire.Beat(
            initial_rank=cfg.initial_rank,
            pid=cfg.target_pid,
            local_rank=self.child[0],
            attempt=self.child[1],
            rank=rank,
            world_size=world_size,
            round=self.round,
            interval=cfg.heartbeat_interval,
            timeout=cfg.heartbeat_timeout,
            monitor_pid=os.getpid(),
            bye=bye,
        )

    # -- progress ----------------------------------------------------------------------
    def _check_progress(self, now: float, info: dict[str, float], pidfd: int | None) -> bool:
        """Apply the soft and hard timeouts (``hang_verdict``); True when the rank was terminated."""
        cfg = self.cfg
        found = hang_verdict(info, now, cfg.soft_timeout, cfg.hard_timeout, self.soft_fired)
        stale = now - last_progress(info)
        log.debug("round %d: %.2f s since the last progress", self.round, stale)
        if found == "hard":  # a second look confirms it before the rank is ended
            info, now = self.board.read(), time.monotonic()
            if hang_verdict(info, now, cfg.soft_timeout, cfg.hard_timeout, self.soft_fired) == "hard":
                self._hard_timeout(now - last_progress(info), info, pidfd)
                return True
            log.debug("round %d: progress after all on a second look", self.round)
            return False
        if found == "soft":
            self._soft_timeout(stale)
        return False

    def _soft_timeout(self, stale: float) -> None:
        self.soft_fired = True
        stack = self._stack()
        self.writer.emit("hang", timeout="soft", stack=stack, stale_s=stale)
        log.warning("rank %s made no progress for %.1f s: soft timeout", self.rank, stale)
        if self.round >= 0:
            message = f"no progress for {stale:.1f} s (soft timeout {self.cfg.soft_timeout:g} s)"
            record = FaultRecord(rank=self.rank, kind="hang_soft", message=message)
            store = self._round_store()  # beats on while it waits for the link
            self.link.rounds.record_fault(store, record)
            emit_fault(
                self.writer.emit, record, fault_kind="hang_soft", origin_rank=self.rank,
                signature="hang_soft", traceback=stack, detection_s=stale,
            )  # fmt: skip

    def _hard_timeout(self, stale: float, info: dict[str, float], pidfd: int | None) -> None:
        cfg, flags = self.cfg, int(info["flags"])
        stack = self._stack()
        self.writer.emit("hang", timeout="hard", stack=stack, stale_s=stale)
        where = "" if flags & FLAG_USER else " between rounds"
        log.error("rank %s made no progress for %.1f s%s: terminating it", self.rank, stale, where)
        self._stop_beating()
        place = (int(info["rank"]), int(info["world_size"]))
        try:  # (released into the next round: its number there is found after its end)
            if self.round >= 0 and not released_into_next(flags):
                store = self._round_store()
                self.link.rounds.register_terminated(store, place[0])
        finally:  # a rank that hangs is ended, store or not
            processes.stop_foreign(cfg.target_pid, pidfd, cfg.termination_grace_time)
        place = self._place_of_gone(place)
        message = f"no progress for {stale:.1f} s{where} (hard timeout {cfg.hard_timeout:g} s)"
        record = FaultRecord(rank=place[0], kind="hang_hard", message=message)
        self._leave(*place, record, cfg.initial_rank)
        self._keep_store()

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        pidfd = monitor_target.open_pidfd(cfg.target_pid)
        poller = select.poll()
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
        ready = {"ready": True, "pid": os.getpid(), "port": cfg.store_port}
        # known to whoever watches it before its rank goes on (a rank dead since: the watch sees it)
        if self.host is not None:
            self.host.beat(self._beat(*self.place))
        elif self.sender is not None:
            self.sender.send(self._beat(*self.place))
        with contextlib.suppress(BrokenPipeError):
            os.write(sys.stdout.fileno(), (json.dumps(ready) + "\n").encode())
        watched = False
        try:
            self._watch(pidfd, poller)
            watched = True
        finally:
            self._stop_beating(failed=not watched)
            if self.sender is not None:
                if watched:  # beating ends on purpose: no silence to declare
                    self.sender.send(self._beat(-1, 0, bye=True), wait_s=BYE_WAIT_S)
                self.sender.close()  # a failed monitor says nothing: its rank is unwatched
            if self.service is not None:
                self.service.stop()
        return 0

    def _watch(self, pidfd: int | None, poller: Any) -> None:
        """Until shutdown, the rank's death or its termination: one look per interval."""
        stdin = sys.stdin.fileno()
        while True:
            ready = poller.poll(self.cfg.monitor_process_interval * 1000)
            info = self.board.read()
            if int(info["flags"]) & FLAG_SHUTDOWN:
                return
            self._sync_round(info)
            if any(fd == stdin for fd, _ in ready) and not os.read(stdin, 4096):
                poller.unregister(stdin)  # the Wrapper closed it: it is shutting down or gone
            died = any(fd == pidfd for fd, _ in ready)
            if died or not monitor_target.alive(self.cfg.target_pid):
                self._rank_died()
                return
            now = time.monotonic()
            self._heartbeat(now, info)
            if self.link.error is not None:  # made beside the watch, and failed: end, said
                self.link.get()  # after a beat: the supervisor then finds this one silent
            if self._check_progress(now, info, pidfd):
                return

    def _rank_died(self) -> None:
        info = self.board.read()
        flags, cfg = int(info["flags"]), self.cfg
        if flags & FLAG_SHUTDOWN:
            return
        if flags & FLAG_KEEPING:  # it had left the job: no fault, the store is kept as it was
            log.warning("rank process %s died while it kept the store", cfg.target_pid)
            self._stop_beating()  # its bye, where the death came before the watch's beat
            self._keep_store()
            return
        log.warning("rank process %s died", cfg.target_pid)
        self._stop_beating()
        place = self._place_of_gone((int(info["rank"]), int(info["world_size"])))
        message = f"process {cfg.target_pid} died"
        self._leave(*place, FaultRecord(place[0], "dead", message=message), cfg.initial_rank)
        self._keep_store()

    def _place_of_gone(self, place: tuple[int, int]) -> tuple[int, int]:
        """(rank, world size) under which the rank, gone (dead, or ended by the monitor),
        leaves: ``place`` in this round, or its place in the next one where this round's
        iteration barrier had released it into it (the board says so; the monitor's round
        moves on to it); ``place`` where that one is not found."""
        flags = int(self.board.read()["flags"])
        if released_into_next(flags) and self.round >= 0 and self._link_made():
            found = self._place_after_death(place[0])
            if found is not None:
                self.round, place = self.round + 1, found
                self.writer.update(round=self.round, rank=place[0])
        return place

    def _place_after_death(self, rank: int) -> tuple[int, int] | None:
        """(rank, world size) in the next round of ``rank``, dead after this round's iteration
        barrier released it there, its state published there; None where its place is not
        found (logged) within ``barrier_timeout``."""
        cfg = self.cfg
        try:
            rounds, base = self.link.rounds, self.link.get()
            return rounds.carry_over_death(
                base, self.round, rank, cfg.initial_world_size, cfg.barrier_timeout,
                cfg.monitor_process_interval, self._beat_now,
            )  # fmt: skip
        except Exception as exc:  # the store failed, or the supervisor is gone: leave this round
            log.warning("round %d: no place found for a dead rank: %r", self.round + 1, exc)
            return None


def main(line: bytes | None = None, early: Any = None) -> int:
    """Read the configuration (``line``, else from stdin), then watch the rank until it is done.

    ``early``: the store service ``nvrx.monitor_boot`` launched for this monitor to
    host, or the exception that launch raised. SLURM's warning signal is ignored
    first: its default action would end the monitor, and the Wrapper starts it
    without a ``preexec_fn``.
    """
    processes.ignore_warning_signal()
    try:
        return _configure_and_watch(line, early)
    finally:  # a launched store that the monitor failed to take (or took) ends with it
        if early is not None and not isinstance(early, BaseException):
            early.stop()


def _configure_and_watch(line: bytes | None, early: Any) -> int:
    if line is None:
        line = sys.stdin.buffer.readline()
    if not line:
        return 0
    cfg = MonitorConfig(**json.loads(line))
    if cfg.env is not None:  # started ahead of its rank (``monitor_process.prestart``)
        os.environ.clear()
        os.environ.update(cfg.env)
    setup_monitor_logging(cfg.logfile)
    if cfg.logfile is not None:
        import faulthandler

        faulthandler.enable(open(cfg.logfile, "a"))  # noqa: SIM115 - kept open for fatal errors
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    monitor = None
    try:
        monitor = _Monitor(cfg, early)
        return monitor.run()
    except BaseException as exc:
        gone = isinstance(exc, rank_wire.SupervisorGone)  # said without a trace: no bug
        log.error("monitor process failed: %r", exc, exc_info=not gone)
        if monitor is not None:  # an event, whatever the log level: the rank is unwatched now
            monitor.writer.emit("process_end", exit_code=1, reason=f"monitor failed: {exc!r}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
