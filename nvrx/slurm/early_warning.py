"""SLURM's warning signal that reaches ``nvrx-srun`` before it becomes srun: kept, then passed on.

``nvrx-srun`` runs in Python for a while before it execs srun: the interpreter's start, its
imports, the check of the supervisor's options (a program of its own). The templates' batch
shell forwards SLURM's warning (``$NVRX_PREEMPT_SIGNAL``, USR2) to it all the same, and with
the signal's default action it would end there (exit 140): nothing checkpointed, the job not
requeued, SLURM records a failure. So:

- ``EarlyWarning.install`` is ``nvrx-srun``'s first act: a handler that notes the wall time of
  the first warning, and nothing else (neither ignored nor blocked meanwhile);
- ``EarlyWarning.pass_on`` comes just before the exec: it blocks the signal, takes one that
  came since, and writes the wall time to ``$NVRX_WARNED_AT`` when a warning came (a value
  inherited from the batch environment is dropped: a requeued run's batch script starts a
  fresh ``nvrx-srun``, which passes on only what it noted itself). srun gives that
  environment to every task of the step (a restrictive ``--export`` names the variable:
  ``nvrx.slurm.srun_export``);
- ``take`` is each supervisor's: it removes the variable from its environment before it starts
  any process, and its ``PreemptionHandler`` acts on the warning as if the signal had come
  then (its window counts from that wall time).

The signal stays blocked through the exec: the exec resets a caught signal to its default
action, and srun takes a moment to set up its own handling. SLURM's srun blocks the signal
itself as it starts and takes it with ``sigwait`` once its step exists, so one pending at the
exec leaves srun running (SLURM 22.05.8). What is still not kept:

- a warning that reaches ``nvrx-srun`` before ``main`` runs (the interpreter's start and the
  imports of this command), or the batch shell before its ``trap``: either ends with the
  default action;
- one that comes between ``pass_on``'s look and the exec (a few instructions), or reaches
  srun before its tasks run: srun takes it and, no task launched yet, passes it to none (seen
  by hand on SLURM 22.05.8); while srun waits to create the step ("step creation temporarily
  disabled") a signal cancels the step instead (SLURM's source);
- one that srun forwards to a supervisor that is still starting, before its signal handling
  is in place: the default action ends that supervisor;
- every warning, where the ``srun`` on PATH is a site's script that runs SLURM's srun as its
  child instead of exec'ing it: the script and its children inherit the signal blocked, so
  what the batch shell forwards to it stays pending there, its own ``trap`` never runs, and
  no supervisor gets it (seen by hand with bash 5.2). A script that execs srun is as srun.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Mapping, MutableMapping
from types import FrameType

from nvrx import jobenv
from nvrx.processes import DEFAULT_WARNING_SIGNAL, signal_from_name, warning_signal


class EarlyWarning:
    """The warning signal as ``nvrx-srun`` keeps it until it execs srun."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        #: Wall time of the first warning; None while none came.
        self.wall: float | None = None

    @classmethod
    def install(cls, env: Mapping[str, str]) -> EarlyWarning:
        """Catch the warning signal ``env`` names (USR2 where ``NVRX_PREEMPT_SIGNAL`` names
        none: the check of the options refuses that value right after): from now on a warning
        is noted, not fatal."""
        try:
            signum = warning_signal(env)
        except ValueError:
            signum = signal_from_name(DEFAULT_WARNING_SIGNAL)
        kept = cls(signum)
        signal.signal(signum, kept._note)
        return kept

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.wall is None:
            self.wall = time.time()

    def pass_on(self, env: MutableMapping[str, str]) -> None:
        """Just before the exec: block the signal (it stays blocked in what this process
        becomes), note a warning that came since, and set ``NVRX_WARNED_AT`` in ``env`` to the
        first warning's wall time, or remove it where none came."""
        # Python runs the handler of a signal caught before the mask changed when the call
        # returns; one that comes after waits, pending, for sigtimedwait.
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})
        if signal.sigtimedwait({self.signum}, 0) is not None:
            self._note(self.signum, None)
        env.pop(jobenv.WARNED_AT, None)
        if self.wall is not None:
            env[jobenv.WARNED_AT] = repr(self.wall)


def take(env: MutableMapping[str, str]) -> float | None:
    """(A supervisor, before it starts any process, so that none inherits it) the wall time at
    which the warning reached ``nvrx-srun``, removed from ``env``; None where none did.
    ValueError naming the variable for a value that is no wall time."""
    raw = env.pop(jobenv.WARNED_AT, None)
    if raw is None:
        return None
    try:
        wall = float(raw)
    except ValueError:
        wall = math.nan
    if not (math.isfinite(wall) and wall > 0):
        raise ValueError(
            f"{jobenv.WARNED_AT}={raw!r} is not a wall time in seconds: nvrx-srun sets it for its "
            "job step alone; unset it"
        )
    return wall
