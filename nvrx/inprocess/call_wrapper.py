"""``CallWrapper``: one call of a wrapped function, its store, monitors and restart rounds.

The round protocol is described in ``nvrx.inprocess.wrap``; this module runs
the call: it starts what runs beside the rank (``rank_services``), joins the
job (a new process generation, or ``rejoin`` as a replacement process), then
loops over rounds. Each round (``round_run``) ends in one outcome: completed
(return), restart (``round_run.restart``, then the next round) or leave
(``round_run.leave``, then the exception is raised).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from nvrx import events, jobenv
from nvrx.node_agent.rank_wire import Meeting
from nvrx.store import rounds

from . import rejoin, round_run
from . import store as rstore
from .exception import RestartAbort
from .logging import release_logger, setup_logger
from .monitor_process import MonitorProcess
from .monitor_thread import RESTART_WAIT_S, Delivery, RankShouldRestart, reraise_if_unraisable
from .param_utils import substitute_param_value
from .progress_watchdog import FLAG_KEEPING, FLAG_TIMEOUTS_OFF, ProgressWatchdog
from .rank_filter import with_rank_filter
from .rank_services import RankServices
from .round_run import (
    Completed,
    Leave,
    Outcome,
    Restart,
    RoundRun,
    forged_reporter,
    preserved_environment,
)
from .state import State
from .store import BarrierTimeout
from .supervision import restarted_process, supervised
from .wrapper_settings import WrapperSettings

_T = TypeVar("_T")

log = logging.getLogger(__name__)


def _refuse_initialized_distributed() -> None:
    """Raise ``ValueError``, as the reference does, when torch.distributed is initialized already:
    each round's function must create its process group itself (a restart destroys it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "torch.distributed is already initialized when the Wrapper is entered: call "
            "torch.distributed.destroy_process_group() before the wrapped function, and "
            "init_process_group inside it"
        )


def _refuse_outside_main_thread() -> None:
    """Raise ``RuntimeError`` when the wrapped function is called in a thread other than the
    main thread, before anything starts: the restart and the hang detection both work on
    the main thread only, so elsewhere a fault would interrupt the main thread instead and
    a hang would go unseen."""
    if threading.current_thread() is threading.main_thread():
        return
    raise RuntimeError(
        "nvrx.inprocess.Wrapper: the wrapped function was called in thread "
        f"{threading.current_thread().name!r}, not in the main thread. The Wrapper runs in "
        "the main thread only: a restart is raised in the main thread (its wake-up signal "
        "is handled there only), and the progress watchdog measures the main thread "
        "(Py_AddPendingCall runs its probe there only), so elsewhere a peer's fault would "
        "interrupt the main thread and a hang of this thread would go unseen"
    )


