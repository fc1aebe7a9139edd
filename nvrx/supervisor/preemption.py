"""Preemption and time-limit warnings: checkpoint, then requeue the job once from the store host.

SLURM warns a job some seconds before it ends, with the signal asked for by
``--signal=[B:]USR2@<seconds>`` (USR2 because NCCL uses USR1): before the time
limit, and, with ``SlurmctldParameters=preempt_send_user_signal``, when a
higher-priority job preempts it; ``warning_cause`` tells which of the two.

The supervisor of each node owns one ``PreemptionHandler``:

- ``start()`` once at start-up (node 0 records requeues SLURM did by itself);
- ``on_signal(signum)`` when the warning signal arrives: it only sets a flag,
  so it is safe inside a signal handler; ``warned_at(wall)`` for one that came at an earlier
  wall time (read later from a signal pipe, or passed on by ``nvrx-srun``, which got it
  before srun ran: ``nvrx.slurm.early_warning``);
- ``act(stop_children)`` from the supervisor's main loop when ``pending`` is true
  (or ``adopt_flag()`` found another node's flag), and from the store host's wait for the
  other nodes once its own children ended: it writes the job's flag file
  (``nvrx.checkpoint_flag``), has the supervisor stop its children, which
  checkpoint and exit within the warning window, and then the deciding node
  (node 0, or the node that hosts the store after a failover) waits for the
  nodes still in the job (not those declared lost or ended) and runs
  ``scontrol requeue`` once, unless the cap on time-limit requeues is
  reached (a warning of unknown cause counts as a time limit; under submitit's local
  executor, which warns only before its time limit, the warning is one). Every node
  returns the same ``WarningOutcome``; its ``exit_code`` is what
  the supervisor should exit with. A stop signal while it waits (the supervisor reads its
  signals meanwhile, ``stopped``) ends the wait: the job was cancelled (scancel), nobody
  requeues it, and every node exits with the signal's code. SLURM's own SIGTERM at the
  time limit or at the end of a preemption's grace comes after the window, which ends a
  margin before the job must have stopped (``warning_cause.window_s``): after the decision.

Files live in ``<job log dir>/preempt/``: ``r<run>.flag`` (the flag children
read), ``r<run>.node<k>.done`` (node k's children are done),
``r<run>.checkpoint`` (a submitted callable's checkpoint; it may refuse the requeue),
``r<run>.decision`` (the decider's decision) and ``requeues.json`` (the ledger of
requeues, written by the decider only). ``<run>`` is ``SLURM_RESTART_COUNT``.
Waits on other nodes' files are bounded polls (no blocking wait on a shared FS).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvrx import jobenv
from nvrx.checkpoint_flag import (
    PREEMPT_DIR,
    PREEMPT_FLAG_ENV,
    flag_path_for,
    write_flag,
)
from nvrx.events import EventWriter, get_writer
from nvrx.processes import KILL_WAIT_S, warning_signal
from nvrx.slurm import commands

from .requeue_ledger import (
    RequeueLedger,
    WarningOutcome,
    checkpoint_record_path,
    requeue_refusal,
)
from .warning_cause import CAUSES, classify, window_s

log = logging.getLogger(__name__)

#: Seconds before the end at which SLURM sends the warning (``--signal=...@<seconds>``).
SIGNAL_DELAY_ENV = jobenv.SIGNAL_DELAY_S
#: Cap on requeues after time limits (preemptions are requeued without a cap).
MAX_TIME_LIMIT_REQUEUES_ENV = jobenv.MAX_TIME_LIMIT_REQUEUES
#: Causes whose requeues count against that cap: a warning nvrx cannot tell from a time
#: limit might be one, and an uncapped one could requeue a job for ever. A requeue SLURM made
#: itself (a node failure, ``scontrol requeue`` by hand: no warning of nvrx's) whose cause is
#: unknown does not count: only those nvrx made after a warning of unknown cause do.
CAPPED_CAUSES = ("time_limit", "unknown")


@dataclass(frozen=True)
class _Ends:
    """What may end the decider's wait or decide its decision instead of a requeue (``act``)."""

    stopped: Callable[[], int | None]
    finished: Callable[[], bool] | None
    stopped_for_good: Callable[[], tuple[str, int] | None]


