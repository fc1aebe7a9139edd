"""The per-node supervisor loop: store, children, restarts, stop requests, signals.

One supervisor runs per node. Node 0 hosts the job's store service before any
child starts; the others wait for it. Each supervisor starts its children,
restarts a failed one (same RANK, ``NVRX_RESTART_COUNT`` + 1) within the
job-wide budget, and stops all of them when any node asks the job to stop.
Everything happens on the main thread: signals, child exits and store events
arrive as readable descriptors of one ``select`` call (only routed output
streams are copied by threads of their own, ``rank_output``).

The supervisor keeps its decisions, its stop and its course (``course``); each
other concern is a part it owns and wires at construction: the children of its
local ranks (``local_ranks``), the rank watch (``hang_watch``), job-wide
restarts (``job_restart``), node messages (``node_messages``), store failover
(``failover``), the ranks' requests (``workload_control``), the standby for
restarts (``restart_standby``), straggler scores (``step_times``) and the end of the
run (``job_end``). They share
the job's store (``job_store``) and see the supervisor as a ``NodeControl``.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import selectors
import signal
import time
from collections.abc import Callable
from typing import Any

from nvrx import events, jobenv
from nvrx.signal_pipe import FORWARD_SIGNALS, STOP_SIGNALS, SignalPipe
from nvrx.slurm import early_warning
from nvrx.slurm.job_ids import slurm_job_ids
from nvrx.store import seal

from . import job_secret, node_requeue, preemption, store_failover
from .children import Child, ExitStatus, stop_children
from .config import (
    ALL_DONE_KEY,
    ALL_ENDED_KEY,
    MAX_SECONDS,
    ConfigError,
    StopRequest,
    SupervisorConfig,
)
from .course import Course, CourseTracker
from .exit_codes import CLEAN_STOP_EXIT, ExitCode, SupervisorError, for_signal
from .failover import Failover
from .hang_watch import WATCHED, HangWatch
from .job_end import FINAL_EXITS, JobEnd
from .job_restart import JobRestart
from .job_store import JobStore
from .local_ranks import CannotSpawn, LocalRanks, Spawner
from .node_messages import NodeMessages
from .node_roles import NodeRoles
from .policy import Decision, RestartPolicy, Verdict, last_fault, last_round_fault, root_cause_line
from .preemption import PreemptionHandler
from .restart_standby import RestartStandby
from .standby import READY_KEY, Standbys
from .step_times import StepTimes
from .stop_flag import MAX_REJECTIONS_TOLD, StopFlag
from .store_link import StoreLink, StoreLinkError
from .store_setup import await_store_or_stop, check_store_port, launch_store
from .workload_control import WorkloadControl

log = logging.getLogger(__name__)


class Supervisor:
    """Runs one node of a job until all its children have ended; ``run()`` returns the exit code."""

    def __init__(self, config: SupervisorConfig, spawn: Spawner | None = None) -> None:
        self.store = JobStore(config)
        self.course = CourseTracker()
        self.standbys = Standbys(config.warm_standby and spawn is None, config.rank_logs)
        spawn = spawn or functools.partial(self.standbys.spawn, config.command)
        self.ranks = LocalRanks(self.store, spawn, self.emit)
        self._owner = os.getpid()
        self.policy = RestartPolicy(
            config.max_restarts, config.loop_breaker, self.store.spend_restart,
            budget_name=config.setting("max_restarts"),
        )  # fmt: skip
        self.signals: SignalPipe | None = None
        self.writer: events.EventWriter | None = None
        self.preemption: PreemptionHandler | None = None
        self.stop_reason: str | None = None  # why the job stops, once it does
        self._pending_stop: StopRequest | None = None  # to tell the others once it can
        self._rejections = 0  # control values refused for their seal (``_rejected``)
        self.exit_code: int = ExitCode.OK
        self.signalled: int | None = None  # the last stop signal received
        self.kill_at: float | None = None  # when children still running after a stop get SIGKILL
        self.started_wall = time.time()  # this run's faults are those written after it
        self._compose()

    def _compose(self) -> None:
        """Build the parts, each with what it needs."""
        store, course, requeue = self.store, self.course, self._requeue_without
        ranks = self.ranks
        wrapper_pids: set[int] = set()  # processes whose monitor beat: Wrapper ranks
        self.workload = WorkloadControl(store, self, ranks)
        self.step_times = StepTimes(store, course, self)
        self.job_restart = JobRestart(
            store, course, self, ranks, self.policy, wrapper_pids, self.workload
        )
        self.messages = NodeMessages(store, course, self, ranks, self.job_restart, requeue)
        self.failover = Failover(
            store, course, self, ranks, self.standbys, requeue, self.job_restart, self.messages.fenced
        )
        self.hang_watch = HangWatch(
            store, course, self, ranks, wrapper_pids, self.workload, self.job_restart,
            self.failover.store_lost, self.step_times,
        )  # fmt: skip
        self.restart_standby = RestartStandby(store, self.standbys, course, self, ranks)
        self.job_end = JobEnd(
            store, course, self, self.messages, self.job_restart, requeue,
            self._make_selector, self._poll_once, self._warned_while_finishing,
        )  # fmt: skip

    @property
    def config(self) -> SupervisorConfig:
        """The configuration; after a store failover, it names the new store."""
        return self.store.config

    # -- life ---------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until done. Raises ``SupervisorError`` for failures before supervision
        begins (a port in use, a store that never answers: its children are ended then)."""
        cfg = self.config
        try:  # first: the events go there, and a folder that cannot be made is one line
            job_secret.private_job_dir(cfg.events_dir)
        except ConfigError as exc:
            raise SupervisorError(ExitCode.USAGE, str(exc)) from None
        self.writer = events.configure(
            "supervisor",
            directory=cfg.events_dir,
            job=cfg.job_id,
            node=cfg.node_rank,
            rank=None,
            round=None,
        )
        self.writer.emit(
            "supervisor_start", **cfg.start_fields(), supervisor_pid=os.getpid(),
            **slurm_job_ids(os.environ),
        )
        reason = "all children ended"
        try:
            stop = self._start()
            if stop is not None:  # its children, if any, are ended at once: they did not train
                reason = f"received {signal.Signals(stop).name} before the store answered"
                self.exit_code = for_signal(stop)
                return self.exit_code
            self._monitor()
            while self.course.state is Course.TRAINING and self.job_restart.claim_end():
                self._monitor()  # a failure elsewhere claimed a job-wide restart first: join it
            if self.course.state is Course.TRAINING:  # (a stop stays the course to the end)
                self.course.to(Course.FINISHING)
            self.job_end.finish()
            reason = self.stop_reason or reason
            return self.exit_code
        except SupervisorError as exc:
            self.exit_code, reason = exc.code, str(exc)
            raise
        except BaseException as exc:
            if os.getpid() == self._owner and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                self.exit_code, reason = ExitCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if os.getpid() == self._owner:
                self.course.to(Course.ENDED)
                self._cleanup()
                self.writer.emit("supervisor_end", exit_code=int(self.exit_code), reason=reason)

    def _start(self) -> int | None:
        """Bring up the store, the watch and the children; the stop signal that came before
        the store answered, if one did."""
        cfg, store = self.config, self.store
        given = jobenv.JOB_SECRET in os.environ
        if cfg.node_rank == 0 or given:
            self._know_secret()  # at once: slot 0 writes it for the others, or it was given
        try:  # before anything is started: nothing inherits it
            warned_at = early_warning.take(os.environ)
            # SLURM's warning (--signal=USR2@N): flag file, checkpoint, requeue (docs/submit.md);
            # a bad setting is a usage error here too, not only where ``nvrx-supervise`` checks it
            self.preemption = PreemptionHandler.from_env(
                cfg.node_rank, cfg.nnodes, job_dir=cfg.events_dir, writer=self.writer
            )
        except ValueError as exc:
            raise SupervisorError(ExitCode.USAGE, str(exc)) from None
        # first: a warning while ``start`` asks sacct about past runs waits in the pipe
        self.signals = SignalPipe((*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD)).install()
        self.preemption.start()
        if warned_at is not None:  # it reached nvrx-srun, before srun ran: as if it came here
            self._on_warning(warned_at, "checkpoint, then requeue (it reached nvrx-srun first)")
        private_dir = self.hang_watch.start()  # before any child: each one gets its socket
        flag = self.store.stop
        try:
            job_secret.share(cfg, flag.sealer.secret if given and flag is not None else None, private_dir)
        except ConfigError as exc:
            raise SupervisorError(ExitCode.USAGE, str(exc)) from None
        check_store_port(cfg)
        # The agent retries connecting while the store comes up: start it first.
        store.beats_fd = self.hang_watch.beats_fd
        link = store.link = StoreLink(
            cfg.store_host, cfg.store_port, cfg.store_timeout, store.beats_fd
        ).launch()
        store.service = launch_store(cfg)
        store.rejected = self._rejected
        roles = store.roles = NodeRoles(cfg, link, self.emit, lambda: store.sealer, self._rejected)
        self._start_children()
        stop, later = await_store_or_stop(cfg, store.service, self.signals)
        if stop is not None:
            return stop
        self._connect_link(link, roles)
        self._on_signals(later)
        self.failover.prepare()
        return None

    def _start_children(self) -> None:
        cfg = self.config
        if cfg.starts_as_spare:  # a spare starts children when it takes over a node
            self.course.to(Course.SPARE)
            self.standbys.start(
                cfg.command, range(cfg.nproc_per_node), cfg.child_env(0, 1, node_rank=0)
            )
            return
        self.course.to(Course.TRAINING)
        for local_rank in range(cfg.nproc_per_node):
            self.start_child(local_rank)

    def _connect_link(self, link: StoreLink, roles: NodeRoles) -> None:
        try:
            link.wait_ready()
            if self.store.stop is None:
                self._know_secret()
            self.store.stop.watch(link)  # type: ignore[union-attr]
            if self._pending_stop is not None:  # a stop made before the secret was known
                self.store.stop.write(link, self._pending_stop)  # type: ignore[union-attr]
            self.job_restart.watch()
            if self.store.service is not None and self.config.nnodes > 1:
                roles.watch_chain(ALL_ENDED_KEY)
            roles.start()
        except StoreLinkError as exc:
            self.store_unavailable(exc)

    def _know_secret(self, wait: bool = True) -> None:
        """The job's secret (``job_secret``), which seals the stop flag: slot 0 and a slot
        given it know it at start, the others once the store answers (slot 0 wrote it by
        then) or when they stop the job before that, if they can read it already."""
        try:
            self.store.stop = StopFlag(job_secret.resolve(self.config, wait), seal.run_of_job())
        except ConfigError as exc:
            if wait:
                raise SupervisorError(ExitCode.USAGE, str(exc)) from None
            log.warning("cannot tell the other nodes to stop yet: %s", exc)

    # -- children -----------------------------------------------------------------
    def start_child(self, local_rank: int, flag: str | None = None) -> None:
        """Start (or restart) the child of ``local_rank``; ``flag``: a jobenv variable set to 1."""
        if self.course.stopping:
            return  # the job is stopping: a rank not started yet is not started at all
        extra: dict[str, str] = {}
        self.hang_watch.child_env(extra)
        if flag is not None:
            extra[flag] = "1"
        try:
            self.ranks.start(local_rank, self.node_rank, extra)
        except CannotSpawn as exc:
            self.request_stop(str(exc), ExitCode.SPAWN_FAILED, broadcast=True)
            return
        # a new process: what an earlier one with its pid told (a Wrapper of its own) is not
        # its own; an ended child keeps its word until then (a lost node's restart asks)
        self.job_restart.wrapper_pids.discard(self.ranks.children[local_rank].pid)

    def running(self) -> list[Child]:
        """The children still running."""
        return self.ranks.running()

    @property
    def node_rank(self) -> int | None:
        """The training node rank this slot holds; None while it waits as a spare."""
        roles = self.store.roles
        if roles is None:
            return None if self.config.starts_as_spare else self.config.node_rank
        return roles.node_rank

    def reap(self) -> None:
        """Record the children that ended, and decide on each (unless the job stops)."""
        self.ranks.reap(self.node_rank, self._ended)

    def _ended(self, local_rank: int, status: ExitStatus, pid: int) -> None:
        if not self.course.stopping:
            self._decide(local_rank, status, pid)

    def _decide(self, local_rank: int, status: ExitStatus, pid: int) -> None:
        if self.course.state is Course.FAILING_OVER:
            return  # it ended with the store: restarted with the next one
        if self.preemption is not None and (
            self.preemption.pending or self.preemption.adopt_flag()
        ):
            return  # it stopped for SLURM's warning (this node's or another's): no restart
        if self.messages.fence_if_superseded():
            return
        hang, who = self.hang_watch.hang_fault(pid), self.ranks.key(local_rank, pid)
        fault = None if status.code == 0 else hang or last_fault(self.config.events_dir, who)
        try:
            failed = status.code not in (0, CLEAN_STOP_EXIT)
            if failed and self._stopped_by_another_node():
                return
            if self.job_restart.pending is not None and status.code != CLEAN_STOP_EXIT:
                # stopped by a job-wide restart (a Wrapper rank too): it starts again with the
                # others, unless its failure is one that no restart may follow
                if failed:
                    self.workload.non_retryable(local_rank, who)
                return
            if failed and self.job_restart.failure_handled(local_rank, status, who, fault):
                return
            verdict = self.policy.decide(local_rank, status, fault)
        except StoreLinkError as exc:
            self._store_failed(exc)
            return
        if verdict.decision is Decision.DONE:
            return
        self.emit(
            "restart_decision", local_rank=local_rank, decision=verdict.decision.value,
            reason=verdict.reason, budget_left=verdict.budget_left, signature=verdict.signature,
            global_rank=self.config.rank(local_rank, self.node_rank),
        )  # fmt: skip
        if verdict.decision is Decision.RESTART:
            self.ranks.restarts[local_rank] += 1
            self.start_child(local_rank, self._restart_flag())
        else:
            self.request_stop(verdict.reason, verdict.exit_code, broadcast=True)
            if verdict.exit_code != ExitCode.OK:  # (after the others were told to stop)
                self._log_root_cause(verdict, local_rank)

    def _restart_flag(self) -> str | None:
        """How a rank restarted alone starts: with the others' new generation while the one
        a store failover opened has run no round (there is none to rejoin:
        ``NodeRoles.opening_fresh``), else as a replacement that rejoins. Whether the rank
        runs the Wrapper (the only reader of the flag) is not asked: one that died before
        its first Wrapper event would rejoin nothing."""
        roles = self.store.roles
        if roles is None or not roles.enabled:
            return None
        try:
            return jobenv.FRESH_START if roles.opening_fresh() else None
        except StoreLinkError:  # the store is failing: what comes of it decides
            return None

    # -- stopping -----------------------------------------------------------------
    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        """Stop every local child (SIGTERM, SIGKILL after the grace period, reaped); tell other nodes if ``broadcast``."""
        if self.course.stopping:
            return
        self.course.to(Course.STOPPING)
        self.stop_reason, self.exit_code = reason, int(exit_code)
        log.warning("stopping the job: %s", reason)
        self.emit("job_stop", reason=reason, exit_code=int(exit_code))
        link = self.store.link
        if broadcast and link is not None and link.lost is None and self.store.stop is None:
            self._know_secret(wait=False)
        flag, request = self.store.stop, StopRequest(reason, int(exit_code), self.config.node_rank)
        if broadcast and flag is None:
            self._pending_stop = request  # written once the secret is known (``_connect_link``)
        if broadcast and link is not None and link.lost is None and flag is not None:
            try:
                flag.write(link, request)
            except StoreLinkError as exc:
                log.warning("could not tell the other nodes to stop: %s", exc)
        # Ask now; the loop SIGKILLs what still runs after the grace period and
        # records each exit as it happens, so a second signal can cut the wait short.
        for child in self.running():
            child.signal_group(signal.SIGTERM)
        self.kill_at = time.monotonic() + self.config.grace_period
        self.failover.drop_prepared()  # a stopping job fails over no more

    def _store_failed(self, exc: StoreLinkError) -> None:
        """A store request failed: fail over where the store was lost (a child of a plain
        script dies with the store host, before the agent's ``lost`` comes through the
        loop), else stop."""
        link = self.store.link
        if link is not None and link.lost is not None:
            self.failover.store_lost(link.lost)
        else:
            self.store_unavailable(exc)

    def declare_lost(self, report: dict[str, Any]) -> None:
        """Declare the slot of ``report`` lost through the path of a silent slot's report."""
        self.messages.on_message(report)

    def store_unavailable(self, exc: Exception) -> None:
        """The store cannot be used (and it was not lost: nothing to fail over from): stop."""
        self.request_stop(f"store unavailable: {exc}", ExitCode.STORE_UNAVAILABLE, broadcast=False)

    def _on_signals(self, received: list[int]) -> None:
        for signum in received:
            if signum == signal.SIGCHLD:
                self.reap()
                continue
            name = signal.Signals(signum).name
            if self.preemption is not None and signum == self.preemption.signum:
                self._on_warning(time.time(), "checkpoint, then requeue")
            elif signum in FORWARD_SIGNALS:
                self.emit("signal_received", signal=name, action="forwarded to children")
                for child in self.running():
                    child.signal_group(signum)
            elif signum in STOP_SIGNALS:
                self._on_stop_signal(signum, name)

    def _on_warning(self, wall: float, action: str) -> None:
        """SLURM's warning signal came at wall time ``wall``: the main loop acts on it."""
        assert self.preemption is not None
        name = signal.Signals(self.preemption.signum).name
        self.emit("signal_received", signal=name, action=action)
        self.preemption.warned_at(wall)

    def _on_stop_signal(self, signum: int, name: str) -> None:
        self.signalled = signum
        if not self.course.stopping:
            self.emit("signal_received", signal=name, action="stop the job")
            self.request_stop(f"received {name}", for_signal(signum), broadcast=True)
        else:
            self.emit("signal_received", signal=name, action="kill children now")
            self.kill_at = time.monotonic()

    def _stopped_by_another_node(self) -> bool:
        """Whether the job is stopping because another node stopped it, the stop flag taken
        from the store now rather than from its watch event: a node that stops the job sets
        the flag before it ends its children, whose peers here then fail at once, and such a
        failure must not count as a fault of this node (a restart decision, a claim)."""
        link, flag = self.store.link, self.store.stop
        if link is None or link.lost is not None or flag is None:
            return False
        request = flag.read(link, ExitCode.INTERNAL)
        if request is not None:
            self._stopped_by(request)
        return self.course.stopping

    def _on_store_events(self, messages: list[dict]) -> None:
        link, relinks = self.store.link, self.store.relinks
        for message in messages:
            if self.store.link is not link or self.store.relinks != relinks:
                return  # failed over: what else came through the old link is void
            if self.failover.on_message(message) or self.messages.on_message(message):
                continue
            if self.job_restart.on_message(message):
                continue
            if self.hang_watch.on_message(message):
                continue
            if message.get("event") == "lost":
                if self.failover.store_lost(str(message.get("message"))):
                    return  # failed over: what else came through the old link is void
            elif StopFlag.owns(message.get("key")):
                self._on_stop_value(str(message["key"]), str(message.get("value", "")))
            elif message.get("event") == "rejected":  # a forged end, or a set-back beat, of this slot
                self._rejected(str(message.get("key")), str(message.get("reason")),
                               int(message.get("value_bytes") or 0))  # fmt: skip

    def _on_stop_value(self, key: str, value: str) -> None:
        """A watched key of the stop flag was set: stop, or reject it and watch on."""
        flag, link = self.store.stop, self.store.link
        if flag is None or link is None:
            return
        verdict = flag.on_value(key, value, ExitCode.INTERNAL)
        if verdict.request is not None:
            self._stopped_by(verdict.request)
            return
        if self.store.service is not None:  # one record per forged value: the store's host
            self._rejected(key, str(verdict.rejected), len(value.encode(errors="replace")))
        else:
            log.warning("rejected a value of %s: %s", key, verdict.rejected)
        try:
            flag.watch(link)
        except StoreLinkError as exc:
            self._store_failed(exc)

    def _rejected(self, key: str, reason: str, size: int) -> None:
        """Record a control value refused for its seal: an event for each of the first
        ``MAX_REJECTIONS_TOLD``, then only the log."""
        self._rejections += 1
        if self._rejections <= MAX_REJECTIONS_TOLD:
            self.emit("rejected_write", key=key, reason=reason, value_bytes=size)
        log.warning("rejected a value of %s (%d so far): %s", key, self._rejections, reason)

    def _stopped_by(self, request: StopRequest) -> None:
        if not self.course.stopping:
            self.request_stop(
                request.told,
                request.exit_code,
                broadcast=False,
            )

    # -- loop -----------------------------------------------------------------------
    def _make_selector(self) -> selectors.BaseSelector:
        selector = selectors.DefaultSelector()
        assert self.signals is not None
        selector.register(self.signals.fileno(), selectors.EVENT_READ, "signals")
        link = self.store.link
        if link is not None and link.lost is None:
            selector.register(link.fileno(), selectors.EVENT_READ, "store")
        self.hang_watch.register(selector)
        self.standbys.register(selector)  # the standby for restarts, until it is warm
        return selector

    def _poll_once(self, selector: selectors.BaseSelector, timeout: float | None) -> list[dict]:
        """Wait for one batch of signals/store messages; returns the store messages."""
        messages: list[dict] = []
        link = self.store.link
        if link is not None and link.has_events:
            # Read while waiting for an answer to a request: the descriptor will not wake us for them.
            messages.extend(link.read_events())
            timeout = 0
        for key, _ in selector.select(timeout):
            if key.data == "signals":
                assert self.signals is not None
                self._on_signals(self.signals.read())
            elif key.data == "store" and link is not None:
                messages.extend(link.read_events())
                if link.lost is not None:
                    selector.unregister(key.fd)  # at EOF the descriptor stays readable
            elif key.data in WATCHED:
                self.hang_watch.on_ready(selector, key)
            elif key.data == READY_KEY:
                self.restart_standby.on_ready()
        return messages

    def _monitor(self) -> None:
        """The main loop: wait for what comes (signals, child exits, store messages, hangs)
        and act on it, until no child runs and nothing is awaited."""
        selector, relinks = self._make_selector(), self.store.relinks
        try:
            self.reap()  # children that ended before the selector existed
            first = True  # the first look waits for nothing: what came while the store came up
            while self.running() or self.course.one_of(Course.SPARE, Course.RESTARTING):
                self.restart_standby.keep_ready()  # once the children train; again after a restart
                wait, first = 0.0 if first else self._wait_s(), False
                self._on_store_events(self._poll_once(selector, wait))
                if self.store.roles is not None:
                    self.store.roles.probes.poll()
                self.hang_watch.check()
                self.step_times.check()
                try:
                    self.job_restart.progress()
                except StoreLinkError as exc:  # counting itself ready, or the go, went unanswered
                    self._store_failed(exc)
                if self.store.relinks != relinks:  # failed over: the new link is registered
                    selector.close()
                    selector, relinks = self._make_selector(), self.store.relinks
                if not self._ended_cleanly():  # else decided as the loop ends: training is over
                    self._handle_preemption()
                if self.kill_at is not None and time.monotonic() >= self.kill_at:
                    stop_children(self.running(), 0.0, ask=signal.SIGKILL)
                    self.reap()
            self._warning_at_the_end()
        finally:
            selector.close()

    def _wait_s(self) -> float | None:
        """How long the loop may wait for what comes: until the kill deadline, a probe's
        deadline, the end of the standby's wait for the children, the end of a job-wide
        restart's wait for every slot to be ready or the hang watch's next look, whichever
        is first; None: no bound. A day at most: a rank's timeouts (computed, or from its
        checkpoint) are not bounded, and ``select`` refuses a wait of about 25 days."""
        roles = self.store.roles
        probe = roles and roles.probes.deadline()
        times = (self.kill_at, probe, self.restart_standby.deadline(), self.job_restart.ready_deadline())
        wake = [t for t in times if t is not None]
        timeout = max(0.0, min(wake) - time.monotonic()) if wake else None
        timeout = self.step_times.timeout(self.hang_watch.timeout(timeout))
        return None if timeout is None else min(timeout, MAX_SECONDS)

    def _handle_preemption(self, finished: Callable[[], bool] | None = None) -> bool:
        """After SLURM's warning (or another node's flag): let the children checkpoint and
        stop; the store's host requeues (``PreemptionHandler.act``, which ``finished`` is passed to).
        True when it decided now."""
        if self.preemption is None:
            return False
        if self.course.stopping and self.exit_code in FINAL_EXITS:
            self._decline_warning()  # it stops for good (a rank stopped it, the budget is spent)
            return False
        if not (self.preemption.pending or self.preemption.adopt_flag()):
            return False
        roles = self.store.roles
        decision = self.preemption.act(
            self._checkpoint_then_stop,
            decider=self.store.service is not None,  # the store host: node 0, or its successor
            running=None if roles is None else roles.running_slots,
            stopped=self._stop_signal,
            finished=finished,
            stopped_for_good=self._stopped_for_good,
        )
        if not self.course.stopping:
            self.request_stop(decision.reason, decision.exit_code, broadcast=False)
        else:
            self.exit_code = decision.exit_code
        return True

    def _ended_cleanly(self) -> bool:
        """Every child of this training node ended, and the job is not stopping."""
        clean = self.course.state is Course.TRAINING and self.exit_code == ExitCode.OK
        return clean and not self.running()

    def _warning_at_the_end(self) -> None:
        """Decide on a warning that came with the last child's exit. After a clean end here
        the training is over, not cut short, and a requeue would run it again: a job of one
        node decides so now (``finished``); the store host of several first reports done and
        decides as it waits for the others, knowing whether they ended too (``job_end``)."""
        clean = self._ended_cleanly()
        if clean and self.store.service is not None and self.config.nnodes > 1:
            link = self.store.link
            if link is not None and link.lost is None and self.store.roles is not None:
                return  # (``job_end.finish`` waits, and decides, only with them)
        alone = clean and self.config.nnodes == 1
        self._handle_preemption(finished=(lambda: True) if alone else None)

    def _warned_while_finishing(self) -> bool:
        """(The store host, its children ended, waiting for the other nodes) decide on a
        warning as in the loop: the nodes that still train checkpoint and await the decision.
        Nothing is requeued where another node stopped the job for good meanwhile, nor, after
        a clean finish here, where every training node's children had ended before the
        warning (a requeue would run a finished training again). True when it decided now."""
        if self.preemption is not None and (self.preemption.pending or self.preemption.adopt_flag()):
            self.job_end.read_stop()  # a stop on its way through the watch counts before the warning
        if self.job_end.stop_request is not None and self.exit_code in FINAL_EXITS:
            self._decline_warning()
            return False
        clean = not self.course.stopping and self.exit_code == ExitCode.OK
        return self._handle_preemption(finished=self._every_node_ended if clean else None)

    def _stopped_for_good(self) -> tuple[str, int] | None:
        """(The store host, deciding on a warning) a stop for good another node wrote, read
        from the store now, for its watch event may not have come yet: its reason and exit
        code; None where there is none (a requeue would run a job stopped for good again)."""
        request = self.job_end.another_nodes_stop(ExitCode.INTERNAL)
        if request is None or request.exit_code not in FINAL_EXITS:
            return None
        return request.told, request.exit_code

    def _decline_warning(self) -> None:
        """(The store host, the job stopping for good) no requeue for a warning; the nodes that
        acted on its flag read the stop's exit code as the decision."""
        if self.preemption is not None and self.store.service is not None:
            reason = self.stop_reason or f"the job stops with exit code {self.exit_code}"
            self.preemption.decline(reason, self.exit_code)

    def _every_node_ended(self) -> bool:
        """Whether every training node's children ended (the job's ``all_done``)."""
        roles = self.store.roles
        try:
            return roles is not None and roles.flag_set(ALL_DONE_KEY)
        except StoreLinkError as exc:
            log.warning("cannot tell whether every node's children ended (%s): taken as not", exc)
            return False

    def _checkpoint_then_stop(self, exit_by: float) -> None:
        """Let the children checkpoint and exit until ``exit_by`` (monotonic), with the
        signals read as they come: a child's end is reaped, a stop signal (scancel) stops the
        job at once and ends the wait; then end what still runs."""
        while self.running() and self.signalled is None and self.signals is not None:
            left = exit_by - time.monotonic()
            if left <= 0 or not select.select([self.signals], [], [], left)[0]:
                break
            self._on_signals(self.signals.read())
        stop_children(self.running(), preemption.TERM_GRACE_S, None if self.signalled else exit_by)

    def _stop_signal(self) -> int | None:
        """The stop signal received so far, with the signals that came meanwhile handled."""
        if self.signals is not None:
            self._on_signals(self.signals.read())
        return self.signalled

    def _cleanup(self) -> None:
        store = self.store
        self.failover.drop_prepared()
        self.standbys.discard()
        stop_children(list(self.ranks.children.values()), 0.0, ask=signal.SIGKILL)
        if store.roles is not None:
            store.roles.probes.close()
        if store.link is not None:
            self.job_end.leave_job()
            store.link.close()
        if store.service is not None:
            store.service.stop()
            if self.job_end.over:
                store_failover.forget_run(self.config.events_dir)
        self.standbys.close_outputs()  # the last lines of each routed stream
        self.hang_watch.close()
        if self.signals is not None:
            self.signals.restore()

    # -- helpers ------------------------------------------------------------------------
    def _log_root_cause(self, verdict: Verdict, local_rank: int) -> None:
        """One line for the failure that stops the job; after a Wrapper gave up, the fault
        of its last round (any rank's), not its ``RestartAbort``."""
        rank = self.config.rank(local_rank, self.node_rank)
        where = self.config.events_dir
        stopped = verdict.decision is Decision.STOP
        fault = last_round_fault(where, since=self.started_wall) if stopped else None
        log.error(root_cause_line(verdict, rank, self.node_rank, where, fault))

    def _requeue_without(self, hosts: list[str | None], probe: bool = True) -> None:
        node_requeue.requeue_without(hosts, self.preemption, self.emit, probe)

    def emit(self, kind: str, **fields: object) -> None:
        """Record one supervisor event (none before ``run`` configured the writer)."""
        if self.writer is not None:
            self.writer.emit(kind, **fields)
