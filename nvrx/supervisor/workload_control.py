"""What a supervisor does with its ranks' requests and with failures not worth a restart
(a mixin of ``Supervisor``).

* ``ShutdownWorkload`` (``nvrx.fault_tolerance``): every node stops its children
  cleanly; the job ends with exit 0 and the request's description as its reason.
* ``ExcludeThisNode``: this node stops its children and leaves the job as a lost
  node (exit 10): it declares its own slot lost, so a spare takes over at once, or
  the job shrinks or stops (and, under SLURM, is requeued without this host) as
  for any lost node.
* A failure that matches ``--ft-non-retryable-exception-file`` stops the job at
  once (exit 11), with the pattern and the matching line in a ``non_retryable``
  event and in the stop reason.
"""

from __future__ import annotations

import logging
from typing import Any

from . import non_retryable
from .config import STOP_KEY, StopRequest
from .exit_codes import ExitCode
from .store_link import StoreLinkError

log = logging.getLogger(__name__)


class WorkloadControl:
    """Expects the attributes and methods of ``Supervisor``."""

    config: Any
    children: dict[int, Any]
    roles: Any
    link: Any

    def _on_control(self, watched: Any, request: Any) -> None:
        action = request.get("action") if isinstance(request, dict) else None
        description = str(request.get("description", "")) if isinstance(request, dict) else ""
        self._emit(
            "workload_control", rank=watched.rank, local_rank=watched.local_rank,
            child_pid=watched.pid, action=action, description=description,
        )  # fmt: skip
        who = f"rank {watched.rank}"
        if action == "ShutdownWorkload":
            self.request_stop(f"{who} asked to shut the workload down: {description}", ExitCode.OK, True)
        elif action == "ExcludeThisNode":
            self.request_stop(f"{who} asked to exclude this node: {description}", ExitCode.EXCLUDED, False)
        elif action != "Continue":
            log.warning("%s sent an unknown workload-control action %r: ignored", who, action)

    def _leave_as_lost(self) -> None:
        """An excluded node declares its own slot lost once its children ended."""
        if self.roles is None or not self.roles.enabled:
            return
        try:
            loss = self.roles.declare({"slot": self.roles.slot, "silent_s": 0.0})
        except StoreLinkError as exc:
            log.warning("could not declare this excluded node lost: %s", exc)
            return
        if loss is not None and loss.action == "stop":  # tell the others, as _node_silent would
            request = StopRequest(loss.reason, int(ExitCode.NODE_LOST), self.config.node_rank)
            try:
                self.link.set(STOP_KEY, request.encode())
            except StoreLinkError as exc:
                log.warning("could not tell the other nodes to stop: %s", exc)
            self._requeue_without(loss.host)
        try:
            if loss is not None and loss.action == "spare":  # the others restart with the spare
                self._restart_for_lost_node(loss.node_rank, leaving=True)
        except StoreLinkError as exc:
            log.warning("could not announce the job-wide restart: %s", exc)

    def _non_retryable(self, local_rank: int, pid: int) -> bool:
        """Stop the job when the failure of child ``pid`` matches a non-retryable pattern."""
        patterns = self.config.non_retryable_patterns
        if not patterns:
            return False
        child = self.children.get(local_rank)
        directory = getattr(child, "directory", None)
        error_file = None if directory is None else directory / "error.json"
        found = non_retryable.exception_text(self.config.events_dir, pid, error_file)
        match = None if found is None else non_retryable.first_match(patterns, *found)
        if match is None:
            return False
        rank = self.config.rank(local_rank, self.node_rank)
        self._emit(
            "non_retryable", local_rank=local_rank, global_rank=rank, child_pid=pid,
            pattern=match.pattern, line=match.line, source=match.source,
        )  # fmt: skip
        reason = f"non-retryable failure of rank {rank}: {match.line!r} matches {match.pattern!r}"
        self.request_stop(reason, ExitCode.NON_RETRYABLE, broadcast=True)
        return True
