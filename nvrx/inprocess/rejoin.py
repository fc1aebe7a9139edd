"""Rejoin: under a supervisor, the replacement of a dead process takes its place in the running job.

1. The replacement (``NVRX_RESTART_COUNT`` > 0, not ``NVRX_FRESH_START``)
   checks that the job has a round, posts ``nvrx/join/<initial rank>`` = its
   pid and waits for ``nvrx/admit/<initial rank>/<pid>``. An admission ends
   the wait as soon as it is written. Once per heartbeat interval without
   one, it looks whether anyone is left to answer (``nobody_to_admit``): it
   stops waiting when the job's round completed, or when every rank of the
   round before is terminated, by the last restart's decision or registered
   since, except the ranks taken back then (no survivor runs ``take_back``).
   A spare's takeover skips that look: its supervisor was just told that the
   job runs. Nothing is read while a job runs: the look costs the store a few
   requests per interval, only while a replacement waits.
2. Meanwhile the survivors restart. After the iteration barrier the lowest
   surviving rank waits up to ``rejoin_timeout`` for the join requests of the
   terminated ranks (except those that left by ``RestartAbort``), admits every
   replacement that came (an ``Admission``) and publishes the ranks that came
   back under the round's ``rejoin`` key; the other survivors read it there.
3. The replacement starts in the admitted round with the dead rank's state;
   the ranks that came back are not terminated, so the job keeps its size.

When nobody answers, the replacement starts a new process generation instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import time
from typing import Any

from nvrx.store import barrier as nvrx_barrier
from nvrx.store import errors as store_errors
from nvrx.store import generations, gone_ranks, keys, rounds

from .fault_recording import Emit
from .state import Mode, State

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Admission:
    """What a running job tells an admitted replacement (stored as JSON)."""

    generation: int
    round: int
    state: dict[str, Any]  # the dead rank's state at the start of its last round
    terminated: list[int]  # ranks that stay terminated in the round it joins
    job_restarts: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Admission:
        data = json.loads(text)
        return cls(
            generation=int(data["generation"]),
            round=int(data["round"]),
            state=dict(data["state"]),
            terminated=[int(r) for r in data["terminated"]],
            job_restarts=int(data["job_restarts"]),
        )

    def rank_state(self, initial_rank: int, initial_world_size: int) -> State:
        """This process's State in the round it joins (its own initial rank and size kept)."""
        state = State(**dict(self.state, mode=Mode[self.state["mode"]]))
        state.initial_rank, state.initial_world_size = initial_rank, initial_world_size
        state.iteration = self.job_restarts
        return state


def state_json(state: State) -> str:
    """The part of a rank's state a replacement of it needs (written at every round start)."""
    fields = (
        "rank",
        "world_size",
        "active_rank",
        "active_world_size",
        "initial_rank",
        "initial_world_size",
    )
    data: dict[str, Any] = {name: getattr(state, name) for name in fields}
    data["mode"] = state.mode.name
    return json.dumps(data)


