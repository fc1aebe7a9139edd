"""One restart round on this rank: its start, its outcome, and what the rank does between
it and the next round, or instead of the next one.

``RoundRun.start`` publishes the round (progress board, event context,
rendezvous environment, this rank's state in the store) and starts the
round's ``MonitorThread``. ``RoundRun.run`` runs user code (``initialize``,
the health check, the function on active ranks), then the completion barrier,
and returns one outcome, which the restart loop of ``CallWrapper`` acts on:

* the restart reaches this thread as ``RankShouldRestart`` (raised by the
  monitor thread's delivery, or here once this rank's own exception is on
  record): ``Restart``;
* any other ``BaseException``, until the round's ``round_end`` event is
  written: ``Leave``;
* otherwise ``Completed``.

The rendezvous environment of a round: a plain ``init_process_group()`` inside
the wrapped function rendezvouses on the Wrapper's store. For every round with a TCP
store ``MASTER_ADDR``/``MASTER_PORT`` name the store, and
``TORCHELASTIC_USE_AGENT_STORE=True`` makes every rank a client of it (no rank
tries to host a server, so it works whichever process is rank 0 this round);
``RANK``/``WORLD_SIZE`` are the round's active rank and world size. Torch
writes its rendezvous keys under ``default_pg/``; the Wrapper deletes them
between rounds (after every rank left the previous round's groups) and when a
process generation opens (``nvrx.store.rounds``), so a round never reads
another round's addresses. The previous values come back when the Wrapper
returns (``preserved_environment``).

A round reads and changes the call it belongs to (``call_wrapper.CallWrapper``)
through ``RoundCall``, which stands below the call: the call runs its rounds
(here), and the rounds do not import the call.

Between two rounds
------------------
After a ``Restart`` outcome (``restart``): the abort's report, ``finalize``, the restart
health check, the iteration barrier (the window for concurrent faults: its
last arrival publishes the terminated ranks once every rank reported), the
rejoin of replacement processes, then ``rank_assignment`` for the next round.
From ``finalize`` on the progress board says the rank is between rounds
(``ProgressBoard.between_rounds``), and each wait for its peers (or for the
round's monitor thread) names its limit there (``ProgressBoard.waiting``): its
monitor process ends a rank that makes no progress for ``hard_timeout`` past
that (``monitor_main.hang_verdict``), which its peers then see as terminated.
Any ``BaseException`` on the way turns into a ``Leave`` (whose exit is
recorded, as a leave from user code is), chained to the round's fault as if
raised while handling it.

After a ``Leave`` outcome (``leave``): the rank records its exit, registers itself
terminated and arrives at the iteration barrier on its own behalf, so the
others go on without it (in the next round where the iteration barrier had
released it into that one already); then ``terminate`` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, NoReturn, Protocol

from nvrx import events
from nvrx.events import failures
from nvrx.node_agent.rank_wire import Meeting
from nvrx.store import rounds
from nvrx.store.rounds import CheckedRecords

from . import gloo_abort, rejoin
from .exception import InternalError, RestartAbort
from .health_check_base import run_check
from .monitor_thread import (
    RESTART_WAIT_S,
    Delivery,
    MonitorThread,
    RankShouldRestart,
    tell_kept_state,
)
from .progress_watchdog import FLAG_RELEASED, released_into_next
from .rank_assignment import RankAssignment, RankAssignmentCtx, RankDiscarded, assignment_wait_s
from .rank_services import RankServices
from .state import Mode, State
from .supervision import supervised
from .wrapper_settings import WrapperSettings

log = logging.getLogger(__name__)

_FOREVER_S = 365 * 86400.0


# -- how a round ends on this rank -------------------------------------------------------
@dataclasses.dataclass
class Completed:
    """The round completed on every rank; ``value`` is what the function returned (None on a spare)."""

    value: Any


@dataclasses.dataclass
class Restart:
    """Every rank restarts; ``fault``: the exception this rank raised in the round, if any.

    Either this rank's own fault, or an exception that a peer's fault caused
    here (a collective failing once the monitor thread aborted the process
    groups; recorded as a ``peer`` fault); None when this rank raised nothing.
    ``signal``: the ``RankShouldRestart`` that ended the round here, the cause
    of an exception that ends the rank before the next round (as in the reference).
    """

    fault: BaseException | None
    signal: BaseException | None = None


@dataclasses.dataclass
class Leave:
    """This rank leaves the job because of ``exc``; ``recorded``: its fault is on record already."""

    exc: BaseException
    recorded: bool


Outcome = Completed | Restart | Leave


class RoundCall(Protocol):
    """One call of a wrapped function, as its rounds see it."""

    wrapper: WrapperSettings
    assignment: RankAssignment  # the rank assignment, then an old-style rank filter
    state: State
    initial_rank: int
    initial_world_size: int
    writer: events.EventWriter
    services: RankServices
    delivery: Delivery
    round_store: Any  # the store of the current round
    round: int
    generation: int
    pending_latency_from: float | None  # when the fault behind a restart was seen

    def emit(self, kind: str, **fields: Any) -> None: ...

    def phase(self, phase: str) -> AbstractContextManager[None]: ...

    def enter_round(self, round_: int) -> None: ...

    def arguments_for(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]: ...


def forged_reporter(call: RoundCall) -> Callable[[str, int], None]:
    """What a barrier or a signal of the round protocol calls when this rank's own value took
    the place of a forged one (``rounds.OnForged``): one ``rejected_write`` event."""

    def report(key: str, value_bytes: int) -> None:
        call.emit(
            "rejected_write",
            key=key,
            reason="a barrier's value with no valid seal: not written by this job's "
            "processes here (forged, or copied from another key, round or run)",
            value_bytes=value_bytes,
        )

    return report


class RoundRun:
    """One round on this rank: its store, its monitor thread, the call's timing and this rank's fault."""

    def __init__(
        self, call: RoundCall, store: Any, monitor: MonitorThread, started: float
    ) -> None:
        self.call = call
        self.store = store
        self.monitor = monitor
        self.started = started  # time.monotonic() when the round began
        self.fault: BaseException | None = None  # this rank's own exception in the round
        self.recorded = False  # ... and it is on record (store and event)
        self._fault_emitted = False  # its event is written (a failed store write may be retried)
        self._call_started: float | None = None

    # -- start ------------------------------------------------------------------------
    @classmethod
    def start(cls, call: RoundCall) -> RoundRun:
        """Publish the round of ``call`` (board, events, environment, store); start its monitor thread."""
        state, services, store = call.state, call.services, call.round_store
        started = time.monotonic()
        services.board.set_flag(FLAG_RELEASED, False)  # first: never with the new round
        services.board.set_round(call.round, state.rank, state.world_size, call.initial_rank)
        call.writer.update(rank=state.rank, round=call.round)
        apply_env(_round_env(call))
        rounds.publish_rank_state(store, state.rank, state)
        if call.round > call.generation:
            rounds.commit_round_start(store, services.base_store, state.iteration)
        latency = None
        if call.pending_latency_from is not None:
            latency = started - call.pending_latency_from
        call.emit(
            "round_start",
            world_size=state.world_size,
            active_world_size=state.active_world_size,
            active_rank=state.active_rank,
            iteration=state.iteration,
            restart_latency_s=latency,
        )
        call.delivery.reset()
        monitor = MonitorThread(
            rounds.round_store(services.mt_store, call.round),
            call.delivery,
            call.wrapper.abort,
            state.freeze(),
            on_rejected=functools.partial(_rejected, call) if state.rank == 0 else None,
        )
        monitor.start()
        return cls(call, store, monitor, started)

    # -- run --------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """Run the round on this rank; how it ended."""
        call = self.call
        try:
            call.services.check_monitor()  # a rank nothing watches leaves the job
            value = self._user_code(fn, args, kwargs)
            self._complete()
            self.monitor.stop.set()  # the round completed: a failure of its thread now restarts nothing
            self.monitor.join(call.wrapper.seconds.monitor_thread_interval + 5)
            call.emit("round_end", outcome="completed", duration_s=time.monotonic() - self.started)
        except RankShouldRestart as request:
            call.delivery.caught()
            tell_kept_state(self.monitor.seen_mono or time.monotonic())  # a commit raced it
            call.services.board.leave_user()
            self._call_ended("restart")  # a peer's fault cut the call short
            if self.fault is None and call.delivery.requested.is_set():
                self.fault = _in_flight(request)
            if self.monitor.error is not None:
                self._monitor_failed(self.monitor.error)
            self._record(self.fault)
            if self.fault is not None and request.__cause__ is None:
                request.__cause__ = self.fault
            return Restart(self.fault, request)
        except BaseException as exc:
            call.delivery.settle()  # a restart requested meanwhile is moot: this rank leaves
            call.services.board.leave_user()
            return Leave(exc, self.recorded)
        return Completed(value)

    def _user_code(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``initialize``, the health check, then the function on an active rank (None on a spare).

        An exception here is this rank's fault: it is recorded, and the
        restart it causes is raised (``RankShouldRestart``).
        """
        call = self.call
        w, state = call.wrapper, call.state
        try:
            call.delivery.enter_user()
            call.services.board.enter_user()
            gloo_abort.mark_user_code()  # the store clients open now are the Wrapper's
            gloo_abort.release_held()  # every peer ran its abort before this round began
            if w.initialize is not None:
                w.initialize(state.freeze())
            if w.health_check is not None:
                run_check(w.health_check, state.freeze(), "health check failed at round start")
            if state.mode != Mode.ACTIVE or state.active_rank is None:
                return None
            self._call_started_now()
            call_args, call_kwargs = call.arguments_for(fn, args, kwargs)
            return fn(*call_args, **call_kwargs)
        except Exception as exc:  # RankShouldRestart is no Exception: it passes
            self._fault_then_restart(exc)

    def _complete(self) -> None:
        """After user code: the completion barrier; a fault of any rank before it completes restarts."""
        call = self.call
        call.services.board.leave_user()
        call.delivery.leave_user()
        try:
            if call.state.active_rank is not None:
                self._call_ended("completed")
                rounds.mark_completed(self.store, forged_reporter(call))
            else:  # a spare waits for the active ranks (or a fault) without a time limit
                rounds.wait_completed(self.store, _FOREVER_S)
            self._completion_barrier()
        except InternalError as exc:  # waited for the restart request in vain already
            self._fault_then_restart(exc, retry=False)
        except Exception as exc:  # the completion barrier failed: everyone restarts
            self._fault_then_restart(exc)

    def _completion_barrier(self) -> None:
        call = self.call
        done = rounds.arrive_completion(
            self.store,
            call.state.rank,  # type: ignore[arg-type]
            call.state.world_size,
            call.wrapper.seconds.completion_timeout,
            forged_reporter(call),
        )
        if not done:
            call.delivery.await_restart(RESTART_WAIT_S)

    # -- faults -----------------------------------------------------------------------
    def _fault_then_restart(self, exc: Exception, *, retry: bool = True) -> NoReturn:
        """This rank raised ``exc``: record it, then wait for the restart it causes.

        Raises ``RankShouldRestart`` once the monitor thread requests the
        restart. When no request comes within ``RESTART_WAIT_S`` (an abort
        slower than that, or a fault the store did not take), the fault is
        recorded again if it is not on record yet and, with ``retry``, the
        wait repeats once; the ``InternalError`` of the last timeout is raised
        (this rank leaves).
        """
        delivery = self.call.delivery
        rank, round_ = self.call.state.rank, self.call.round
        if self.monitor.seen_mono is None:
            log.error("rank %s faulted in round %s: %r", rank, round_, exc)
        else:  # recorded as a ``peer`` fault: the round's abort failed this rank
            log.warning("rank %s raised %r in round %s after the round was interrupted, whose "
                        "abort ends its collectives", rank, exc, round_)  # fmt: skip
        self.fault = self.fault or exc
        delivery.begin_wait()
        self.call.services.board.leave_user()
        self._record(exc)
        self._call_ended("fault")
        try:
            delivery.await_restart(RESTART_WAIT_S)
        except InternalError as timeout:
            if not retry:
                raise
            log.warning("%s; waiting once more", timeout)
            self._record(exc)
            delivery.await_restart(RESTART_WAIT_S)

    def _monitor_failed(self, error: BaseException) -> None:
        """The round's monitor thread failed (its store connection broke) and restarted this
        rank: no other rank learns of that, and each would wait for this one (in a
        collective, a rendezvous) until a timeout, round after round. So it is this rank's
        fault, on record (through the main thread's connection), which restarts the others
        too; a fault of its own (recorded before, or raised as the restart came) stands for it,
        and so does a peer's the thread saw before it failed (``seen_mono``: the round was
        interrupted for every rank already)."""
        if self.recorded or self.monitor.seen_mono is not None:
            return
        lost = InternalError(
            f"rank {self.call.state.rank}'s monitor thread lost its store connection ({error!r}) "
            f"in round {self.call.round}: it could not see the round's faults, so every rank "
            "restarts, and the next round's thread watches on a new connection"
        )
        lost.__cause__ = error
        log.error("%s", lost)
        self.fault = self.fault or lost

    def _record(self, exc: BaseException | None) -> None:
        """Put this rank's fault on record once (see ``record_rank_fault``): a ``peer`` fault
        where the monitor thread saw another rank's first (``seen_mono``), else its own.

        Called again after a failed store write, it retries the write only:
        the fault's event was written by the first call.
        """
        if exc is None or self.recorded:
            return
        self.recorded = record_rank_fault(
            self.store,
            self.call.emit,
            self.call.state.rank,
            exc,
            self.monitor.seen_mono,
            event=not self._fault_emitted,
        )
        self._fault_emitted = True

    # -- the call's timing (goodput) --------------------------------------------------
    def _call_started_now(self) -> None:
        self.call.emit("call_start", note="the wrapped function is entered")
        self._call_started = time.monotonic()

    def _call_ended(self, outcome: str) -> None:
        """The function ended (``completed``, ``fault``, ``restart``); once per call."""
        if self._call_started is None:
            return
        duration = time.monotonic() - self._call_started
        self._call_started = None
        self.call.emit("call_end", duration_s=duration, outcome=outcome)


