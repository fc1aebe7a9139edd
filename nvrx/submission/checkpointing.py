"""submitit's checkpoint protocol for a submitted callable, on nvrx's warning and requeue.

submitit calls ``fn.__submitit_checkpoint__(*args, **kwargs)`` (or, without it,
``fn.checkpoint``) on rank 0 when the job is warned of its preemption or time
limit, in the middle of ``fn``; what it returns, a ``DelayedSubmission``
(function, args, kwargs), is what the requeued job runs instead, and ``None``
refuses the requeue. ``helpers.Checkpointable`` returns the callable itself, its
state as it is then, with the same arguments.

Here the warning reaches the children as nvrx's flag file, not as a signal.
``CheckpointGuard`` watches the flag from a thread while ``fn`` runs. On rank 0 it
then interrupts the main thread (``INTERRUPT_SIGNAL``, handled in Python), so the
checkpoint runs there, between two bytecodes of ``fn``, as submitit's runs in its
signal handler (a main thread inside one long C call is interrupted when it returns
from it). The new call replaces the job's spec file atomically (the next run
loads it), and rank 0 writes the checkpoint record the deciding supervisor reads
before it requeues (``requeue_ledger.write_checkpoint_record``). The other ranks
wait for that record and stop too. Every rank then leaves ``fn`` by raising
``CheckpointStop``, so a callable that never looks at ``nvrx.preemption_requested()``
still ends within the warning window; one that does, and returns first, is
checkpointed after it returned.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from nvrx.checkpoint_flag import flag_path, record_checkpoint
from nvrx.submission.call_spec import dump_spec
from nvrx.supervisor.requeue_ledger import checkpoint_record_path, write_checkpoint_record

log = logging.getLogger(__name__)

#: submitit's names of the checkpoint method, in the order it looks for them.
CHECKPOINT_METHODS = ("__submitit_checkpoint__", "checkpoint")
#: Seconds between looks at the flag file (a child has nothing to block on).
POLL_S = 0.25
#: Sent by the watcher thread to its own process's main thread. Nothing sends it to a
#: training process otherwise (no controlling terminal), and its default action is to be
#: ignored, so a process that inherits it past exec is not harmed.
INTERRUPT_SIGNAL = signal.SIGWINCH


class CheckpointStop(BaseException):
    """Raised inside the callable once this rank's part of the checkpoint is done: it ends the
    call (a ``BaseException``, so that ``except Exception`` in training code lets it through)."""


def checkpoint_method(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """``fn``'s submitit checkpoint method, or None when it has none."""
    for name in CHECKPOINT_METHODS:
        method = getattr(fn, name, None)
        if callable(method):
            return method
    return None


class CheckpointGuard:
    """Around one call of a checkpointable callable: checkpoint it when the job is warned."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        spec_file: str | os.PathLike[str],
        rank: int,
        flag: Path | None = None,
    ) -> None:
        method = checkpoint_method(fn)
        if method is None:
            raise TypeError(f"{fn!r} has no {' or '.join(CHECKPOINT_METHODS)} method")
        self.method, self.args, self.kwargs = method, args, kwargs
        self.spec_file = Path(spec_file)
        self.rank = rank
        self.flag = flag if flag is not None else flag_path()
        self.record = checkpoint_record_path(self.flag)
        self.error: BaseException | None = None  # what the checkpoint method raised
        self._interrupt = threading.Event()  # the watcher asked the main thread to stop
        self._closed = threading.Event()
        self._stopped = False
        self._saved = False  # take() replaced the spec: its event is still to be written
        self._previous: Any = None
        self._thread = threading.Thread(target=self._watch, name="nvrx-checkpoint", daemon=True)

    def __enter__(self) -> CheckpointGuard:
        previous = signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)
        self._previous = signal.SIG_DFL if previous is None else previous  # None: not from Python
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._stopped = True  # from here on, an interrupt of ours is ignored
            self._closed.set()
        finally:  # the interrupt may land here first, and raise CheckpointStop
            self._thread.join()
            signal.signal(INTERRUPT_SIGNAL, self._previous)
            unrecorded = exc_type is None and not self.record.exists()  # it returned
            if unrecorded and self.rank == 0 and self.flag.exists():
                self.take()  # on the warning, before the watcher interrupted it
            if self._saved:  # not in the handler: the interrupted code may hold emit's lock
                record_checkpoint(self.spec_file, None)

    def _watch(self) -> None:
        """Wait for the flag (and, beside rank 0, for rank 0's record), then interrupt."""
        waited = [self.flag] if self.rank == 0 else [self.flag, self.record]
        for path in waited:
            while not path.exists():
                if self._closed.wait(POLL_S):
                    return
        if signal.getsignal(INTERRUPT_SIGNAL) != self._on_interrupt:
            log.warning(
                "the callable replaced nvrx's %s handler: rank %d stops only %s",
                INTERRUPT_SIGNAL.name,
                self.rank,
                "when it returns" if self.rank == 0 else "at the end of the warning window",
            )
        self._interrupt.set()
        signal.pthread_kill(threading.main_thread().ident or 0, INTERRUPT_SIGNAL)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self._interrupt.is_set():  # not ours: the handler there was before
            if callable(self._previous):
                self._previous(signum, frame)
            return
        if self._stopped:
            return  # the call already ended
        self._stopped = True
        if self.rank == 0:
            self.take()
        raise CheckpointStop

    def take(self) -> None:
        """Call the checkpoint method; replace the spec with what it returns, record the outcome."""
        log.warning("the job was warned: calling %s of the callable", self.method.__name__)
        try:
            delayed = self.method(*self.args, **self.kwargs)
        except Exception as exc:
            self.error = exc
            self._refuse(f"the checkpoint of the submitted callable raised {exc!r}")
            return
        if delayed is None:
            self._refuse("the submitted callable's checkpoint returned None (no requeue)")
            return
        try:
            fn, args, kwargs = delayed.function, tuple(delayed.args), dict(delayed.kwargs)
            dump_spec(self.spec_file, fn, args, kwargs)  # atomic: the next run loads it
        except (AttributeError, TypeError, ValueError, OSError) as exc:
            self.error = exc
            what = f"the checkpoint returned {delayed!r}"
            self._refuse(f"{what}, which cannot be saved as the next run's call: {exc}")
            return
        self._saved = True
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        write_checkpoint_record(self.flag, True, f"checkpoint taken: the next run calls {name}")

    def _refuse(self, reason: str) -> None:
        log.warning("not requeueing the job: %s", reason)
        write_checkpoint_record(self.flag, False, reason)
