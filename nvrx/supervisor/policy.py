"""Restart decisions: the job-wide budget and the loop breaker.

The budget counts process restarts of the whole job in the store (one entry of a
sealed list per restart, each spender learning its own entry's place, as from an
atomic ``add``), so a node cannot outspend it by restarting quickly. The
loop breaker stops a job whose local rank fails the same way K times in a row (for
job-wide restarts: when the job does, whichever rank fails first), because such a
failure will not fix itself by restarting.
"""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvrx.events.failures import EXIT, PEER, fault_signature, process_end_signature
from nvrx.events.reader import ProcessKey, iter_file, process_events

from .children import ExitStatus
from .exit_codes import CLEAN_STOP_EXIT, ExitCode


class Decision(enum.StrEnum):
    RESTART = "restart"  # start a replacement for this local rank
    STOP = "stop"  # a rank stopped the whole job (exit 130): no restart
    GIVE_UP = "give_up"  # a failure that restarts will not fix: stop the job with an error
    DONE = "done"  # the child completed; nothing to do


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    signature: str | None = None
    budget_left: int | None = None
    exit_code: int = ExitCode.OK
    #: Of a RESTART: the failure signature in a row after this failure and how often it came
    #: (a collateral failure leaves the streak before it), where the next job-wide decision
    #: starts from.
    streak: tuple[str | None, int] = (None, 0)


def root_cause_line(
    verdict: Verdict,
    rank: int,
    node: int | None,
    job_dir: Path,
    fault: dict[str, object] | None = None,
) -> str:
    """What a stopped job's log ends with: the failure that stopped it, and where to read more.
    ``fault``: the fault event behind it when another rank's (``last_round_fault``)."""
    told: tuple[object, object, object] = (rank, node, socket.gethostname())
    cause = verdict.signature or "no failure signature"
    if fault is not None:
        told = (fault.get("rank"), fault.get("node"), fault.get("host"))
        cause = str(fault.get("signature") or cause)
    where = f"rank {told[0]}" + (f" on node {told[1]} ({told[2]})" if told[1] is not None else "")
    return f"root cause: {where}: {cause} ({verdict.reason}); nvrx-report {job_dir} tells the rest"


def exit_signature(status: ExitStatus) -> str:
    """Failure signature from the exit status alone: ``signal SIGKILL`` or ``exit code 1``."""
    return process_end_signature(status.code, status.signal_name)


@dataclass(frozen=True)
class LastFault:
    """What a child said about its own failure in its last ``fault`` event."""

    signature: str | None
    fault_kind: str | None

    @property
    def collateral(self) -> bool:
        """A failure caused by another rank's fault (a collective that lost its peer)."""
        return self.fault_kind == PEER


def _text(value: object) -> str | None:
    """A field as text, as the report reads it: a number as its digits, anything else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) and value else None


def _fault_record(event: dict[str, object]) -> LastFault:
    """A fault event's signature and kind, as ``nvrx-report`` reads them (old spellings too)."""
    kind = _text(event.get("fault_kind"))
    signature = fault_signature(
        _text(event.get("signature")),
        kind,
        _text(event.get("exc_type")),
        _text(event.get("message")),
        _text(event.get("traceback")),
    )
    return LastFault(signature, kind)


def last_fault(events_dir: str | os.PathLike[str], who: int | ProcessKey) -> LastFault | None:
    """The ``fault`` event that ended process ``who``: its last one, unless a later round started.

    The Wrapper (or the application) records an exception's type and innermost
    user frame; that tells "the same bug again" apart from an unrelated crash
    with the same exit code, and a rank that only lost its peer from the rank
    that failed first.
    """
    event = last_fault_event(events_dir, who)
    return None if event is None else _fault_record(event)


#: What ``last_fault_event`` reads of a child's events: its faults, and what recovered them.
_FAULT_LOOKUP_KINDS = frozenset({"fault", "round_start", "call_start"})


def last_fault_event(
    events_dir: str | os.PathLike[str], who: int | ProcessKey
) -> dict[str, object] | None:
    """The ``fault`` event that ended process ``who`` (see ``last_fault``), as written.

    ``who``: the child's ``ProcessKey`` (its pid, node and start), so that another node's
    process, or an earlier run's, that had the same pid is not taken for it; the events of
    all its files (the application's, the Wrapper's) are read in the order it wrote them.
    """
    record = None
    for event in process_events(events_dir, who, kinds=_FAULT_LOOKUP_KINDS):
        if event.get("kind") == "fault":
            record = event
        elif event.get("kind") in ("round_start", "call_start"):
            record = None  # that fault was recovered in-process; it did not end the child
    return record


#: Fault kinds that tell of another fault, not of their own cause.
_NOT_A_CAUSE = (EXIT, PEER)