# -- the record of this rank's fault ------------------------------------------------------
def record_rank_fault(
    store: Any,
    emit: failures.Emit,
    rank: int | None,
    exc: BaseException,
    peer_seen_mono: float | None,
    *,
    event: bool = True,
) -> bool:
    """Record an exception of this rank: its own fault, or the consequence of a peer's.

    Every ``fault`` event is built by ``failures.emit_fault`` from a ``FaultRecord``; the
    store record is what the other ranks act on, the event is what the report reads.
    Once the monitor thread has seen another rank's fault (``peer_seen_mono``) it aborts
    the process groups, which makes pending collectives here fail: such an exception is
    a ``peer`` fault naming the rank that faulted first, and is not written to the store.
    Returns whether the fault is on record (False when the store could not be written).
    ``event=False``: a second attempt at the store write, whose event the first emitted.
    """
    record = failures.from_exception(rank if rank is not None else -1, exc)
    emit = emit if event else _no_event
    if peer_seen_mono is not None:
        origin = _first_origin(store)
        failures.emit_fault(
            emit, record, fault_kind="peer", origin_rank=origin, detected_mono=peer_seen_mono
        )
        return True
    failures.emit_fault(emit, record, fault_kind="exception", origin_rank=rank, detection_s=0.0)
    try:
        rounds.record_fault(store, record)
    except Exception as store_exc:
        log.error("could not record the fault in the store: %r", store_exc)
        return False
    return True


