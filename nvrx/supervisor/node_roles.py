"""A supervisor's part in surviving a lost node: its node rank, spares, declaring a node lost.

Slots and node ranks are described in ``node_keys``. The node's agent beats for
this slot and reports a watched slot that fell silent
(``nvrx.node_agent.supervised.NodeDuty``); the supervisor then declares it lost here, once for the whole job (the first
valid entry of the slot's claim wins), and decides what the job does:

1. **spare**: the lowest free spare slot that is still alive takes the lost
   node rank (spares are handed out by one claim each, so two losses
   never get the same spare); its children join the running job through the
   Wrapper's rejoin path, and the world size does not change;
2. **shrink**: no spare left, but at least ``--min-nodes`` nodes remain: the
   lost ranks are marked gone and the Wrapper's rank assignment goes on without
   them;
3. **stop**: below ``--min-nodes``: the job stops with "node lost, no spare"
   (exit code 8).

In every case the lost node's ranks leave the Wrapper's running round at once
(``rounds.leave_round``), so that their peers stop waiting for them.

Every key here that steers the job is sealed with the job's secret
(``nvrx.store.sealed_keys``): a slot's end, a spare taken, the count of nodes the job
shrank by, of nodes done and ended are sealed lists; a spare's assignment and the flags
"every training node is done" and "every other slot ended" are sealed chains, whose
watchers record a value they reject as a ``rejected_write`` event; each slot's info is a
sealed value. A value that does not unseal is never acted on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from nvrx.slurm import commands
from nvrx.store import ring, sealed_keys
from nvrx.store.seal import Sealer
from nvrx.store.sealed_keys import ChainValue, SealedChain
from nvrx.store.snapshot import KeptKeys

from . import node_keys
from .config import ALL_DONE_KEY, ALL_ENDED_KEY, ENDED_KEY, NODES_DONE_KEY, SupervisorConfig
from .node_probe import NodeProbes
from .store_link import StoreLink, StoreLinkError

log = logging.getLogger(__name__)

#: Seconds allowed for ``scontrol show node`` when a node is declared lost.
SLURM_LOOK_S = 5.0


@dataclass(frozen=True)
class Loss:
    """What declaring one slot lost decided."""

    slot: int
    host: str | None  # SLURM node name, else host name
    node_rank: int | None  # the node rank it held; None for a spare
    action: str  # spare | shrink | stop | none
    replaced_by: int | None
    remaining: int  # training nodes left after the loss
    reason: str
    ranks: tuple[int, ...] = ()  # the global ranks the node rank held
    slurm_node: str | None = None  # the SLURM node name the slot published
    silent_s: float | None = None  # as the report of its silence said
    last_seen_wall: float | None = None
    cause: str = "silent"  # silent | never_ready | excluded (``node_lost``'s ``cause``)


class NodeRoles:
    """This slot's role (training node rank, or spare) and its handling of lost slots."""

    def __init__(
        self,
        cfg: SupervisorConfig,
        link: StoreLink,
        emit: Callable[..., None],
        sealer: Callable[[], Sealer | None],
        rejected: Callable[[str, str, int], None] | None = None,
    ) -> None:
        """``sealer``: the job's, once known; ``rejected``: records a value refused for its
        seal (key, reason, size), by default as a ``rejected_write`` event."""
        self.cfg, self.link, self._emit, self._sealer = cfg, link, emit, sealer
        self._rejected = rejected or (
            lambda key, reason, size: emit("rejected_write", key=key, reason=reason, value_bytes=size)
        )
        self.slot = cfg.node_rank
        self.node_rank: int | None = None if cfg.starts_as_spare else cfg.node_rank
        self.left = False
        self.store_slot = 0  # the slot hosting the store: its end is not counted in ENDED
        #: After a store failover, the first round of the generation the ranks start anew
        #: in, until it runs (``opening_fresh``); None otherwise.
        self.fresh_from: int | None = None
        self.probes = NodeProbes(emit)  # does a lost node still answer SLURM?
        self._watched: dict[str, SealedChain] = {}  # sealed chains this slot waits on
        #: The rejected values this slot recorded, as (key, digest of the value): a chain it
        #: watches again from its start (after a failover, in the store restored from the
        #: snapshot) meets them again.
        self._recorded: set[tuple[str, bytes]] = set()

    @property
    def enabled(self) -> bool:
        """Liveness only matters when there is another node to notice a loss."""
        return self.cfg.nnodes > 1 and self.cfg.node_liveness

    @property
    def keeps_store_ready(self) -> bool:
        """Whether the slot next in line to host the job's store keeps one ready
        (``Failover.prepare``): with node liveness, 3 slots or more and warm standbys."""
        return self.enabled and self.cfg.nnodes >= 3 and self.cfg.warm_standby

    def start(self) -> None:
        """Publish this slot, start beating and watching; a spare also waits for an assignment."""
        if not self.enabled:
            return
        self._publish_info()
        cfg = self.cfg
        self.link.start_liveness(
            self.slot, cfg.nnodes, cfg.node_heartbeat, cfg.node_timeout, cfg.store_timeout,
            str(cfg.events_dir),
        )  # fmt: skip
        if self.node_rank is None:
            self.watch_chain(node_keys.assign(self.slot))
            self.watch_chain(ALL_DONE_KEY)

    # -- sealed keys ----------------------------------------------------------------
    def _known_sealer(self) -> Sealer:
        sealer = self._sealer()
        if sealer is None:
            raise StoreLinkError("the job's secret is not known yet: no control key can be sealed")
        return sealer

    def _store(self, store: Any) -> Any:
        """``store``, or the store link when none is given (a snapshot's keys, say)."""
        return self.link if store is None else store

    def _chain(self, base: str) -> SealedChain:
        return SealedChain(base, self._known_sealer())

    def watch_chain(self, base: str) -> None:
        """Wait on the sealed chain at ``base`` (``on_chain_value`` tells what it holds)."""
        chain = self._watched[base] = self._chain(base)
        chain.watch(self.link)

    def watched_base(self, key: object) -> str | None:
        """The base of the watched chain that owns ``key``; None for other keys."""
        found = self._chain_of(key)
        return None if found is None else found[0]

    def _chain_of(self, key: object) -> tuple[str, SealedChain] | None:
        """The base and chain of a watched chain that owns ``key``; None for other keys."""
        for base, chain in self._watched.items():
            if chain.owns(key):
                return base, chain
        return None

    def on_chain_value(self, key: object, value: str) -> tuple[str, ChainValue] | None:
        """What watched ``key`` holds: its chain's base and payload; a value rejected is
        recorded (``rejected_write``, by the slot that stands for its watchers; once by this
        slot, though it watches the chain again) and the watch moves on. None when ``key`` is
        no watched chain's."""
        found = self._chain_of(key)
        if found is None:
            return None
        base, chain = found
        seen = chain.on_value(str(key), value)
        if seen.payload is None:
            records = base != ALL_DONE_KEY or self.slot == self.cfg.active_nodes  # the lowest spare
            raw = value.encode(errors="replace")
            met = (str(key), hashlib.sha256(raw).digest())
            if records and met not in self._recorded:
                self._recorded.add(met)
                self._rejected(str(key), str(seen.rejected), len(raw))
            chain.watch(self.link)
        return base, seen

    def _count_up(self, key: str) -> int:
        return sealed_keys.count_up(self.link, self._known_sealer(), key, self.slot)

    def _count(self, key: str) -> int:
        return sealed_keys.count(self.link, self._known_sealer(), key)

    def _set_flag(self, base: str) -> None:
        self._chain(base).write(self.link, "1")

    def flag_set(self, base: str, store: Any = None) -> bool:
        """Whether the sealed flag at ``base`` was set by the job (in ``store``, by default
        the store)."""
        return self._chain(base).read(self._store(store)) is not None

    def _publish_info(self) -> None:
        info = {
            "host": socket.gethostname(),
            "slurm_node": os.environ.get("SLURMD_NODENAME"),
            "pid": os.getpid(),
            "node_rank": self.node_rank,
        }
        key = node_keys.info(self.slot)
        self.link.set(key, self._known_sealer().seal(key, json.dumps(info)))

    # -- a lost slot ----------------------------------------------------------------
    def relink(
        self, cfg: SupervisorConfig, link: StoreLink, store_slot: int, fresh_from: int | None = None
    ) -> None:
        """After a store failover: the same role, through the new store hosted by ``store_slot``.
        ``fresh_from``: the first round of the generation the ranks start anew in there (the
        one after the last round of the snapshot it was restored from)."""
        self.cfg, self.link, self.store_slot = cfg, link, store_slot
        self.fresh_from = fresh_from

    def opening_fresh(self) -> bool:
        """Whether the job's ranks are starting anew after a store failover and that generation
        has run no round yet: a spare's ranks then start with them (there is no round to
        rejoin), whichever slot was lost."""
        if self.fresh_from is None:
            return False
        current = self.link.current_round()
        if current is not None and current >= self.fresh_from:
            self.fresh_from = None  # opened: a later spare rejoins its running round
            return False
        return True

    def declare(self, report: dict[str, Any], fresh: bool = False) -> Loss | None:
        """Declare the silent slot of ``report`` lost and record it (``take_out``, then
        ``record``); None when another supervisor did first.

        ``fresh``: the job starts anew (store failover), so a spare's children
        start a new generation with everyone instead of rejoining.
        """
        loss = self.take_out(report, fresh)
        if loss is not None:
            self.record(loss)
        return loss

    def take_out(self, report: dict[str, Any], fresh: bool = False) -> Loss | None:
        """The store's half of ``declare``: end the silent slot of ``report``, decide what
        replaces it and take its ranks out of the job; nothing is recorded yet (a successor
        store host records the loss only once its store is published). None when another
        supervisor did first."""
        slot = int(report["slot"])
        start_fresh = fresh or self.opening_fresh()  # (asked first: a failed ask claims nothing)
        if not self._end(slot):
            return None
        info = self._info(slot)
        node_rank = self._held_node_rank(slot, info)
        host = info.get("slurm_node") or info.get("host")
        loss = self._decide(slot, host, node_rank, start_fresh)
        ranks = () if node_rank is None else tuple(self._ranks(node_rank))
        if ranks:
            message = f"node rank {node_rank} (slot {slot}, {host}) lost: {loss.reason}"
            self.link.leave_ranks(list(ranks), self.cfg.world_size, message, gone=loss.action != "spare")
        if not fresh:  # after a failover every slot looks for the next store itself (``prepare``)
            self._hand_on_held_store(slot)
        return replace(
            loss, ranks=ranks, slurm_node=info.get("slurm_node"),
            silent_s=report.get("silent_s"), last_seen_wall=report.get("last_seen_wall"),
            cause=str(report.get("cause", "silent")),
        )  # fmt: skip

    def record(self, loss: Loss) -> None:
        """The record of a loss ``take_out`` decided: its ``node_lost`` event and log line, a
        SLURM probe of the node lost, and the job's end when a shrink left nothing to train."""
        self._emit(
            "node_lost",
            lost_node=loss.node_rank,
            lost_slot=loss.slot,
            lost_host=loss.host,
            silent_s=loss.silent_s,
            last_seen_wall=loss.last_seen_wall,
            cause=loss.cause,
            seen_by=self.slot,
            slurm_state=_slurm_state(loss.slurm_node),
            action=loss.action,
            replaced_by=loss.replaced_by,
            ranks=list(loss.ranks),
        )
        log.warning("slot %d (%s) lost: %s", loss.slot, loss.host, loss.reason)
        if loss.action in ("spare", "shrink") and loss.slot != self.slot:  # (a stop probes at requeue)
            self.probes.start(loss.slot, loss.slurm_node)  # not a node that left on purpose
        if loss.action == "shrink":
            self._check_all_done()

    def record_lost_unreplaced(self, slot: int, host: str, lost_wall: float, kept: KeptKeys) -> None:
        """Record ``slot`` lost as a survivor sees it once the store is gone with no successor:
        nothing can be declared in the store, and the job stops. What the store knew comes
        from its snapshot, ``kept``: a slot whose end it shows (it left, or was declared lost)
        is not recorded again; the node rank given is the one the slot held there, and the
        action ``none`` for a spare that held none or a slot whose training had ended."""
        if self.ended(slot, kept):
            log.info("slot %d (%s) had ended before the store was lost", slot, host)
            return
        try:
            node_rank = self._held_node_rank(slot, self._info(slot, kept), kept)
            done = self.flag_set(node_keys.done(slot), kept) or self.flag_set(ALL_DONE_KEY, kept)
        except StoreLinkError:  # the job's secret was never known: as the slot started
            node_rank, done = (slot if slot < self.cfg.active_nodes else None), False
        self._emit(
            "node_lost",
            lost_node=node_rank,
            lost_slot=slot,
            lost_host=host,
            silent_s=None,
            last_seen_wall=lost_wall,
            cause="silent",
            seen_by=self.slot,
            slurm_state=_slurm_state(host),
            action="none" if node_rank is None or done else "stop",
            replaced_by=None,
            ranks=[] if node_rank is None else self._ranks(node_rank),
        )
        log.warning("slot %d (%s) lost with the job's store: the job cannot go on", slot, host)

    def next_in_line(self, kept: KeptKeys | None = None, passed: frozenset[int] = frozenset()) -> int | None:
        """The slot that would host the next store: the lowest but the store host's, those in
        ``passed`` and those ended (they left, or were declared lost) in ``kept`` (the lost
        store's snapshot) or else the store; None when every slot is one of those."""
        for slot in range(self.cfg.nnodes):
            if slot != self.store_slot and slot not in passed and not self.ended(slot, kept):
                return slot
        return None

    def _hand_on_held_store(self, lost: int) -> None:
        """``lost`` just ended (declared lost): where it was next in line to host the store,
        the slot next in line now is told to keep a store ready in its place (its
        ``hold_store`` chain); without that it would hold none until the next failover."""
        if not self.keeps_store_ready or lost == self.store_slot:
            return
        successor = self.next_in_line()
        if successor is not None and lost < successor:
            self._chain(node_keys.hold_store(successor)).write(self.link, str(lost))

    def _decide(self, slot: int, host: str | None, node_rank: int | None, fresh: bool) -> Loss:
        if node_rank is None:
            return Loss(slot, host, None, "none", None, self._training_nodes(), "a spare was lost")
        if self.flag_set(node_keys.done(slot)) or self.flag_set(ALL_DONE_KEY):
            reason = "its training had ended: nothing to replace"
            return Loss(slot, host, node_rank, "none", None, self._training_nodes(), reason)
        spare = self._take_spare()
        if spare is not None:
            assignment = {
                "node_rank": node_rank,
                "lost_slot": slot,
                "declared_wall": time.time(),
                "fresh": fresh,
            }
            self._chain(node_keys.assign(spare)).write(self.link, json.dumps(assignment))
            reason = f"spare slot {spare} takes over node rank {node_rank}"
            return Loss(slot, host, node_rank, "spare", spare, self._training_nodes(), reason)
        remaining = self.cfg.active_nodes - self._count_up(node_keys.SHRUNK)
        if remaining >= self.cfg.least_nodes:
            reason = f"no spare left: the job goes on with {remaining} nodes"
            return Loss(slot, host, node_rank, "shrink", None, remaining, reason)
        reason = (
            f"node lost, no spare: {remaining} nodes left, below --min-nodes {self.cfg.least_nodes}"
        )
        return Loss(slot, host, node_rank, "stop", None, remaining, reason)

    def _take_spare(self) -> int | None:
        """The lowest spare slot that is alive and not taken yet, now taken; None when none is."""
        for spare in self._alive_spares():
            if sealed_keys.claim(self.link, self._known_sealer(), node_keys.spare_taken(spare), self.slot):
                return spare
        return None

    def _info(self, slot: int, store: Any = None) -> dict[str, Any]:
        """What ``slot`` published about itself, read from ``store`` (the store by default)."""
        try:
            key = node_keys.info(slot)
            value = self._store(store).get(key)
            info = json.loads(self._known_sealer().unseal(key, value) or "{}") if value else {}
        except ValueError:
            info = {}
        return info if isinstance(info, dict) else {}

    def _held_node_rank(self, slot: int, info: dict[str, Any], store: Any = None) -> int | None:
        """The node rank ``slot`` held: its own, or the one it was assigned as a spare."""
        assigned = self._chain(node_keys.assign(slot)).read(self._store(store))
        if assigned:
            return int(json.loads(assigned)["node_rank"])
        if slot >= self.cfg.active_nodes:
            return None
        return int(info.get("node_rank", slot) if info.get("node_rank") is not None else slot)

    def _ranks(self, node_rank: int) -> list[int]:
        return [self.cfg.rank(local, node_rank) for local in range(self.cfg.nproc_per_node)]

    def running_slots(self) -> list[int]:
        """Slots that have neither ended nor been declared lost (all of them when the store
        cannot tell): the ones whose answer to SLURM's warning is worth waiting for."""
        slots = list(range(self.cfg.nnodes))
        if not self.enabled:
            return slots
        try:
            return [s for s in slots if not self.ended(s)]
        except StoreLinkError:
            return slots

    def ended(self, slot: int, store: Any = None) -> bool:
        """Whether ``slot``'s claim holds a valid entry in ``store`` (the store by default):
        it left, or was declared lost. (Before the job's secret is known, nothing can have
        ended: the claims need it.)"""
        sealer = self._sealer()
        if sealer is None:
            return False
        return bool(ring.read_claims(self._store(store), node_keys.RING, sealer, slot).valid)

    def free_spares(self) -> int:
        """How many spare slots are alive and not taken yet (nothing is taken here)."""
        sealer = self._known_sealer()
        alive = self._alive_spares()
        return sum(1 for s in alive if not sealed_keys.claimed(self.link, sealer, node_keys.spare_taken(s)))

    def _alive_spares(self) -> Iterator[int]:
        """The spare slots, lowest first, that have not ended nor been lost themselves."""
        for spare in range(self.cfg.active_nodes, self.cfg.nnodes):
            if not self.ended(spare):
                yield spare

    def _training_nodes(self) -> int:
        return self.cfg.active_nodes - self._count(node_keys.SHRUNK)

    # -- ends of slots ------------------------------------------------------------------
    def _end(self, slot: int) -> bool:
        """Claim the end of ``slot`` (this slot's own, or another declared lost and fenced:
        its own next beat shows it); True for the one caller that got it."""
        sealer = self._known_sealer()
        end = ring.claim if slot == self.slot else ring.declare_lost
        if not end(self.link, node_keys.RING, sealer, slot, self.slot):
            return False
        if slot != self.store_slot and self._count_up(ENDED_KEY) >= self.cfg.nnodes - 1:
            self._set_flag(ALL_ENDED_KEY)  # every slot but the store host's
        return True

    def leave(self) -> bool:
        """This slot ends cleanly; False when the others had declared it lost already."""
        if self.cfg.nnodes < 2 or self.left:
            return True
        self.left = True
        return self._end(self.slot)

    def node_done(self) -> None:
        """This node's children all ended: count it; the last training node sets ALL_DONE."""
        self._set_flag(node_keys.done(self.slot))
        self._count_up(NODES_DONE_KEY)
        self._check_all_done()

    def _check_all_done(self) -> None:
        if self._count(NODES_DONE_KEY) >= self._training_nodes():
            self._set_flag(ALL_DONE_KEY)

    # -- a spare takes over -------------------------------------------------------------
    def assignment(self) -> str | None:
        """The node rank assignment written for this slot, if any, read now (not watched)."""
        return self._chain(node_keys.assign(self.slot)).read(self.link)

    def take_over(self, value: str | None) -> dict[str, Any]:
        """This spare was assigned a lost node rank: hold it from now on; returns the assignment."""
        assignment = json.loads(value or "{}")
        self.node_rank = int(assignment["node_rank"])
        self._publish_info()
        declared = assignment.get("declared_wall")
        self._emit(
            "node_takeover",
            node_rank=self.node_rank,
            lost_slot=assignment.get("lost_slot"),
            wait_s=None if declared is None else round(time.time() - float(declared), 3),
        )
        return assignment


def _slurm_state(node: str | None) -> dict[str, str] | None:
    """SLURM's view of ``node`` (State, Reason), when there is SLURM to ask."""
    if not node or "SLURM_JOB_ID" not in os.environ:
        return None
    try:
        info = commands.show_node(node, timeout=SLURM_LOOK_S)
    except (commands.SlurmCommandError, OSError) as exc:
        log.warning("cannot ask SLURM about node %s: %s", node, exc)
        return None
    if info is None:
        return None
    return {k: info[k] for k in ("State", "Reason") if k in info}
