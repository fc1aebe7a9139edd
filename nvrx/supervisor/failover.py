"""What a supervisor does when the job's store is lost with its host.

The training children cannot work without the store, so they are stopped.
The survivors elect the successor (``store_failover``), which starts the next
store restored from the old one's snapshot; everyone reconnects and starts
its children again with the new address, as one new process generation
(``NVRX_FRESH_START``). The successor declares the old host's slot lost, so a
spare takes over its node rank as after any node loss. A slot that the lost store's
snapshot shows declared lost (it stalled past the node timeout and was fenced, but
lived to see the store lost) stands in no election: it ends its children and stops
as a fenced node does (exit 9). A store host that
loses its own store service, or a job of one node, has nobody to fail over
to: it stops as before (exit 3). Neither has a survivor of a job of two slots,
which never holds a majority, nor one of a job that lost too many slots at once for
a majority to elect a successor, nor a majority whose successor publishes no store (it
was lost as well, say): they stop too, and under SLURM, when the job's
batch host (without which the allocation would stay until its time limit) no longer
runs a SLURM step, the first survivor whose node answers and that
claims the requeue records every node that does not lost and requeues the job without
them (``node_requeue.probe_step_nodes``). Before it requeues, it waits ``node_timeout``
plus a probe's timeout: the time a store host that is alive beyond a partition takes
to declare the survivors' slots lost and requeue the job itself, which leaves them
nothing to do.

What takes seconds is ready before it is needed: while the job runs, each
supervisor keeps a node agent started that has no address yet, and the slot next in
line (the lowest one but the store host's and those known lost) keeps a store service
held before it binds (``Failover.prepare``); when that slot is declared lost, the one
next in line now is told (``NodeRoles.next_in_line``, ``node_keys.hold_store``) and
keeps one in its place. When the store is lost, the held service is let go (stopped
again if the election names another slot) and standbys for the node's ranks start
(``standby``) while the children stop and the survivors elect; whatever was not kept
ready starts then.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nvrx import jobenv
from nvrx.slurm import commands
from nvrx.store import rounds, snapshot
from nvrx.store.service import StoreService

from . import node_keys, node_requeue, store_failover
from .children import stop_children
from .config import ALL_ENDED_KEY
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .job_restart import JobRestart
from .job_store import JobStore
from .local_ranks import LocalRanks
from .node_control import NodeControl
from .node_roles import Loss, NodeRoles
from .standby import Standbys
from .store_failover import StoreAddress
from .store_link import StoreLink, StoreLinkError
from .store_setup import snapshot_spec

log = logging.getLogger(__name__)

#: Seconds children get to end when their store is gone (they cannot checkpoint without it).
_STOP_GRACE_S = 1.0


class Failover:
    """Goes on with a new store when the job's store is lost; keeps ready what that needs."""

    def __init__(
        self,
        store: JobStore,
        course: CourseTracker,
        control: NodeControl,
        ranks: LocalRanks,
        standbys: Standbys,
        requeue: node_requeue.Requeue,
        job_restart: JobRestart,
        fence: Callable[[], None],
    ) -> None:
        """``fence``: what this slot does once it finds the job gave it up (it was declared
        lost while it stalled): ``NodeMessages.fenced``."""
        self.store, self.course, self.control, self.ranks = store, course, control, ranks
        self.standbys, self.requeue, self.job_restart = standbys, requeue, job_restart
        self.fence = fence
        self._ahead_link: StoreLink | None = None
        self._ahead_service: StoreService | None = None
        self._prepared_link: StoreLink | None = None
        self._prepared_service: StoreService | None = None
        #: The slots that announced themselves in an election that found no majority, or in
        #: one whose store was not published (less its successor and its claimant).
        self._unelected: frozenset[int] | None = None
        #: The first round of the generation the ranks start anew in after this failover.
        self._fresh_from: int | None = None
        #: This slot found its own end in the lost store's snapshot: it stood in no election.
        self._fenced_off = False
        #: (The successor) its new store was the one held ready (``prepare``), not one started
        #: at the failover.
        self._held_used = False

    @property
    def _roles(self) -> NodeRoles:
        roles = self.store.roles
        assert roles is not None  # only a slot with roles fails over (``_can_fail_over``)
        return roles

    def store_lost(self, detail: str) -> bool:
        """The store link reported the store lost: fail over (True), else stop the job."""
        if self.course.stopping:
            return False
        lost_wall = self._last_answered()
        if self._fail_over(detail):
            return True
        if self._fenced_off:
            self.fence()  # the job went on without this slot before its store was lost
            return False
        cfg = self.store.config
        self.control.request_stop(
            f"store at {cfg.store_host}:{cfg.store_port} lost: {detail}",
            ExitCode.STORE_UNAVAILABLE,
            broadcast=False,
        )
        if self._unelected is not None and self._roles.enabled:
            self._requeue_without_lost_nodes(lost_wall, self._unelected)
        return False

    def _last_answered(self) -> float:
        """When the lost store was last seen alive: the sending of the last request or beat of
        this node's that it answered (now, when none did). Its host's loss counts from there,
        so that what the survivors' ranks wrote once it was gone follows from the loss."""
        link = self.store.link
        seen = link.answered_wall if link is not None else None
        return seen if seen is not None else time.time()

    def _requeue_without_lost_nodes(self, lost_wall: float, alive: frozenset[int]) -> None:
        """After an election that found no majority, or whose successor published no store
        (the ``alive`` slots announced themselves, less its successor and claimant), under
        SLURM, the first survivor whose node answers and that claims it asks SLURM about the
        job's batch host and the nodes of the other slots: each that runs no step is
        recorded lost, but for a slot whose end (it left, or was declared lost) the store's
        snapshot shows. When the batch host does not answer and the job is still
        RUNNING a while later, the job is requeued without them, or ended when it may not
        be requeued (nothing else would end it before its time limit); when it answers, the
        job ends with the survivors, and a ``node_probe`` tells whether the store host's
        node answered."""
        job_id, cfg = os.environ.get("SLURM_JOB_ID"), self.store.config
        if not job_id:
            return
        silent = set(range(cfg.nnodes)) - alive
        settle_s = cfg.node_timeout + commands.PROBE_TIMEOUT_S
        answers = node_requeue.probe_step_nodes(
            job_id, self._roles.slot, cfg.nnodes, silent, settle_s, claim=self._claims_requeue
        )
        if answers is None or self._elected_after_all(answers):
            return
        lost_store = store_failover.snapshot_path(
            cfg.events_dir, self.store.epoch - 1, self.store.lost_slot
        )
        kept = snapshot.KeptKeys(snapshot.read(lost_store))
        for lost_slot, node in answers.silent:
            self._roles.record_lost_unreplaced(lost_slot, node, lost_wall, kept)
        if answers.batch_host_answered:
            self._store_host_probed(answers)
            if alive == {self._roles.slot}:  # it alone counted this epoch: the others count it next
                self._give_back_requeue_claim()
            return
        self.requeue(answers.unanswered, probe=False)
        if answers.batch_host is not None:  # it did not answer
            node_requeue.end_unrequeued(job_id, answers.batch_host)

    def _elected_after_all(self, answers: node_requeue.StepAnswers) -> bool:
        """Whether a store was decided for this epoch meanwhile (a late announcement made the
        others' majority, or the successor was only slow): then the job goes on without this
        slot, which records nothing. When the batch host does not answer, this survivor is
        about to requeue the job, and decides the epoch for it unless a store was decided
        first, so that a claimant that comes later publishes nothing
        (``store_failover.decide``); a store decided but not published within the store
        timeout is given up (``store_failover.abandon``) and the job requeued. When the batch
        host answers, nothing is requeued: the store is given up only when its claimant's
        node ran no step either (it was lost too, and this slot records the losses), and
        waited for otherwise. A claim alone decides nothing: a successor that claimed the
        epoch may have been lost before it decided."""
        store = self.store
        job_dir, epoch = store.config.events_dir, store.epoch
        try:
            if not answers.batch_host_answered:
                elected = not store_failover.decide(job_dir, epoch, store_failover.REQUEUE)
                give_up = elected
            else:
                elected = store_failover.decided(job_dir, epoch)
                give_up = elected and self._claimant_silent(answers)
            elected = elected and not (give_up and self._give_up_store(job_dir))
        except OSError as exc:
            log.error("cannot read or decide epoch %d through %s: the job is not requeued: %s",
                      epoch, job_dir, exc)  # fmt: skip
            return True
        if elected:
            log.warning("a store was elected for epoch %d after all: the job goes on with it, "
                        "without this slot", epoch)  # fmt: skip
        return elected

    def _claimant_silent(self, answers: node_requeue.StepAnswers) -> bool:
        """Whether SLURM was asked about the node of the slot that claimed this epoch, and
        it ran no step."""
        claimant = store_failover.claimant(self.store.config.events_dir, self.store.epoch)
        node = answers.nodes[claimant] if claimant is not None and claimant < len(answers.nodes) else None
        return node is not None and node in answers.asked and node not in answers.answered

    def _give_up_store(self, job_dir: Path) -> bool:
        """Whether the store decided for this epoch, unpublished within the store timeout,
        is given up (``store_failover.abandon``): no slot connects to it afterwards."""
        epoch, timeout = self.store.epoch, self.store.config.store_timeout
        if store_failover.wait_address(job_dir, epoch, timeout) is not None:
            return False
        if not store_failover.abandon(job_dir, epoch):
            return False  # published just now
        log.error("epoch %d was decided for a store that %s does not name within %.0f s: it is "
                  "given up, its successor counts as lost", epoch,
                  store_failover.epoch_dir(job_dir, epoch) / "store.json", timeout)  # fmt: skip
        return True

    def _claims_requeue(self) -> bool:
        """Whether this slot is the one survivor of the failed election that asks SLURM."""
        try:
            claimed = store_failover.claim_requeue(
                self.store.config.events_dir, self.store.epoch, self._roles.slot
            )
        except OSError as exc:
            log.error("cannot claim the requeue through %s: %s", self.store.config.events_dir, exc)
            return False
        if not claimed:
            log.info("another survivor asks SLURM about the job's nodes")
        return claimed

    def _give_back_requeue_claim(self) -> None:
        try:
            store_failover.release_requeue(self.store.config.events_dir, self.store.epoch, self._roles.slot)
        except OSError as exc:
            log.error("cannot give back the requeue claim through %s: %s", self.store.config.events_dir, exc)

    def _store_host_probed(self, answers: node_requeue.StepAnswers) -> None:
        """The job ends with the survivors, for its batch host still runs: the answer about
        the store host's node (always asked, for it announced nothing) is a ``node_probe``."""
        slot = self.store.slot
        if answers.batch_host is None:
            log.warning("job has no batch script (an salloc, say): the job is not requeued")
        else:
            log.warning("node %s, the batch host, still runs SLURM steps: the job is not "
                        "requeued", answers.batch_host)  # fmt: skip
        if answers.nodes[slot] not in answers.asked:
            return
        node = answers.nodes[slot]
        self.control.emit(
            "node_probe", lost_slot=slot, lost_host=node, responding=node in answers.answered,
            probe_s=answers.probe_s[node], note=None,
        )  # fmt: skip

    def _can_fail_over(self) -> bool:
        store = self.store
        return store.config.nnodes > 1 and store.service is None and store.roles is not None

    def _fail_over(self, detail: str) -> bool:
        """Go on with a new store after the old one was lost; False when that is not possible."""
        if not self._can_fail_over():
            return False
        store, control = self.store, self.control
        t0, lost_wall = time.monotonic(), self._last_answered()
        old = f"{store.config.store_host}:{store.config.store_port}"
        log.warning("store at %s lost (%s): failing over", old, detail)
        interrupted = self.course.state
        self.course.to(Course.FAILING_OVER)
        self._ahead_link, self._ahead_service = self._start_ahead()
        loss: Loss | None = None
        try:
            stop_children(self.ranks.running(), _STOP_GRACE_S)
            control.reap()
            assert store.link is not None
            store.link.close()
            address, loss = self._elect_and_connect(lost_wall)
        except OSError as exc:  # the job directory cannot be written or read
            log.error("cannot fail over through %s: %s", store.config.events_dir, exc)
            address = None
        finally:
            self.course.to(interrupted)
            self._drop_ahead()
        if address is None:
            self.standbys.discard()
            return False
        control.emit(
            "store_failover",
            epoch=address.epoch,
            old_store=old,
            new_store=f"{address.host}:{address.port}",
            successor=address.slot,
            lost_slot=store.lost_slot,
            duration_s=round(time.monotonic() - t0, 3),
            store_held=self._held_used if address.slot == self._roles.slot else None,
        )
        if loss is not None and loss.action == "stop":
            control.request_stop(loss.reason, ExitCode.NODE_LOST, broadcast=True)
            self.requeue([loss.host])
        if not self.course.stopping:
            try:
                self.job_restart.after_failover()
            except StoreLinkError as exc:  # the new store's loss comes through its link
                log.warning("could not catch up on job-wide restarts in the new store: %s", exc)
        if self._roles.node_rank is not None:
            for local_rank in range(store.config.nproc_per_node):
                self.ranks.restarts[local_rank] += 1
                control.start_child(local_rank, jobenv.FRESH_START)
        self.prepare()  # for the next one
        return True

    def _next_in_line(self, kept: snapshot.KeptKeys | None = None) -> bool:
        """Whether this slot would host the next store: the lowest slot but the store host's
        and the slots known lost (``_known_lost``, as ``kept``, the lost store's snapshot,
        or else the store shows them), which no election names."""
        store = self.store
        passed = frozenset({store.slot, store.lost_slot})
        return self._roles.next_in_line(kept, passed) == self._roles.slot

    def _known_lost(self, kept: snapshot.KeptKeys) -> set[int]:
        """The slots known lost: the host lost at the failover before (its successor declared
        it) and every slot whose end (it left, or was declared lost) ``kept``, the lost
        store's snapshot, shows."""
        store = self.store
        ended = {s for s in range(store.config.nnodes) if self._roles.ended(s, kept)}
        return ended | {store.lost_slot}

    @staticmethod
    def _generation_after(kept: snapshot.KeptKeys) -> int | None:
        """The first round of the generation the ranks start anew in: the next store is
        restored from ``kept``, and they open the generation after its round. None when
        the round cannot be read (the job's secret file, say): a spare then rejoins."""
        try:
            return rounds.generation_after(rounds.current_round(kept))
        except (OSError, ValueError) as exc:
            log.error("cannot read the round of the lost store's snapshot: %s", exc)
            return None

    def _lost_store_keys(self) -> snapshot.KeptKeys:
        """What the store just lost kept in its snapshot, as the survivors all read it."""
        store = self.store
        path = store_failover.snapshot_path(store.config.events_dir, store.epoch, store.slot)
        return snapshot.KeptKeys(snapshot.read(path))

    def prepare(self) -> None:
        """While the job runs, keep ready what a failover would wait for first: a node
        agent started and, on the slot next in line, a store service (torch imported)
        held before it binds. Only where a failover can happen (node liveness on, 3 slots
        or more, this slot not the store host) and warm standbys are on. The slot watches
        its ``hold_store`` chain: a slot found next in line once the one before it was
        declared lost is told so there (``NodeRoles.next_in_line``). Nothing is started once
        the job is stopping (``Supervisor.request_stop`` ends what was kept ready)."""
        if self.course.stopping or not (self._can_fail_over() and self._roles.keeps_store_ready):
            return
        try:
            self._roles.watch_chain(node_keys.hold_store(self._roles.slot))
        except StoreLinkError as exc:
            log.warning("cannot watch whether this slot is to keep a store ready: %s", exc)
        self._keep_ready()

    def on_message(self, message: dict) -> bool:
        """A value of this slot's ``hold_store`` chain: the slot next in line to host the
        store was declared lost, and this one is next now: it keeps a store ready. False
        for any other message."""
        roles, key = self.store.roles, message.get("key")
        if roles is None or roles.watched_base(key) != node_keys.hold_store(roles.slot):
            return False
        try:
            seen = roles.on_chain_value(key, str(message.get("value", "")))
        except StoreLinkError as exc:  # a rejected value is watched past: the store's loss follows
            log.warning("could not watch on whether this slot is to keep a store ready: %s", exc)
            return True
        ready = self._can_fail_over() and not self.course.stopping
        if seen is not None and seen[1].payload is not None and ready:
            log.info("slot %s, next in line to host the store, was lost: this slot keeps a "
                     "store ready in its place", seen[1].payload)  # fmt: skip
            self._keep_ready()
        return True

    def _keep_ready(self) -> None:
        """Start what ``prepare`` keeps ready and does not run yet."""
        cfg = self.store.config
        if self._prepared_link is None or not self._prepared_link.running:
            try:
                self._prepared_link = StoreLink(None, None, cfg.store_timeout, self.store.beats_fd).launch()
            except OSError as exc:
                log.warning("cannot keep a node agent ready for a failover: %s", exc)
        if self._prepared_service is None and self._next_in_line_now():
            try:
                self._prepared_service = self._successor_store(self.store.epoch + 1, held=True).launch()
            except (OSError, RuntimeError) as exc:
                log.warning("cannot keep a store ready for a failover: %s", exc)

    def _next_in_line_now(self) -> bool:
        """``_next_in_line`` as the store tells it now; False when it does not answer (the
        failover that follows reads the lost store's snapshot instead)."""
        try:
            return self._next_in_line()
        except StoreLinkError as exc:
            log.warning("cannot read which slots the job lost: %s", exc)
            return False

    def drop_prepared(self) -> None:
        """What was kept ready for a failover ends (the job ends, or it was not needed)."""
        _end(self._prepared_link, self._prepared_service)
        self._prepared_link = self._prepared_service = None

    def _start_ahead(self) -> tuple[StoreLink | None, StoreService | None]:
        """Start the programs the failover will need, before anyone knows the new address
        (or take the ones kept ready)."""
        cfg = self.store.config
        if self._roles.node_rank is not None:
            self.standbys.start(cfg.command, range(cfg.nproc_per_node), cfg.child_env(0, 1))
        link, service = self._prepared_link, self._prepared_service
        self._prepared_link = self._prepared_service = None
        if link is not None and not link.running:
            link.close()
            link = None
        if link is None:
            try:
                link = StoreLink(None, None, cfg.store_timeout, self.store.beats_fd).launch()
            except OSError as exc:
                log.warning("cannot start the next node agent ahead: %s", exc)
        next_in_line = self._next_in_line(self._lost_store_keys())
        if service is not None and not (service.alive and next_in_line):
            service.stop()
            service = None
        if service is not None:
            service.release()
        elif next_in_line:
            try:
                service = self._successor_store(self.store.epoch + 1).launch()
            except (OSError, RuntimeError) as exc:
                log.warning("cannot start the next store ahead: %s", exc)
        return link, service

    def _drop_ahead(self) -> None:
        """What was started ahead and not used ends."""
        _end(self._ahead_link, self._ahead_service)
        self._ahead_link = self._ahead_service = None

    def _successor_store(self, epoch: int, held: bool = False) -> StoreService:
        """A store service for failover ``epoch`` on this slot's host (not launched yet), to
        replace the store of the slot the job's store is on (until ``_connect`` moves it)."""
        cfg = self.store.config
        return StoreService(
            os.environ.get("SLURMD_NODENAME") or cfg.master_addr,
            0,
            job_id=cfg.job_id,
            log_dir=cfg.log_dir,
            node=self._roles.slot,
            snapshot=snapshot_spec(cfg, epoch, self._roles.slot, self.store.slot),
            held=held,
        )

    def _elect_and_connect(self, lost_wall: float) -> tuple[StoreAddress | None, Loss | None]:
        """Elect, start or find the next store, connect to it; with the successor's
        declaration of the old host's slot, when this slot is the successor."""
        store = self.store
        cfg, slot = store.config, self._roles.slot
        job_dir = cfg.events_dir
        election = self._elect()
        if election is None:
            return None, None
        successor = election.successor
        if successor != slot and self._ahead_service is not None:
            self._ahead_service.stop()  # another slot hosts the next store
            self._ahead_service = None
        if successor is None:
            self._unelected = election.alive
            store_failover.withdraw(job_dir, store.epoch, slot)
            return None, None
        address = self._host_store(job_dir) if successor == slot else None
        if address is None and successor == slot and not store_failover.claimed(job_dir, store.epoch):
            return None, None  # this slot's store did not start, and no other slot's did
        if address is not None and not self._decide_for_store(job_dir):
            return None, None
        if address is None:
            wait_s = cfg.store_timeout + cfg.node_timeout
            address = store_failover.wait_address(job_dir, store.epoch, wait_s)
        if address is None:
            self._unelected = self._unserved(election, wait_s)
            return None, None
        if not self._connect(address):
            if address.slot == slot:
                self._withdraw_store()  # unpublished: the others count this slot silent
            return None, None
        loss = None
        if address.slot == slot:
            # before the address is out: the new generation's children must find the old
            # host's ranks already marked gone (no spare) or assigned (a spare); recorded
            # once published, or as a stop if the store was given up meanwhile
            loss = self._declare_lost_store_host(lost_wall)
            if not store_failover.publish(job_dir, address):
                log.warning("the survivor that asked SLURM gave up the store of epoch %d "
                            "before this slot published it: the store stops", store.epoch)  # fmt: skip
                self._withdraw_store()
                self._record(_given_up(loss))
                return None, None
            self._record(loss)
        try:
            self._roles.start()
        except StoreLinkError as exc:
            log.error("cannot use the successor store %s:%s: %s", address.host, address.port, exc)
            return None, None
        return address, loss

    def _elect(self) -> store_failover.Election | None:
        """Announce this slot in the election of the next epoch and find its successor.
        The election waits for every slot but the lost store's host and the slots known lost
        (``_known_lost``, from the lost store's snapshot), which would only make it wait out
        the node timeout; one of those that announces itself still counts toward the
        majority, but is never the successor (``store_failover.elect``). None when this slot
        is known lost itself: the job gave it up while it stalled, so it does not stand (it
        announces nothing) and ends as fenced (``store_lost``)."""
        store = self.store
        cfg, slot = store.config, self._roles.slot
        kept = self._lost_store_keys()
        known_lost = self._known_lost(kept)
        self._fresh_from = self._generation_after(kept)
        if slot in known_lost:
            lost_store = store_failover.snapshot_path(cfg.events_dir, store.epoch, store.slot)
            log.error("%s, the lost store's snapshot, shows this slot's end: the job gave it up, "
                      "and it stands in no election", lost_store)  # fmt: skip
            self._fenced_off = True
            return None
        awaited = set(range(cfg.nnodes)) - {store.slot} - known_lost
        store.lost_slot = store.slot
        store.epoch += 1
        store_failover.announce(cfg.events_dir, store.epoch, slot)
        return store_failover.elect(
            cfg.events_dir, store.epoch, awaited, cfg.node_timeout, cfg.nnodes, frozenset(known_lost)
        )

    def _decide_for_store(self, job_dir: Path) -> bool:
        """This slot claimed the epoch for its store: decide the epoch for it, before
        anything of it is used or declared; False, with the store stopped, when the
        survivor that asked SLURM decided it for the job's requeue first."""
        store = self.store
        if store_failover.decide(job_dir, store.epoch, store_failover.STORE):
            return True
        log.warning("a survivor decided epoch %d for the job's requeue (%s) before this slot "
                    "could publish its store: the store stops", store.epoch,
                    store_failover.epoch_dir(job_dir, store.epoch) / "decided")  # fmt: skip
        self._withdraw_store()
        return False

    def _withdraw_store(self) -> None:
        """The store this slot started for the epoch serves nobody: it stops, and this slot
        does not end as a store host."""
        _end(None, self.store.service)
        self.store.service = None

    def _unserved(self, election: store_failover.Election, wait_s: float) -> frozenset[int]:
        """The slots left after an election whose store was not published within ``wait_s``:
        its successor and the slot that claimed the epoch, if another, count as silent."""
        epoch, job_dir = self.store.epoch, self.store.config.events_dir
        claimant = store_failover.claimant(job_dir, epoch)
        gone = {election.successor, claimant} - {None}
        log.error("no store of epoch %d was published in %s within %.0f s: slot(s) %s (the "
                  "successor, the claimant) count as silent", epoch,
                  store_failover.epoch_dir(job_dir, epoch) / "store.json", wait_s,
                  sorted(gone))  # fmt: skip
        return election.alive - gone

    def _connect(self, address: StoreAddress) -> bool:
        """Aim this slot at the store at ``address``: the configuration, the link, the roles."""
        store = self.store
        job = replace(store.config.job, master_addr=address.host, store_port=address.port)
        store.config = replace(store.config, job=job)
        store.slot = address.slot
        store.relinks += 1
        try:
            if self._ahead_link is not None and self._ahead_link.running:
                store.link, self._ahead_link = self._ahead_link.aim(address.host, address.port), None
            else:
                store.link = StoreLink(
                    address.host, address.port, store.config.store_timeout, store.beats_fd
                ).launch()
            store.link.wait_ready()
            if store.stop is not None:
                store.stop.watch(store.link)
            self._roles.relink(store.config, store.link, address.slot, self._fresh_from)
            if store.service is not None:
                self._roles.watch_chain(ALL_ENDED_KEY)
        except StoreLinkError as exc:
            log.error("cannot use the successor store %s:%s: %s", address.host, address.port, exc)
            return False
        return True

    def _record(self, loss: Loss | None) -> None:
        """Record the old store host's loss that this slot took out (``NodeRoles.record``)."""
        if loss is None:
            return
        try:
            self._roles.record(loss)
        except StoreLinkError as exc:  # a shrink reads the store: the new store is gone already
            log.error("could not record slot %s lost: %s", loss.slot, exc)

    def _declare_lost_store_host(self, lost_wall: float) -> Loss | None:
        """Take the old store host's slot out in this slot's new store (not recorded yet)."""
        lost = self.store.lost_slot
        report = {"slot": lost, "silent_s": None, "last_seen_wall": lost_wall}
        try:
            return self._roles.take_out(report, fresh=True)
        except StoreLinkError as exc:  # the new store is gone already: its loss follows
            log.error("could not declare slot %s lost: %s", lost, exc)
            return None

    def _host_store(self, job_dir: Path) -> StoreAddress | None:
        """This slot is the successor: start the next store (or take the one started ahead),
        restored, and claim the epoch for it; None when that failed or another slot's
        store claimed the epoch first."""
        service, self._ahead_service = self._ahead_service, None
        self._held_used = service is not None and service.held
        try:
            if service is None:
                service = self._successor_store(self.store.epoch).launch()
            service.wait_started(self.store.config.store_timeout)
        except (OSError, RuntimeError) as exc:
            log.error("cannot start the successor store: %s", exc)
            if service is not None:
                service.stop()
            return None
        mine = StoreAddress(service.host, service.port, self._roles.slot, self.store.epoch)
        if not store_failover.claim(job_dir, mine):
            log.warning("another slot claimed epoch %d first: using its store", self.store.epoch)
            service.stop()
            return None
        self.store.service = service
        return mine


def _given_up(loss: Loss | None) -> Loss | None:
    """``loss`` as it ends when the store it was decided in was given up: nothing replaces
    the node, the job is requeued or ends (the survivor that gave the store up may record
    it too, from the snapshot: the report keeps the first)."""
    if loss is None or loss.action == "none":
        return loss
    reason = "its successor's store was given up: the job stops"
    return replace(loss, action="stop", replaced_by=None, reason=reason)


def _end(link: StoreLink | None, service: StoreService | None) -> None:
    """An agent and a store service that are not needed end."""
    if link is not None:
        link.close()
    if service is not None:
        service.stop()