def _first_origin(store: Any) -> int | None:
    """The rank whose fault the store received first in this round, None when unknown."""
    with contextlib.suppress(Exception):
        origins = rounds.fault_records(store)  # in the order the store received them
        if origins:
            return origins[0].rank
    return None


def _no_event(kind: str, **fields: Any) -> None:
    """An ``Emit`` that writes nothing."""


# -- the round's rendezvous environment ----------------------------------------------------
_MANAGED = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
)


def round_env(
    store_host: str,
    store_port: int,
    active_rank: int | None,
    active_world_size: int | None,
    round_: int,
) -> dict[str, str | None]:
    """Variables for one round (None removes a variable, e.g. ``RANK`` on a spare)."""
    return {
        "MASTER_ADDR": store_host,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(round_),
        "RANK": None if active_rank is None else str(active_rank),
        "WORLD_SIZE": None if active_world_size is None else str(active_world_size),
    }


def apply_env(env: Mapping[str, str | None]) -> None:
    """Set the variables of ``env``; a None value removes its variable."""
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def preserved_environment() -> Iterator[None]:
    """Restore the variables a round sets to their values at entry."""
    saved = {name: os.environ.get(name) for name in _MANAGED}
    try:
        yield
    finally:
        apply_env(saved)


def _round_env(call: RoundCall) -> dict[str, str | None]:
    """Rendezvous variables of the round (``round_env``; a custom store: RANK, WORLD_SIZE)."""
    state = call.state
    if call.services.store_address is not None:
        return round_env(
            *call.services.store_address, state.active_rank, state.active_world_size, call.round
        )
    # a custom store: the function brings its own rendezvous
    return {
        "RANK": None if state.active_rank is None else str(state.active_rank),
        "WORLD_SIZE": None if state.active_world_size is None else str(state.active_world_size),
    }


