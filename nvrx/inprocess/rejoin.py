"""Rejoin: under a supervisor, the replacement of a dead process takes its place in the running job.

The keys and their order are the round protocol's (``nvrx.store.rounds``); this
module is the Wrapper's side of it, with its events.

1. The replacement (``NVRX_RESTART_COUNT`` > 0, not ``NVRX_FRESH_START``)
   checks that the job has a round, posts its join request and waits for its
   admission. An admission ends the wait as soon as it is written. Once per
   heartbeat interval without one, it looks whether anyone is left to answer
   (``rounds.nobody_to_admit``). A spare's takeover skips that look: its
   supervisor was just told that the job runs. Nothing is read while a job
   runs: the look costs the store a few requests per interval, only while a
   replacement waits.
2. Meanwhile the survivors restart. After the iteration barrier the lowest
   surviving rank waits up to ``rejoin_timeout`` for the join requests of the
   terminated ranks (except those that left by ``RestartAbort``), admits every
   replacement that came and publishes the ranks that came back; the other
   survivors read them there.
3. The replacement starts in the admitted round with the dead rank's state;
   the ranks that came back are not terminated, so the job keeps its size.

When nobody answers, the replacement starts a new process generation instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nvrx.events.failures import Emit
from nvrx.store import rounds
from nvrx.store.rounds import Admission

from .state import Mode, State

log = logging.getLogger(__name__)

__all__ = ["Admission", "admitted_state", "request_admission", "take_back"]


def admitted_state(admission: Admission, initial_rank: int, initial_world_size: int) -> State:
    """This process's State for the rank assignment into the round it joins (its own initial
    rank and size kept).

    Its iteration is the one its survivors assign ranks with: the round before's, one
    less than the ``job_restarts`` of the round it joins, which the assignment sets
    after it (``round_run.assign``). An assignment that meets its peers under a
    name made from the iteration (``FilterCountGroupedByKey``) then meets them.
    """
    state = State(**dict(admission.state, mode=Mode[admission.state["mode"]]))
    state.initial_rank, state.initial_world_size = initial_rank, initial_world_size
    state.iteration = admission.job_restarts - 1
    return state


def request_admission(
    base_store: Any,
    initial_rank: int,
    timeout: float,
    emit: Emit,
    *,
    heartbeat_interval: float,
    look: bool = True,
) -> Admission | None:
    """Replacement side: ask the running job to take this process back; its admission, or None.

    With ``look``, a job with nobody left to answer (looked at once per heartbeat
    interval of the wait) is given up then instead of after ``timeout``.
    """
    join_id = rounds.new_join_id()
    t0 = time.monotonic()
    posted = rounds.post_join(base_store, initial_rank, join_id)
    if posted is None:  # every generation of the request is taken (logged)
        return None
    chunk = max(heartbeat_interval, 0.01) if look else timeout
    while True:
        wait_s = min(chunk, t0 + timeout - time.monotonic())
        admission = rounds.await_admission(base_store, initial_rank, join_id, wait_s)
        if admission is not None:
            break
        if time.monotonic() >= t0 + timeout:
            log.warning("not admitted back into the running job: starting a new generation")
            admission = _withdraw(base_store, initial_rank, join_id, posted)
            break
        reason = rounds.nobody_to_admit(base_store) if look else None
        if reason is not None:
            log.info("%s: nobody can take this process back; starting a new generation", reason)
            admission = _withdraw(base_store, initial_rank, join_id, posted)
            break
    if admission is not None:
        emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
    return admission


def _withdraw(base_store: Any, initial_rank: int, join_id: int, posted: str) -> Admission | None:
    """Withdraw the join request, then look for an admission once more: a survivor that
    read the request before it was withdrawn admits it all the same, and counts the rank
    back in its next round. (One that writes the admission only after this look still
    counts a rank that does not come: its round waits for it until its barrier's timeout.)"""
    rounds.withdraw_join(base_store, posted)
    admission = rounds.await_admission(base_store, initial_rank, join_id, 0.0)
    if admission is not None:
        log.info("admitted back into the running job as the request was withdrawn: taken")
    return admission


def take_back(
    store: Any,
    base_store: Any,
    state: State,
    terminated: set[int],
    next_round: Admission,
    *,
    leader_timeout: float,
    follower_timeout: float,
    emit: Emit,
) -> set[int]:
    """Survivor side, after the iteration barrier: the terminated ranks whose replacement came back.

    The lowest survivor waits up to ``leader_timeout`` (``rejoin_timeout``)
    for the replacements and admits them into ``next_round`` (an admission
    whose state and terminated ranks are filled in per replacement); the other
    survivors wait up to ``follower_timeout`` for its answer.
    """
    survivors = [r for r in range(state.world_size) if r not in terminated]
    if not survivors:
        return set()
    candidates = rounds.rejoin_candidates(store, base_store, terminated)
    if not candidates:
        return set()
    t0 = time.monotonic()
    if state.rank == min(survivors):
        admitted = rounds.admit(
            store, base_store, candidates, terminated, leader_timeout, next_round
        )
        for key, size in admitted.refused.items():
            what = (
                "a join request or admission with no valid seal, or a request naming a "
                "process admitted before"
            )
            _refused(emit, key, size, what)
        back = set(admitted.back)
    else:
        back = rounds.await_rejoined(store, follower_timeout)
    emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
    for t in sorted(back):
        emit("rejoin", rank_rejoined=t, wait_s=time.monotonic() - t0)
    return back


def _refused(emit: Emit, key: str, value_bytes: int, what: str) -> None:
    emit(
        "rejected_write",
        key=key,
        reason=f"{what}: not written by this job's processes in this run",
        value_bytes=value_bytes,
    )
