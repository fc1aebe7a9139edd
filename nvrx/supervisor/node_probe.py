"""Asking SLURM whether a node declared lost still answers, without holding up the job.

A node is declared lost when its supervisor falls silent; that says nothing of
the node itself (a killed supervisor leaves a healthy node behind). When a spare
takes the node's place or the job shrinks without it, the job does not wait:
``NodeProbes`` starts one no-op SLURM step on the node (the command of
``commands.node_answers``) as a child process, and the supervisor's loop polls
it (its exit wakes the loop by SIGCHLD; ``deadline`` bounds the loop's wait), so
no thread runs beside the supervisor's fork of children. Its answer is the
``node_probe`` event, which ``nvrx-report`` reads before it advises excluding
the node. A probe the supervisor outlives is ended with it and recorded as
unknown; one whose supervisor is killed dies with it (``die_with_parent``). A
job that stops for the loss probes before its requeue instead (``node_requeue``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from nvrx import processes
from nvrx.slurm import commands

log = logging.getLogger(__name__)


@dataclass
class _Probe:
    slot: int
    host: str
    proc: subprocess.Popen[bytes]
    started: float  # time.monotonic()


class NodeProbes:
    """The probes of lost nodes this supervisor started and has not recorded yet."""

    def __init__(
        self,
        emit: Callable[..., None],
        job_id: str | None = None,
        timeout: float = commands.PROBE_TIMEOUT_S,
    ) -> None:
        self._emit = emit
        self._job_id = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID")
        self._timeout = timeout
        self._running: list[_Probe] = []

    def start(self, slot: int, host: str | None) -> bool:
        """Start probing ``host`` (the SLURM node name of lost ``slot``); False when there is
        nothing to ask (not under SLURM, the host unknown) or ``srun`` cannot be started."""
        if not self._job_id or not host:
            return False
        try:
            proc = processes.start(
                commands.node_answers_argv(self._job_id, host), die_with_parent=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as exc:
            log.warning("cannot ask SLURM whether node %s answers: %s", host, exc)
            return False
        self._running.append(_Probe(slot, host, proc, time.monotonic()))
        return True

    def deadline(self) -> float | None:
        """When the oldest running probe times out (``time.monotonic()``), None without one."""
        return min((p.started + self._timeout for p in self._running), default=None)

    def poll(self) -> None:
        """Record each probe that ended or timed out (a timeout: the node did not answer)."""
        now, still = time.monotonic(), []
        for p in self._running:
            code = p.proc.poll()
            if code is None and now < p.started + self._timeout:
                still.append(p)
            elif code is None:
                self._end(p, False, "no answer within the probe's timeout")
            else:
                self._end(p, code == 0, None)
        self._running = still

    def close(self) -> None:
        """Record the probes that ended, and end the others (their answer stays unknown)."""
        self.poll()
        for p in self._running:
            self._end(p, None, "the supervisor ended first")
        self._running = []

    def _end(self, p: _Probe, responding: bool | None, why: str | None) -> None:
        if p.proc.poll() is None:
            processes.signal_group(p.proc.pid, signal.SIGKILL)
        p.proc.wait()
        took = round(time.monotonic() - p.started, 3)
        if responding:
            log.warning("lost slot %d: node %s still runs SLURM steps (its supervisor was lost, "
                        "not the node)", p.slot, p.host)  # fmt: skip
        self._emit(
            "node_probe", lost_slot=p.slot, lost_host=p.host, responding=responding, probe_s=took,
            note=why,
        )  # fmt: skip