def _rejected(call: RoundCall, found: rounds.Interruption) -> None:
    """The round's rank 0 records an interruption that every rank passed over (no valid seal)."""
    call.emit(
        "rejected_write",
        key=found.key,
        reason="an interruption with no valid seal: not written by this job's processes in this round",
        value_bytes=found.size,
    )


# -- between two rounds, or instead of the next one --------------------------------------
def restart(call: RoundCall, run: RoundRun, outcome: Restart) -> Leave | None:
    """Take this rank into the next round; a ``Leave`` when it cannot go on."""
    fault = outcome.fault
    log.warning(
        "rank %s restarts after round %s: %r", call.state.rank, call.round, outcome.signal or fault
    )
    if run.monitor.woke.is_set():  # its abort, and the restart request, end the thread
        run.monitor.join(RESTART_WAIT_S)
    else:  # the function raised RankShouldRestart itself: no abort, as in the reference
        run.monitor.stop.set()
    seen = run.monitor.seen_mono or time.monotonic()
    call.pending_latency_from = seen
    call.emit(
        "restart_phase",
        phase="abort",
        duration_s=run.monitor.abort_s or 0.0,
        ok=run.monitor.abort_ok,
    )
    round_state = call.state  # the next round gets a State of its own (``assign``)
    round_state.fn_exception = fault if isinstance(fault, Exception) else None
    try:  # watched by the monitor process: a rank that stops making progress is ended
        with call.services.board.between_rounds():
            _next_round(call, run, outcome.signal)
            if run.monitor.error is not None:  # past the iteration barrier: the store answers
                call.services.reconnect_monitor_thread(run.monitor.error)
    except BaseException as exc:
        _chain(exc, fault)
        # not on record yet: the round's fault was, this exit was not (a rejoin
        # leader reads it to know that a rank left by RestartAbort stays away)
        return Leave(exc, recorded=False)
    # The fault's traceback holds the round's frames, which hold ``run`` and the
    # round's State: reference cycles that would keep the round (its store views,
    # the call and its store connections) alive until the garbage collector runs.
    run.fault = None
    round_state.fn_exception = None
    return None


