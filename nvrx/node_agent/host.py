"""The node agent's duty in a Wrapper job without a supervisor: it decides for its host.

The monitor processes of a host's ranks send their beats (``nvrx.node_agent.rank_wire``)
to one agent process of that host and job (``python -m nvrx.node_agent host FD``). It
alone talks to the store about liveness, so the store's load grows with hosts,
not ranks. The agent runs no user code: a rank that hangs cannot hang it.

Where it listens: an abstract Unix datagram socket named from the user, the job's
store and the host (``agent_address``); the kernel frees the name when the agent
ends, however it ends, so no file is left on any file system.

The first monitor of the host whose beat finds no agent starts it, with its
``HostConfig`` (``nvrx.inprocess.agent_link``); one that died is started again the same
way and takes the same place in the ring. Its loop reads the beats as every node agent
does (``rank_wire.BeatLoop``); its duty (``nvrx.node_agent``) takes silent ranks and
hosts out itself and ticks from the loop every heartbeat period. At each tick it

1. starts the host's barrier relay where it does not run yet (below);
2. ticks its host's place in the ring of hosts (``nvrx.store.ring``, the ring the
   supervisors' slots beat in too: its counter bumped, the next host's read);
3. takes out of the running round, as ``unresponsive`` with a ``fault`` event
   (``rounds.leave_round``): a rank of its host whose monitor stopped beating
   for the rank's ``heartbeat_timeout`` (unless it said it ended on purpose);
   and, once a watched host's counter stood still for ``Thresholds.host_s``,
   that host's listed ranks. A rank in no round yet (no round published, or the ranks
   numbered anew and no state of its own there), or a take-out the store
   failed, is tried again ``Thresholds.replace_s`` later; a silent host that beats
   again before any of that was done (its counter moved, and no other host declared it
   lost) is watched again instead.

Its place in the ring is the slot its ranks listed themselves in (their beats name it;
where the host's previous agent ended that place, its ranks all gone, the host's next).
Another host that found it silent while it stalled has ended that place and fenced it:
then the agent beats no more and takes nobody out (``_fence``); it ends once its ranks
ended or fell silent, or when a rank of the host beats for a later place, whose agent
the next beat then starts.

It also meets the round protocol's barriers for its host's ranks, in a thread of its own
(``rank_wire.BarrierRelay``, ``start_relay``): one arrival and one wait at the store for
all of them.

It ends when every rank of its host it knows of ended on purpose or was taken
out, ending its host's place in the ring first so that nobody finds it
silent (a store whose server refused or closed its connection by then ended
with the job: it is not waited for; one that failed otherwise is connected to
again for ``ENDING_STORE_S`` at most); and when the store stays unreachable for
``Thresholds.host_s`` (``STORE_GONE_S`` at most: the job ended or was killed; a store
that holds no job token counts as unreachable, since this job's monitors wrote theirs
before their first beat); and when the store it reaches holds another job's token
(``host_ring.job_token``: a job started again at the same store address, whose next beat
then starts its own agent); and when
every rank it still watches fell silent and no round names them, the others having ended
(they died before the job's first round formed; spares; ranks waiting to be admitted; a
listed rank that never beat here, which the job went on without), for ``NO_ROUND_S`` (its
place left to the host watching it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nvrx import events, jobenv, processes
from nvrx.events.failures import FaultRecord, announce_leave
from nvrx.store import host_ring
from nvrx.store.client import factory_store
from nvrx.store.host_ring import Thresholds, ended_ranks, live_ranks, register
from nvrx.store.ring import RingPlace
from nvrx.store.wire import StoreGone, WireStore

from .rank_wire import BarrierRelay, Beat, BeatLoop, BeatSocket, NewPids, Silence, relay_address

log = logging.getLogger(__name__)

#: An agent that no monitor beat to for this long after it started ends (its starter died
#: before its first beat was read), whatever the heartbeat timeout.
IDLE_START_S = 60.0
#: The longest the agent waits for a store that does not answer before it ends (the job is
#: gone; were it not, the next beat that finds no agent starts one), whatever the timeouts.
STORE_GONE_S = 60.0
#: An agent whose every rank fell silent and is named by no round (their take-outs find them
#: in no round) ends once they stood so for this long (``Thresholds.host_s`` if longer), so
#: about ``heartbeat_timeout`` plus that after their last beat, though the store answers: a
#: store of the job's that outlives it would keep the agent forever.
NO_ROUND_S = 60.0
#: The longest an agent whose ranks all ended tries to reach a store it lost, to end its
#: host's place: a store that does not answer by then ended with the job.
ENDING_STORE_S = 5.0


@dataclasses.dataclass
class HostConfig:
    """What a host's agent needs of its job: where the store is, the ranks' heartbeat
    timing, the world size, where to log and write events (the part of the ranks'
    monitor configuration that their agent shares)."""

    store_host: str | None
    store_port: int | None
    store_factory: str | None  # base64 pickle of (factory, kwargs): a store of the user's
    heartbeat_interval: float
    heartbeat_timeout: float
    monitor_process_interval: float
    initial_world_size: int
    logfile: str | None = None
    events_dir: str | None = None
    events_context: dict | None = None
    job_token: str = ""  # the job's token in its store (``host_ring.job_token``): none, unchecked

    @classmethod
    def of(cls, config: Any) -> HostConfig:
        """The fields of this class out of ``config`` (a monitor's configuration; the job's
        token the monitor reads from the store, not from its configuration)."""
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "job_token"]
        return cls(**{name: getattr(config, name) for name in fields})


def job_key(cfg: HostConfig) -> str:
    """What tells the job apart on this host: its store."""
    return f"{cfg.store_host}:{cfg.store_port}:{cfg.store_factory or ''}"


def agent_address(cfg: HostConfig, host: str) -> str:
    """The abstract socket name of ``host``'s agent in ``cfg``'s job, for this user."""
    digest = hashlib.sha1(f"{os.geteuid()}\0{job_key(cfg)}\0{host}".encode()).hexdigest()[:24]
    return f"\0nvrx-node-agent-{digest}"


def host_key(cfg: HostConfig, host: str) -> str:
    """The host's name in the store's ring, per job: a host name shared by processes in
    different network namespaces (containers) names as many hosts, each with its agent."""
    digest = hashlib.sha1(f"{job_key(cfg)}\0{host}\0{_net_namespace()}".encode()).hexdigest()
    return f"{host}/{digest[:16]}"


def _net_namespace() -> int:
    """This process's network namespace (abstract socket names are per namespace)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def limits_of(cfg: HostConfig) -> Thresholds:
    return Thresholds(cfg.heartbeat_timeout, cfg.heartbeat_interval + cfg.monitor_process_interval)