def capped_requeues(entries: list[dict[str, Any]]) -> int:
    """Requeues of the ledger ``entries`` that count against the time-limit cap: time limits,
    requeues nvrx made after a warning of unknown cause, and entries whose cause was lost."""
    return sum(
        1
        for e in entries
        if e.get("cause") is None
        or e.get("cause") == "time_limit"
        or (e.get("cause") == "unknown" and e.get("issued_by") != "slurm")
    )
#: Seconds a preempted job may use to checkpoint when the partition's GraceTime is unknown.
PREEMPT_WINDOW_ENV = jobenv.PREEMPT_WINDOW_S

#: Warning delay nvrx.submit asks for by default (submitit's default too).
DEFAULT_SIGNAL_DELAY_S = 90
DEFAULT_MAX_TIME_LIMIT_REQUEUES = 3
#: Supervisor exit code when the job was requeued (EX_TEMPFAIL: "try again later").
EXIT_REQUEUED = 75
#: Exit code that makes submitit's local executor run a task again (its emulated requeue).
SUBMITIT_LOCAL_REQUEUE_EXIT = 144
#: Seconds a child gets between SIGTERM and SIGKILL once the warning window is over.
TERM_GRACE_S = 5.0
#: Fields of ``scontrol show job`` the cause is read from, kept in the event to tell why.
_CLASSIFIED_BY = ("TimeLimit", "RunTime", "PreemptTime")
#: Seconds between looks at other nodes' files.
POLL_S = 0.2
#: How long past the warning's deadline a node waits for the deciding node's word: the
#: decider first stops its own children (``TERM_GRACE_S``, then SIGKILL and its wait), then
#: asks SLURM to requeue the job (one ``scontrol``, ``COMMAND_TIMEOUT_S`` at most), and only
#: then writes its decision; a few seconds more for the file system.
DECISION_WAIT_S = TERM_GRACE_S + KILL_WAIT_S + commands.COMMAND_TIMEOUT_S + 5.0
#: How long a node still waits for the decision once a stop signal came (SLURM's SIGKILL
#: follows within its KillWait, 30 s by default): a decider that requeued the job writes
#: its decision as soon as its ``scontrol requeue`` returned.
STOPPED_WAIT_S = 10.0


