"""Heartbeats of the Wrapper's ranks without a supervisor: one party per host talks to the store.

The monitor processes of one host elect a leader (``host_group``); the others
send it their beats. Every heartbeat interval the leader bumps its host's
counter in the store and reads the counter of the next host in the ring of
hosts (``nvrx.store.ring_watch``): two requests per host per interval, however
many ranks the host runs. Each monitor writes its rank into its host's list
once, before its rank goes on, and once more when it stops beating on purpose:
what a leader watches, and what a silent host takes out. What is found silent
is taken out of the running round as ``unresponsive``, with a ``fault`` event
(``rounds.leave_round``):

* a rank whose monitor stopped beating to the leader for its ``heartbeat_timeout``
  (unless its list says it ended on purpose);
* a leader that stopped stamping for ``Thresholds.replace_s`` (it stamps only
  after it reached the store) is replaced (``host_group``): its rank is taken
  out at once where it died (seen alive before) or its process is stopped;
  else, blocked maybe, its rank gets a full timeout to beat to the new leader;
* a host whose counter stood still for ``Thresholds.host_s``: the host that
  watches it takes out its ranks, and watches the next host.

A rank not in the running round (it has not published its state there yet),
or a store that failed meanwhile, is tried again ``replace_s`` later. A leader that ends on purpose hands over
first (its rank ended, died or hung): the next leader reads the host's ranks
from the store and gives each a full timeout to beat to it. The host's last
monitor to end ends the host's place in the ring, so that nobody finds it silent.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nvrx import jobenv
from nvrx.rank_beats import Beat, RankBeats
from nvrx.store import keys, rank_lists
from nvrx.store.faults import FaultRecord

from .fault_events import announce_leave
from .host_group import HostGroup, Leader, Stale
from .host_group_dir import group_dir
from .host_ring import HostRing, Thresholds, ended_ranks, live_ranks, register

if TYPE_CHECKING:
    from .monitor_process import MonitorConfig

log = logging.getLogger(__name__)


@dataclass
class _Out:
    """One of this host's ranks to take out of the running round: why, and when to try."""

    message: str
    at: float


def join(
    cfg: MonitorConfig,
    store: Callable[[], Any],
    emit: Callable[..., Any],
    arrive_for: Callable[[int], None],
) -> HostBeats:
    """The heartbeats of the monitor of ``cfg``'s rank in its host's group (leading it if
    it is the first there). The group is the job's (its store) on this host."""
    host = jobenv.host_id()
    job = f"{cfg.store_host}:{cfg.store_port}:{cfg.store_factory or ''}"
    own = Leader(monitor_pid=os.getpid(), initial_rank=cfg.initial_rank, rank_pid=cfg.target_pid)
    limits = Thresholds(cfg.heartbeat_timeout, cfg.heartbeat_interval + cfg.monitor_process_interval)
    group = HostGroup(group_dir(job, host), own, limits.replace_s)
    return HostBeats(group, host, store, cfg.initial_world_size, emit, arrive_for, limits)


