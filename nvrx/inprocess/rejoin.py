"""Rejoin: under a supervisor, the replacement of a dead process takes its place in the running job.

1. The replacement (``NVRX_RESTART_COUNT`` > 0, not ``NVRX_FRESH_START``)
   checks that the job has a round, posts ``nvrx/join/<initial rank>`` = its
   pid and waits for ``nvrx/admit/<initial rank>/<pid>``. An admission ends
   the wait as soon as it is written. When none came within two heartbeat
   intervals, the monitors' shared heartbeat counter (``nvrx/alive``) tells
   whether anyone is left to answer: if it did not move, the replacement
   stops waiting (a spare's takeover skips that look: its supervisor was just
   told that the job runs).
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

from nvrx.store import gone_ranks, keys, rounds

from . import store as rstore
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

    With ``look``, a job whose monitors stopped beating (the alive counter did not move
    in the first two heartbeat intervals of the wait) is given up at that point instead
    of after ``timeout``: nobody is left to answer.
    """
    pid = os.getpid()
    t0 = time.monotonic()
    alive_before = int(base_store.add(keys.ALIVE, 0)) if look else None
    base_store.set(keys.join_request(initial_rank), str(pid))
    admitted = keys.admission(initial_rank, pid)
    first = min(timeout, 2 * heartbeat_interval) if look else timeout
    ok = _await(base_store, admitted, first)
    if not ok and alive_before is not None:
        if int(base_store.add(keys.ALIVE, 0)) == alive_before:
            log.info("no monitor of the job beat for %.1f s: starting a new generation", first)
            return _withdraw(base_store, initial_rank)
        ok = _await(base_store, admitted, timeout - first)
    if not ok:
        log.warning("not admitted back into the running job: starting a new generation")
        return _withdraw(base_store, initial_rank)
    admission = Admission.from_json(base_store.get(admitted))
    emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
    return admission


def _await(base_store: Any, key: str, timeout: float) -> bool:
    """Whether ``key`` was written within ``timeout`` seconds."""
    from torch.distributed import DistStoreError

    if timeout <= 0:
        return bool(base_store.check([key]))
    try:
        base_store.wait([key], datetime.timedelta(seconds=timeout))
    except DistStoreError:
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
        for rec in rstore.fault_records(store)
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
    from torch.distributed import DistStoreError

    states = {t: json.loads(store.get(keys.rank_state(t))) for t in candidates}
    joins = {t: keys.join_request(states[t]["initial_rank"]) for t in candidates}
    with contextlib.suppress(DistStoreError):  # some did not come back in time
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