def _chain(exc: BaseException, fault: BaseException | None) -> None:
    """Make ``fault`` the context at the end of ``exc``'s context chain.

    As Python does for an exception raised while ``fault`` is handled, so
    the traceback of a rank that leaves between rounds shows the fault that
    started the restart. Nothing changes when the two chains share an
    exception already (``finalize`` re-raised the fault, say).
    """
    if fault is None:
        return
    chain = _links(exc, "__context__")
    ids = {id(link) for link in chain}
    shared = any(id(e) in ids for e in _links(fault, "__context__"))
    if chain[-1].__context__ is None and not shared:
        chain[-1].__context__ = fault


def _in_flight(request: RankShouldRestart) -> Exception | None:
    """The exception of this rank's that a restart requested by the monitor thread cut short,
    where it landed while one was raised (its context): this rank's own fault, which its
    handler never got to record; None when it landed outside any. A restart the function
    raises itself is not asked here: what it handled is its own affair, not a fault."""
    context = request.__context__
    return context if isinstance(context, Exception) else None


def _links(exc: BaseException, attr: str) -> list[BaseException]:
    """``exc`` and its ``attr`` links (``__context__`` or ``__cause__``), innermost last
    (a cycle ends it)."""
    chain = [exc]
    while (nxt := getattr(chain[-1], attr)) is not None and all(nxt is not e for e in chain):
        chain.append(nxt)
    return chain