def last_round_fault(
    events_dir: str | os.PathLike[str], since: float = 0.0
) -> dict[str, Any] | None:
    """The first fault of the last round any rank of the job faulted in since wall time
    ``since`` (this run: round numbers start again after a requeue), of any process (a
    Wrapper's or its monitor's): why a Wrapper gave up, rather than its ``RestartAbort``."""
    directory = Path(events_dir)
    best, best_key = None, None
    for path in directory.glob("*.jsonl") if directory.is_dir() else ():
        for event in iter_file(path, kinds=("fault",)):
            if event.get("kind") != "fault" or event.get("fault_kind") in _NOT_A_CAUSE:
                continue
            rnd, wall = event.get("round"), event.get("wall")
            if not isinstance(rnd, int) or not isinstance(wall, (int, float)) or wall < since:
                continue
            key = (rnd, -wall)
            if best_key is None or key > best_key:
                best, best_key = event, key
    return best


class RestartPolicy:
    """Decides what to do when a child ends.

    ``spend_restart`` takes one restart from the job-wide budget and returns how many
    restarts the job had used once it took it (its place in the store's count).
    """

    def __init__(
        self,
        max_restarts: int,
        loop_breaker: int,
        spend_restart: Callable[[], int],
        budget_name: str = "--max-restarts",
    ) -> None:
        """``budget_name``: how the user sets the budget, for the message that it is spent."""
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if loop_breaker < 0:
            raise ValueError(f"loop_breaker must be >= 0 (0 disables it), got {loop_breaker}")
        self.max_restarts = max_restarts
        self.loop_breaker = loop_breaker
        self._spend = spend_restart
        self.budget_name = budget_name
        self._streaks: dict[int, tuple[str, int]] = {}

    def streak(self, local_rank: int) -> tuple[str | None, int]:
        """The current failure signature of ``local_rank`` and how often it came in a row."""
        signature, count = self._streaks.get(local_rank, (None, 0))
        return signature, count

    def decide(
        self,
        local_rank: int,
        status: ExitStatus,
        fault: LastFault | None = None,
        job_streak: tuple[str | None, int] | None = None,
    ) -> Verdict:
        """Verdict for a child of ``local_rank`` that ended with ``status``.

        A collateral failure (``fault.collateral``: the child only lost a peer)
        spends budget but does not count towards the loop breaker, so that the
        ranks around one repeated real fault are not mistaken for a loop.

        ``job_streak``: for a failure that restarts the whole job, the signature of the
        job-wide restart before it and how often it came in a row (the store keeps them).
        The streak is then the job's, not the local rank's: whichever rank of whichever
        node fails first, the same failure again is the same loop.
        """
        if status.code == 0:
            self._streaks.pop(local_rank, None)
            return Verdict(Decision.DONE, "child completed")
        if status.code == CLEAN_STOP_EXIT:
            return Verdict(
                Decision.STOP,
                "a rank stopped the job: exit 130 (RestartAbort: its Wrapper gave up; or a "
                "shell's SIGINT)",
                fault.signature if fault else None,
                exit_code=ExitCode.RANK_STOPPED,
            )
        signature = (fault.signature if fault else None) or exit_signature(status)
        streak = self._count(local_rank, signature, fault, job_streak)
        collateral = fault is not None and fault.collateral
        if self.loop_breaker and not collateral and streak[1] >= self.loop_breaker:
            who = f"local rank {local_rank}" if job_streak is None else "the job"
            return Verdict(
                Decision.GIVE_UP,
                f"loop breaker: {who} failed with {signature} {streak[1]} times in a row",
                signature,
                exit_code=ExitCode.LOOP_BREAKER,
            )
        used = self._spend()
        left = self.max_restarts - used
        if left < 0:
            return Verdict(
                Decision.GIVE_UP,
                f"restart budget exhausted: {self.max_restarts} restarts allowed ({self.budget_name})",
                signature,
                budget_left=0,
                exit_code=ExitCode.BUDGET_EXHAUSTED,
            )
        reason = f"child failed ({status})"
        return Verdict(Decision.RESTART, reason, signature, budget_left=left, streak=streak)

    def _count(
        self,
        local_rank: int,
        signature: str,
        fault: LastFault | None,
        job_streak: tuple[str | None, int] | None,
    ) -> tuple[str | None, int]:
        """The streak once this failure is counted: the job's (``job_streak``) or the local
        rank's, one longer for the same signature, a new one for another; a collateral
        failure leaves it as it was."""
        last, count = job_streak if job_streak is not None else self.streak(local_rank)
        if fault is not None and fault.collateral:
            return last, count
        streak = (signature, count + 1 if last == signature else 1)
        if job_streak is None:
            self._streaks[local_rank] = streak
        return streak
