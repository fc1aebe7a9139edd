"""What a supervisor does with its ranks' requests and with failures not worth a restart.

* ``ShutdownWorkload`` (``nvrx.fault_tolerance``): every node stops its children
  cleanly; the job ends with exit 0 and the request's description as its reason.
* ``ExcludeThisNode``: this node stops its children and leaves the job as a lost
  node (exit 10): it declares its own slot lost, so a spare takes over at once, or
  the job shrinks or stops (and, under SLURM, is requeued without this host) as
  for any lost node (``job_end``, once its children ended).
* A failure that matches ``--ft-non-retryable-exception-file`` stops the job at
  once (exit 11), with the pattern and the matching line in a ``non_retryable``
  event and in the stop reason.
"""

from __future__ import annotations

import logging

from nvrx.events.reader import ProcessKey

from . import non_retryable
from .exit_codes import ExitCode
from .job_store import JobStore
from .local_ranks import LocalRanks
from .node_control import NodeControl
from .rank_watch import Watched

log = logging.getLogger(__name__)


class WorkloadControl:
    """Acts on the workload-control requests of this node's ranks and on non-retryable failures."""

    def __init__(self, store: JobStore, control: NodeControl, ranks: LocalRanks) -> None:
        self.store, self.control, self.ranks = store, control, ranks

    def on_control(self, watched: Watched, request: object) -> None:
        """Rank ``watched`` asked for ``request`` (a dict with ``action`` and ``description``)."""
        action = request.get("action") if isinstance(request, dict) else None
        description = str(request.get("description", "")) if isinstance(request, dict) else ""
        self.control.emit(
            "workload_control", rank=watched.rank, local_rank=watched.local_rank,
            child_pid=watched.pid, action=action, description=description,
        )  # fmt: skip
        who, stop = f"rank {watched.rank}", self.control.request_stop
        if action == "ShutdownWorkload":
            stop(f"{who} asked to shut the workload down: {description}", ExitCode.OK, True)
        elif action == "ExcludeThisNode":
            stop(f"{who} asked to exclude this node: {description}", ExitCode.EXCLUDED, False)
        elif action != "Continue":
            log.warning("%s sent an unknown workload-control action %r: ignored", who, action)

    def non_retryable(self, local_rank: int, who: ProcessKey) -> bool:
        """Stop the job when the failure of child ``who`` (``Child.key``) matches a
        non-retryable pattern."""
        cfg = self.store.config
        patterns = cfg.non_retryable_patterns
        if not patterns:
            return False
        child = self.ranks.children.get(local_rank)
        directory = None if child is None else child.directory
        error_file = None if directory is None else directory / "error.json"
        found = non_retryable.exception_text(cfg.events_dir, who, error_file)
        match = None if found is None else non_retryable.first_match(patterns, *found)
        if match is None:
            return False
        rank = cfg.rank(local_rank, self.control.node_rank)
        self.control.emit(
            "non_retryable", local_rank=local_rank, global_rank=rank, child_pid=who.pid,
            pattern=match.pattern, line=match.line, source=match.source,
        )  # fmt: skip
        reason = f"non-retryable failure of rank {rank}: {match.line!r} matches {match.pattern!r}"
        self.control.request_stop(reason, ExitCode.NON_RETRYABLE, broadcast=True)
        return True