class HostBeats:
    """One monitor's heartbeats without a supervisor: sent to its host's leader, or, leading,
    beaten for the host (see the module docstring)."""

    def __init__(
        self,
        group: HostGroup,
        host: str,
        store: Callable[[], Any],
        world_size: int,
        emit: Callable[..., Any],
        arrive_for: Callable[[int], None] | None,
        limits: Thresholds,
    ) -> None:
        self.group, self._store, self.limits = group, store, limits
        self.world_size, self.emit, self.arrive_for = world_size, emit, arrive_for
        self.table = RankBeats()
        self.ring: HostRing | None = None
        self._refresh_at = 0.0
        self._out: dict[int, _Out] = {}  # this host's ranks to take out: why, when
        self._silent_hosts: dict[int, dict[str, Any]] = {}  # slot -> its report, when to act
        self._failing = False
        group.join()
        base = store()
        self.slot = register(base, f"{host}/{group.identity}")
        rank_lists.add(base, keys.host_ranks(self.slot), self.own)

    @property
    def own(self) -> int:
        return self.group.own.initial_rank

    @property
    def fileno(self) -> int | None:
        """The socket the followers beat to, while this monitor leads: read it when readable."""
        return self.group.fileno

    def beat(self, beat: Beat, now: float) -> None:
        """This monitor's beat, every heartbeat interval."""
        if self.group.leading and not self.group.still_leading():
            self.ring, self.table, self._out = None, RankBeats(), {}  # replaced: follow
        if not self.group.leading:
            stale = self.group.send(beat, now)
            if stale is None or not self.group.replace(stale):
                return
            self._took_over(stale, now)
        if self._guarded(self._tick, now):
            self.group.touch()  # only a leader that reaches the store keeps the lead
            self._guarded(self._act, now)

    def drain(self, now: float) -> None:
        """Read the followers' beats waiting now (the socket's queue is short)."""
        if self.group.leading:
            self._receive(now)

    def new_round(self, now: float) -> None:
        """The rank began a round: hosts and ranks that joined since are known by now."""
        if self.ring is not None:
            self._guarded(self._look_again, now)

    def end(self, failed: bool = False) -> None:
        """This monitor stops beating. A leader hands over: on purpose (its rank ended, died
        or hung: it takes care of it), or, ``failed``, as if it had died (its member file
        stays, as a killed monitor's does). Never raises."""
        if failed:
            self.group.abandon()
            self.group.close()
            return
        try:
            rank_lists.add(self._store(), keys.host_ended(self.slot), self.own)
        except Exception as exc:  # the store may be gone at the job's end
            log.info("could not write that this monitor ends: %r", exc)
        was_leading = self.group.leading
        last = self.group.leave()
        if not was_leading:
            bye = Beat(initial_rank=self.own, pid=self.group.own.rank_pid, bye=True)
            self.group.sender.send(bye, wait_s=1.0)
        self.group.close()
        if last:  # the host's last monitor: nobody is to find it silent
            try:
                self._store().add(keys.host_claim(self.slot), 1)
            except Exception as exc:
                log.info("could not end this host's place in the ring: %r", exc)

    # -- leading -------------------------------------------------------------------------
    def _took_over(self, stale: Stale, now: float) -> None:
        """Now leading in place of ``stale``'s leader."""
        old = stale.leader
        if old is None:
            log.info("leading this host's heartbeats after the last leader ended")
            return
        log.warning(
            "the monitor leading this host's heartbeats %s (%s): leading in its place",
            "died" if stale.why == "gone" else f"stood still for {stale.silent_s:.1f} s", old,
        )  # fmt: skip
        if old.initial_rank == self.own:
            return
        if stale.why == "gone" or stale.stopped:
            why = "its socket closed" if stale.why == "gone" else "its process is stopped"
            self._queue([old.initial_rank], f"the monitor leading its host stopped ({why})", now)
        else:  # blocked, maybe: a full timeout to beat to this leader
            self.table.record([Beat(old.initial_rank, pid=0, timeout=self.limits.timeout)], now)

    def _watch_listed(self, now: float) -> None:
        """Each rank of the host's list not heard of yet gets a full timeout to beat to this leader."""
        for rank in live_ranks(self._store(), self.slot):
            if rank != self.own and rank not in self.table.ranks:
                self.table.record([Beat(rank, pid=0, timeout=self.limits.timeout)], now)

    def _look_again(self, now: float) -> None:
        assert self.ring is not None
        self.ring.refresh()
        self._watch_listed(now)

    def _guarded(self, step: Callable[[float], None], now: float) -> bool:
        """Run ``step``; whether it reached the store. A store that fails is told once, and
        what was left to do is done at a later beat."""
        try:
            step(now)
        except Exception as exc:
            if not self._failing:
                log.warning("this host's heartbeats did not reach the store: %r", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("this host's heartbeats reach the store again")
        self._failing = False
        return True

    def _tick(self, now: float) -> None:
        """The host's beat, and the look at the next host: first, the rest may take a while."""
        if self.ring is None:
            ring = HostRing(self._store(), self.slot, self.limits)
            self._watch_listed(now)
            self.ring, self._refresh_at = ring, now + self.limits.host_s
        report = self.ring.tick(now, time.time())
        if report is not None:  # the ring moves on; the host's place ends once its ranks are out
            self.ring.ring.ended_slot(report["slot"])
            log.warning("host slot %s silent for %.1f s", report["slot"], report["silent_s"])
            self._silent_hosts[report["slot"]] = {**report, "at": now}

    def _act(self, now: float) -> None:
        """What the followers' beats, and the silences found, call for."""
        assert self.ring is not None
        self._receive(now)
        for s in self.table.due(now):
            self._queue([s.beat.initial_rank], f"no heartbeat for {s.silent_s:.1f} s", now)
        if now >= self._refresh_at > 0:
            self._refresh_at = 0.0
            self.ring.refresh()
        self._take_out_due(now)
        for slot, report in list(self._silent_hosts.items()):
            if report["at"] <= now:
                self._take_out_host(slot, report, now)

    def _take_out_host(self, slot: int, report: dict[str, Any], now: float) -> None:
        """Take the ranks of silent host ``slot`` out; end its place in the ring once they all
        are. Until then a later leader that finds it silent does so again."""
        assert self.ring is not None
        ranks = live_ranks(self.ring.store, slot)
        message = f"its host sent no heartbeat for {report['silent_s']:.1f} s"
        later = self._leave(ranks, message) if ranks else []
        if later:
            report["at"] = now + self.limits.replace_s
            return
        self.ring.claim(slot)
        del self._silent_hosts[slot]

    def _receive(self, now: float) -> None:
        """The followers' beats that came since the last look; a rank beating again is no
        longer to take out."""
        assert self.group.socket is not None
        beats = self.group.socket.receive()
        for b in beats:
            held = self.table.ranks.get(b.initial_rank)
            if b.bye and held is not None and held.beat.pid == 0:  # known only from the store
                del self.table.ranks[b.initial_rank]
            elif not b.bye:
                self._out.pop(b.initial_rank, None)
        self.table.record([b for b in beats if b.initial_rank != self.own], now)
        self.table.ranks.pop(self.own, None)
        for b in beats:  # beating again: a later silence is a new one
            held = self.table.ranks.get(b.initial_rank)
            if not b.bye and held is not None:
                held.declared = False

    def _queue(self, ranks: list[int], message: str, now: float) -> None:
        for rank in ranks:
            self._out.setdefault(rank, _Out(message, now))

    def _take_out_due(self, now: float) -> None:
        """Take this host's ranks due out of the running round. One not in it (no state
        published there yet), or a take-out the store failed, is tried again ``replace_s``
        later; one that ended on purpose meanwhile (its bye lost) is left alone."""
        due = {rank: out for rank, out in self._out.items() if out.at <= now}
        if not due:
            return
        ended = ended_ranks(self._store(), self.slot)
        for rank in [r for r in due if r in ended]:
            del self._out[rank], due[rank]
        by_message: dict[str, list[int]] = {}
        for rank, out in due.items():
            out.at = now + self.limits.replace_s  # unless it is out below
            by_message.setdefault(out.message, []).append(rank)
        for message, ranks in by_message.items():
            self._leave(ranks, message)

    def _leave(self, ranks: list[int], message: str) -> list[int]:
        """Take ``ranks`` (initial ranks) out of the running round as unresponsive, each with
        its event as it leaves; those not out yet (in no round yet), to try again."""
        from nvrx.store import rounds

        def left(rank: int) -> None:
            announce_leave(self.emit, rank, FaultRecord(rank, "unresponsive", message=message))

        done = rounds.leave_round(
            self._store(), ranks, self.world_size, message, False, "unresponsive",
            published=True, on_left=left,
        )  # fmt: skip
        for initial in done["out"]:  # it will not pass the termination barrier
            if self.arrive_for is not None:
                self.arrive_for(initial)
            self._out.pop(initial, None)
        later = [r for r in ranks if r not in done["out"]]
        log.log(
            logging.WARNING if done["ranks"] else logging.INFO,
            "ranks %s taken out (%s)%s", done["ranks"], message,
            f"; initial ranks {later} are in no round yet: again later" if later else "",
        )  # fmt: skip
        return later