def connect_store(cfg: HostConfig, connect_within: float = STORE_GONE_S) -> Any:
    """A connection to ``cfg``'s store whose requests wait ``host_s`` (``STORE_GONE_S`` at
    most), and whose connecting that or ``connect_within`` (unless a store factory says
    otherwise)."""
    if cfg.store_factory:
        return factory_store(cfg.store_factory)
    host, port = cfg.store_host or "127.0.0.1", int(cfg.store_port or 0)
    limit = min(limits_of(cfg).host_s, STORE_GONE_S)
    store = WireStore(host, port, timeout=min(limit, connect_within))
    store.set_timeout(limit)
    return store


def _server_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the store's server is not there: it refused, reset or closed
    the connection (not a request or a connection that timed out)."""
    return isinstance(exc, StoreGone) and isinstance(exc.__cause__, ConnectionError)


def start_relay(cfg: HostConfig, host: str) -> BarrierRelay:
    """The host's barrier relay (``nvrx.node_agent.rank_wire``) for ``cfg``'s job. ``OSError``
    where another agent of this host still holds its address (the one this agent follows,
    ending: its ranks' arrivals go there until it is gone)."""
    relay = BarrierRelay(relay_address(agent_address(cfg, host)), lambda: connect_store(cfg))
    return relay.start()


@dataclasses.dataclass
class _Out:
    """A rank of this host to take out of the running round: why, when to try, and since
    when it was silent (the agent's clock)."""

    message: str
    at: float
    since: float


class NodeAgent:
    """The agent's loop (see the module docstring): ``run`` until its host's ranks ended."""

    def __init__(
        self,
        cfg: HostConfig,
        sock: BeatSocket,
        emit: Callable[..., Any],
        host: str,
        store: Any = None,
    ) -> None:
        self.cfg, self.sock, self.emit, self.host = cfg, sock, emit, host
        self.limits = limits_of(cfg)
        self.store: Any = None
        self.place: RingPlace | None = None  # this host's part in the ring of hosts
        self.fenced = False  # another host declared this one lost: out of the ring for good
        self.slot = -1
        self._listed_in = -1  # the slot the ranks that beat here are listed in
        self.loop = BeatLoop(sock, self)
        self.table = self.loop.beats
        self.heard: set[int] = set()  # ranks whose monitor beat here
        self.done: set[int] = set()  # ranks that ended on purpose, or were taken out
        self._out: dict[int, _Out] = {}
        self._silent_hosts: dict[int, dict[str, Any]] = {}
        self._refresh_at = 0.0
        self._round = -1  # the latest round a beat named
        self._reached = time.monotonic()  # the last time the store answered
        self._failing = False
        self._gone_at: float | None = None  # the last look whose store's server was gone
        self._job_seen = False  # the store connected to holds this job's token
        self.other_job = False  # the store at the job's address is another job's: it ended
        self._no_round_since: float | None = None  # every rank silent, none out yet, since
        #: The host's barrier relay, told how many ranks the agent serves (``received``);
        #: started at each tick until it is (``_keep_relay``), unless ``relays`` is False.
        self.relay: BarrierRelay | None = None
        self.relays = not cfg.store_factory  # a store of the user's: its ranks meet there
        self._relay_refused = False
        self._started = time.monotonic()
        if store is not None:
            self._attach(store, self._reached)

    def run(self) -> None:
        """Until ``finished`` (asked at each tick): the beats as they come, the host's tick
        every interval (``BeatLoop``)."""
        self._started = time.monotonic()
        self.loop.run()

    def interval(self) -> float:
        return self.cfg.heartbeat_interval

    def tick(self, now: float) -> bool:
        """The host's tick (the relay started where it does not run yet); False once the
        agent may end."""
        self._keep_relay()
        self._guarded(self._tick, now)
        return not self.finished(now, self._started)

    @property
    def live(self) -> set[int]:
        """The ranks of this host the agent heard of and that did not end."""
        return self.heard - self.done

    @property
    def settled(self) -> bool:
        """Every rank this agent heard of ended, and none waits to be taken out."""
        return not self.live and not self._out

    def _count_ranks(self) -> None:
        """Tell the relay how many ranks it serves, and how many of them meet the barriers of
        the running round."""
        assert self.relay is not None
        held = (self.table.ranks.get(rank) for rank in self.live)
        self.relay.serve(None if b is None else b.beat for b in held)

    def _keep_relay(self) -> None:
        """Start the host's barrier relay where it does not run yet."""
        if self.relay is not None or not self.relays:
            return
        try:
            self.relay = start_relay(self.cfg, self.host)
        except OSError as exc:
            if not self._relay_refused:
                log.info("no barrier relay yet (%s): this host's ranks meet the barriers at the "
                         "store until it starts", exc)  # fmt: skip
            self._relay_refused = True
            return
        self._count_ranks()
        log.info("meets the barriers of this host's ranks")

    def close(self) -> None:
        """Stop the barrier relay (before the beat socket is closed: the next agent of the
        host may bind both at once)."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    def step(self, now: float) -> bool:
        """One look at ``now``: the beats that came, then the tick; whether the store answered."""
        self.loop.look(now)
        return self._guarded(self._tick, now)

    def finished(self, now: float, started: float) -> bool:
        """Whether the agent may end (see the module docstring)."""
        if self.other_job:
            return True
        if now - self._reached > min(self.limits.host_s, STORE_GONE_S):
            log.warning("the store did not answer for %.1f s: the job is gone", now - self._reached)
            return True
        if not self.heard:  # its starter's first beat waits in the socket before it starts
            return now - started > IDLE_START_S
        if self.fenced and self._listed_in > self.slot:
            # the next beat starts the agent of that place (one started by a beat of this
            # place is fenced too, and ends at the later place's next beat)
            log.info("a rank of this host beats for its next place: the agent for it starts")
            return True
        if not self.settled:
            return self._silent_in_no_round(now)
        if self._gone_at == now:
            return True  # every rank ended, and this look's tick found the server gone
        with_store = self._guarded(self._end_place, now)
        return with_store or self.store is None  # every rank ended, and the store is gone

    def _silent_in_no_round(self, now: float) -> bool:
        """Whether every rank this agent still watches fell silent and waits to be taken out,
        no round naming them (their take-outs are tried again: ranks that died before the
        job's first round formed, spares, ranks waiting to be admitted, a listed rank that
        never beat here and that the job went on without), the others having ended, for
        ``NO_ROUND_S`` (``host_s`` if longer). The agent then ends, its place left standing:
        the host watching this one finds it silent and takes its listed ranks out, should a
        round name them later; with no other host, no rank of the job lives to wait for
        them."""
        if not self._out or not self.live <= self._out.keys():
            self._no_round_since = None
            return False
        if self._no_round_since is None:
            self._no_round_since = now
        if now - self._no_round_since < max(self.limits.host_s, NO_ROUND_S):
            return False
        log.warning("ranks %s of this host fell silent and no round names them: the agent "
                    "ends, its place left to the host watching it", sorted(self._out))  # fmt: skip
        return True

    def _end_place(self, now: float) -> None:
        """Every rank this agent heard of is done: end the host's place unless a listed
        rank still lives (one that never beat here yet); a rank listed as it ended goes on
        the host's next place (``host_ring.carry_over``). Raises to say 'not yet'. A fenced
        agent's place ended already, and the host that ended it took its listed ranks out."""
        if self.fenced:
            log.info("every rank of this host ended or fell silent: the fenced agent ends")
            return
        listed = set(live_ranks(self.store, self.slot)) - self.done
        if listed:
            raise _NotYet(f"ranks {sorted(listed)} of this host are still listed")
        if host_ring.end_place(self.store, self.slot):
            # a monitor lists its rank, then reads the claim: one that listed it while the
            # place was ending saw no claim and beats for it still, so the list is read again
            late = set(live_ranks(self.store, self.slot)) - self.done
            if late:
                host_ring.carry_over(self.store, host_key(self.cfg, self.host), late)
                log.info("ranks %s listed as the place ended: listed in the host's next place, "
                         "for the agent their next beat starts", sorted(late))  # fmt: skip
        log.info("every rank of this host ended: the agent ends")

    def _guarded(self, step: Callable[[float], None], now: float) -> bool:
        """Run ``step``; whether it reached the store. A store that fails is told once."""
        try:
            if self.store is None:
                self._connect(now)
            step(now)
        except _NotYet:
            self._reached = now
            return False
        except _OtherJob as exc:
            log.warning("%s: this job is gone, its agent ends", exc)
            self.other_job = True
            self._drop_store()
            return False
        except Exception as exc:
            if not self._failing:
                log.warning("this host's beats did not reach the store: %r", exc)
            self._failing = True
            if _server_gone(exc):
                self._gone_at = now
            self._drop_store()  # connect again next time: the store may serve again there
            return False
        if self._failing:
            log.info("this host's beats reach the store again")
        self._failing, self._reached = False, now
        return True

    def _drop_store(self) -> None:
        if self.store is not None and hasattr(self.store, "close"):
            with contextlib.suppress(Exception):
                self.store.close()
        self.store, self.place, self._job_seen = None, None, False
        self._silent_hosts.clear()  # found in that store; the next may be another job's call

    def _connect(self, now: float) -> None:
        """Connect (within ``host_s`` unless a store factory says otherwise; once every rank
        ended, within ``ENDING_STORE_S``), once a beat came: it names the place of its ranks."""
        if not self.heard:
            raise _NotYet("no beat came yet")
        within = ENDING_STORE_S if self.settled else STORE_GONE_S
        self._attach(connect_store(self.cfg, within), now)

    def _attach(self, store: Any, now: float) -> None:
        """Use ``store``: take the host's slot in the ring, watch the host's listed ranks.

        The slot is the one its ranks listed themselves in, as their beats say. Another
        host may have declared it lost while this agent could not tick (it stalled before
        its first tick, or its connection was down): then it is fenced at once."""
        self.store = store
        self._check_job()
        if self.slot < 0:
            self.slot = self._listed_in
        if self.slot >= 0 and not self.fenced and host_ring.declared_lost(store, self.slot):
            self._fence()
        if self.fenced:  # its slot is ended: no new one, the ring goes on without this host
            return
        self.slot = register(store, host_key(self.cfg, self.host))
        context = self.cfg.events_context or events.context_from_env()  # as its events name it
        host_ring.name_place(store, self.slot, self.host, context.get("node"))
        self.place = host_ring.place(store, self.slot, self.limits)
        self._watch_listed(now)
        self._refresh_at = now + self.limits.host_s

    def _check_job(self) -> None:
        """Raise ``_OtherJob`` where the store holds another job's token: this job ended and
        another serves its store at the same address (its own agent starts when this one
        ends). Raise ``_NoToken`` where it holds none: each monitor of this job wrote the
        token before its first beat, so the store is not this job's either (another job's
        whose first monitor did not write it yet); the connection is dropped and does not
        count as the store answering."""
        if self._job_seen or not self.cfg.job_token:
            return
        token = host_ring.read_job_token(self.store)
        if token is None:
            raise _NoToken("the store at this job's address holds no job token: not this job's")
        if token != self.cfg.job_token:
            raise _OtherJob(f"the store at this job's address holds another job's token {token}")
        self._job_seen = True

    def _tick(self, now: float) -> None:
        """The host's beat, the look at the next host, then what the silences call for."""
        self._check_job()
        if self.fenced:  # the store is still read, to know it answers
            host_ring.host_count(self.store)
            return
        assert self.place is not None
        if not self.place.tick(self.store, now, time.time(), lambda r: self._found(r, now)):
            self._fence()
            return
        if now >= self._refresh_at:
            self._refresh_at = now + self.limits.host_s
            self.place.ring.resize(host_ring.host_count(self.store))
            self._watch_listed(now)
        self._take_out_due(now)
        for slot, silent in list(self._silent_hosts.items()):
            if silent["at"] <= now:
                self._take_out_host(slot, silent, now)

    def _fence(self) -> None:
        """Another host found this one silent while it stalled, took its ranks out and ended
        its place: it beats no more, takes no new place and takes nobody out, neither its
        own ranks (they are out already: those it was about to take out count as ended) nor
        the hosts it found silent (the host that fenced it watches them now). It ends once
        its ranks ended or fell silent, with the store, or when a rank of the host beats for
        a later place (``finished``)."""
        log.warning(
            "another host found this one silent and took its ranks out: it beats no more in "
            "the ring of hosts"
        )
        self.place, self.fenced = None, True
        self._silent_hosts.clear()
        self.done.update(self._out)
        self._out.clear()

    def _found(self, report: dict[str, Any], now: float) -> None:
        """What this host's tick found that it acts on: a host newly silent (the ring moves
        on; its place ends once its ranks are out). A ``rejected`` write the ring logged;
        ``fenced`` comes with the tick's end (``_fence``)."""
        if report["event"] == "node_silent":
            assert self.place is not None
            beats = self.place.ring.seen  # what stood still: it beats again once this moves
            self.place.ring.ended_slot(report["slot"])
            slot, since = report["slot"], now - report["silent_s"]
            self._silent_hosts[slot] = {**report, "at": now, "since": since, "beats": beats}

    def _watch_listed(self, now: float) -> None:
        """Each listed live rank not heard of yet gets a full timeout to beat here."""
        for rank in live_ranks(self.store, self.slot):
            if rank not in self.table.ranks and rank not in self.done:
                self.table.record([Beat(rank, pid=0, timeout=self.limits.timeout)], now)

    def received(self, beats: list[Beat], new: NewPids, now: float) -> None:
        """The beats that came, in order (recorded in ``table``); a rank beating again is no
        longer to take out, and a round not seen before has the ring and the host's list
        looked at again."""
        for b in beats:
            self._out.pop(b.initial_rank, None)
            if b.bye:
                self.done.add(b.initial_rank)
                continue
            self.heard.add(b.initial_rank)
            self.done.discard(b.initial_rank)
            self._listed_in = max(self._listed_in, b.slot)
            if b.round > self._round:
                self._round, self._refresh_at = b.round, now
        if self.relay is not None:
            self._count_ranks()

    def silent(self, silence: Silence, now: float) -> None:
        """A rank silent for its timeout is taken out at the next tick; one that ended on
        purpose (its bye read: its listed place may still be watched) is not, and a fenced
        agent counts it as out already."""
        rank = silence.beat.initial_rank
        if rank in self.done:
            return
        if self.fenced:
            self.done.add(rank)
            return
        self._queue([rank], f"no heartbeat for {silence.silent_s:.1f} s", now, now - silence.silent_s)

    def _queue(self, ranks: list[int], message: str, now: float, since: float) -> None:
        for rank in ranks:
            self._out.setdefault(rank, _Out(message, now, since))

    def _take_out_due(self, now: float) -> None:
        """Take this host's ranks due out of the running round; one that ended on purpose
        meanwhile (its bye lost) is left alone."""
        due = {rank: out for rank, out in self._out.items() if out.at <= now}
        if not due:
            return
        ended = ended_ranks(self.store, self.slot)
        for rank in [r for r in due if r in ended]:
            del self._out[rank], due[rank]
            self.done.add(rank)
        by_message: dict[str, list[int]] = {}
        for rank, out in due.items():
            out.at = now + self.limits.replace_s  # unless it is out below
            by_message.setdefault(out.message, []).append(rank)
        for message, ranks in by_message.items():
            self._leave(ranks, message, {r: now - due[r].since for r in ranks})

    def _take_out_host(self, slot: int, silent: dict[str, Any], now: float) -> None:
        """Take the ranks of silent host ``slot`` out; end its place in the ring once they
        all are. Until then another agent that finds it silent does so again. A host that
        beats again before any of that was done is alive (``_back``); not one whose counter
        moved by the fence of another host that declared it lost."""
        moved = not silent.get("acted") and host_ring.beats(self.store, slot) != silent["beats"]
        if moved and not host_ring.declared_lost(self.store, slot):
            self._back(slot)
            return
        ranks = live_ranks(self.store, slot)
        message = f"its host sent no heartbeat for {silent['silent_s']:.1f} s"
        silent_s = now - silent["since"]
        where = host_ring.place_name(self.store, slot)  # its faults name it, not this host
        later = self._leave(ranks, message, dict.fromkeys(ranks, silent_s), where) if ranks else []
        silent["acted"] = silent.get("acted") or len(later) < len(ranks)
        if later:
            silent["at"] = now + self.limits.replace_s
            return
        silent["acted"] = True
        host_ring.declare_lost(self.store, slot, self.slot)
        # a monitor lists its rank, then reads the claim: one that listed it while the place
        # was ending saw no claim and stays there, so the list is read once more after it
        if set(live_ranks(self.store, slot)) - set(ranks):
            silent["at"] = now + self.limits.replace_s  # taken out at the next pass
            return
        del self._silent_hosts[slot]

    def _back(self, slot: int) -> None:
        """Silent host ``slot`` beats again before any of its ranks was taken out or its place
        ended (its agent was started again, or thawed, while its ranks were in no round):
        its own agent watches its ranks, and the ring watches it again."""
        log.info("host slot %d beats again before any of its ranks was taken out: watched "
                 "again", slot)  # fmt: skip
        del self._silent_hosts[slot]
        assert self.place is not None
        self.place.ring.watch_again(slot)

    def _leave(
        self,
        ranks: list[int],
        message: str,
        silent_s: dict[int, float],
        where: dict[str, Any] | None = None,
    ) -> list[int]:
        """Take ``ranks`` (initial ranks) out of the running round as unresponsive in one
        call, each with its event as it leaves, whose ``detection_s`` is how long that rank
        had been silent (``silent_s``, by initial rank: the report counts the fault from when
        it fell silent); those not out yet (in no round yet), to try again."""
        from nvrx.store import rounds

        round_ = rounds.current_round(self.store)

        own = where is None  # else another host's ranks: ``where`` names that host
        place = {} if own else {"rank_host": where.get("host"), "rank_node": where.get("node")}

        def left(rank: int, initial: int) -> None:  # its event names it and its round, as its monitor's would
            emit = functools.partial(self.emit, rank=rank, round=round_, **place)
            record = FaultRecord(rank, "unresponsive", message=message)
            announce_leave(emit, rank, record, detection_s=silent_s[initial])

        # a rank that died before it wrote its state in the round stands at its initial rank
        # where the ranks are not numbered anew: without a supervisor no replacement waits
        # to be admitted under a number that is another's
        size = self.cfg.initial_world_size
        done = rounds.leave_round(self.store, ranks, size, message, False, "unresponsive", on_left=left)
        if done["out"]:  # they will not pass the termination barrier
            generation = rounds.generation_of(self.store, done["round"])
            for initial in done["out"]:
                rounds.arrive_one(self.store, "termination", generation, initial, size)
        for initial in done["out"]:
            self._out.pop(initial, None)
            if own:
                self.done.add(initial)
        later = [r for r in ranks if r not in done["out"]]
        log.log(
            logging.WARNING if done["ranks"] else logging.INFO,
            "ranks %s taken out (%s)%s", done["ranks"], message,
            f"; initial ranks {later} are in no round yet: again later" if later else "",
        )  # fmt: skip
        return later


class _OtherJob(Exception):
    """The store the agent reached is another job's."""


class _NoToken(Exception):
    """The store the agent reached holds no job token: it is not this job's."""


class _NotYet(Exception):
    """Not yet: the agent may not end (the store answered), or may not connect (no beat
    came yet)."""


def log_paths(cfg: HostConfig, host: str) -> list[Path]:
    """Where the agent of ``host`` logs, in the order tried: the log file of the monitor
    that started it, where one is given, then ``node_agent-<host>.log`` in the job's event
    directory (a ``/`` of the host id as ``_``; agents of one host id in two network
    namespaces share it, each line naming its pid). Its stderr goes nowhere: it outlives
    the launcher that would read it."""
    directory = Path(cfg.events_dir) if cfg.events_dir else events.job_log_dir()
    beside_events = directory / f"node_agent-{host.replace(os.sep, '_')}.log"
    return [Path(cfg.logfile), beside_events] if cfg.logfile else [beside_events]


def _setup_logging(paths: list[Path]) -> None:
    """Log to the first of ``paths`` that opens; to stderr where none does: the agent
    serves its host all the same, and its events say what it did."""
    handler: logging.Handler | None = None
    refused = []
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path)
            break
        except OSError as exc:
            refused.append(f"cannot log to {path}: {exc}")
    handler = handler or logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s nvrx.node_agent[%(process)d] %(levelname)s: %(message)s")
    )
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if jobenv.flag_in(None, jobenv.MONITOR_DEBUG) else logging.INFO)
    for said in refused:
        log.warning("%s", said)


