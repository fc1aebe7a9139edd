"""What a rank does between two rounds, or instead of the next one.

After a ``Restart`` outcome: the abort's report, ``finalize``, the restart
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

After a ``Leave`` outcome: the rank records its exit, registers itself
terminated and arrives at the iteration barrier on its own behalf, so the
others go on without it (in the next round where the iteration barrier had
released it into that one already); then ``terminate`` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

from nvrx.events import failures
from nvrx.node_agent.rank_wire import Meeting
from nvrx.store import rounds
from nvrx.store.rounds import CheckedRecords

from . import rejoin
from .exception import RestartAbort
from .health_check_base import run_check
from .monitor_thread import RESTART_WAIT_S
from .progress_watchdog import FLAG_RELEASED, released_into_next
from .rank_assignment import RankAssignmentCtx, RankDiscarded, assignment_wait_s
from .round_outcome import Leave, Restart
from .round_run import RoundCall, RoundRun, forged_reporter
from .state import Mode, State
from .supervision import supervised

log = logging.getLogger(__name__)


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
    with call.phase("iteration_barrier"), board.waiting(w.barrier_timeout):
        base, rank, world_size = call.services.base_store, call.state.rank, call.state.world_size
        meeting = Meeting("iteration", call.round, world_size)
        on_forged = forged_reporter(call)
        call.services.barriers.meet(base, meeting, rank, w.barrier_timeout, on_forged=on_forged)  # type: ignore[arg-type]
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
    wait_s = assignment_wait_s(call.assignment, w.barrier_timeout)
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
    if not terminated or w.rejoin_timeout <= 0 or not supervised():
        return set()
    next_round = rejoin.Admission(
        generation=call.generation,
        round=call.round + 1,
        state={},
        terminated=[],
        job_restarts=call.state.iteration + 1,
    )
    follower_timeout = w.rejoin_timeout + w.barrier_timeout
    with call.services.board.waiting(follower_timeout):
        return rejoin.take_back(
            store,
            call.services.base_store,
            call.state,
            terminated,
            next_round,
            leader_timeout=w.rejoin_timeout,
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


def leave(call: RoundCall, store: Any, outcome: Leave) -> BaseException:
    """This rank leaves the job for good: let the others go on without it; the exception it
    leaves with (``outcome.exc``, or that of a failed ``terminate``, caused by it).

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
        _register_exit(call, store, outcome, rank, world_size)
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
        base, round_, rank, call.initial_world_size, w.barrier_timeout, w.monitor_process_interval
    )
    if found is not None:
        call.enter_round(round_ + 1)
        call.writer.update(round=round_ + 1, rank=found[0])
    return found


def _register_exit(
    call: RoundCall, store: Any, outcome: Leave, rank: int | None, world_size: int
) -> None:
    """Record the exit, register this rank terminated, interrupt the round, arrive for it."""
    if rank is None:
        return
    if not outcome.recorded and not isinstance(outcome.exc, RankDiscarded):
        record = failures.from_exception(rank, outcome.exc, kind="exit")
        rounds.append_fault(store, record)
        failures.emit_fault(call.emit, record, fault_kind="exit", origin_rank=rank)
    rounds.register_terminated(store, rank)
    rounds.interrupt(store, "fault")
    rounds.arrive_one(
        call.services.base_store, "iteration", store.iteration, rank, world_size,
        forged_reporter(call),
    )  # fmt: skip
