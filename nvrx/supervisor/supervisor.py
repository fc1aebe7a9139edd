"""The per-node supervisor loop: store, children, restarts, stop requests, signals.

One supervisor runs per node. Node 0 hosts the job's store service before any
child starts; the others wait for it. Each supervisor starts its children,
restarts a failed one (same RANK, ``NVRX_RESTART_COUNT`` + 1) within the
job-wide budget, and stops all of them when any node asks the job to stop.
Everything happens on the main thread: signals, child exits and store events
arrive as readable descriptors of one ``select`` call (only routed output
streams are copied by threads of their own, ``rank_output``).
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import signal
import time
from collections.abc import Callable
from pathlib import Path

from nvrx import events
from nvrx.store.service import StoreService

from . import preemption, rank_logs
from .children import Child, ExitStatus, stop_children
from .config import ALL_ENDED_KEY, RESTARTS_KEY, STOP_KEY, StopRequest, SupervisorConfig
from .course import Course, CourseTracker
from .exit_codes import ExitCode, SupervisorError, for_signal
from .failover import Failover
from .hang_watch import WATCHED, HangWatch
from .job_end import JobEnd
from .job_restart import JobRestart
from .node_messages import NodeMessages
from .node_roles import NodeRoles
from .policy import Decision, RestartPolicy, last_fault
from .preemption import PreemptionHandler
from .restart_standby import RestartStandby
from .signals import FORWARD_SIGNALS, STOP_SIGNALS, SignalPipe
from .standby import READY_KEY, Standbys
from .store_link import StoreLink, StoreLinkError
from .store_setup import await_store_or_stop, check_store_port, launch_store
from .workload_control import WorkloadControl

log = logging.getLogger(__name__)

#: Starts the child of a local rank: ``spawn(local_rank, attempt, env, directory) -> Child``
#: (``directory``: where its log files go, ``rank_logs``; None: nowhere).
Spawner = Callable[[int, int, dict, Path | None], Child]


class Supervisor(
    NodeMessages, JobEnd, Failover, HangWatch, JobRestart, WorkloadControl, RestartStandby
):
    """Runs one node of a job until all its children have ended; ``run()`` returns the exit code."""

    def __init__(self, config: SupervisorConfig, spawn: Spawner | None = None) -> None:
        self.config = config
        self.standbys = Standbys(config.warm_standby and spawn is None, config.rank_logs)
        self._spawn = spawn or functools.partial(self.standbys.spawn, config.command)
        self._owner = os.getpid()
        self.children: dict[int, Child] = {}
        self.restarts: dict[int, int] = dict.fromkeys(range(config.nproc_per_node), 0)
        self.policy = RestartPolicy(config.max_restarts, config.loop_breaker, self._spend_restart)
        self.link: StoreLink | None = None
        self.service: StoreService | None = None
        self.signals: SignalPipe | None = None
        self.writer: events.EventWriter | None = None
        self.course = CourseTracker()
        self.stop_reason: str | None = None  # why the job stops, once it does
        self.exit_code: int = ExitCode.OK
        self._signalled: int | None = None
        self._kill_at: float | None = None  # when children still running after a stop get SIGKILL
        self._exit_seen: dict[int, float] = {}
        self.preemption: PreemptionHandler | None = None
        self.roles: NodeRoles | None = None
        self._all_ended = False  # node 0 saw every other slot end
        self._epoch = 0  # store failovers so far
        self._store_slot = self._lost_store_slot = 0  # slot hosting the store now / before
        self._selector_stale = False  # the store link changed: the main loop re-registers it

    # -- life ---------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until done. Raises ``SupervisorError`` for failures before supervision
        begins (a port in use, a store that never answers: its children are ended then)."""
        cfg = self.config
        self.writer = events.configure(
            "supervisor",
            directory=cfg.events_dir,
            job=cfg.job_id,
            node=cfg.node_rank,
            rank=None,
            round=None,
        )
        self.writer.emit("supervisor_start", **cfg.start_fields(), supervisor_pid=os.getpid())
        reason = "all children ended"
        try:
            # SLURM's warning (--signal=USR2@N): flag file, checkpoint, requeue (docs/submit.md)
            self.preemption = PreemptionHandler.from_env(
                cfg.node_rank, cfg.nnodes, job_dir=cfg.events_dir, writer=self.writer
            )
            self.preemption.start()
            self.signals = SignalPipe((*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD)).install()
            self._start_watch()  # before any child: each one gets its socket
            check_store_port(cfg)
            # The agent imports torch and retries connecting while the store comes up: start it first.
            self.link = StoreLink(cfg.store_host, cfg.store_port, cfg.store_timeout).launch()
            self.service = launch_store(cfg)
            self.roles = NodeRoles(cfg, self.link, self._emit)
            if not cfg.starts_as_spare:  # a spare starts children when it takes over a node
                self.course.to(Course.TRAINING)
                for local_rank in range(cfg.nproc_per_node):
                    self._start_child(local_rank)
            else:
                self.course.to(Course.SPARE)
                self.standbys.start(
                    cfg.command, range(cfg.nproc_per_node), cfg.child_env(0, 1, node_rank=0)
                )
            stop, later = await_store_or_stop(cfg, self.service, self.signals)
            if stop is not None:  # its children, if any, are ended at once: they did not train
                reason = f"received {signal.Signals(stop).name} before the store answered"
                self.exit_code = for_signal(stop)
                return self.exit_code
            self._connect_link()
            self._on_signals(later)
            self._prepare_failover()
            self._loop()
            if self.course.state is Course.TRAINING:  # (a stop stays the course to the end)
                self.course.to(Course.FINISHING)
            self._finish()
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

    def _connect_link(self) -> None:
        assert self.link is not None
        try:
            self.link.wait_ready()
            self.link.watch(STOP_KEY)
            self._watch_job_restarts()
            if self.service is not None and self.config.nnodes > 1:
                self.link.watch(ALL_ENDED_KEY)
            assert self.roles is not None
            self.roles.start()
        except StoreLinkError as exc:
            self._store_unavailable(exc)

    # -- children -----------------------------------------------------------------
    def _start_child(self, local_rank: int, flag: str | None = None) -> None:
        """Start (or restart) the child of ``local_rank``; ``flag``: a jobenv variable set to 1."""
        if self.course.stopping:
            return  # the job is stopping: a rank not started yet is not started at all
        attempt = self.restarts[local_rank]
        env = self.config.child_env(local_rank, attempt, node_rank=self.node_rank)
        self._watch_env(env)
        if flag is not None:
            env[flag] = "1"
        rank = self.config.rank(local_rank, self.node_rank)
        job_dir = self.config.events_dir
        directory = rank_logs.prepare_dir(job_dir, rank, attempt, self.config.node_rank)
        if directory is not None:
            env[rank_logs.ERROR_FILE_ENV] = str(directory / rank_logs.ERROR_FILE)
        try:
            child = self._spawn(local_rank, attempt, env, directory)
        except OSError as exc:
            self.request_stop(
                f"cannot start {self.config.command[0]!r}: {exc.strerror or exc}",
                ExitCode.SPAWN_FAILED,
                broadcast=True,
            )
            return
        self.children[local_rank] = child
        child.directory = directory
        ids = {"local_rank": local_rank, "child_pid": child.pid, "global_rank": rank}
        files = None if directory is None else str(directory.relative_to(job_dir))
        self._emit("child_start", **ids, attempt=attempt, warm=child.warm, files=files)
        if attempt > 0:
            exited = self._exit_seen.pop(local_rank, None)
            wait_s = None if exited is None else round(time.monotonic() - exited, 6)
            self._emit("rejoin", **ids, phase="replacement_started", wait_s=wait_s)

    def _running(self) -> list[Child]:
        return [c for c in self.children.values() if c.running]

    @property
    def node_rank(self) -> int | None:
        """The training node rank this slot holds; None while it waits as a spare."""
        if self.roles is None:
            return None if self.config.starts_as_spare else self.config.node_rank
        return self.roles.node_rank

    def _reap(self) -> None:
        for local_rank, child in list(self.children.items()):
            if not child.running or child.poll() is None:
                continue
            status = child.status
            assert status is not None
            self._exit_seen[local_rank] = time.monotonic()
            child.kill_group()  # whatever the command left behind in its group
            self._emit(
                "child_exit", local_rank=local_rank, child_pid=child.pid, exit_code=status.code,
                signal=status.signal_name, runtime_s=round(child.runtime_s, 6), attempt=child.attempt,
                global_rank=self.config.rank(local_rank, self.node_rank),
                error_file=rank_logs.error_file(child.directory, self.config.events_dir),
            )  # fmt: skip
            log.info("local rank %d (pid %d) ended: %s", local_rank, child.pid, status)
            if not self.course.stopping:
                self._decide(local_rank, status, child.pid)

    def _decide(self, local_rank: int, status: ExitStatus, pid: int) -> None:
        if self.course.state is Course.FAILING_OVER:
            return  # it ended with the store: restarted with the next one
        if self.preemption is not None and (
            self.preemption.pending or self.preemption.adopt_flag()
        ):
            return  # it stopped for SLURM's warning (this node's or another's): no restart
        if self._fence_if_superseded():
            return
        hang = self._hang_fault(pid)
        fault = None if status.code in (0, 130) else hang or last_fault(self.config.events_dir, pid)
        try:
            if status.code not in (0, 130) and self._failure_handled(local_rank, status, pid, fault):
                return
            verdict = self.policy.decide(local_rank, status, fault)
        except StoreLinkError as exc:
            self._store_unavailable(exc)
            return
        if verdict.decision is Decision.DONE:
            return
        self._emit(
            "restart_decision", local_rank=local_rank, decision=verdict.decision.value,
            reason=verdict.reason, budget_left=verdict.budget_left, signature=verdict.signature,
            global_rank=self.config.rank(local_rank, self.node_rank),
        )  # fmt: skip
        if verdict.decision is Decision.RESTART:
            self.restarts[local_rank] += 1
            self._start_child(local_rank)
        else:
            self.request_stop(verdict.reason, verdict.exit_code, broadcast=True)

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        """Stop every local child (SIGTERM, SIGKILL after the grace period, reaped); tell other nodes if ``broadcast``."""
        if self.course.stopping:
            return
        self.course.to(Course.STOPPING)
        self.stop_reason, self.exit_code = reason, int(exit_code)
        log.warning("stopping the job: %s", reason)
        self._emit("job_stop", reason=reason, exit_code=int(exit_code))
        if broadcast and self.link is not None and self.link.lost is None:
            try:
                self.link.set(
                    STOP_KEY, StopRequest(reason, int(exit_code), self.config.node_rank).encode()
                )
            except StoreLinkError as exc:
                log.warning("could not tell the other nodes to stop: %s", exc)
        # Ask now; the loop SIGKILLs what still runs after the grace period and
        # records each exit as it happens, so a second signal can cut the wait short.
        for child in self._running():
            child.signal_group(signal.SIGTERM)
        self._kill_at = time.monotonic() + self.config.grace_period

    def _on_signals(self, received: list[int]) -> None:
        for signum in received:
            if signum == signal.SIGCHLD:
                self._reap()
                continue
            name = signal.Signals(signum).name
            if self.preemption is not None and signum == self.preemption.signum:
                self._emit("signal_received", signal=name, action="checkpoint, then requeue")
                self.preemption.on_signal(signum)
            elif signum in FORWARD_SIGNALS:
                self._emit("signal_received", signal=name, action="forwarded to children")
                for child in self._running():
                    child.signal_group(signum)
            elif signum in STOP_SIGNALS:
                self._signalled = signum
                if not self.course.stopping:
                    self._emit("signal_received", signal=name, action="stop the job")
                    self.request_stop(f"received {name}", for_signal(signum), broadcast=True)
                else:
                    self._emit("signal_received", signal=name, action="kill children now")
                    self._kill_at = time.monotonic()

    def _on_store_events(self, messages: list[dict]) -> None:
        for message in messages:
            if self._on_node_message(message) or self._on_job_message(message):
                continue
            if message.get("event") == "lost":
                if self._store_lost(str(message.get("message"))):
                    return  # failed over: what else came through the old link is void
            elif message.get("key") == STOP_KEY and not self.course.stopping:
                request = StopRequest.decode(message.get("value"), ExitCode.INTERNAL)
                self.request_stop(
                    f"node {request.node} stopped the job: {request.reason}",
                    request.exit_code,
                    broadcast=False,
                )

    def _make_selector(self) -> selectors.BaseSelector:
        selector = selectors.DefaultSelector()
        assert self.signals is not None
        selector.register(self.signals.fileno(), selectors.EVENT_READ, "signals")
        if self.link is not None and self.link.lost is None:
            selector.register(self.link.fileno(), selectors.EVENT_READ, "store")
        self._register_watch(selector)
        self.standbys.register(selector)  # the standby for restarts, until it is warm
        return selector

    def _poll_once(self, selector: selectors.BaseSelector, timeout: float | None) -> list[dict]:
        """Wait for one batch of signals/store messages; returns the store messages."""
        messages: list[dict] = []
        if self.link is not None and self.link.has_events:
            # Read while waiting for an answer to a request: the descriptor will not wake us for them.
            messages.extend(self.link.read_events())
            timeout = 0
        for key, _ in selector.select(timeout):
            if key.data == "signals":
                assert self.signals is not None
                self._on_signals(self.signals.read())
            elif key.data == "store" and self.link is not None:
                messages.extend(self.link.read_events())
                if self.link.lost is not None:
                    selector.unregister(key.fd)  # at EOF the descriptor stays readable
            elif key.data in WATCHED:
                self._on_watch(selector, key)
            elif key.data == READY_KEY:
                self._on_standby_ready()
        return messages

    def _loop(self) -> None:
        selector = self._make_selector()
        try:
            self._reap()  # children that ended before the selector existed
            while self._running() or self.course.is_(Course.SPARE, Course.RESTARTING):
                self._keep_standby_ready()  # once the children started; again after a restart
                timeout = None if self._kill_at is None else max(0.0, self._kill_at - time.monotonic())
                self._on_store_events(self._poll_once(selector, self._watch_timeout(timeout)))
                self._check_hangs()
                self._job_restart_progress()
                if self._selector_stale:
                    selector.close()
                    selector, self._selector_stale = self._make_selector(), False
                self._handle_preemption()
                if self._kill_at is not None and time.monotonic() >= self._kill_at:
                    stop_children(self._running(), 0.0, ask=signal.SIGKILL)
                    self._reap()
            self._handle_preemption()  # a warning that came with the last child's exit
        finally:
            selector.close()

    def _handle_preemption(self) -> None:
        """After SLURM's warning (or another node's flag): let the children checkpoint and stop; node 0 requeues."""
        if self.preemption is None:
            return
        if not (self.preemption.pending or self.preemption.adopt_flag()):
            return
        decision = self.preemption.act(
            lambda exit_by: stop_children(self._running(), preemption.TERM_GRACE_S, exit_by),
            decider=self.service is not None,  # the store host: node 0, or its successor
            running=None if self.roles is None else self.roles.running_slots,
        )
        if not self.course.stopping:
            self.request_stop(decision.reason, decision.exit_code, broadcast=False)
        else:
            self.exit_code = decision.exit_code

    def _cleanup(self) -> None:
        self._drop_prepared()
        self.standbys.discard()
        stop_children(list(self.children.values()), 0.0, ask=signal.SIGKILL)
        if self.link is not None:
            self._leave_job()
            self.link.close()
        if self.service is not None:
            self.service.stop()
        self.standbys.close_outputs()  # the last lines of each routed stream
        self._close_watch()
        if self.signals is not None:
            self.signals.restore()

    def _spend_restart(self) -> int:
        if self.link is None:
            raise StoreLinkError("no store link")
        return self.link.add(RESTARTS_KEY, 1)

    def _emit(self, kind: str, **fields: object) -> None:
        if self.writer is not None:
            self.writer.emit(kind, **fields)