def main(argv: list[str]) -> int:
    """Serve on the socket of descriptor ``argv[0]`` as the agent of the job and host of the
    ``HostConfig`` (JSON) on the first line of stdin."""
    if len(argv) != 1 or not argv[0].isdigit():
        usage = "usage: python -m nvrx.node_agent host FD (a HostConfig as JSON on stdin)"
        print(usage, file=sys.stderr)
        return 2
    processes.ignore_warning_signal()
    fd, cfg = int(argv[0]), HostConfig(**json.loads(sys.stdin.readline()))
    _setup_logging(log_paths(cfg, jobenv.host_id()))
    sock = BeatSocket(agent_address(cfg, jobenv.host_id()), fd)
    context = dict(cfg.events_context or events.context_from_env())
    context.update(rank=None, round=None)
    writer = events.EventWriter(cfg.events_dir or events.job_log_dir(), "node_agent", context)
    log.info("node agent of host %s serving (pid %d)", jobenv.host_id(), os.getpid())
    agent = None
    try:
        agent = NodeAgent(cfg, sock, writer.emit, jobenv.host_id())
        agent.run()
    except Exception:
        log.exception("the node agent failed")  # its stderr is closed: said in its log
        return 1
    finally:
        if agent is not None:
            agent.close()
        sock.close(unlink=False)
    return 0