def settings_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The handler's settings that SLURM's and nvrx's variables give (``from_env``), so that
    ``nvrx-supervise`` can refuse a bad one as a usage error before anything starts;
    ValueError naming the variable whose value is none."""
    delay = env.get(SIGNAL_DELAY_ENV)
    window = env.get(PREEMPT_WINDOW_ENV)
    cap = jobenv.count_from(env, MAX_TIME_LIMIT_REQUEUES_ENV, DEFAULT_MAX_TIME_LIMIT_REQUEUES)
    return {
        "run_index": jobenv.slurm_restart_count(env),
        "signum": warning_signal(env),
        "signal_delay_s": jobenv.seconds_from(env, SIGNAL_DELAY_ENV, 0) if delay else None,
        "max_time_limit_requeues": cap,
        "preempt_window_s": jobenv.seconds_from(env, PREEMPT_WINDOW_ENV, 0) if window else None,
    }


class PreemptionHandler:
    """One node's reaction to SLURM's warning signal (see the module docstring)."""

    def __init__(
        self,
        job_dir: str | os.PathLike[str],
        node_rank: int,
        nnodes: int,
        *,
        job_id: str | None = None,
        run_index: int = 0,
        slurm: bool = True,
        signum: int = signal.SIGUSR2,
        signal_delay_s: float | None = None,
        max_time_limit_requeues: int = DEFAULT_MAX_TIME_LIMIT_REQUEUES,
        preempt_window_s: float | None = None,
        local_requeue: bool = False,
        writer: EventWriter | None = None,
        export_env: bool = True,
    ) -> None:
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank={node_rank} must be in 0..{nnodes - 1} (nnodes={nnodes})")
        if max_time_limit_requeues < 0:
            raise ValueError(f"max_time_limit_requeues must be >= 0, got {max_time_limit_requeues}")
        if slurm and not job_id:
            raise ValueError("job_id is needed to requeue a SLURM job")
        self.job_dir = Path(job_dir).absolute()  # its flag must hold after a rank changes directory
        self.dir = self.job_dir / PREEMPT_DIR
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.job_id = job_id
        self.slurm = slurm
        self.signum = int(signum)
        self.signal_delay_s = signal_delay_s
        self.max_time_limit_requeues = max_time_limit_requeues
        self.preempt_window_s = preempt_window_s
        self.local_requeue = local_requeue
        self._writer = writer
        self.ledger = RequeueLedger(self.dir / "requeues.json", run_index if slurm else 0)
        # Without SLURM there is no restart count: the ledger counts the runs.
        self.run_index = run_index if slurm else self.ledger.count()
        self.flag_path = flag_path_for(self.job_dir, self.run_index)
        self._pending: int | None = None
        self._signal_wall: float | None = None
        self._decision: WarningOutcome | None = None
        self._created_wall = time.time()
        if export_env:
            os.environ[PREEMPT_FLAG_ENV] = str(self.flag_path)

    @classmethod
    def from_env(
        cls,
        node_rank: int,
        nnodes: int,
        *,
        job_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        writer: EventWriter | None = None,
    ) -> PreemptionHandler:
        """A handler configured from SLURM's and nvrx's environment variables."""
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or None
        return cls(
            job_dir if job_dir is not None else jobenv.job_dir(env=env),
            node_rank,
            nnodes,
            job_id=job_id,
            slurm=job_id is not None,
            **settings_from_env(env),
            local_requeue=env.get("SUBMITIT_EXECUTOR") == "local",
            writer=writer,
        )

    # -- signal side: flags only ------------------------------------------------
    @property
    def pending(self) -> bool:
        """A warning arrived and ``act`` has not handled it yet."""
        return self._pending is not None and self._decision is None

    @property
    def decision(self) -> WarningOutcome | None:
        return self._decision

    def on_signal(self, signum: int, frame: object = None) -> None:
        """Note the warning as come now (``warned_at``; safe in a signal handler: sets two
        attributes, nothing else)."""
        self.warned_at(time.time())

    def warned_at(self, wall: float) -> None:
        """Note this handler's warning signal as come at wall time ``wall`` (the supervisor
        read it from its signal pipe, or it reached ``nvrx-srun`` before srun ran:
        ``nvrx.slurm.early_warning``): ``act`` counts the window from then."""
        if self._pending is None:
            self._pending = self.signum
            self._signal_wall = wall

    def adopt_flag(self) -> bool:
        """Take the job's flag, raised by another node, as this node's warning; True if it was.

        The flag file is shared by every node, so children may checkpoint and
        exit before this node's supervisor got SLURM's signal (SLURM signals the
        nodes one after another, a forwarding batch shell later still). Such a
        node must still take part in the decision instead of ending as if
        training had completed.
        """
        if self._pending is not None or self._decision is not None:
            return False
        if self._current_flag() is None:
            return False
        self._pending = self.signum
        self._signal_wall = time.time()
        log.info("the job's warning flag %s is raised (by another node)", self.flag_path)
        return True

    def _current_flag(self) -> dict[str, Any] | None:
        """The job's flag of this run, unless absent, unreadable or left over from an earlier
        run under the same job id (its deadline passed before this supervisor started)."""
        try:
            flag = json.loads(self.flag_path.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(flag, dict):
            return None
        deadline = flag.get("deadline_wall")
        if not isinstance(deadline, (int, float)) or deadline < self._created_wall:
            return None
        return flag

    # -- start-up -------------------------------------------------------------------
    def start(self) -> None:
        """Once at start-up: drop a stale flag of this run (node 0) and record requeues
        SLURM made without us (preemption grace ran out, node failure, manual requeue)."""
        if self.node_rank != 0:
            return
        record = checkpoint_record_path(self.flag_path)
        for stale in (self.flag_path, self._decision_path(), record):
            stale.unlink(missing_ok=True)
        for path in self.dir.glob(f"r{self.run_index}.node*.done"):
            path.unlink(missing_ok=True)
        if not self.slurm:
            return
        recorded = self.ledger.count()
        for run in range(recorded, self.run_index):
            cause = self._cause_of_past_run(run)
            count = self.ledger.append(cause, run, issued_by="slurm")
            self._emit("requeue", cause=cause, count=count, run=run, issued_by="slurm")
            log.info("job %s run %d was requeued by SLURM (%s)", self.job_id, run, cause)

    def _cause_of_past_run(self, run: int) -> str:
        try:
            info = json.loads(flag_path_for(self.job_dir, run).read_text())
            if info.get("cause") in CAUSES and info["cause"] != "unknown":
                return str(info["cause"])
        except (OSError, ValueError, AttributeError):
            pass
        try:
            rows = commands.sacct_job(self.job_id or "", fields=("State",)).job
        except commands.SlurmCommandError as exc:
            log.warning("cannot ask sacct why run %d of job %s ended: %s", run, self.job_id, exc)
            return "unknown"
        state = rows[run]["State"].split()[0] if run < len(rows) else ""
        return {
            "NODE_FAIL": "node_failure",
            "PREEMPTED": "preemption",
            "TIMEOUT": "time_limit",
        }.get(state, "unknown")

    # -- main-loop side: the work ------------------------------------------------
    def act(
        self,
        stop_children: Callable[[float], None],
        cause: str | None = None,
        decider: bool | None = None,
        running: Callable[[], Iterable[int]] | None = None,
        stopped: Callable[[], int | None] | None = None,
        finished: Callable[[], bool] | None = None,
        stopped_for_good: Callable[[], tuple[str, int] | None] | None = None,
    ) -> WarningOutcome:
        """Handle a pending warning: flag, stop the children, requeue from the decider.

        ``stop_children(exit_by)``: the supervisor's stop, which lets children checkpoint and
        exit until ``exit_by`` (monotonic), then ends the rest. ``cause`` overrides the
        classification. ``decider``: whether this node decides (default: node 0; after a
        store failover, the store host); ``running()``: the nodes it waits for (default:
        all); ``stopped()``: the stop signal the supervisor received meanwhile, if any (it
        reads its signals when called): on the decider it ends the wait, without a requeue;
        elsewhere the decider's word is awaited all the same, the signal's code taken where
        none comes. ``finished()`` (the decider, once every node is done): whether training
        had ended on every node without the warning: then no requeue, and exit code 0.
        ``stopped_for_good()`` (the decider, as it decides): the reason and exit code of a
        stop for good that another node wrote meanwhile, read then: no requeue, its code.
        Blocks for the window, the stop, and elsewhere the decision (bounded). Idempotent:
        a second call returns the first decision.
        """
        if self._decision is not None:
            return self._decision
        if cause is not None and cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}, got {cause!r}")
        signum = self._pending if self._pending is not None else self.signum
        received = self._signal_wall or time.time()
        signame = signal.Signals(signum).name
        flag = self._current_flag()  # the first node to act decides cause and deadline for all
        seen: dict[str, str | None] = {"decided_by": "flag"}
        if flag is not None and flag.get("cause") in CAUSES:
            cause = cause or str(flag["cause"])
            deadline = float(flag["deadline_wall"])
            window = max(0.0, deadline - received)
        else:
            cause, window, seen = self._judge(cause, received)
            deadline = received + window
            flag = None
        self._emit("preempt_signal", signal=signame, cause=cause, window_s=round(window, 1), **seen)
        log.warning("%s: %s warning, %.0f s to checkpoint and stop", signame, cause, window)
        if flag is None:
            fields = {"cause": cause, "signal": signame, "deadline_wall": deadline}
            write_flag(self.flag_path, {**fields, "run": self.run_index})
        stop_children(time.monotonic() + max(0.0, deadline - time.time()))
        write_flag(self._done_path(self.node_rank), {"wall": time.time()})
        stopped = stopped or (lambda: None)
        if (self.node_rank == 0) if decider is None else decider:
            ends = _Ends(stopped, finished, stopped_for_good or (lambda: None))
            decision = self._decide_for_all(cause, deadline, running, ends)
        else:
            decision = self._await_decision(cause, deadline + DECISION_WAIT_S, stopped)
        self._decision = decision
        log.warning("after the %s warning: %s", cause, decision.reason)
        return decision

    def _judge(
        self, cause: str | None, received: float
    ) -> tuple[str, float, dict[str, str | None]]:
        """The cause (``cause`` where the caller gave one) and window of the warning that came
        at wall time ``received``, and the fields of the job they were judged by. The job's
        clock is read now, possibly well after the warning (one that reached ``nvrx-srun``
        before srun ran): the time left then counts, not the time left now."""
        late = time.time() - received  # taken before the look: never more than its lag
        info = self._job_info()
        seen = {name: (info or {}).get(name) for name in _CLASSIFIED_BY}
        seen["decided_by"] = "caller" if cause else "scontrol" if self.slurm else "no SLURM"
        if cause is None:
            cause = classify(info, self.signal_delay_s, late) if self.slurm else self._local_cause()
        return cause, window_s(info, cause, self.signal_delay_s, self.preempt_window_s, late), seen

    def _decide_for_all(
        self,
        cause: str,
        deadline: float,
        running: Callable[[], Iterable[int]] | None,
        ends: _Ends,
    ) -> WarningOutcome:
        """(The decider) wait for the nodes still in the job until ``deadline`` (wall), decide,
        and write the decision the other nodes read."""
        self._wait_for(lambda: self._all_done(running) or ends.stopped() is not None, deadline)
        signum = ends.stopped()
        stop = None if signum is not None else ends.stopped_for_good()
        if signum is not None:
            decision = self._stopped(cause, signum)
        elif stop is not None:
            reason, exit_code = stop
            decision = WarningOutcome(cause, False, exit_code, f"not requeued: {reason}", self.ledger.count())
        elif ends.finished is not None and ends.finished():
            decision = self._ended_before(cause)
        else:
            decision = self._decide(cause)
        write_flag(self._decision_path(), decision.to_dict())
        return decision

    def _decide(self, cause: str) -> WarningOutcome:
        fail_exit = 128 + (self._pending or self.signum)
        total = self.ledger.count()
        refused = requeue_refusal(self.flag_path)  # written before rank 0 exited, so before now
        if refused is not None:
            return WarningOutcome(cause, False, fail_exit, f"not requeued: {refused}", total)
        capped = capped_requeues(self.ledger.entries())
        if cause in CAPPED_CAUSES and capped >= self.max_time_limit_requeues:
            return WarningOutcome(
                cause, False, fail_exit, f"not requeued: {self.max_time_limit_requeues} time-limit "
                f"requeue(s) already used (cap {MAX_TIME_LIMIT_REQUEUES_ENV}; nvrx's requeues after "
                "warnings of unknown cause count as time limits)", total
            )  # fmt: skip
        if not self.slurm:
            if not self.local_requeue:
                return WarningOutcome(
                    cause, False, fail_exit, "not requeued: not running under SLURM", total
                )
            count = self.ledger.append(cause, self.run_index, issued_by="submitit-local")
            self._emit(
                "requeue", cause=cause, count=count, run=self.run_index, issued_by="submitit-local"
            )
            reason = "requeued by submitit's local executor"
            return WarningOutcome(cause, True, SUBMITIT_LOCAL_REQUEUE_EXIT, reason, count)
        try:
            commands.requeue(self.job_id or "")
        except commands.SlurmCommandError as exc:
            return WarningOutcome(cause, False, fail_exit, f"not requeued: {exc}", total)
        count = self.ledger.append(cause, self.run_index, issued_by="nvrx")
        self._emit("requeue", cause=cause, count=count, run=self.run_index, issued_by="nvrx")
        reason = f"requeued job {self.job_id} ({cause}, requeue {count})"
        return WarningOutcome(cause, True, EXIT_REQUEUED, reason, count)

    def _local_cause(self) -> str:
        """The cause of a warning without SLURM: submitit's local executor warns only before
        its time limit; anything else cannot tell."""
        return "time_limit" if self.local_requeue else "unknown"

    def _stopped(self, cause: str, signum: int) -> WarningOutcome:
        """The outcome of a warning a stop signal cut short: the job was cancelled."""
        reason = f"not requeued: stopped by {signal.Signals(signum).name} during the warning"
        return WarningOutcome(cause, False, 128 + signum, reason, self.ledger.count())

    def decline(self, reason: str, exit_code: int) -> WarningOutcome | None:
        """(The decider) the job stops for good while a warning is pending here or another
        node's flag is raised: no requeue, and a decision with the stop's exit code, which the
        nodes that acted on the flag await. None where there is nothing to decline."""
        if self._decision is not None:
            return None
        flag = self._current_flag()
        if flag is None and self._pending is None:
            return None
        cause = str(flag["cause"]) if flag and flag.get("cause") in CAUSES else "unknown"
        decision = WarningOutcome(
            cause, False, int(exit_code), f"not requeued: {reason}", self.ledger.count()
        )
        write_flag(self._decision_path(), decision.to_dict())
        self._decision = decision
        log.warning("a %s warning while the job stops for good: %s", cause, decision.reason)
        return decision

    def _ended_before(self, cause: str) -> WarningOutcome:
        """The outcome of a warning that came once training had ended on every node."""
        reason = "not requeued: the training had ended on every node before the warning"
        return WarningOutcome(cause, False, 0, reason, self.ledger.count())

    def _await_decision(
        self, cause: str, deadline: float, stopped: Callable[[], int | None]
    ) -> WarningOutcome:
        """The decider's decision; this node's stop signal, where none came in time."""
        path = self._decision_path()
        wait = {"until": deadline}

        def decided() -> bool:
            # a stop signal ends no wait at once (the decider, which gets the same scancel,
            # says whether the job is requeued), but shortens it: SLURM's SIGKILL follows
            # within its KillWait, and this node must still end on its own terms
            if stopped() is not None:
                wait["until"] = min(wait["until"], time.time() + STOPPED_WAIT_S)
            return path.exists()

        if self._wait_for(decided, lambda: wait["until"]):
            try:
                return WarningOutcome(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("the deciding node's decision %s is unreadable: %s", path, exc)
        signum = stopped()
        if signum is not None:
            return self._stopped(cause, signum)
        fail_exit = 128 + (self._pending or self.signum)
        reason = "the deciding node made no decision in time"
        return WarningOutcome(cause, False, fail_exit, reason, self.ledger.count())

    # -- helpers ----------------------------------------------------------------
    def _job_info(self) -> dict[str, str] | None:
        if not self.slurm:
            return None
        try:
            return commands.show_job(self.job_id or "")
        except commands.SlurmCommandError as exc:
            log.warning("cannot ask slurmctld about job %s: %s", self.job_id, exc)
            return None

    @staticmethod
    def _wait_for(condition: Callable[[], bool], deadline: float | Callable[[], float]) -> bool:
        """Whether ``condition`` held by ``deadline`` (wall clock; a callable: read anew at
        each look, it may come nearer)."""
        until = deadline if callable(deadline) else lambda: deadline
        while True:
            if condition():
                return True
            left = until() - time.time()
            if left <= 0:
                return False
            time.sleep(min(POLL_S, left))

    def _all_done(self, running: Callable[[], Iterable[int]] | None) -> bool:
        """Whether every node (of those ``running()`` names) has reported its children done."""
        missing = {k for k in range(self.nnodes) if not self._done_path(k).exists()}
        return not missing or (running is not None and not missing.intersection(running()))

    def _done_path(self, node: int) -> Path:
        return self.dir / f"r{self.run_index}.node{node}.done"

    def _decision_path(self) -> Path:
        return self.dir / f"r{self.run_index}.decision"

    def _emit(self, kind: str, **fields: object) -> None:
        (self._writer or get_writer("supervisor")).emit(kind, **fields)