def _next_round(call: RoundCall, run: RoundRun, signal: BaseException | None) -> None:
    """``finalize``, the restart health check, the iteration barrier, then the next round's
    rank assignment. A failure of the first two is caused by the round's ``signal``
    (its ``RankShouldRestart``), as the reference chains it."""
    w = call.wrapper
    with _caused_by(signal):
        if w.finalize is not None:
            with call.phase("finalize"):
                w.finalize(call.state.freeze())
        if w.health_check is not None:
            with call.phase("health_check"):
                run_check(w.health_check, call.state.freeze(), "restart health check failed")
    # The window for concurrent faults is the iteration barrier itself: it releases
    # once every rank of the round has reported, by itself or (dead, hung, silent)
    # through its monitor or supervisor, and the last arrival reads every fault
    # recorded until then. A fixed ``last_call_wait`` sleep would only add faults of
    # ranks that had reported already.
    board = call.services.board
    with call.phase("iteration_barrier"), board.waiting(w.seconds.barrier_timeout):
        base, rank, world_size = call.services.base_store, call.state.rank, call.state.world_size
        meeting = Meeting("iteration", call.round, world_size)
        on_forged = forged_reporter(call)
        call.services.barriers.meet(base, meeting, rank, w.seconds.barrier_timeout, on_forged=on_forged)  # type: ignore[arg-type]
        decision = rounds.decision_of(run.store)
    with board.waiting(RESTART_WAIT_S):
        _end_monitor(run)
    terminated = {int(r) for r in decision["terminated"]}
    if rank not in terminated:  # its monitor: the next round counts it (place_in_next_round)
        call.services.board.set_flag(FLAG_RELEASED, True)
    rejoined = _take_back(call, run.store, terminated)
    terminated -= rejoined
    if terminated:
        call.emit("ranks_terminated", ranks=sorted(terminated))
    checked = rounds.checked_fault_records(run.store)
    if rank == min(set(range(world_size)) - terminated, default=None):
        _report_forged(call, run.store, checked, decision)
    faults = [dataclasses.asdict(r) | {"traceback": None} for r in checked.records]
    call.emit(
        "round_end",
        outcome="restart",
        duration_s=time.monotonic() - run.started,
        faults=faults[:16],
    )
    call.enter_round(call.round + 1)
    # a rank assignment may wait for its peers (``Tree``, ``FilterCountGroupedByKey``), so
    # long as it says; one that waits for none (the default one) is watched without a limit
    wait_s = assignment_wait_s(call.assignment, w.seconds.barrier_timeout)
    with call.phase("rank_assignment"), board.waiting(wait_s) if wait_s else contextlib.nullcontext():
        assign(call, terminated, rejoined, int(decision["job_restarts"]))
    call.state.fn_exception = None


