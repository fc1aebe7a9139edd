"""Job-wide restarts (``--ft-restart-policy any-failed``), one part of the supervisor.

A plain script's ranks cannot go on when one of them fails: the others block
in a collective with it. So under ``any-failed`` one failure restarts every
rank of every node together, as one restart of the job:

1. the supervisor that sees a failure claims restart ``e`` (a sealed list in
   the store: only the first claim of ``e`` that unseals counts), takes one unit
   of the budget through the restart policy (loop breaker included: the streak of
   failures in a row is the job's, carried from each announcement to the next) and
   announces ``e``; a failure on another node of the same epoch finds the claim taken
   and only follows;
2. every supervisor, told of ``e`` by its watch, stops its children (SIGTERM,
   SIGKILL after ``--grace-period``; their exits are part of the restart,
   not new failures) and, once they ended, counts itself ready;
3. the last node ready lets everyone go, and each supervisor starts all its
   children again (restart count + 1, ``NVRX_FRESH_START=1``: a Wrapper in
   them opens a new generation at once instead of asking a job that no
   longer runs to take it back): no old process is left to meet a new one in
   ``init_process_group``'s rendezvous.

A slot that is ready waits for the others at most ``ready_limit`` (``ready_deadline``),
then records the slots that never became ready (phase ``timed_out``). Without node liveness
(``fork_and_monitor``: one monitor per rank, no ring of beats), nothing else would ever
declare a monitor that is gone or stuck lost: the job stops (``PEER_LOST``), naming them.
With liveness on, a slot whose supervisor is gone falls silent and is declared lost; but a
supervisor that is stuck (stopped, blocked in I/O) while its node agent beats on for it is
never silent, and would hold the restart forever: once the limit passed, such a slot is
declared lost as a silent one is (``NodeControl.declare_lost``: fenced, replaced by a spare,
or the job shrinks or stops, as ``--min-nodes`` says), and the others go on without it; but
the store's host, whose store serves on, stops the job instead.

Every key of it is sealed with the job's secret (``nvrx.store.sealed_keys``): the claim
and the count of nodes ready are sealed lists, the announcement and the go-ahead sealed
chains; the supervisor that hosts the store records a value rejected there as a
``rejected_write`` event. A client without the secret can neither restart the job, nor
let nodes start again before every node is ready, nor take the restart from the node
that claimed it.

A restart needs every node's ranks, so it races with the end of a node: a node whose
ranks all ended claims restart ``e`` too, for its end (``claim_end``), before it reports
itself done. A failure that finds such a claim first cannot restart the job (the ranks of
that node have completed, and a node other than the store's host has left): it stops the job
(``AFTER_COMPLETION``). A node that finds a failure's claim first takes part in the restart:
its ranks start again with the others'.

``min-healthy`` restarts only the failed rank (the Wrapper's way: its peers
restart in-process and wait for the replacement). ``auto`` (the default) takes
the job-wide path for a child that did not run the Wrapper, and restarts a
failed Wrapper rank alone.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import Any

from nvrx import jobenv
from nvrx.events.failures import NODE_LOST_SIGNATURE
from nvrx.events.reader import ProcessKey, process_events
from nvrx.store import sealed_keys
from nvrx.store.sealed_keys import SealedChain

from .children import ExitStatus
from .config import KEY_PREFIX, SupervisorConfig
from .course import Course, CourseTracker
from .exit_codes import ExitCode
from .job_store import JobStore
from .local_ranks import LocalRanks
from .node_control import NodeControl
from .policy import Decision, LastFault, RestartPolicy, exit_signature, root_cause_line
from .store_link import StoreLink, StoreLinkError
from .workload_control import WorkloadControl

log = logging.getLogger(__name__)


def _key(epoch: int, what: str) -> str:
    return f"{KEY_PREFIX}job_restart/{epoch}/{what}"


def uses_wrapper(events_dir: str, who: int | ProcessKey) -> bool:
    """Whether process ``who`` ran the in-process Wrapper (it wrote Wrapper events); its
    ``ProcessKey``, so that another node's or an earlier run's Wrapper rank with the same
    pid does not count. Its first event tells: the rest is not read."""
    return any(True for _ in process_events(events_dir, who, component="wrapper"))


def job_wide(config: SupervisorConfig, wrapper_pids: set[int], who: int | ProcessKey) -> bool:
    """Whether the failure of child ``who`` restarts the whole job (``--ft-restart-policy``);
    ``wrapper_pids``: this node's children whose Wrapper monitor beat (a pid leaves it when
    a new child is started with it)."""
    policy = config.ft_restart_policy
    if policy == "auto":  # a rank waiting to be admitted has no Wrapper events yet
        wrapped = ProcessKey.of(who).pid in wrapper_pids or uses_wrapper(config.events_dir, who)
        return not wrapped
    return policy == "any-failed"


class JobRestart:
    """Restarts of the whole job, agreed through the store by every node."""

    def __init__(
        self,
        store: JobStore,
        course: CourseTracker,
        control: NodeControl,
        ranks: LocalRanks,
        policy: RestartPolicy,
        wrapper_pids: set[int],
        workload: WorkloadControl,
    ) -> None:
        self.store, self.course, self.control, self.ranks = store, course, control, ranks
        self.policy, self.wrapper_pids, self.workload = policy, wrapper_pids, workload
        self.epoch = 0  # job-wide restarts this node has taken part in
        self.pending: int | None = None  # the epoch being restarted now, until the children start
        self._ready: int | None = None  # the last epoch this node counted itself ready for
        self._ready_by: float | None = None  # monotonic end of the wait for the others
        self._announced: SealedChain | None = None  # the next epoch's announcement, watched
        self._go: SealedChain | None = None  # the pending epoch's go-ahead, watched

    @property
    def _link(self) -> StoreLink:
        link = self.store.link
        assert link is not None  # every call comes from the store's messages or a decision
        return link

    def _claim(self, epoch: int, end: bool = False) -> dict[str, Any] | None:
        """Claim restart ``epoch`` for this slot (``end``: for this node's end, so that no
        restart follows it); None when this claim is the first valid one, else that one."""
        slot, key = self.store.config.node_rank, _key(epoch, "claim")
        fields: dict[str, Any] = {"end": True, "node": self.control.node_rank} if end else {}
        fields["store"] = self.store.epoch  # claimed before or after a failover (``after_failover``)
        mine = sealed_keys.entry_payload(slot, **fields)
        first = sealed_keys.append_entry(self._link, self.store.known_sealer(), key, mine).first
        if first is None or first == mine:
            return None
        found = _parse(first)
        return found if isinstance(found, dict) else {}

    def claim_end(self) -> bool:
        """This training node's ranks all ended: claim the next restart for its end, before it
        reports itself done. True when a failure claimed that restart first: this node takes
        part in it (it is restarting now), and its loop goes on."""
        store, link = self.store, self.store.link
        if store.config.nnodes < 2 or link is None or link.lost is not None or not link.ready:
            return False
        if self.control.node_rank is None or store.sealer is None or self.pending is not None:
            return False
        epoch = self.epoch + 1
        try:
            first = self._claim(epoch, end=True)
        except StoreLinkError as exc:
            log.warning("could not claim this node's end against a job-wide restart: %s", exc)
            return False
        if first is None or first.get("end"):
            return False
        self._begin(epoch, None)  # its announcement follows, or came already
        return self.pending == epoch

    def _stop_after_end(
        self, ended: dict[str, Any], what: str, signature: str | None, local_rank: int
    ) -> None:
        """A node's end claimed the restart before this failure of ``local_rank``: stop the
        job instead."""
        control = self.control
        reason = (
            f"{what} after every rank of node {ended.get('node')} had completed: a job-wide "
            "restart would start every rank of every node again, so the job stops without one"
        )
        control.emit(
            "restart_decision", local_rank=local_rank, scope="job",
            global_rank=self.store.config.rank(local_rank, control.node_rank),
            decision=Decision.GIVE_UP.value, reason=reason, budget_left=None, signature=signature,
        )  # fmt: skip
        log.error("%s", reason)
        control.request_stop(reason, ExitCode.AFTER_COMPLETION, broadcast=True)

    def _streak_before(self, epoch: int) -> tuple[str | None, int]:
        """The loop breaker's streak as restart ``epoch - 1`` announced it (``streak_of``):
        the same failure counts in a row across the job, whichever node claimed each
        restart."""
        if epoch <= 1:
            return None, 0
        chain = SealedChain(_key(epoch - 1, "begin"), self.store.known_sealer())
        return streak_of(chain.read(self._link))

    def _announce(self, epoch: int, cause: dict[str, Any]) -> None:
        """Announce restart ``epoch``, through the chain this node watches (never behind it)."""
        chain = self._announced
        if chain is None or chain.base != _key(epoch, "begin"):
            chain = SealedChain(_key(epoch, "begin"), self.store.known_sealer())
        chain.write(self._link, json.dumps(cause))

    def job_wide(self, who: ProcessKey) -> bool:
        """Whether the failure of child ``who`` (``Child.key``) restarts the whole job."""
        return job_wide(self.store.config, self.wrapper_pids, who)

    def failure_handled(
        self, local_rank: int, status: ExitStatus, who: ProcessKey, fault: LastFault | None
    ) -> bool:
        """A failure that is not one rank's restart: non-retryable, or job-wide; True when handled."""
        if self.workload.non_retryable(local_rank, who):
            return True
        if self.job_wide(who):
            self.failure(local_rank, status, fault)
            return True
        return False

    def watch(self) -> None:
        """Be told of the next job-wide restart."""
        self._announced = SealedChain(_key(self.epoch + 1, "begin"), self.store.known_sealer())
        self._announced.watch(self._link)

    def failure(self, local_rank: int, status: ExitStatus, fault: LastFault | None) -> None:
        """A child failed under a job-wide policy: claim the next restart, or follow the claim."""
        if self.pending is not None:
            return  # it ended with the restart under way
        epoch = self.epoch + 1  # (store errors reach the caller, which handles the store's loss)
        first = self._claim(epoch)
        control = self.control
        if first is not None and first.get("end"):
            rank = self.store.config.rank(local_rank, control.node_rank)
            signature = (fault.signature if fault else None) or exit_signature(status)
            self._stop_after_end(first, f"rank {rank} failed ({status})", signature, local_rank)
            return
        if first is not None:
            # Another failure of this epoch claimed it: restart now, without waiting for its
            # announcement (this node's loop must not end meanwhile). If that claim stops
            # the job instead, the stop request ends the wait.
            self._begin(epoch, None)
            return
        verdict = self.policy.decide(local_rank, status, fault, self._streak_before(epoch))
        rank = self.store.config.rank(local_rank, control.node_rank)
        control.emit(
            "restart_decision", local_rank=local_rank, global_rank=rank, scope="job",
            decision=verdict.decision.value, reason=verdict.reason,
            budget_left=verdict.budget_left, signature=verdict.signature,
        )  # fmt: skip
        if verdict.decision is not Decision.RESTART:
            if verdict.decision is Decision.GIVE_UP:
                events_dir = self.store.config.events_dir
                log.error(root_cause_line(verdict, rank, control.node_rank, events_dir))
            control.request_stop(verdict.reason, verdict.exit_code, broadcast=True)
            return
        cause = {"rank": rank, "node": control.node_rank, "signature": verdict.signature}
        cause["streak"] = list(verdict.streak)
        self._announce(epoch, cause)
        self._begin(epoch, cause)  # here at once: the loop must not end meanwhile

    def restart_for_lost_node(self, node_rank: int | None, leaving: bool = False) -> None:
        """A spare took over a lost node of a plain script: restart every rank with it.

        The survivors' ranks wait for the lost ones in a collective (or fail in turn), and the
        spare's new ranks cannot join their old process group. Called by the slot that
        declared the loss: the lost slot's watcher in the ring of slots (a training slot,
        whose own ranks tell whether the job runs the Wrapper), or the leaving node itself
        after ``ExcludeThisNode`` (``leaving``: it stopped its ranks already), which only
        announces it. A node loss spends no unit of the budget (``node_lost`` counts it), and
        carries the loop breaker's streak on as it found it: it is no failure of the script. A
        declarer whose ranks all ended announces nothing: they are done, and nothing here
        would count itself ready for the restart.
        """
        children = self.ranks.children
        if node_rank is None or self.pending is not None or not children:
            return  # (a restart under way: ``slot_lost`` lets it go on without the lost slot)
        if not leaving and not self.ranks.running():
            return
        if not all(self.job_wide(child.key) for child in children.values()):
            return  # Wrapper ranks restart in-process and wait for the spare's
        epoch = self.epoch + 1
        first = self._claim(epoch)
        if first is not None and first.get("end"):
            # A node's ranks completed: no restart of the job. The spare's replacements run on
            # their own (a script whose ranks meet in collectives fails there: a failure,
            # which then stops the job with AFTER_COMPLETION).
            return
        if first is not None:
            self._begin(epoch, None)  # another slot (or a failure) claimed it first
            return
        rank = self.store.config.rank(0, node_rank)
        cause = {"rank": rank, "node": node_rank, "signature": NODE_LOST_SIGNATURE}
        cause["streak"] = list(self._streak_before(epoch))  # neither broken nor made longer
        self._announce(epoch, cause)
        self._begin(epoch, cause)

    def slot_lost(self, job_stops: bool) -> None:
        """A slot was declared lost, or left (this one, excluded), during a restart: it will
        not count itself ready, and the slots left may all be ready already (unless the job
        stops: then nothing starts again)."""
        if self.pending is not None and not job_stops:
            self._go_if_all_ready(self.pending)

    def after_failover(self) -> None:
        """The job's store failed over: every node starts its ranks again, which ends a restart
        under way, and every restart claimed on the lost store (the claims its snapshot kept:
        the new store starts from it). Watch the next one on the new store.

        Every node counts from what the new store shows, not from what it saw itself (a
        claim the snapshot did not keep, an announcement that reached some nodes only), so
        all count alike: the restarts claimed, from the first on, on an earlier store (the
        ``store`` of each claim's entry), up to a claim for a node's end, which stays for
        the next failure to find (it stops the job, as it would have). A claim made on the
        new store is a restart this node takes part in, found by its watch.
        """
        if self.pending is not None:
            self.control.kill_at = None
        self.pending, self._go, self._ready, self._ready_by = None, None, None, None
        done = 0
        while self._claimed_before_failover(done + 1):
            done += 1
        self.epoch = done
        if self.course.state is Course.RESTARTING:
            training = self.control.node_rank is not None or self._assigned_meanwhile()
            self.course.to(Course.TRAINING if training else Course.SPARE)
        self.watch()

    def _claimed_before_failover(self, epoch: int) -> bool:
        """Whether restart ``epoch`` was claimed, not for a node's end, on an earlier store
        than this one."""
        listed = sealed_keys.read_list(self._link, self.store.known_sealer(), _key(epoch, "claim"))
        found = _parse(listed.first) if listed.first is not None else None
        if not isinstance(found, dict) or found.get("end"):
            return False
        store = found.get("store", 0)  # (an entry without it was made before any failover)
        return type(store) is int and store < self.store.epoch

    def on_message(self, message: dict[str, Any]) -> bool:
        """Act on a job-restart announcement or go-ahead; False for other messages."""
        try:
            return self._on_chain_value(message.get("key"), str(message.get("value", "")))
        except StoreLinkError as exc:  # the store's loss reaches the main loop as its own message
            log.warning("store failed while handling %s: %s", message.get("key"), exc)
            return True

    def _on_chain_value(self, key: object, value: str) -> bool:
        for chain in (self._announced, self._go):
            if chain is None or not chain.owns(key):
                continue
            seen = chain.on_value(str(key), value)
            if seen.payload is None:
                self._rejected(chain, str(key), value, str(seen.rejected))
            elif chain is self._announced and self.pending is None:
                self._begin(self.epoch + 1, seen.payload)
            elif chain is self._go and self.pending is not None:
                self._start_again()
            return True
        return False

    def _rejected(self, chain: SealedChain, key: str, value: str, reason: str) -> None:
        """A forged value in a watched chain: recorded once (by the store's host), watched past."""
        if self.store.service is not None and self.store.rejected is not None:
            self.store.rejected(key, reason, len(value.encode(errors="replace")))
        else:
            log.warning("rejected a value of %s: %s", key, reason)
        chain.watch(self._link)

    def _begin(self, epoch: int, cause: object) -> None:
        if self.course.stopping:
            return
        self.pending = epoch
        self.course.to(Course.RESTARTING)
        self.control.emit("job_restart", epoch=epoch, phase="stopping", cause=_parse(cause))
        log.warning("job-wide restart %d: stopping this node's children", epoch)
        self._go = SealedChain(_key(epoch, "go"), self.store.known_sealer())
        self._go.watch(self._link)
        for child in self.ranks.running():
            child.signal_group(signal.SIGTERM)
        self.control.kill_at = time.monotonic() + self.store.config.grace_period

    def progress(self) -> None:
        """Once this node's children of a restarting epoch ended: ready; the last node says go."""
        epoch = self.pending
        if epoch is None or self.ranks.running() or self.course.stopping:
            return
        if self._ready == epoch:
            if self._ready_by is not None and time.monotonic() >= self._ready_by:
                self._not_all_ready(epoch)
            return
        self._ready = epoch
        self.control.kill_at = None
        self._ready_by = time.monotonic() + self.ready_limit()
        slot = self.store.config.node_rank
        sealed_keys.count_up(self._link, self.store.known_sealer(), _key(epoch, "ready"), slot)
        ready, nodes = self._ready_count(epoch)
        # recorded before the go-ahead: no node starts its children before this node was ready
        self.control.emit("job_restart", epoch=epoch, phase="ready", ready=ready, nodes=nodes)
        if ready >= nodes:
            self._let_go(epoch)

    def ready_deadline(self) -> float | None:
        """When this slot, ready for a restart, stops waiting for the others (monotonic);
        None where it does not wait."""
        return self._ready_by if self.pending is not None else None

    def ready_limit(self) -> float:
        """Seconds a slot that is ready waits for the others to be.

        Each of them is told of the restart through its store watch, gives its children
        ``grace_period`` to stop (then kills them), and counts itself ready with one store
        request, which may take ``store_timeout``: so ``grace_period + store_timeout``
        bounds a slot that works. With node liveness, ``node_timeout`` more: a supervisor
        may stall that long, as long as a node may be silent, before it is declared lost
        (and a slot that is gone falls silent within it, and is declared lost as such, the
        more telling cause, before this wait ends)."""
        config = self.store.config
        limit = config.grace_period + config.store_timeout
        return limit + config.node_timeout if self._liveness() else limit

    def _liveness(self) -> bool:
        """Whether a slot that falls silent is declared lost (``NodeRoles.enabled``)."""
        roles = self.store.roles
        return roles.enabled if roles is not None else self.store.config.node_liveness

    def _not_all_ready(self, epoch: int) -> None:
        """The wait for every slot to be ready for restart ``epoch`` passed its deadline:
        record the slots that never became ready; declare them lost (liveness), or stop the
        job naming them and the time to raise (without it)."""
        self._ready_by = None
        try:
            missing: list[int] | None = self._not_ready(epoch)
        except StoreLinkError as exc:
            log.warning("could not read which slots are ready for restart %d: %s", epoch, exc)
            missing = None
        if missing == []:  # every slot counted itself ready as the deadline passed: go
            self._let_go(epoch)
            return
        limit, liveness, roles = self.ready_limit(), self._liveness(), self.store.roles
        if liveness and missing is None:  # the store did not answer: its loss reaches the loop; else ask again
            self._ready_by = time.monotonic() + limit
            return
        self.control.emit("job_restart", epoch=epoch, phase="timed_out", missing=missing, limit_s=limit)
        if not liveness or missing is None:
            self._stop_not_ready(epoch, missing, limit)
        elif (roles.store_slot if roles is not None else 0) in missing:
            self._stop_store_host_not_ready(epoch, missing, limit)
        else:
            self._declare_not_ready(epoch, missing, limit)

    def _stop_not_ready(self, epoch: int, missing: list[int] | None, limit: float) -> None:
        """Without node liveness: stop the job, naming the slots that never became ready."""
        config = self.store.config
        slots = (
            "slot(s) " + ", ".join(map(str, missing))
            if missing else "slots (the store did not say which)"
        )  # fmt: skip
        reason = (
            f"job-wide restart {epoch}: node {slots} never became ready within {limit:g} s "
            f"(grace_period {config.grace_period:g} s + store_timeout {config.store_timeout:g} s) "
            "after this node was: their monitors are gone or stuck, and without node liveness "
            f"nothing declares them lost; if they are only slow, raise {config.setting('store_timeout')}"
        )
        log.error("%s", reason)
        self.control.request_stop(reason, ExitCode.PEER_LOST, broadcast=True)

    def _stop_store_host_not_ready(self, epoch: int, missing: list[int], limit: float) -> None:
        """With node liveness, the store's host among the slots never ready: its supervisor
        is stuck while its store serves, and a slot is declared lost only with its store
        (a store failover): declared lost now, it would take down, once it runs again and
        finds itself fenced, the store the job goes on with. So the job stops instead."""
        reason = (
            f"job-wide restart {epoch}: node slot(s) {', '.join(map(str, missing))} never "
            f"became ready within {limit:g} s ({self._limit_terms()}) after this node was, "
            "though their node agents beat: their supervisors are stuck, among them the store's "
            "host, which is not declared lost while its store serves"
        )
        log.error("%s", reason)
        self.control.request_stop(reason, ExitCode.PEER_LOST, broadcast=True)

    def _limit_terms(self) -> str:
        """The settings ``ready_limit`` adds up with node liveness, as the user sets them."""
        config = self.store.config
        return " + ".join(
            f"{config.setting(name)} {getattr(config, name):g} s"
            for name in ("grace_period", "store_timeout", "node_timeout")
        )

    def _declare_not_ready(self, epoch: int, missing: list[int], limit: float) -> None:
        """With node liveness: each slot that beats on but never became ready is declared
        lost, as a silent one would be (its node agent beats for a supervisor that is stuck)."""
        for slot in missing:
            log.error(
                "job-wide restart %d: slot %d never became ready within %g s (%s) after this "
                "node was, though its node beats: its supervisor is stuck; declaring it lost",
                epoch, slot, limit, self._limit_terms(),
            )  # fmt: skip
            report = {"event": "node_silent", "slot": slot, "cause": "never_ready", "silent_s": None}
            self.control.declare_lost(report)

    def _go_if_all_ready(self, epoch: int) -> None:
        """Let everyone go if every slot still in the job counted itself ready for restart
        ``epoch``: asked when a slot is declared lost during the restart, as the slots left
        may all be ready by then, and no one else would ask again."""
        ready, nodes = self._ready_count(epoch)
        if ready >= nodes:
            self._let_go(epoch)

    def _ready_count(self, epoch: int) -> tuple[int, int]:
        """(slots ready for restart ``epoch``, slots still in the job; a waiting spare counts
        itself ready at once). A lost slot's own entry does not count."""
        running, ready = self._slots_ready(epoch)
        return len(running & ready), len(running)

    def _not_ready(self, epoch: int) -> list[int]:
        """The slots still in the job that have not counted themselves ready for ``epoch``."""
        running, ready = self._slots_ready(epoch)
        return sorted(running - ready)

    def _slots_ready(self, epoch: int) -> tuple[set[int], set[int | None]]:
        """(slots still in the job, slots that counted themselves ready for ``epoch``)."""
        roles = self.store.roles
        slots = roles.running_slots() if roles is not None else range(self.store.config.nnodes)
        listed = sealed_keys.read_list(self._link, self.store.known_sealer(), _key(epoch, "ready"))
        return set(slots), {_entry_by(entry) for entry in listed.valid}

    def _let_go(self, epoch: int) -> None:
        """The go-ahead of restart ``epoch``. Two nodes that both see every slot ready both
        write it: the chain keeps the first."""
        chain = self._go if self._go is not None else SealedChain(_key(epoch, "go"), self.store.known_sealer())
        chain.write(self._link, "1")  # through the chain watched here: never behind it

    def _assigned_meanwhile(self) -> bool:
        """Whether this spare was assigned a node rank whose message has not reached it yet:
        the assignment is written before the restart for the lost node is announced, but the
        two are watched apart, and the go may come first. Taken now, so the go starts its
        ranks with everyone's."""
        roles = self.store.roles
        value = roles.assignment() if roles is not None else None
        if roles is None or not value:
            return False
        roles.take_over(value)
        log.warning("spare slot %d takes over node rank %s", roles.slot, roles.node_rank)
        return True

    def _declared_lost(self) -> bool:
        """Whether the others declared this slot lost during the restart: its supervisor
        was stuck, and runs again before its node agent's next beat finds the fence (the
        ``fenced`` report, which ends this node, follows within a heartbeat)."""
        roles = self.store.roles
        return roles is not None and roles.enabled and roles.ended(roles.slot)

    def _start_again(self) -> None:
        epoch = self.pending
        assert epoch is not None
        if self._declared_lost():
            return  # no child starts beside the job that went on without this slot
        self.epoch, self.pending, self._ready_by = epoch, None, None
        self.watch()
        if self.course.stopping:
            return
        control = self.control
        if control.node_rank is None and not self._assigned_meanwhile():
            self.course.to(Course.SPARE)  # a spare that took no node rank meanwhile
            return
        self.course.to(Course.TRAINING)
        for local_rank in range(self.store.config.nproc_per_node):  # a spare's too, if it took over meanwhile
            self.ranks.restarts[local_rank] += 1
            control.start_child(local_rank, jobenv.FRESH_START)
        control.emit("job_restart", epoch=epoch, phase="started")


def streak_of(announcement: str | None) -> tuple[str | None, int]:
    """The loop breaker's streak in a job-wide restart's announcement (its cause's
    ``streak``: ``[signature, count]``); none in one without it, as an older version wrote."""
    cause = _parse(announcement or "")
    streak = cause.get("streak") if isinstance(cause, dict) else None
    if not isinstance(streak, list) or len(streak) != 2:
        return None, 0
    signature, count = streak
    if not isinstance(signature, str) or type(count) is not int or count < 1:
        return None, 0
    return signature, count


def _entry_by(payload: str) -> int | None:
    """The slot that appended a sealed list's entry (``sealed_keys.entry_payload``)."""
    found = _parse(payload)
    by = found.get("by") if isinstance(found, dict) else None
    return by if type(by) is int else None


def _parse(value: object) -> object:
    try:
        return json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return value
