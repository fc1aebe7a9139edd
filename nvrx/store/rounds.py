"""The round protocol: every key of a restart round and of a process generation, who
writes it, in which order. The Wrapper, its monitor process and the supervisor's node
agent call the functions below; none of them spells a key.

Generations and rounds
----------------------
A *process generation* is every process of the job started anew (the job's start, a
restart of all processes, a store failover). Its first round ``g`` is the next multiple
of ``GENERATION_STEP`` above the last round the store saw, so no key of an earlier
generation is read again. An in-process restart moves the job from round ``R`` to
``R + 1``. The keys of round ``R`` live under ``nvrx/r<R>/`` (a ``RoundView``); a
generation's two barriers under ``nvrx/g<g>/``. Ranks are named by their rank in the
round, except where a process is meant across rounds (gone ranks, join requests,
admissions, a generation's two barriers): there by its *initial* rank.

The course of one round, as every rank sees it::

    generation g opens ──────────────┐   (its initial barrier, steps 1-2 below)
    iteration barrier of R-1 ────────┤   (DECIDED below)
    admission of a replacement ──────┤   (ADMITTED below)
                                     ▼
                                  STARTED ──── every active rank returned ──► DONE
                                     │          (completion barrier,             (the call
                                     │           INTERRUPTED = "done")            returns)
                      a fault: FAULT_LIST += record, INTERRUPTED = "fault"
                                     ▼
                                INTERRUPTED ── a rank that leaves for good: TERMINATED
                                     │
                      every rank (or a proxy for it) at the iteration barrier
                                     ▼
                                  DECIDED ──── the lowest survivor admits replacements
                                     │         (join → admit, REJOIN): ADMITTED
                                     └──────► round R+1: STARTED

Who writes what
---------------
In this order:

1. ``g<g>/initial``: every process of the generation arrives, and someone for each rank
   gone (``arrive_generation``, ``arrive_for_gone``).
2. ``job_restarts``, ``g<g>/gone`` (the ranks gone at the opening), ``round``: the
   arrival that completes the initial barrier, in this order, after clearing torch's
   ``default_pg/`` keys, before anyone is released (``_open_generation``). With the job's
   secret ``round`` is a sealed list whose highest entry counts (``current_round``).
3. ``r<R>/state/<rank>``: each rank as it starts the round (``publish_rank_state``); for
   a rank that died or left on its way in, under a number nobody took, its monitor or the
   rank itself (``carry_over_death``). With the job's secret a state is sealed
   for its round; one that does not unseal is read as none (``read_rank_state``).
   ``r<R>/started``: each rank as it starts a round after a restart (not a generation's
   first round); the first one counts the restart in ``job_restarts``
   (``commit_round_start``), which with the job's secret is a sealed list, one entry per
   restart (the iteration barrier's last arrival drops and reports forged ones).
4. ``r<R>/faults`` and ``r<R>/interrupted``: a rank that faults, or a monitor, agent or
   peer on its behalf (``record_fault``). With the job's secret both are sealed for their
   round: a record that does not unseal is skipped, an interruption that does not is
   passed over and the next generation (``interrupted/g2``, ...) is written and watched
   (``interrupted_key``). ``r<R>/completed``: an active rank that returned
   (``mark_completed``); a spare waits on it. ``r<R>/completion``: every rank that
   completed; its last arrival sets ``interrupted`` to ``done`` before the release
   (``arrive_completion``). On a fault, each rank's monitor thread raises ``completed``
   and that barrier's release (``wake_completion``), to wake those waiting there. With
   the job's secret every barrier is sealed, and ``completed`` and the releases are
   signals that a forged value does not raise (``nvrx.store.barrier``).
5. ``r<R>/terminated`` and ``r<R>/terminated_flag/<r>``: a rank that leaves for good, or
   a proxy (``register_terminated``, ``proxy_leave``, ``leave_round``). With the job's
   secret each entry of the list is sealed for its round; one that does not unseal is
   skipped (and counted in the decision).
6. ``r<R>/iteration``, ``r<R>/decision``, ``round``: every rank or proxy arrives; the
   last arrival writes the decision and publishes ``R + 1`` before the release
   (``arrive_one``, ``wait_barrier`` and ``decision_of``). With the job's secret the decision is sealed for its round; a
   rank that reads one that does not unseal (overwritten after the release) acts on none
   (``ForgedDecision``).
7. ``admit/<i>/<join id>``, then ``r<R>/rejoin``: the lowest survivor of round R, after the
   decision, admits each replacement that asked, then lists the ranks that came back
   (``admit``). With the job's secret both are sealed, and so is the join request they
   answer: the request and the admission are chains (``join/<i>/g2``, ...) written past
   forged values and read past them; a request that does not unseal, or names a process
   admitted before, admits nobody; a list that does not unseal is acted on by nobody
   (``ForgedDecision``). ``r<R+1>/late_deaths`` and
   ``r<R+1>/late_death_claim/<n>``: the monitor of a rank that the decision kept and that
   died before it started R + 1, or such a rank leaving by itself (``place_in_next_round``).
8. ``g<g>/termination``: every rank as its call ends, and a proxy for a rank that is
   gone; the store's host waits for all (``arrive_one``, ``wait_barrier``).
   A store that a rank hosts then closes: it serves one call, whose only generation is
   0. A rank that does not host it and calls again may find it still open: a store that
   holds that rank's own arrival at this barrier is an earlier call's (``ended_here``),
   and the rank waits for it to close (``await_close``) before it connects again.

At any time: ``join/<i>`` (with the job's secret a chain: ``join/<i>/g2``, ...), a
replacement process (its join id: a random number per request, as pids repeat across
hosts and containers), withdrawn when it gives up (``post_join``,
``withdraw_join``). ``gone/<i>`` and ``gone/all``, the supervisor that
declares a node lost with no spare for it (``leave_round``).

Keys of the user's plug-ins live under a round's prefix too (the rank assignment's
``nvrx_tree/`` and ``nvrx_filter/``): they belong to those plug-ins, not to this protocol.

The job-level keys (``round``, ``job_restarts``, ``gone/``) outlive a store failover
(``FAILOVER_KEYS``); the keys of rounds do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from nvrx.events import failures

from . import barrier, errors, rank_lists, seal
from .client import delete_prefix, wait_span
from .keys import ROOT
from .sealed_keys import MAX_GENERATIONS

log = logging.getLogger(__name__)

GENERATION_STEP = 100

# -- keys --------------------------------------------------------------------------------
#: Round the job is in now (int; with the job's secret a sealed list, see ``current_round``).
CURRENT_ROUND = ROOT + "round"
#: Restarts of the job so far, in-process and process restarts together (counter).
JOB_RESTARTS = ROOT + "job_restarts"
#: Torch's own keys written through the env:// rendezvous (``init_process_group``).
TORCH_DEFAULT_PG_PREFIX = "default_pg/"
#: Everything about ranks that will not come back.
GONE_PREFIX = ROOT + "gone/"
#: Append-only ``"r,"`` list of the initial ranks marked gone.
GONE_LIST = GONE_PREFIX + "all"
#: A key no one sets: a wait on it ends only when the store closes (``await_close``).
NEVER_SET = ROOT + "never_set"
#: The job-level keys a store failover carries over to the next store.
FAILOVER_KEYS = (CURRENT_ROUND, JOB_RESTARTS, GONE_PREFIX)

# names inside one round's prefix
INTERRUPTED = "interrupted"  # "fault" when any rank faults, "done" when the round completed
FAULT_LIST = "faults"  # append-only ``failures.FaultRecord``s: a JSON line or a sealed entry each
TERMINATED = "terminated"  # append-only list of the round's ranks that left the job
DECISION = "decision"  # JSON written by the last arrival at the iteration barrier
REJOIN = "rejoin"  # JSON: ranks whose replacement process rejoined (written by the round's leader)
COMPLETED = "completed"  # an active rank returned (or a fault): spares stop waiting
STARTED = "started"  # counter: ranks that started the round
LATE_DEATHS = "late_deaths"  # counter: ranks counted in the round that died before starting it
ITERATION_BARRIER = "iteration"
COMPLETION_BARRIER = "completion"
#: Value of ``INTERRUPTED`` when a round completed without a fault.
DONE = "done"


def round_prefix(round_: int) -> str:
    """Prefix of every key of restart round ``round_``."""
    if round_ < 0:
        raise ValueError(f"round must be >= 0, got {round_}")
    return f"{ROOT}r{round_}/"


def initial_barrier(generation: int) -> str:
    """Name of the initial barrier of ``generation`` (its first round's number)."""
    return f"{ROOT}g{generation}/initial"


def termination_barrier(generation: int) -> str:
    """Name of the barrier every rank of ``generation`` passes as its call ends."""
    return f"{ROOT}g{generation}/termination"


def _gone_record(generation: int) -> str:
    return f"{ROOT}g{generation}/gone"


def join_request(initial_rank: int) -> str:
    """Set by a replacement process that wants to rejoin the job (value: its join id, ``new_join_id``)."""
    return f"{ROOT}join/{initial_rank}"


def admission(initial_rank: int, join_id: int) -> str:
    """Set by the job for an admitted replacement process (value: JSON ``Admission``)."""
    return f"{ROOT}admit/{initial_rank}/{join_id}"


def rank_gone(initial_rank: int) -> str:
    """Set when the process of ``initial_rank`` will not come back."""
    return f"{GONE_PREFIX}{initial_rank}"


def rank_state(rank: int) -> str:
    """JSON state of ``rank`` at the start of the round (read for a replacement of it)."""
    return f"state/{rank}"


def late_death_claim(rank: int) -> str:
    """Counter by which the monitor of one rank that died before starting the round takes
    ``rank``, a number of the round that no rank published its state under."""
    return f"late_death_claim/{rank}"


def terminated_flag(rank: int) -> str:
    """Counter bumped by each registration of ``rank`` as terminated in the round: the
    first writes its entry; with the job's secret a later one writes it too unless a valid
    entry stands (a flag set ahead by a client without the secret keeps no end out)."""
    return f"terminated_flag/{rank}"


#: Every key name and key function above: code outside the store layer calls the
#: protocol's functions instead (``tests/unit/test_round_protocol.py``).
KEY_NAMES = frozenset(
    {
        "CURRENT_ROUND", "JOB_RESTARTS", "TORCH_DEFAULT_PG_PREFIX", "GONE_PREFIX", "GONE_LIST",
        "INTERRUPTED", "FAULT_LIST", "TERMINATED", "DECISION", "REJOIN", "COMPLETED",
        "STARTED", "LATE_DEATHS", "ITERATION_BARRIER", "COMPLETION_BARRIER", "NEVER_SET",
        "round_prefix", "initial_barrier", "termination_barrier", "join_request", "admission", "rank_gone",
        "rank_state", "late_death_claim", "terminated_flag",
    }
)  # fmt: skip


# -- counters of the job -----------------------------------------------------------------
def _read_int(store: Any, key: str) -> int | None:
    if not store.check([key]):
        return None
    return int(store.get(key))


# The round the job is in. With the job's secret a sealed list, read as the highest entry
# that unseals: rounds only grow within a run, so an entry copied again changes nothing,
# and a forged one (a low round, from which a new generation would number its rounds into
# the keys of an earlier one; a value that is no number) is skipped. A publication
# replaces the list it read by its own entry (forged entries go with it), or appends its
# entry when the list changed meanwhile. Without a secret, a plain number.
def current_round(store: Any) -> int | None:
    """The round the job is in, or None when no round started yet."""
    sealer = seal.job_sealer()
    if sealer is None:
        return _read_int(store, CURRENT_ROUND)
    if not store.check([CURRENT_ROUND]):
        return None
    entries = sealer.entries(CURRENT_ROUND, seal.text_of(store.get(CURRENT_ROUND)))
    published = [int(e) for e in entries.valid if e.isdigit()]
    return max(published) if published else None


def publish_round(store: Any, round_: int) -> None:
    """Record that the job is in ``round_`` now."""
    sealer = seal.job_sealer()
    if sealer is None:
        store.set(CURRENT_ROUND, str(int(round_)))
        return
    entry = sealer.entry(CURRENT_ROUND, str(int(round_)))
    read = store.get(CURRENT_ROUND) if store.check([CURRENT_ROUND]) else b""
    if bytes(store.compare_set(CURRENT_ROUND, read, entry)) != entry.encode():
        store.append(CURRENT_ROUND, entry)


def generation_base(store: Any, *, step: int = GENERATION_STEP) -> int:
    """First round of a new process generation (``step`` by keyword only).

    0 for a fresh store; otherwise the next multiple of ``step`` above the last
    published round (a restarted job, or a second wrapped call, never reuses a
    key space). All processes of a generation read the same value because the
    round is published only after the initial barrier, which every one of them
    must pass first.
    """
    return generation_after(current_round(store), step=step)


def generation_after(last: int | None, *, step: int = GENERATION_STEP) -> int:
    """First round of the generation that opens after round ``last`` (0 after none)."""
    return 0 if last is None else (last // step + 1) * step


# The job's restart count: one more as a round starts after an in-process restart, and as a
# later process generation opens. With the job's secret it is a sealed list, one entry per
# restart naming the round or generation it began, counted as the distinct entries that
# unseal (a copied entry counts once, a forged one never: a client could otherwise spend
# the Wrapper's ``max_iterations`` and stop the job); without one, a counter.
def count_job_restart(store: Any, began: str = "") -> int:
    """Count the restart that began ``began`` (a round or generation, as ``r7`` or ``g100``:
    the same restart counted twice counts once; none given: a restart of its own); returns
    the new total."""
    sealer = seal.job_sealer()
    if sealer is None:
        if began and int(store.add(f"{JOB_RESTARTS}/{began}", 1)) != 1:
            return job_restarts(store)  # counted before
        return int(store.add(JOB_RESTARTS, 1))
    _append_restart(store, sealer, began or f"x{secrets.token_hex(8)}")
    return job_restarts(store)


def _append_restart(store: Any, sealer: seal.Sealer, began: str) -> None:
    store.append(JOB_RESTARTS, sealer.entry(JOB_RESTARTS, began))


def job_restarts(store: Any) -> int:
    """Job restarts counted so far (in-process and process restarts)."""
    sealer = seal.job_sealer()
    if sealer is None:
        return int(store.add(JOB_RESTARTS, 0))
    if not store.check([JOB_RESTARTS]):
        return 0
    return len(set(sealer.entries(JOB_RESTARTS, seal.text_of(store.get(JOB_RESTARTS))).valid))


def _restarts_without_forged(store: Any) -> tuple[int, int, int]:
    """(restarts, forged entries, their bytes): the count, and the entries that did not
    unseal, which are dropped from the list (unless an entry came meanwhile) so that the
    decision that found them is the only one to count them."""
    sealer = seal.job_sealer()
    if sealer is None or not store.check([JOB_RESTARTS]):
        return job_restarts(store), 0, 0
    raw = store.get(JOB_RESTARTS)  # compared as read: a forged value need not be UTF-8
    entries = sealer.entries(JOB_RESTARTS, seal.text_of(raw))
    valid = list(dict.fromkeys(entries.valid))
    if entries.invalid:
        kept = "".join(sealer.entry(JOB_RESTARTS, began) for began in valid)
        store.compare_set(JOB_RESTARTS, raw, kept)
    return len(valid), entries.invalid, entries.invalid_bytes


# -- the view of one round ---------------------------------------------------------------
class RoundView:
    """The keys of one restart round, on any store client (torch's or ``nvrx.store.wire``):
    every key under the round's prefix, joined as torch's ``PrefixStore`` joins them."""

    def __init__(self, iteration: int, base_store: Any) -> None:
        self.iteration = iteration
        self.base_store = base_store
        self.prefix = round_prefix(iteration).rstrip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    @property
    def timeout(self) -> timedelta:
        return self.base_store.timeout

    def set(self, key: str, value: str | bytes) -> None:
        self.base_store.set(self._key(key), value)

    def append(self, key: str, value: str | bytes) -> None:
        self.base_store.append(self._key(key), value)

    def add(self, key: str, amount: int) -> int:
        return int(self.base_store.add(self._key(key), amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.base_store.compare_set(self._key(key), expected, desired)

    def check(self, names: Iterable[str]) -> bool:
        return bool(self.base_store.check([self._key(k) for k in names]))

    def delete_key(self, key: str) -> bool:
        return bool(self.base_store.delete_key(self._key(key)))

    def get(self, key: str) -> bytes:
        return self.base_store.get(self._key(key))

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        return self.base_store.multi_get([self._key(k) for k in names])

    def multi_set(self, names: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.base_store.multi_set([self._key(k) for k in names], list(values))

    def wait(self, names: Iterable[str], timeout: timedelta | None = None) -> None:
        names = [self._key(k) for k in names]
        if timeout is None:
            self.base_store.wait(names)
        else:
            self.base_store.wait(names, timeout)


def round_store(base: Any, round_: int) -> RoundView:
    """The store view of one restart round."""
    return RoundView(round_, base)


# -- sealed values ------------------------------------------------------------------------
# With the job's secret (``seal.job_sealer``: processes a supervisor started), the values
# that steer the Wrapper are sealed for their full key; without one they are plain.
def _sealed(key: str, payload: str) -> str:
    sealer = seal.job_sealer()
    return payload if sealer is None else sealer.seal(key, payload)


def _unsealed(key: str, raw: bytes | str) -> str | None:
    """The payload of ``raw`` read at ``key``; None when it does not unseal."""
    sealer = seal.job_sealer()
    return seal.text_of(raw) if sealer is None else sealer.unseal(key, seal.text_of(raw))


#: Told of a forged value a process passed over (its full key, its length in bytes).
OnForged = Callable[[str, int], None]


def _sealing(store: Any, on_forged: OnForged | None = None) -> barrier.Sealing | None:
    """How the barriers and signals of ``store`` (a round's view or the base store) are
    sealed; None without the job's secret."""
    sealer = seal.job_sealer()
    if sealer is None:
        return None
    return barrier.Sealing(sealer, lambda key: _round_key(store, key), on_forged)


# -- gone ranks --------------------------------------------------------------------------
# Ranks whose node was lost with no spare to take it over. Survivors deciding whose
# replacement to wait for look at one rank's flag; a new generation reads the whole list.
# Both are sealed: a forged one would leave a healthy rank out of the job.
def mark_gone(store: Any, initial_ranks: Iterable[int]) -> None:
    """Record that ``initial_ranks`` are gone for the rest of this run of the job."""
    sealer = seal.job_sealer()
    for rank in initial_ranks:
        store.set(rank_gone(rank), _sealed(rank_gone(rank), "1"))
        if sealer is None:
            rank_lists.add(store, GONE_LIST, rank)
        else:
            store.append(GONE_LIST, sealer.entry(GONE_LIST, str(int(rank))))


def is_gone(store: Any, initial_rank: int) -> bool:
    """Whether ``initial_rank`` was marked gone."""
    key = rank_gone(initial_rank)
    return bool(store.check([key])) and _unsealed(key, store.get(key)) is not None


def all_gone(store: Any) -> set[int]:
    """Every initial rank marked gone so far."""
    sealer = seal.job_sealer()
    if sealer is None:
        return rank_lists.read(store, GONE_LIST)
    if not store.check([GONE_LIST]):
        return set()
    entries = sealer.entries(GONE_LIST, seal.text_of(store.get(GONE_LIST)))
    return {int(r) for r in entries.valid if r.isdigit()}


def gone_in(store: Any, world_size: int) -> set[int]:
    """The initial ranks below ``world_size`` marked gone so far."""
    return {r for r in all_gone(store) if 0 <= r < world_size}


# -- a generation: its initial and termination barriers ----------------------------------
# Ranks marked gone never come, so someone arrives for them: every rank of the generation
# for the ones gone when it starts, and the supervisor that marks a rank gone for the
# generation that is opening (or the next one). Any arrival may be the completing one,
# so each carries the same opening.
def clear_torch_keys(store: Any) -> int:
    """Delete torch's rendezvous keys left by an earlier round."""
    try:
        return delete_prefix(store, TORCH_DEFAULT_PG_PREFIX)
    except Exception as exc:  # a custom store without list_keys: keys stay, torch re-sets them
        log.debug("could not clear torch rendezvous keys: %r", exc)
        return 0


def _open_generation(store: Any, generation: int, world_size: int) -> None:
    clear_torch_keys(store)
    if generation > 0:
        count_job_restart(store, f"g{generation}")
    key = _gone_record(generation)
    store.set(key, _sealed(key, json.dumps(sorted(gone_in(store, world_size)))))
    publish_round(store, generation)


def arrive_generation(
    store: Any, generation: int, rank: int, world_size: int, on_forged: OnForged | None = None
) -> bool:
    """Register ``rank`` (its own arrival, or one for a rank that will not come) at the
    initial barrier of ``generation``; True when it completed and opened the generation.
    With the job's secret the barrier is sealed (``on_forged``: told of a forged value
    this arrival replaced)."""
    return arrive_one(store, "initial", generation, rank, world_size, on_forged)


def arrive_for_gone(
    store: Any,
    generation: int,
    world_size: int,
    ranks: Iterable[int] | None = None,
    on_forged: OnForged | None = None,
) -> None:
    """Arrive for ``ranks`` (default: every rank marked gone) at ``generation``'s initial barrier."""
    for rank in sorted(gone_in(store, world_size) if ranks is None else ranks):
        if 0 <= rank < world_size:
            arrive_generation(store, generation, rank, world_size, on_forged)


def generation_of(store: Any, round_: int) -> int:
    """The generation ``round_`` belongs to (its first round), as opened in ``store``.

    Generations start at multiples of ``GENERATION_STEP`` but may run more rounds than
    that: the next one starts above the last round published. So it is the highest
    multiple at or below ``round_`` that opened in this store (none for a round restored
    after a store failover: then the multiple at or below it, whose record is missing).
    """
    first = round_ - round_ % GENERATION_STEP
    generation = first
    while generation >= 0:
        key = _gone_record(generation)
        if store.check([key]) and _unsealed(key, store.get(key)) is not None:
            return generation
        generation -= GENERATION_STEP
    return first


def gone_at_start(store: Any, generation: int) -> set[int]:
    """The ranks that were gone when ``generation`` opened; empty when it did not open in
    this store (a round restored after a store failover)."""
    key = _gone_record(generation)
    if not store.check([key]):
        return set()
    record = _unsealed(key, store.get(key))
    return set() if record is None else {int(r) for r in json.loads(record)}


def generation_opened(store: Any, generation: int) -> bool:
    """Whether the initial barrier of ``generation`` released."""
    return barrier.is_released(store, initial_barrier(generation), _sealing(store))


def ended_here(store: Any, initial_rank: int) -> bool:
    """Whether ``initial_rank`` ended a call in ``store``: it arrived at the termination
    barrier of generation 0, the only generation of a store that a rank hosts."""
    return barrier.has_arrived(store, termination_barrier(0), initial_rank, _sealing(store))


def await_close(store: Any, timeout: float) -> bool:
    """True once ``store`` closed; False when it is still open after ``timeout``."""
    try:
        store.wait([NEVER_SET], wait_span(timeout))
    except errors.unreachable():
        return True
    except errors.timeouts():
        return False
    return False  # someone set it: the store is open


# -- one round: start, faults, completion ------------------------------------------------
#: The fields of a rank's published state that a replacement of it needs.
RANK_STATE_FIELDS = (
    "rank", "world_size", "active_rank", "active_world_size", "initial_rank",
    "initial_world_size", "mode",
)  # fmt: skip


def publish_rank_state(store: Any, rank: int, state: Any) -> None:
    """A rank starts the round: the ``RANK_STATE_FIELDS`` of its ``state`` (an object with
    those attributes; an enum by its name), for a replacement of it and for the monitor of
    a rank that dies before starting it (counted once its state is there)."""
    fields = {k: getattr(state, k) for k in RANK_STATE_FIELDS}
    fields.update({k: v.name for k, v in fields.items() if isinstance(v, enum.Enum)})
    _set_rank_state(store, rank, fields)


def _set_rank_state(store: Any, rank: int, fields: dict[str, Any]) -> None:
    """Write ``rank``'s state in ``store``'s round, sealed for it with the job's secret."""
    key = rank_state(rank)
    store.set(key, _sealed(_round_key(store, key), json.dumps(fields)))


def read_rank_state(store: Any, rank: int) -> dict[str, Any] | None:
    """``rank``'s state in ``store``'s round; None when none is published there, or the one
    there does not unseal (a client without the job's secret could otherwise have a lost
    node's ranks, or a silent one, taken for a healthy rank's, or hand a replacement a
    state of its own making)."""
    key = rank_state(rank)
    if not store.check([key]):
        return None
    payload = _unsealed(_round_key(store, key), store.get(key))
    if payload is None:
        log.warning("round %s: the state of rank %d has no valid seal: ignored",
                    getattr(store, "iteration", "?"), rank)  # fmt: skip
        return None
    return dict(json.loads(payload))


def commit_round_start(store: Any, base: Any, restarts: int) -> None:
    """The first rank to start a round after a restart counts it, up to ``restarts`` (the
    count its decision gave)."""
    if int(store.add(STARTED, 1)) != 1 or job_restarts(base) >= restarts:
        return
    sealer = seal.job_sealer()
    if sealer is None:
        base.set(JOB_RESTARTS, str(int(restarts)))
    else:  # no read back: the total is not needed here
        _append_restart(base, sealer, f"r{store.iteration}")


def wake_completion(store: Any) -> None:
    """Wake the ranks of the round waiting to complete (at the completion barrier, or a
    spare for ``COMPLETED``): a rank's monitor thread, as it wakes on an interruption. They
    read the interruption next. Not reported: every rank's monitor does it."""
    sealing = _sealing(store)
    barrier.signal(store, barrier.release_key(COMPLETION_BARRIER), sealing, "interrupted")
    barrier.signal(store, COMPLETED, sealing, "interrupted")


def interrupted_key(generation: int) -> str:
    """Generation ``generation`` (from 1) of the round's interruption: ``INTERRUPTED``,
    then ``INTERRUPTED/g2``, ... Without a secret only the first is ever written; with one,
    a value that does not unseal there sends writers and watchers to the next."""
    return INTERRUPTED if generation == 1 else f"{INTERRUPTED}/g{generation}"


def _interruption_key(store: Any, generation: int) -> str:
    """The full key of ``generation`` of ``store``'s round's interruption, which its seal
    binds to. The Wrapper's store and the monitor threads' ``RoundView`` know their round;
    a seal for a store that does not would bind to no round, and nobody could read it."""
    if getattr(store, "iteration", None) is None and seal.job_sealer() is not None:
        raise TypeError(f"{type(store).__name__} is no view of one round (no 'iteration')")
    return _round_key(store, interrupted_key(generation))


@dataclasses.dataclass
class Interruption:
    """One generation of a round's interruption as read (``value`` None: it did not unseal)."""

    generation: int
    value: str | None  # "fault", "done", ...; None when rejected
    key: str  # the full key, round prefix included
    size: int  # bytes of the value read


def read_interruption(store: Any, generation: int) -> Interruption:
    """The value of ``generation`` of the round's interruption, which is set: unsealed with
    the job's secret when it has one (``seal.job_sealer``); ``value`` None when it does not
    unseal (forged, or replayed from another round or run)."""
    raw = store.get(interrupted_key(generation))
    return _interruption_of(generation, _interruption_key(store, generation), raw)


def _interruption_of(generation: int, key: str, raw: bytes | str) -> Interruption:
    return Interruption(generation, _unsealed(key, raw), key, len(raw))


def interruption(store: Any) -> str | None:
    """The round's interruption if it was interrupted (the first generation that unseals),
    else None."""
    for generation in range(1, MAX_GENERATIONS + 1):
        if not store.check([interrupted_key(generation)]):
            return None
        found = read_interruption(store, generation)
        if found.value is not None:
            return found.value
    return None


@dataclasses.dataclass(frozen=True)
class CheckedRecords:
    """A round's fault records that can be trusted, and what was skipped for a seal that did
    not verify."""

    records: list[failures.FaultRecord]
    forged: int = 0  # entries that did not unseal
    forged_bytes: int = 0


def append_fault(store: Any, record: failures.FaultRecord) -> None:
    """Add ``record`` to the round's fault records without interrupting it (a rank's exit):
    one line of JSON, or, when the job has a secret (``seal.job_sealer``), one entry sealed
    for this round's list."""
    sealer = seal.job_sealer()
    if sealer is None:
        store.append(FAULT_LIST, record.to_json() + "\n")
    else:
        store.append(FAULT_LIST, sealer.entry(fault_list_key(store), record.to_json()))


def record_fault(store: Any, record: failures.FaultRecord) -> bool:
    """Record a fault in the round and interrupt it; False when the round had completed already."""
    append_fault(store, record)
    return interrupt(store, "fault")


def interrupt(store: Any, value: str) -> bool:
    """Interrupt the round with ``value`` unless it was interrupted; True when ``value`` (or
    a fault) holds now. The first generation of ``interrupted_key`` that is unset or holds
    a value that unseals decides; one holding anything else is passed over."""
    for generation in range(1, MAX_GENERATIONS + 1):
        key, sealed_for = interrupted_key(generation), _interruption_key(store, generation)
        current = store.compare_set(key, "", _sealed(sealed_for, value))
        # The key never changes once set, so writing its value again is safe, and a ``set``
        # wakes the monitor threads waiting on it on every server: torch's legacy TCPStore
        # backend (``use_libuv=False``) answers a ``compare_set`` without waking any waiter.
        store.set(key, current)
        held = _interruption_of(generation, sealed_for, current).value
        if held is not None:
            return held != DONE or value == DONE
    log.error("could not interrupt the round: every generation holds a forged value")
    return value != DONE


def completed(store: Any) -> bool:
    """Whether the round ended without a fault (its interruption is ``done``)."""
    return interruption(store) == DONE


def fault_records(store: Any) -> list[failures.FaultRecord]:
    """The round's fault records, in the order the store received them."""
    return checked_fault_records(store).records


def checked_fault_records(store: Any) -> CheckedRecords:
    """The round's fault records that can be trusted, and how many entries were not (a
    seal that did not verify: appended by a client without the job's secret, or copied
    from another round or run). Unreadable lines are logged and skipped."""
    sealer = seal.job_sealer()
    if not store.check([FAULT_LIST]):
        return CheckedRecords([])
    text = seal.text_of(store.get(FAULT_LIST))
    if sealer is None:
        lines, forged, forged_bytes = text.splitlines(), 0, 0
    else:
        sealed = sealer.entries(fault_list_key(store), text)
        lines, forged, forged_bytes = list(sealed.valid), sealed.invalid, sealed.invalid_bytes
    records = []
    for line in filter(str.strip, lines):
        try:
            records.append(failures.FaultRecord.from_json(line))
        except (ValueError, TypeError) as exc:
            log.warning("skipping an unreadable fault record at %s: %s", fault_list_key(store), exc)
    return CheckedRecords(records, forged, forged_bytes)


def fault_list_key(store: Any) -> str:
    """The full name of the round's fault list, which its records are sealed for, so that
    no record counts in another round (a view of a round, ``RoundView`` or the Wrapper's
    ``PrefixStore``, knows its ``iteration``)."""
    return _round_key(store, FAULT_LIST)


@dataclasses.dataclass(frozen=True)
class Forged:
    """Entries of one list that did not unseal, as a restart found them."""

    key: str  # the list's full name
    what: str  # what its entries are
    entries: int
    value_bytes: int


def forged_at_restart(
    store: Any, checked: CheckedRecords, decision: dict[str, Any]
) -> list[Forged]:
    """The forged entries a round's restart found: in its fault list (``checked``, as read),
    in its terminated list and in the job's restart count (both counted by the decision's
    last arrival); one per list that had any."""
    forged_terminated = decision.get("forged_terminated", (0, 0))
    forged_restarts = decision.get("forged_restarts", (0, 0))
    found = (
        Forged(fault_list_key(store), "fault records", checked.forged, checked.forged_bytes),
        Forged(terminated_list_key(store), "terminated ranks", *forged_terminated),
        Forged(JOB_RESTARTS, "job restarts", *forged_restarts),
    )
    return [f for f in found if f.entries]


def terminated_list_key(store: Any) -> str:
    """The full name of the round's terminated list, which its entries are sealed for."""
    return _round_key(store, TERMINATED)


def _round_key(store: Any, key: str) -> str:
    """``key`` of ``store``'s round with the round's prefix, for a view of a round that
    knows its ``iteration``; ``key`` itself otherwise."""
    iteration = getattr(store, "iteration", None)
    return key if iteration is None else round_prefix(int(iteration)) + key


def mark_completed(store: Any, on_forged: OnForged | None = None) -> None:
    """An active rank returned from its function: the round's spares stop waiting. With the
    job's secret a signal (``barrier.signal``): a forged one wakes no spare."""
    barrier.signal(store, COMPLETED, _sealing(store, on_forged))


# -- the barriers a host's agent arrives at for its ranks (``nvrx.node_agent.rank_wire``) --
#: Which: a generation's initial and termination barriers, a round's iteration barrier
#: (``at`` is the generation or the round). The completion barrier is not among them: a
#: fault interrupts it, and each rank's own arrival decides whether it completed.
HOST_BARRIERS = ("initial", "iteration", "termination")


def _host_barrier(
    base: Any, kind: str, at: int, world_size: int
) -> tuple[Any, str, Callable[[], None] | None]:
    """The store view, name and ``before_release`` of barrier ``kind`` of ``at``."""
    if kind == "initial":
        return base, initial_barrier(at), lambda: _open_generation(base, at, world_size)
    if kind == "termination":
        return base, termination_barrier(at), None
    if kind == "iteration":
        store = round_store(base, at)
        return store, ITERATION_BARRIER, lambda: _publish_decision(store, base, world_size)
    raise ValueError(f"no barrier {kind!r}: one of {', '.join(HOST_BARRIERS)}")


def arrive_group(
    base: Any,
    kind: str,
    at: int,
    ranks: Iterable[int],
    world_size: int,
    on_forged: OnForged | None = None,
    closer: str | None = None,
    again: bool = False,
) -> bool:
    """Register ``ranks`` at barrier ``kind`` of ``at`` in one arrival (``barrier.arrive_group``),
    as each would register itself; True when this arrival completed and released it.
    ``on_forged``: told of each forged value it replaced (an arrival's, the release's).
    ``closer``: the arrival's token, the same for each of its tries; ``again``: a try after
    the first (see ``barrier``)."""
    store, name, before_release = _host_barrier(base, kind, at, world_size)
    sealing = _sealing(store, on_forged)
    return barrier.arrive_group(
        store, name, ranks, world_size,
        before_release=before_release, sealing=sealing, closer=closer, again=again,
    )  # fmt: skip


def arrive_one(
    base: Any, kind: str, at: int, rank: int, world_size: int, on_forged: OnForged | None = None
) -> bool:
    """``rank``'s own arrival (or a proxy's) at barrier ``kind`` of ``at``; True when it
    completed and released it."""
    store, name, before_release = _host_barrier(base, kind, at, world_size)
    sealing = _sealing(store, on_forged)
    return barrier.arrive(
        store, name, rank, world_size,
        reentrant=True, before_release=before_release, sealing=sealing, by_keys=True,
    )  # fmt: skip


def await_barrier(base: Any, kind: str, at: int, world_size: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for barrier ``kind`` of ``at`` to release; whether it did."""
    store, name, _ = _host_barrier(base, kind, at, world_size)
    return barrier.await_signal(store, barrier.release_key(name), timeout, _sealing(store))


def wait_barrier(base: Any, kind: str, at: int, world_size: int, timeout: float) -> None:
    """Wait for barrier ``kind`` of ``at`` (``BarrierTimeout`` naming who is missing)."""
    store, name, _ = _host_barrier(base, kind, at, world_size)
    barrier.wait(store, name, world_size, max(timeout, 0.001), sealing=_sealing(store))


def keep_until_terminated(
    base: Any, generation: int, world_size: int, chunk_s: float, moving: Callable[[], bool]
) -> bool:
    """The store host's wait for ``generation``'s termination barrier (arrived at already):
    waits of ``chunk_s``, renewed while ``moving()`` (the job still moves: a host's agent
    beat meanwhile). True once every rank passed it; False once a whole wait passed with
    the job standing still. The others may train on long after the host's rank left, on
    its store."""
    while True:
        try:
            wait_barrier(base, "termination", generation, world_size, chunk_s)
            return True
        except barrier.BarrierTimeout:
            if not moving():
                return False


def wait_completed(store: Any, timeout: float) -> None:
    """A spare waits for an active rank to return (or a fault to restart it first)."""
    if not barrier.await_signal(store, COMPLETED, timeout, _sealing(store)):
        raise errors.StoreTimeout(f"no active rank of the round completed within {timeout:g} s")


def arrive_completion(
    store: Any, rank: int, world_size: int, timeout: float, on_forged: OnForged | None = None
) -> bool:
    """The completion barrier of the round; True when it completed without a fault (a
    fault of any rank before the last arrival interrupts it instead)."""
    sealing = _sealing(store, on_forged)
    barrier.arrive(
        store,
        COMPLETION_BARRIER,
        rank,
        world_size,
        before_release=lambda: interrupt(store, DONE),
        sealing=sealing,
    )
    barrier.wait(store, COMPLETION_BARRIER, world_size, timeout, range(world_size), sealing=sealing)
    return interruption(store) == DONE  # set by now: the release, or a fault


def register_terminated(store: Any, rank: int) -> bool:
    """Register ``rank`` (its rank in this round) as terminated; True if this call wrote its
    entry. Readers take the list as a set, so two registrations at once (a rank and its
    monitor) may both write one.

    With the job's secret the entry is sealed for the round's list: a flag that a client
    without the secret set ahead does not keep the real entry out."""
    first = int(store.add(terminated_flag(rank), 1)) == 1
    if not first and rank in terminated_ranks(store):
        return False
    # first, or after a first registrant that died between its count and its entry
    sealer = seal.job_sealer()
    if sealer is None:
        store.append(TERMINATED, f"{rank},")
    else:
        store.append(TERMINATED, sealer.entry(terminated_list_key(store), str(rank)))
    return True


@dataclasses.dataclass(frozen=True)
class Terminated:
    """The round's terminated ranks as read, and what was skipped there (no valid seal)."""

    ranks: set[int]
    forged: int = 0
    forged_bytes: int = 0


def terminated_ranks(store: Any) -> set[int]:
    """The ranks of the round registered as terminated so far."""
    return checked_terminated(store).ranks


def checked_terminated(store: Any) -> Terminated:
    """The round's terminated ranks that can be trusted: with the job's secret the entries
    sealed for this round's list, the others counted (a client without the secret could
    otherwise make a healthy rank leave at the next restart, or hide a real end)."""
    if not store.check([TERMINATED]):
        return Terminated(set())
    text = seal.text_of(store.get(TERMINATED))
    sealer = seal.job_sealer()
    if sealer is None:
        return Terminated({int(part) for part in text.split(",") if part.strip()})
    entries = sealer.entries(terminated_list_key(store), text)
    ranks = {int(e) for e in entries.valid if e.isdigit()}
    return Terminated(ranks, entries.invalid, entries.invalid_bytes)


# -- the iteration barrier and its decision ----------------------------------------------
def _publish_decision(store: Any, base: Any, world_size: int) -> None:
    """Run by the last arrival at a round's iteration barrier, before anyone is released.

    ``world_size`` is in the decision for a replacement process: a round whose
    ranks all terminated has nobody left to take it back (``nobody_to_admit``).
    """
    # The restart is counted when the next round starts (commit_round_start), so
    # a round that every rank leaves (RestartAbort everywhere) counts nothing.
    terminated = checked_terminated(store)
    restarts, forged, forged_bytes = _restarts_without_forged(base)
    decision = {
        "terminated": sorted(terminated.ranks),
        "job_restarts": restarts + 1,
        "world_size": world_size,
    }
    if terminated.forged:  # the round's lowest rank that goes on tells it
        decision["forged_terminated"] = [terminated.forged, terminated.forged_bytes]
    if forged:
        decision["forged_restarts"] = [forged, forged_bytes]
    round_ = getattr(store, "iteration", None)
    if round_ is not None:
        _clear_stale_keys(base, round_)
        publish_round(base, round_ + 1)
    store.set(DECISION, _sealed(_round_key(store, DECISION), json.dumps(decision)))


class ForgedDecision(RuntimeError):
    """A round's decision that does not unseal: a client without the job's secret
    overwrote the one the last arrival wrote, which is lost; no rank may act on it."""


def _decided(store: Any, key: str, what: str) -> Any:
    """The JSON value at the round's ``key``, which is set (``ForgedDecision``, naming it
    ``what``, when it does not unseal)."""
    full = _round_key(store, key)
    raw = store.get(key)
    payload = _unsealed(full, raw)
    if payload is None:
        raise ForgedDecision(
            f"{what} at {full} ({len(raw)} bytes) has no valid seal: not written by this "
            "job's processes in this round"
        )
    return json.loads(payload)


def decision_of(store: Any) -> dict[str, Any]:
    """The round's decision, which is set (``ForgedDecision`` when it does not unseal)."""
    return dict(_decided(store, DECISION, "the decision"))


def _clear_stale_keys(base: Any, round_: int) -> None:
    """Delete torch's rendezvous keys (every rank left its groups) and rounds older than the previous one."""
    stale = tuple(round_prefix(r) for r in range(max(0, round_ - 3), max(0, round_ - 1)))
    try:
        for key in base.list_keys():
            if key.startswith(TORCH_DEFAULT_PG_PREFIX) or (stale and key.startswith(stale)):
                base.delete_key(key)
    except Exception as exc:  # a store without list_keys: nothing to collect
        log.debug("could not clear stale keys: %r", exc)


def proxy_leave(
    store: Any, base: Any, rank: int, world_size: int, record: failures.FaultRecord | None
) -> None:
    """Everything peers need when ``rank`` leaves the round for good (it died or was killed)."""
    if record is not None:
        append_fault(store, record)
    register_terminated(store, rank)
    interrupt(store, "fault")
    arrive_one(base, "iteration", store.iteration, rank, world_size)


def kept_for_next(store: Any) -> int | None:
    """How many ranks a round's decision keeps for the next round (None: it does not say)."""
    decision = decision_of(store)
    if decision.get("world_size") is None:  # a decision of an older version
        return None
    terminated = {int(r) for r in decision["terminated"]}
    terminated -= rejoined(store)  # replacements taken back into the next round
    return int(decision["world_size"]) - len(terminated)


# -- the rejoin of a replacement process -------------------------------------------------
# The replacement posts ``join/<initial rank>`` = its join id and waits for its admission;
# after the iteration barrier the lowest survivor waits for the join requests of the
# terminated ranks, admits each replacement that came and lists them under ``REJOIN``.
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


# With the job's secret a join request and an admission are chains (``join/<i>``,
# ``join/<i>/g2``, ...; the same for an admission): a writer puts its value into the first
# generation not set, so a forged value written ahead neither ends the lowest survivor's
# wait for the real request nor makes a replacement read a forged admission; readers pass
# over what does not unseal. A join request is written past any value (an earlier
# replacement's that was never withdrawn too), and the survivor takes the last valid one.
# A request withdrawn, taken or refused is overwritten by a sealed ``TAKEN``, never
# deleted: a reader stops at the first generation not set, so a hole would hide the
# requests written after it.
_TAKEN = "-"


def _chain_write(base: Any, key: str, payload: str, past_valid: bool) -> tuple[str | None, list]:
    """Put ``payload``, sealed, into the first generation of the chain at ``key`` not set;
    (the key written, or None where a value that unseals stood first and not
    ``past_valid``, or every generation is taken (logged); the forged values passed over,
    as (key, bytes))."""
    sealer = seal.job_sealer()
    forged: list[tuple[str, int]] = []
    for generation in range(1, MAX_GENERATIONS + 1):
        at = barrier.signal_key(key, generation)
        value = sealer.seal(at, payload).encode()  # type: ignore[union-attr]
        held = bytes(base.compare_set(at, "", value))
        if held == value:
            base.set(at, value)  # a compare_set wakes no waiter on torch's legacy backend
            return at, forged
        if sealer.unseal(at, seal.text_of(held)) is None:  # type: ignore[union-attr]
            forged.append((at, len(held)))
        elif not past_valid:
            return None, forged
    log.error("could not write %s: its %d generations are taken", key, MAX_GENERATIONS)
    return None, forged


def new_join_id() -> int:
    """A number that names one join request of one process: not its pid, which a
    replacement on another host or in another container may share with a process admitted
    before (its admission would be taken for this one's, and this one refused)."""
    return int.from_bytes(os.urandom(7), "big")


def post_join(base: Any, initial_rank: int, join_id: int) -> str | None:
    """Replacement side: ask to be taken back into the running job; the key written (to
    withdraw; None: none could be). With the job's secret the join id is sealed, in the first
    free generation."""
    key = join_request(initial_rank)
    if seal.job_sealer() is None:
        base.set(key, str(join_id))
        return key
    return _chain_write(base, key, str(join_id), past_valid=True)[0]


def await_admission(base: Any, initial_rank: int, join_id: int, timeout: float) -> Admission | None:
    """Replacement side: the admission of ``join_id``, once written within ``timeout`` seconds;
    one that does not unseal is passed over (the survivor writes past it)."""
    key = admission(initial_rank, join_id)
    deadline = time.monotonic() + max(timeout, 0.0)
    for generation in range(1, MAX_GENERATIONS + 1):
        at = barrier.signal_key(key, generation)
        left = deadline - time.monotonic()
        if left <= 0:
            if not base.check([at]):
                return None
        else:
            try:
                base.wait([at], wait_span(left))
            except errors.timeouts():
                return None
        raw = base.get(at)
        payload = _unsealed(at, raw)
        if payload is not None:
            return Admission.from_json(payload)
        log.warning("passed over an admission with no valid seal at %s (%d bytes)", at, len(raw))
    return None


def withdraw_join(base: Any, key: str | None) -> None:
    """Replacement side: no longer waiting to be taken back (``key``: the one it posted)."""
    if key is not None:
        _take_out(base, key)


def _take_out(base: Any, key: str) -> None:
    """A join request read or withdrawn: deleted without the job's secret, else ``TAKEN``."""
    sealer = seal.job_sealer()
    if sealer is None:
        base.delete_key(key)
    else:
        base.set(key, sealer.seal(key, _TAKEN))


def nobody_to_admit(base: Any) -> str | None:
    """Why no survivor of the job can take a replacement back, or None when one may.

    The job's round completed, or the iteration barrier of the round before it
    found every rank terminated (each left by itself or through its monitor or
    supervisor) or has been registered terminated since, and no rank was taken
    back into this round, so nobody admits. The first round of a process
    generation (its initial barrier released) has no round before it: an earlier
    generation's last decision says nothing about the ranks of this one.
    """
    round_ = current_round(base)
    if round_ is None:
        return "the job has no round"
    if completed(round_store(base, round_)):
        return f"round {round_} completed"
    if generation_opened(base, round_) or round_ == 0:
        return None
    previous = round_store(base, round_ - 1)
    if not previous.check([DECISION]):
        return None
    try:
        decision = decision_of(previous)
        # a survivor that died after the decision is registered in that round too; the
        # ranks taken back then (``REJOIN``) run in this round, whatever that round says
        back = rejoined(previous)
    except ForgedDecision as exc:  # overwritten after the survivors read it: they may admit
        log.warning("cannot tell whether anyone can admit this process: %s", exc)
        return None
    world_size = decision.get("world_size")  # absent in a decision of an older version
    terminated = (set(decision["terminated"]) | terminated_ranks(previous)) - back
    if world_size is not None and set(range(int(world_size))) <= terminated:
        return f"every rank of round {round_ - 1} left it"
    return None


def rejoin_candidates(store: Any, base: Any, terminated: set[int]) -> list[int]:
    """Terminated ranks a replacement may come back for: not those that left by
    ``RestartAbort``, nor those of a lost node that no spare node took over."""
    stopped = {
        rec.rank
        for rec in fault_records(store)
        if rec.kind == "exit" and (rec.exc_type or "").endswith("RestartAbort")
    }
    candidates = []
    for t in sorted(terminated - stopped):
        state = read_rank_state(store, t)
        initial = t if state is None else int(state["initial_rank"])
        if state is not None and not is_gone(base, initial):
            candidates.append(t)
    return candidates


@dataclasses.dataclass(frozen=True)
class Admitted:
    """What the lowest survivor did with the join requests: the ranks taken back, and the
    requests refused (``{key: value bytes}``: no valid seal, or a join id admitted before)."""

    back: list[int]
    refused: dict[str, int] = dataclasses.field(default_factory=dict)


def admit(
    store: Any,
    base: Any,
    candidates: list[int],
    terminated: set[int],
    timeout: float,
    next_round: Admission,
) -> Admitted:
    """Lowest survivor: wait for the replacements of ``candidates``, admit those that came
    (``next_round`` with each one's state), publish who came back.

    A join request that does not unseal, or that names a process admitted before (a
    sealed request copied back), admits nobody: a client without the job's secret could
    otherwise bring a rank back that no process runs."""
    states = {t: read_rank_state(store, t) for t in candidates}
    candidates = [t for t in candidates if states[t] is not None]
    initial = {t: int(states[t]["initial_rank"]) for t in candidates}
    if seal.job_sealer() is None:
        joins = _plain_joins(base, initial, timeout)
    else:
        joins = _sealed_joins(base, initial, time.monotonic() + timeout)
    join_ids = {t: join.join_id for t, join in joins.items() if join.join_id is not None}
    refused = {key: size for join in joins.values() for key, size in join.refused}
    final = sorted(terminated - set(join_ids))
    for t, join_id in list(join_ids.items()):
        for key in joins[t].read:
            _take_out(base, key)
        entry = dataclasses.replace(next_round, state=states[t], terminated=final)
        written, forged = _write_admission(base, admission(initial[t], join_id), entry.to_json())
        refused.update(forged)
        if not written:
            del join_ids[t]
    store.set(REJOIN, _sealed(_round_key(store, REJOIN), json.dumps(sorted(join_ids))))
    return Admitted(sorted(join_ids), refused)


@dataclasses.dataclass
class _Join:
    """A replacement's join request as the lowest survivor read it: the join id to admit (None:
    none), the keys read (deleted once it is admitted) and those refused, with their size."""

    join_id: int | None = None
    read: list[str] = dataclasses.field(default_factory=list)
    refused: list[tuple[str, int]] = dataclasses.field(default_factory=list)


def _plain_joins(base: Any, initial: dict[int, int], timeout: float) -> dict[int, _Join]:
    """Without a secret: one key per request, waited for together."""
    keys = {t: join_request(i) for t, i in initial.items()}
    with contextlib.suppress(*errors.timeouts()):  # some did not come back in time
        base.wait(list(keys.values()), wait_span(timeout))
    joins = {}
    for t, i in initial.items():
        join_id, size = _join_id(base, keys[t], i)
        joins[t] = _Join(join_id, [keys[t]], [(keys[t], size)] if size else [])
    return joins


def _sealed_joins(base: Any, initial: dict[int, int], deadline: float) -> dict[int, _Join]:
    """With the secret: each request's chain, up to ``deadline``; the last valid request of
    a process not admitted before is the one to admit."""
    joins = {}
    for t, i in initial.items():
        join = joins[t] = _Join()
        key = join_request(i)
        for generation in range(1, MAX_GENERATIONS + 1):
            at = barrier.signal_key(key, generation)
            if not _arrived_by(base, at, deadline if join.join_id is None else 0.0):
                break
            join_id, size = _join_id(base, at, i)
            join.read.append(at)
            if join_id is not None:
                join.join_id = join_id
            elif size:
                join.refused.append((at, size))
        for refused, _ in join.refused:
            _take_out(base, refused)
    return joins


def _arrived_by(base: Any, key: str, deadline: float) -> bool:
    """Whether ``key`` is set, waiting for it until ``deadline`` (monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return bool(base.check([key]))
    try:
        base.wait([key], wait_span(left))
    except errors.timeouts():
        return False
    return True


def _write_admission(base: Any, key: str, payload: str) -> tuple[bool, dict[str, int]]:
    """Admit at ``key`` (past forged values with the secret); whether it was written, and
    the forged values passed over."""
    if seal.job_sealer() is None:
        base.set(key, payload)
        return True, {}
    written, forged = _chain_write(base, key, payload, past_valid=False)
    return written is not None, dict(forged)


def _join_id(base: Any, key: str, initial_rank: int) -> tuple[int | None, int]:
    """(join_id, 0) for a join request to admit; (None, its size) for one refused (no valid
    seal, or its process was admitted before); (None, 0) where none is posted."""
    if not base.check([key]):
        return None, 0
    raw = base.get(key)
    payload = _unsealed(key, raw)
    if payload == _TAKEN and seal.job_sealer() is not None:
        return None, 0
    if payload is None or not payload.isdigit():
        return None, max(len(raw), 1)
    if barrier.raised(base, admission(initial_rank, int(payload)), _sealing(base)):
        return None, max(len(raw), 1)
    return int(payload), 0


def await_rejoined(store: Any, timeout: float) -> set[int]:
    """Other survivors: the ranks the lowest one took back, once it published them."""
    store.wait([REJOIN], wait_span(timeout))
    return rejoined(store)


def rejoined(store: Any) -> set[int]:
    """The ranks taken back into the round after this one (none until published);
    ``ForgedDecision`` when the list does not unseal (it is part of that decision)."""
    if not store.check([REJOIN]):
        return set()
    return {int(r) for r in _decided(store, REJOIN, "the list of ranks taken back")}


# -- a rank that dies between two rounds -------------------------------------------------
# Round R's iteration barrier releases every rank into R + 1 with one decision. A rank
# that dies after it, before it starts R + 1, is counted in R + 1 by that decision: its
# monitor leaves R + 1 for it under the number whose state nobody published once every
# other rank of R + 1 started it. ``STARTED`` counts those, ``LATE_DEATHS`` the ranks
# that died (or left) so; where several did, each claims one unpublished number
# (``late_death_claim``): R + 1's decision depends on which numbers left, not on who had
# which. The number is only found where R + 1 has as many ranks as R kept: an assignment
# that leaves out ranks R kept makes the dead rank's place unknown, and the monitor leaves
# R instead. The store has no wait for a counter's value: the counters are read once per
# ``every_s``.
def place_in_next_round(
    base: Any,
    round_: int,
    ranks_bound: int,
    wait_s: float,
    every_s: float,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[int, int] | None:
    """(rank, world size) in round ``round_`` + 1 of a rank that round ``round_``'s decision
    kept and that died (or left) before starting it, once every other rank of it started it;
    None after ``wait_s`` without that, where that round's size is not what round ``round_``
    kept, or where every rank it kept died or left so before any started it.
    ``ranks_bound``: no world size exceeds it (the job's initial one); ``meanwhile`` runs
    between two looks (a monitor beats to its node's agent)."""
    store, previous = round_store(base, round_ + 1), round_store(base, round_)
    store.add(LATE_DEATHS, 1)
    try:
        size = _wait_for_the_others(store, previous, ranks_bound, wait_s, every_s, meanwhile)
    except BaseException:  # the wait given up: not counted there (as below)
        with contextlib.suppress(Exception):
            store.add(LATE_DEATHS, -1)
        raise
    if size == 0:  # counted still: the others that died so see it too
        log.warning("round %d: every rank left or died before starting it", round_ + 1)
        return None
    try:  # after the wait: a rejoin may have taken replacements back
        kept = kept_for_next(previous)
    except ForgedDecision as exc:
        log.warning("round %d: %s", round_, exc)
        kept = None
    if size is None or kept != size:
        store.add(LATE_DEATHS, -1)  # not counted there: another such death must not be
        _say_unplaced(round_, size, kept, wait_s)
        return None
    for rank in range(size):
        if store.check([rank_state(rank)]):  # even one that does not unseal: a number in use
            continue
        if int(store.add(late_death_claim(rank), 1)) == 1:
            return rank, size
    log.warning("round %d: no number left unpublished for a rank that died before it", round_ + 1)
    return None


def _say_unplaced(round_: int, size: int | None, kept: int | None, wait_s: float) -> None:
    if size is None:
        log.warning("round %d: its ranks did not all start within %g s", round_ + 1, wait_s)
        return
    log.warning(
        "round %d has %d ranks where round %d kept %s: its rank assignment left "
        "ranks out, so the dead rank's number there is unknown",
        round_ + 1, size, round_, kept,
    )  # fmt: skip


def _wait_for_the_others(
    store: Any,
    previous: Any,
    ranks_bound: int,
    wait_s: float,
    every_s: float,
    meanwhile: Callable[[], None] | None,
) -> int | None:
    """The world size of round ``store`` once its ranks that started and those that died
    before starting it add up to it; 0 where none started and those that died so are as
    many as round ``previous`` kept (read again each time: a rejoin may take replacements
    back meanwhile); None after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    size: int | None = None
    while True:
        started = int(store.add(STARTED, 0))
        if started and size is None:
            size = _world_size(store, ranks_bound)
        late = int(store.add(LATE_DEATHS, 0))
        if size is not None and started + late >= size:
            return size
        kept = None if started else kept_for_next(previous)
        if kept is not None and late >= kept:
            return 0
        if time.monotonic() >= deadline:
            return None
        time.sleep(every_s)
        if meanwhile is not None:
            meanwhile()


def carry_over_death(
    base: Any,
    round_: int,
    rank: int,
    ranks_bound: int,
    wait_s: float,
    every_s: float,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[int, int] | None:
    """A rank that died (or left) after round ``round_``'s decision kept it, before it
    started round ``round_`` + 1: its (rank, world size) there (``place_in_next_round``),
    its state of round ``round_`` published there under it, renumbered (a replacement is
    admitted with it); None where that place is not found, or its state in ``round_``
    cannot be read (none, or none that unseals: it then claims no number there)."""
    state = read_rank_state(round_store(base, round_), rank)
    if state is None:
        log.warning("round %d: rank %d has no state to carry over", round_, rank)
        return None
    place = place_in_next_round(base, round_, ranks_bound, wait_s, every_s, meanwhile)
    if place is None:
        return None
    new_rank, world_size = place
    store = round_store(base, round_ + 1)
    peer = _peer_state(store, world_size) or {}
    active = state.get("active_rank") is not None
    state.update(
        rank=new_rank,
        world_size=world_size,
        active_rank=new_rank if active else None,
        active_world_size=peer.get("active_world_size", state.get("active_world_size")),
    )
    _set_rank_state(store, new_rank, state)
    return place


def _world_size(store: Any, ranks_bound: int) -> int | None:
    """The round's world size, from the first rank state published there."""
    state = _peer_state(store, ranks_bound)
    return None if state is None else int(state["world_size"])


def _peer_state(store: Any, ranks_bound: int) -> dict[str, Any] | None:
    """The first rank state published in the round (numbers below ``ranks_bound``)."""
    for rank in range(ranks_bound):
        state = read_rank_state(store, rank)
        if state is not None:
            return state
    return None


# -- ranks taken out of the round on another party's word --------------------------------
# The ranks of a lost node, and a rank whose monitor went silent: nobody is left to record
# the fault, so the declarer (the supervisor's node agent, or without a supervisor the
# host's beating monitor) does what the rank's monitor would have done. A rank no spare
# will replace is marked gone, and the declarer arrives for it at the initial barrier of
# the generation that opens next. Jobs without the Wrapper have no round: nothing to do.
def leave_round(
    base: Any,
    initial_ranks: list[int],
    initial_world_size: int,
    message: str,
    gone: bool,
    kind: str = "node_lost",
    published: bool = False,
    on_left: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Take ``initial_ranks`` out of the running round (a fault record of ``kind``); what was
    done: the round, the ranks there that left it now, and ``out``, the initial ranks out of
    it now (left now or before). ``published``: only those whose state in the round names
    them (not a rank that waits to be admitted, whose number there is another's).
    ``on_left``: called with each rank there and its initial rank as soon as it left (the
    rest may fail)."""
    if gone:
        mark_gone(base, initial_ranks)
        _arrive_for_gone_next(base, initial_ranks, initial_world_size)
    round_ = current_round(base)
    if round_ is None:
        return {"round": None, "ranks": [], "out": []}
    # ranks left out when the round's generation opened are not in the round
    generation = generation_of(base, round_)
    gone_then = gone_at_start(base, generation)
    in_round = set(initial_ranks) - gone_then
    store = round_store(base, round_)
    left, out = [], []
    renumbered = bool(gone_then) or _renumbered_before(base, generation, round_, initial_world_size)
    for rank, world_size, initial in _round_ranks(
        store, in_round, initial_world_size, published, renumbered
    ):
        out.append(initial)
        if rank in terminated_ranks(store):
            # its own monitor, or an earlier declaration, took it out; arrived for again (it
            # counts once), as one that died between registering and arriving did not
            arrive_one(base, "iteration", store.iteration, rank, world_size)
            continue
        record = failures.FaultRecord(rank=rank, kind=kind, message=message)
        proxy_leave(store, base, rank, world_size, record)
        left.append(rank)
        if on_left is not None:
            on_left(rank, initial)
    log.info("ranks %s of round %s left it: %s", left, round_, message)
    return {"round": round_, "ranks": left, "out": sorted(out)}


def leave_silent(base: Any, initial_rank: int, initial_world_size: int, message: str) -> bool:
    """Take the rank of ``initial_rank`` out of the running round as ``unresponsive``; False
    when it was out already. The round is the job's current one, not the last one the
    silent monitor told of: the rank may have moved on just before its monitor froze. A
    rank not in that round (one waiting to be admitted) is left alone: its initial rank
    may be another process's rank there."""
    left = leave_round(
        base, [initial_rank], initial_world_size, message, False, "unresponsive", published=True
    )
    return bool(left["ranks"])


def _renumbered_before(base: Any, generation: int, round_: int, initial_world_size: int) -> bool:
    """Whether ``round_`` may number its ranks otherwise than they began: a rank left the
    round before it for good, its replacement not taken back (the rank assignment may
    number the others anew), or a state written there shows them numbered so already.
    That round is the last one whose keys are kept (``_clear_stale_keys``), and what
    numbered the ranks anew earlier shows in it."""
    if round_ <= generation:
        return False
    previous = round_store(base, round_ - 1)
    try:  # a rank whose replacement was taken back keeps its number
        ended = terminated_ranks(previous) - rejoined(previous)
    except ForgedDecision:
        return True  # nobody can tell who came back
    if ended:
        return True
    states = (read_rank_state(previous, rank) for rank in range(initial_world_size))
    return any(
        state is not None and _off_initial(state, rank, initial_world_size)
        for rank, state in enumerate(states)
    )


def _off_initial(state: dict[str, Any], rank: int, initial_world_size: int) -> bool:
    """Whether the state written at ``rank`` shows the ranks numbered anew: its process
    began at another rank, or the round has another world size."""
    return (
        int(state.get("initial_rank", -1)) != rank
        or int(state.get("world_size", initial_world_size)) != initial_world_size
    )


def _round_ranks(
    store: Any,
    initial_ranks: set[int],
    initial_world_size: int,
    published: bool = False,
    renumbered: bool = False,
) -> list[tuple[int, int, int]]:
    """(rank in the round, world size of the round, initial rank) of each of ``initial_ranks``
    in the round; ``published``: only of those whose state there names them.

    A rank that has not written its state yet is taken to stand at its initial rank, where
    no state stands (one that does not unseal may hide another rank's), unless the ranks
    may have been numbered anew: ``renumbered`` (ranks gone when the generation opened, or
    the round before shows it: ``_renumbered_before``), or a state written in the round
    shows it (a rank off its initial number, another world size). Its number is then
    another's initial one, a healthy rank's, and it is not found: the others wait for it
    until their barrier's timeout rather than lose a healthy rank."""
    found: dict[int, tuple[int, int]] = {}
    world_size = initial_world_size
    for rank in range(initial_world_size):
        state = read_rank_state(store, rank)
        if state is None:
            continue
        world_size = int(state.get("world_size", world_size))
        initial = int(state.get("initial_rank", -1))
        renumbered = renumbered or _off_initial(state, rank, initial_world_size)
        if initial in initial_ranks:
            found[initial] = (rank, world_size)
    for initial in () if published or renumbered else initial_ranks - set(found):
        if initial < world_size and not store.check([rank_state(initial)]):
            found[initial] = (initial, world_size)
    return sorted((rank, ws, initial) for initial, (rank, ws) in found.items())


def _arrive_for_gone_next(base: Any, initial_ranks: list[int], world_size: int) -> None:
    """Arrive for the gone ranks at the initial barrier of the generation that opens next
    (or is opening now), so the others do not wait there for them."""
    arrive_for_gone(base, generation_base(base), world_size, initial_ranks)