def job_alive(base_store: Any) -> bool:
    """Whether the job has a round a replacement could be taken back into."""
    return rounds.current_round(base_store) is not None


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

    With ``look``, a job with nobody left to answer (``nobody_to_admit``, looked at
    once per heartbeat interval of the wait) is given up then instead of after
    ``timeout``.
    """
    pid = os.getpid()
    t0 = time.monotonic()
    base_store.set(keys.join_request(initial_rank), str(pid))
    admitted = keys.admission(initial_rank, pid)
    chunk = max(heartbeat_interval, 0.01) if look else timeout
    while not _await(base_store, admitted, min(chunk, t0 + timeout - time.monotonic())):
        if time.monotonic() >= t0 + timeout:
            log.warning("not admitted back into the running job: starting a new generation")
            return _withdraw(base_store, initial_rank)
        reason = nobody_to_admit(base_store) if look else None
        if reason is not None:
            log.info("%s: nobody can take this process back; starting a new generation", reason)
            return _withdraw(base_store, initial_rank)
    admission = Admission.from_json(base_store.get(admitted))
    emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
    return admission


def nobody_to_admit(base_store: Any) -> str | None:
    """Why no survivor of the job can take a replacement back, or None when one may.

    The job's round completed, or the iteration barrier of the round before it
    found every rank terminated (each left by itself or through its monitor or
    supervisor) or has been registered terminated since, and no rank was taken
    back into this round, so nobody runs ``take_back``. The first round of a
    process generation (its initial barrier released) has no round before it:
    an earlier generation's last decision says nothing about the ranks of this
    one.
    """
    round_ = rounds.current_round(base_store)
    if round_ is None:
        return "the job has no round"
    current = rounds.round_store(base_store, round_)
    if current.check([keys.INTERRUPTED]) and current.get(keys.INTERRUPTED) == rounds.DONE.encode():
        return f"round {round_} completed"
    opened = nvrx_barrier.is_released(base_store, generations.initial_barrier(round_))
    previous = None if opened or round_ == 0 else rounds.round_store(base_store, round_ - 1)
    if previous is not None and previous.check([keys.DECISION]):
        decision = json.loads(previous.get(keys.DECISION))
        world_size = decision.get("world_size")  # absent in a decision of an older version
        # a survivor that died after the decision is registered in that round too; the
        # ranks taken back then (``REJOIN``) run in this round, whatever that round says
        terminated = set(decision["terminated"]) | rounds.terminated_ranks(previous)
        if previous.check([keys.REJOIN]):
            terminated -= {int(r) for r in json.loads(previous.get(keys.REJOIN))}
        if world_size is not None and set(range(int(world_size))) <= terminated:
            return f"every rank of round {round_ - 1} left it"
    return None


def _await(base_store: Any, key: str, timeout: float) -> bool:
    """Whether ``key`` was written within ``timeout`` seconds."""
    if timeout <= 0:
        return bool(base_store.check([key]))
    try:
        base_store.wait([key], datetime.timedelta(seconds=timeout))
    except store_errors.timeouts():
        return False
    return True


def _withdraw(base_store: Any, initial_rank: int) -> None:
    base_store.delete_key(keys.join_request(initial_rank))
    return None


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
    candidates = _candidates(store, base_store, terminated)
    if not candidates:
        return set()
    t0 = time.monotonic()
    if state.rank == min(survivors):
        back = _admit(store, base_store, candidates, terminated, leader_timeout, next_round)
    else:
        store.wait([keys.REJOIN], datetime.timedelta(seconds=follower_timeout))
        back = [int(t) for t in json.loads(store.get(keys.REJOIN))]
    emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
    for t in sorted(back):
        emit("rejoin", rank_rejoined=t, wait_s=time.monotonic() - t0)
    return set(back)


def _candidates(store: Any, base_store: Any, terminated: set[int]) -> list[int]:
    """Terminated ranks a replacement may come back for: not those that left by
    ``RestartAbort``, nor those of a lost node that no spare node took over."""
    stopped = {
        rec.rank
        for rec in rounds.fault_records(store)
        if rec.kind == "exit" and (rec.exc_type or "").endswith("RestartAbort")
    }
    candidates = []
    for t in sorted(terminated - stopped):
        initial = t
        if store.check([keys.rank_state(t)]):
            initial = int(json.loads(store.get(keys.rank_state(t)))["initial_rank"])
        if not gone_ranks.is_gone(base_store, initial):
            candidates.append(t)
    return candidates


def _admit(
    store: Any,
    base_store: Any,
    candidates: list[int],
    terminated: set[int],
    timeout: float,
    next_round: Admission,
) -> list[int]:
    """Wait for the replacements of ``candidates``, admit those that came, publish who came back."""
    states = {t: json.loads(store.get(keys.rank_state(t))) for t in candidates}
    joins = {t: keys.join_request(states[t]["initial_rank"]) for t in candidates}
    with contextlib.suppress(*store_errors.timeouts()):  # some did not come back in time
        base_store.wait(list(joins.values()), datetime.timedelta(seconds=timeout))
    back = [t for t in candidates if base_store.check([joins[t]])]
    final = sorted(terminated - set(back))
    for t in back:
        pid = int(base_store.get(joins[t]))
        base_store.delete_key(joins[t])
        admission = dataclasses.replace(next_round, state=states[t], terminated=final)
        base_store.set(keys.admission(states[t]["initial_rank"], pid), admission.to_json())
    store.set(keys.REJOIN, json.dumps(back))
    return back
