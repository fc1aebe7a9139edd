"""Asking SLURM whether a node declared lost still answers, without holding up the job.

A node is declared lost when its supervisor falls silent; that says nothing of
the node itself (a killed supervisor leaves a healthy node behind). When a spare
takes the node's place or the job shrinks without it, the job does not wait:
``NodeProbes`` runs one no-op SLURM step on the node (``commands.node_answers``)
in a thread and records the answer as a ``node_probe`` event, which
``nvrx-report`` reads before it advises excluding the node. A job that stops for
the loss probes before its requeue instead (``node_requeue``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from nvrx.slurm import commands

log = logging.getLogger(__name__)


class NodeProbes:
    """The probes of lost nodes this supervisor started; ``close`` waits for them."""

    def __init__(self, emit: Callable[..., None], job_id: str | None = None) -> None:
        self._emit = emit
        self._job_id = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID")
        self._threads: list[threading.Thread] = []

    def start(self, slot: int, host: str | None) -> bool:
        """Probe ``host`` (the SLURM node name of lost ``slot``) in the background; False when
        there is nothing to ask (not under SLURM, or the host is unknown)."""
        if not self._job_id or not host:
            return False
        t = threading.Thread(
            target=self._probe, args=(slot, host), name=f"nvrx-node-probe-{slot}", daemon=True
        )
        self._threads.append(t)
        t.start()
        return True

    def _probe(self, slot: int, host: str) -> None:
        began = time.monotonic()
        answered = commands.node_answers(self._job_id or "", host)
        took = round(time.monotonic() - began, 3)
        if answered:
            log.warning("lost slot %d: node %s still runs SLURM steps (its supervisor was lost, "
                        "not the node)", slot, host)  # fmt: skip
        self._emit("node_probe", lost_slot=slot, lost_host=host, responding=answered, probe_s=took)

    def close(self, timeout: float = commands.PROBE_TIMEOUT_S + 5.0) -> None:
        """Wait for the probes still running (each is bounded by its own timeout)."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