def _report_forged(
    call: RoundCall, store: Any, checked: CheckedRecords, decision: dict[str, Any]
) -> None:
    """The round's lowest rank that goes on records the entries that did not unseal in the
    lists its restart read (``rounds.forged_at_restart``): one event each list."""
    for forged in rounds.forged_at_restart(store, checked, decision):
        call.emit(
            "rejected_write",
            key=forged.key,
            reason=f"{forged.entries} {forged.what} with no valid seal: not written by this "
            "job's processes here (forged, or copied from another key, round or run)",
            value_bytes=forged.value_bytes,
        )


@contextlib.contextmanager
def _caused_by(signal: BaseException | None) -> Iterator[None]:
    """An exception of the block gets ``signal`` as the cause at the end of its cause chain
    (unless the two chains share an exception already: ``finalize`` re-raised the fault)."""
    try:
        yield
    except Exception as exc:
        if signal is not None:
            chain = _links(exc, "__cause__")
            if not {id(e) for e in chain} & {id(e) for e in _links(signal, "__cause__")}:
                chain[-1].__cause__ = signal
        raise


def _end_monitor(run: RoundRun) -> None:
    """End the round's monitor thread once every rank left the round (the iteration barrier
    released): one the round's interruption never woke (its function raised
    ``RankShouldRestart`` itself) would otherwise wait on for a day."""
    if not run.monitor.woke.is_set():
        rounds.interrupt(run.store, rounds.DONE)
    run.monitor.join(RESTART_WAIT_S)


def _take_back(call: RoundCall, store: Any, terminated: set[int]) -> set[int]:
    """Under a supervisor, the terminated ranks whose replacement process rejoined (see ``rejoin``)."""
    w = call.wrapper
    if not terminated or w.seconds.rejoin_timeout <= 0 or not supervised():
        return set()
    next_round = rejoin.Admission(
        generation=call.generation,
        round=call.round + 1,
        state={},
        terminated=[],
        job_restarts=call.state.iteration + 1,
    )
    follower_timeout = w.seconds.rejoin_timeout + w.seconds.barrier_timeout
    with call.services.board.waiting(follower_timeout):
        return rejoin.take_back(
            store,
            call.services.base_store,
            call.state,
            terminated,
            next_round,
            leader_timeout=w.seconds.rejoin_timeout,
            follower_timeout=follower_timeout,
            emit=call.emit,
        )


def assign(call: RoundCall, terminated: set[int], rejoined: set[int], iteration: int) -> None:
    """Run the ``rank_assignment`` plug-in, then an old-style ``rank_filter``; the rank's State
    for the next round. ``rejoined``: the ranks whose replacement was taken back into it.
    The assignment sees the State the rank had, its iteration too (as in the reference,
    and the same on every rank, a replacement's included: ``rejoin.admitted_state``);
    the next round's ``iteration`` is set after it.

    An assignment that does not choose the active ranks (``ShiftRanks`` alone, say) leaves
    every rank active, in every round: its output still has no mode, or it is the previous
    round's activation, untouched, which no longer fits the world (more active ranks than
    ranks) and would give the function a stale ``RANK`` and ``WORLD_SIZE``."""
    old = dataclasses.replace(call.state)
    ctx = call.assignment(
        RankAssignmentCtx(call.state, call.round_store, set(terminated), set(rejoined))
    )
    if not hasattr(ctx, "state"):  # (a context of its own with a state is taken, as by the reference)
        raise TypeError(
            f"rank_assignment {call.assignment!r} returned {ctx!r}: it must return the "
            "RankAssignmentCtx it was given, with the rank's new state (add `return ctx`)"
        )
    new = ctx.state
    if _chose_no_activation(old, new):
        new = dataclasses.replace(
            new, mode=Mode.ACTIVE, active_rank=new.rank, active_world_size=new.world_size
        )
    call.state = new if isinstance(new, State) else State(**dataclasses.asdict(new))
    call.state.iteration = iteration
    call.state.set_distributed_vars()
    if (old.rank, old.active_rank, old.world_size) == (new.rank, new.active_rank, new.world_size):
        return
    call.emit(
        "rank_change",
        old_rank=old.rank,
        new_rank=new.rank,
        active=new.active_rank is not None,
        active_rank=new.active_rank,
        world_size=new.world_size,
    )