class CallWrapper:
    """One call of a wrapped function: its store, monitors and restart rounds.

    Passed to the wrapped function through any parameter annotated
    ``CallWrapper``; offers ``iteration``, ``ping()``, ``atomic()`` and
    ``disable_hang_protection()``, and the reference's ``state``, ``store`` and
    ``base_store`` (both the call's store, which is the same object every round:
    a key set in one round is read in the next). The other attributes serve the
    restart machinery (``round_run``), which reads them as a
    ``round_run.RoundCall``; ``round_store``, the current round's view of the
    store, is one of them.
    """

    #: The rank's state of the current round, as its rank assignment left it.
    state: State
    #: The ``Wrapper`` that made this call.
    wrapper: WrapperSettings
    #: The ``threading.RLock`` that ``atomic()`` holds; a restart waits for it.
    atomic_lock: Any

    def __init__(self, wrapper: WrapperSettings) -> None:
        _refuse_outside_main_thread()
        _refuse_initialized_distributed()
        setup_logger()
        try:
            self._build(wrapper)
        except BaseException:
            release_logger()
            raise
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _build(self, wrapper: WrapperSettings) -> None:
        """The call's state, event writer and rank services (nothing started yet)."""
        self.wrapper = wrapper
        # the rank_assignment plug-in, then an old-style rank_filter: one step, every round
        self.assignment = with_rank_filter(wrapper.rank_assignment, wrapper.rank_filter)
        self.state = State.from_env()
        self.initial_rank: int = self.state.initial_rank  # type: ignore[assignment]
        self.initial_world_size: int = self.state.initial_world_size  # type: ignore[assignment]
        self.writer = events.EventWriter(
            events.job_log_dir(), "wrapper", dict(events.context_from_env(), rank=self.initial_rank)
        )
        self.services = RankServices(
            wrapper, self.initial_rank, self.initial_world_size, self.writer
        )
        self.delivery = Delivery()
        self.atomic_lock = self.delivery.atomic_lock
        self.round_store: Any = None  # the store of the current round (``enter_round``)
        self.round = 0
        self.generation = 0
        self.rounds_run = 0
        self.left_job = False  # this rank left the job for good, the others going on
        self.pending_latency_from: float | None = None  # when the fault behind a restart was seen
        self._first_terminated: set[int] = set()
        self._first_rejoined: set[int] = set()  # a replacement: its own rank (``_resume``)
        self._first_iteration = 0  # the job restarts counted when the first round starts
        self._arguments: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._hang_protection_off = 0  # depth of nested ``disable_hang_protection()`` blocks
        self._hang_protection_lock = threading.Lock()  # blocks of several threads at once

    # -- joining the job ------------------------------------------------------------------
    def _setup(self) -> None:
        self.services.board.set_round(-1, self.state.rank, self.state.world_size, self.initial_rank)
        self.services.start()
        admission = self._request_admission()
        self.services.start_watchdog()
        self.delivery.install_signal()
        if admission is not None:
            self._resume(admission)
        else:
            self._open_generation()

    def _request_admission(self) -> rejoin.Admission | None:
        """A replacement process under a supervisor asks the running job to take it back."""
        w = self.wrapper
        if not (restarted_process() and supervised()) or w.seconds.rejoin_timeout <= 0:
            return None
        if rounds.current_round(self.services.base_store) is None:
            return None  # no round to be taken back into
        wait_s = w.seconds.rejoin_timeout + w.seconds.barrier_timeout + w.seconds.soft_timeout
        return rejoin.request_admission(
            self.services.base_store,
            self.initial_rank,
            wait_s,
            self.emit,
            heartbeat_interval=w.seconds.heartbeat_interval,
            # a spare node taking over a lost one: the job told its supervisor it runs, no need to look
            look=not jobenv.flag_in(None, jobenv.TAKEOVER),
        )

    def _resume(self, admission: rejoin.Admission) -> None:
        """Admitted: start in the job's next round with the state of the rank this process replaces."""
        self.generation = admission.generation
        self.services.board.set_generation(self.generation)
        self.enter_round(admission.round)
        self.state = rejoin.admitted_state(admission, self.initial_rank, self.initial_world_size)
        self._first_terminated = set(admission.terminated)
        self._first_rejoined = {self.state.rank}
        self._first_iteration = admission.job_restarts
        local_rank = os.environ.get("LOCAL_RANK", "")
        self.emit(
            "rejoin",
            local_rank=int(local_rank) if local_rank.isdigit() else None,
            round=self.round,
            rank=self.state.rank,
        )

    def _open_generation(self) -> None:
        """A new process generation: every process of the job meets at its initial barrier
        (``nvrx.store.rounds``); the ranks gone by then stay out of its first round."""
        base = self.services.base_store
        self.generation = rounds.generation_base(base)
        self.enter_round(self.generation)
        self.services.board.set_generation(self.generation)
        world = self.initial_world_size
        t0 = time.monotonic()
        gone = rounds.gone_in(base, world) - {self.initial_rank}
        on_forged = forged_reporter(self)
        rounds.arrive_for_gone(base, self.generation, world, gone, on_forged)
        initial = Meeting("initial", self.generation, world)
        timeout = self.wrapper.seconds.barrier_timeout
        self.services.barriers.meet(base, initial, self.initial_rank, timeout, on_forged=on_forged)
        self.emit(
            "restart_phase", phase="initial_barrier", duration_s=time.monotonic() - t0, ok=True
        )
        self._first_terminated = rounds.gone_at_start(base, self.generation)
        self.state.iteration = self._first_iteration = rounds.job_restarts(base)

    def enter_round(self, round_: int) -> None:
        """From now on the call is in round ``round_``, whose keys its ``round_store`` reads and writes."""
        self.round = round_
        self.round_store = rstore.round_store(self.services.base_store, round_)

    # -- public API -------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (job restarts so far)."""
        return self.state.iteration

    def ping(self) -> None:
        """Report progress by hand: from the first ping of a round, silence longer than the timeouts is a hang."""
        self.services.board.stamp_manual()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Run a block that a restart must not interrupt (the restart waits for it to end)."""
        with self.delivery.atomic():
            yield

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """Turn the soft and hard timeouts off for the block (exceptions still restart).

        Blocks nest: the timeouts come back when the outermost block ends, or at the
        next round's start when a restart cut the block short. Progress then
        counts from that moment: the automatic timestamp and, once ``ping()`` made it
        active, the manual one too (else its last ``ping`` before the block, older than
        the block, would be a hang at once)."""
        board = self.services.board
        with self._hang_protection_lock:  # the round read with the depth: never one gone by
            round_ = self.rounds_run
            self._hang_protection_off += 1
            board.set_flag(FLAG_TIMEOUTS_OFF, True)
        try:
            yield
        finally:
            with self._hang_protection_lock:
                self._hang_protection_ends(round_)

    def _hang_protection_ends(self, round_: int) -> None:
        """A block of round ``round_`` ends (one of an earlier round ended with it)."""
        if round_ != self.rounds_run or self._hang_protection_off == 0:
            return  # (0: a block entered as the round changed, and counted off by its start)
        self._hang_protection_off -= 1
        if self._hang_protection_off == 0:
            board = self.services.board
            board.stamp_auto()
            if board.read()["manual"] > 0:  # ``ping()`` used this round (0: inactive)
                board.stamp_manual()
            board.set_flag(FLAG_TIMEOUTS_OFF, False)

    def _hang_protection_back(self) -> None:
        """A new round starts (``rounds_run`` counts it) protected: a block that a restart
        cut short (in its own ``finally`` even) leaves neither its depth nor the timeouts off
        behind."""
        with self._hang_protection_lock:
            self.rounds_run += 1
            self._hang_protection_off = 0
            self.services.board.set_flag(FLAG_TIMEOUTS_OFF, False)

    @property
    def store(self) -> Any:
        """The call's store, the same object every round (not a round's view of it): the
        reference's attribute, which code written for it reads; a key it sets in one round
        is there in the next."""
        return self.services.base_store

    @property
    def base_store(self) -> Any:
        """The call's store outside any round, the object ``store`` is: the reference's
        attribute, which code written for it reads."""
        return self.services.base_store

    @property
    def monitor_process(self) -> MonitorProcess | None:
        return self.services.monitor

    @property
    def progress_watchdog(self) -> ProgressWatchdog | None:
        return self.services.watchdog

    def arguments_for(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args``/``kwargs`` for ``fn``, this object passed to parameters annotated
        ``CallWrapper``: bound at the first round that runs ``fn`` (a binding that fails
        is that round's fault), the same ones every round after."""
        if self._arguments is None:
            self._arguments = substitute_param_value(fn, args, kwargs, {CallWrapper: self})
        return self._arguments

    # -- events -------------------------------------------------------------------------
    def emit(self, kind: str, **fields: Any) -> None:
        """Write one event of this rank's Wrapper (stamped with its initial rank)."""
        self.writer.emit(kind, initial_rank=self.initial_rank, **fields)

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """A ``restart_phase`` event for the block: its duration and whether it succeeded."""
        t0 = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.emit("restart_phase", phase=phase, duration_s=time.monotonic() - t0, ok=ok)

    # -- the restart loop ---------------------------------------------------------------
    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        outcome = "error"
        try:
            with reraise_if_unraisable(RankShouldRestart), preserved_environment():
                ret = self._run_rounds(fn, args, kwargs)
            self._run_completion()
            outcome = "completed"
            return ret
        except BaseException as exc:
            if RestartAbort.behind(exc) is not None:
                outcome = "restart_abort"
            elif self.left_job:
                outcome = "left"  # the others went on without it
            raise
        finally:
            self.emit("wrapper_end", outcome=outcome, rounds=self.rounds_run)

    def _run_rounds(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Rounds until one completes (its value) or this rank leaves (its exception is raised)."""
        self._or_leave(self._first_assignment)
        while True:
            self._hang_protection_back()
            run = self._or_leave(functools.partial(RoundRun.start, self))
            outcome: Outcome | None = run.run(fn, args, kwargs)
            if isinstance(outcome, Completed):
                return outcome.value
            if isinstance(outcome, Restart):
                outcome = round_run.restart(self, run, outcome)
            if isinstance(outcome, Leave):
                # This rank's own leave restarts nothing here: the monitor thread only
                # finishes an abort it began for a peer's fault, and is gone before we raise
                # (unless the leave could not interrupt the round: ``MonitorThread.finish``).
                run.monitor.stop.set()
                self.left_job = True
                exc = round_run.leave(self, run.store, outcome)
                if not run.monitor.finish(RESTART_WAIT_S) and run.monitor.woke.is_set():
                    log.warning("the monitor thread's abort outlasted %.0f s; leaving anyway", RESTART_WAIT_S)
                raise exc

    def _first_assignment(self) -> None:
        with self.phase("rank_assignment"):
            round_run.assign(
                self, self._first_terminated, self._first_rejoined, self._first_iteration
            )

    def _or_leave(self, step: Callable[[], _T]) -> _T:
        """``step()``, a step of the rounds outside any round's run (the first rank assignment,
        the start of a round); where it raises, this rank leaves the job as from a round:
        ``terminate`` runs, its exit is an event, and its exception is raised. A round that
        failed to start is told (the others go on without the rank); the first assignment's
        failure is not: the rank's number in the first round is the assignment's, which
        failed (the others find it gone at their barriers' timeout, or its supervisor starts
        a replacement). A ``RankDiscarded`` there is no fault and no event: every rank's
        assignment left the rank out alike."""
        try:
            return step()
        except BaseException as exc:
            told = self.rounds_run > 0
            self.left_job = True
            raise round_run.leave(self, self.round_store, Leave(exc, recorded=False), told)  # noqa: B904

    def _run_completion(self) -> None:
        if self.wrapper.completion is None:
            return
        try:
            self.wrapper.completion(self.state.freeze())
        except Exception as exc:
            log.error("completion callback failed (ignored): %r", exc)

    # -- shutdown -----------------------------------------------------------------------
    def _termination_barrier(self) -> None:
        """Every rank arrives; the store host waits for everyone, since the store must serve
        until then: past ``barrier_timeout`` on, while the job moves (the others may train
        on long after this rank left, as after a ``RankDiscarded``)."""
        base, world = self.services.base_store, self.initial_world_size
        try:
            ended = Meeting("termination", self.generation, world)
            self.services.barriers.meet(
                base, ended, self.initial_rank, self.wrapper.seconds.barrier_timeout,
                wait=self.services.host_store, on_forged=forged_reporter(self),
            )  # fmt: skip
        except BarrierTimeout as exc:
            if self.services.host_store:
                self._keep_store(base, exc)
            else:
                log.warning("termination barrier: %r", exc)
        except Exception as exc:
            log.warning("termination barrier: %r", exc)

    def _keep_store(self, base: Any, timed_out: BarrierTimeout) -> None:
        """The store host waits on for the others while a host beats (``keep_until_terminated``),
        in waits as long as its monitor's would be had the rank died, until all passed. Its
        monitor beats no more meanwhile (``FLAG_KEEPING``): the job moves only by the
        others' beats."""
        from nvrx.store.host_ring import HostsBeating

        seconds = self.wrapper.seconds
        chunk_s = 2 * max(seconds.barrier_timeout, seconds.completion_timeout)
        log.info("the other ranks train on: this rank keeps the store until they finish")
        self.services.board.set_flag(FLAG_KEEPING, True)  # its own beats no longer count
        try:
            passed = rounds.keep_until_terminated(
                base, self.generation, self.initial_world_size, chunk_s, HostsBeating(base)
            )
        except Exception as exc:
            log.warning("termination barrier, keeping the store: %r", exc)
            return
        if not passed:
            log.warning("termination barrier: %r; no host beat for %g s since", timed_out, chunk_s)

    def shutdown(self) -> None:
        """Termination barrier (the store host waits for everyone), then stop monitors and the
        store; the ``nvrx.inprocess`` logger is put back as the caller left it. Each step runs
        whatever the one before raised (a Ctrl-C in the barrier, say)."""
        with contextlib.ExitStack() as ending:  # its steps run last registered first
            ending.callback(self._release)
            ending.callback(self.services.close)
            ending.callback(self.delivery.uninstall_signal)
            ending.callback(self.services.stop)
            if self.services.base_store is not None:
                self._termination_barrier()

    def _release(self) -> None:
        # A frame of the function that took this object (its ``CallWrapper``
        # parameter) is in the traceback of the round's exception: neither may
        # keep the store alive in that cycle until the garbage collector runs.
        self.round_store = None
        self.state.fn_exception = None
        release_logger()

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