def _chose_no_activation(old: State, new: State) -> bool:
    """Whether the assignment that turned ``old`` into ``new`` left the activation unchosen."""
    if new.rank is None:
        return False
    if new.mode == Mode.INITIALIZED:
        return new.active_rank is None
    activation = (new.mode, new.active_rank, new.active_world_size)
    untouched = activation == (old.mode, old.active_rank, old.active_world_size)
    return (
        untouched
        and new.mode == Mode.ACTIVE
        and new.active_world_size is not None
        and new.active_world_size > new.world_size
    )


def leave(call: RoundCall, store: Any, outcome: Leave, told: bool = True) -> BaseException:
    """This rank leaves the job for good: let the others go on without it; the exception it
    leaves with (``outcome.exc``, or that of a failed ``terminate``, caused by it). Not
    ``told``: the store is left alone (the exit is an event only), where this rank's number
    in the round is not known (its first rank assignment failed: the others' numbering of
    the round may differ from the one it had, and registering that number could take a
    live rank out).

    Released into the next round already (its rejoin or rank assignment failed), it
    leaves that round, which counts it, as its monitor would for a death there
    (``rounds.place_in_next_round``), or the round it ends where its place there is not found;
    a rank that its assignment discarded is not counted there.
    """
    board = call.services.board
    info = board.read()
    released = released_into_next(int(info["flags"]))
    board.set_flag(FLAG_RELEASED, False)
    rank, world_size = call.state.rank, call.state.world_size
    try:
        if released and rank is not None and not isinstance(outcome.exc, RankDiscarded):
            found = _next_round_place(call, int(info["round"]), rank)
            if found is not None:
                store, (rank, world_size) = call.round_store, found
        if told:
            _register_exit(call, store, outcome, rank, world_size)
        else:
            _exit_record(call, outcome, rank)
    except Exception as store_exc:
        log.error("could not register rank %s as terminated: %r", call.state.rank, store_exc)
    call.emit(
        "round_end",
        outcome="abort" if isinstance(outcome.exc, RestartAbort) else "terminated",
        duration_s=0.0,
    )
    call.state.mode = Mode.TERMINATED
    if call.wrapper.terminate is None:
        return outcome.exc
    try:
        call.wrapper.terminate(call.state.freeze())
    except Exception as term_exc:
        log.error("terminate callback failed: %r", term_exc)
        term_exc.__cause__ = outcome.exc
        return term_exc
    return outcome.exc


def _next_round_place(call: RoundCall, round_: int, rank: int) -> tuple[int, int] | None:
    """This rank's (rank, world size) in round ``round_`` + 1, once every other rank started
    it, the call entered there; None where that place is not found (logged)."""
    w, base = call.wrapper, call.services.base_store
    found = rounds.carry_over_death(
        base, round_, rank, call.initial_world_size, w.seconds.barrier_timeout, w.seconds.monitor_process_interval
    )
    if found is not None:
        call.enter_round(round_ + 1)
        call.writer.update(round=round_ + 1, rank=found[0])
    return found


def _exit_record(call: RoundCall, outcome: Leave, rank: int | None) -> failures.FaultRecord | None:
    """The exit's fault record, its event written; None where its fault is on record already
    or its rank was discarded (no fault)."""
    if rank is None or outcome.recorded or isinstance(outcome.exc, RankDiscarded):
        return None
    record = failures.from_exception(rank, outcome.exc, kind="exit")
    failures.emit_fault(call.emit, record, fault_kind="exit", origin_rank=rank)
    return record


def _register_exit(
    call: RoundCall, store: Any, outcome: Leave, rank: int | None, world_size: int
) -> None:
    """Record the exit, register this rank terminated, interrupt the round, arrive for it."""
    if rank is None:
        return
    record = _exit_record(call, outcome, rank)
    if record is not None:
        rounds.append_fault(store, record)
    rounds.register_terminated(store, rank)
    rounds.interrupt(store, "fault")
    rounds.arrive_one(
        call.services.base_store, "iteration", store.iteration, rank, world_size,
        forged_reporter(call),
    )  # fmt: skip
