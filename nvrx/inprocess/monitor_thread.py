"""Delivering a restart to the main thread, and the thread that watches for faults.

``MonitorThread`` blocks in one server-side ``wait`` on the round's
interruption (``rounds.interrupted_key``), which every way out of a round sets (a
fault, a rank that leaves, the completion barrier): it asks the store nothing while
the round runs, however long. A job with a secret seals the interruption; one that
does not unseal (a forged write) is passed over and the thread waits on. When any
rank records a fault it wakes the round's completion barrier, runs ``Abort`` (so
that a main thread blocked in a collective returns to Python) and then raises
``RankShouldRestart`` in the main thread: through a signal whose handler raises it (the signal also
interrupts blocking system calls such as ``time.sleep``), or, when the application
handles that signal itself, with ``PyThreadState_SetAsyncExc``. (The Wrapper runs in the
main thread only: ``call_wrapper`` refuses another.) A thread whose store connection
fails restarts its rank the same way, abort included, and keeps the error (``error``):
the rank records it, since no other rank learns of it otherwise. Once the rank is done with
the round (it completed, leaves, or restarts already: ``stop``) such a failure only
keeps the error. A signal that lands
in the few bytecodes before a blocking call (a ``time.sleep`` right after the abort made
a collective fail) interrupts nothing: its handler runs once the call returns. So the
thread signals again, sooner first, until the main thread took the restart
(``Delivery.keep_waking``; the signal's route only: ``PyThreadState_SetAsyncExc``
interrupts no blocking call at all).

``Delivery`` is the small state machine the two threads share, so that the
restart is raised exactly once, only while the main thread runs user code, and only
in the round whose thread requests it (an abort that outlasted the main thread's wait
ends in a later round and restarts nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NoReturn

from nvrx.store import errors as store_errors
from nvrx.store import rounds

log = logging.getLogger(__name__)

#: Signal that wakes a main thread blocked in an interruptible system call.
WAKE_SIGNAL = signal.SIGRTMIN + 5


#: Bound on the main thread waiting for its monitor thread: for the restart
#: request after a fault was recorded (``Delivery.await_restart``), and for the
#: thread itself to end (it runs ``abort``) before the restart goes on.
RESTART_WAIT_S = 60.0

#: The monitor thread renews its store wait this often: once a day, so that the
#: renewals add nothing that counts to the store's load, and its connection is never
#: idle for the five days after which a stateful firewall (Linux conntrack) forgets
#: it. Nothing wakes it this way (the interrupted key does); it only bounds a thread
#: left behind by a rank that left without interrupting its round
#: (``MonitorThread.finish``).
WAIT_CHUNK_S = 24 * 3600.0

#: How long ``MonitorThread.finish`` waits for a thread that has not woken yet.
WAKE_WAIT_S = 5.0

#: The first wait before the restart's signal is sent again (``Delivery.keep_waking``),
#: doubled each time up to ``RESIGNAL_MAX_S``; no signal is sent again after ``RESIGNAL_FOR_S``.
RESIGNAL_FIRST_S = 0.002
RESIGNAL_MAX_S = 0.1
RESIGNAL_FOR_S = 2.0


class RankShouldRestart(BaseException):
    """Raised in the main thread: a rank faulted and every rank restarts.

    A ``BaseException`` so that ``except Exception`` in training code does not
    swallow it; code that catches ``BaseException`` must re-raise it.
    """


def async_raise(
    tid: int, exc_type: type[BaseException] | None, event: threading.Event | None = None
) -> int:
    """Schedule ``exc_type`` in thread ``tid`` (None clears a scheduled one); returns threads affected.

    With ``event``, waits for it to be set first. Unlike the reference, a
    thread id that matches no thread returns 0 instead of raising.
    """
    if event is not None:
        event.wait()
    if sys.is_finalizing():
        return 0
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = [ctypes.c_ulong, ctypes.py_object]
    set_async.restype = ctypes.c_int
    if exc_type is None:
        set_async.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
        return set_async(tid, None)
    count = set_async(tid, exc_type)
    if count > 1:
        set_async.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
        set_async(tid, None)
        raise RuntimeError(f"async exception reached {count} threads for thread id {tid}")
    return count


def delayed_async_raise(tid: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in thread ``tid`` from a helper thread (callable where raising is not)."""
    threading.Thread(target=async_raise, args=(tid, exc_type), daemon=True).start()


def async_abort_main_thread(msg: str | None = None) -> None:
    """Raise ``RankShouldRestart`` (carrying ``msg`` when given) in the main thread."""
    exc_type: type[RankShouldRestart] = RankShouldRestart
    if msg is not None:
        text = msg

        class RankShouldRestartWithMessage(RankShouldRestart):
            # the C API raises a type, not an instance: the message comes with the type
            def __init__(self) -> None:
                super().__init__(text)

        exc_type = RankShouldRestartWithMessage
    main = threading.main_thread().ident
    if main is None or async_raise(main, exc_type) != 1:
        raise RuntimeError("async_abort_main_thread: the main thread could not be reached")


class Delivery:
    """Who raises the restart in the main thread, and when (see module doc)."""

    IDLE, USER, WAITING, RAISED, DONE = range(5)

    def __init__(self) -> None:
        self.main_ident = threading.main_thread().ident or threading.get_ident()
        self.lock = threading.Lock()
        self.atomic_lock = threading.RLock()
        self.requested = threading.Event()
        self.taken = threading.Event()  # set while no restart waits raised (``keep_waking``)
        self.state = self.IDLE
        self.message = ""
        self.round = 0  # counts ``reset``: a thread delivers only into the round it watched
        self._signal_installed = False

    @property
    def state(self) -> int:
        return self._state

    @state.setter
    def state(self, state: int) -> None:
        self._state = state
        if state == self.RAISED:
            self.taken.clear()
        else:
            self.taken.set()

    # main thread --------------------------------------------------------------
    def install_signal(self) -> None:
        """Install the wake-up handler (main thread only; skipped if the signal is taken)."""
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(WAKE_SIGNAL)
        if current not in (signal.SIG_DFL, signal.SIG_IGN, None) and current != self._on_signal:
            log.warning(
                "signal %s has a handler already: blocking calls are not woken", WAKE_SIGNAL
            )
            return
        signal.signal(WAKE_SIGNAL, self._on_signal)
        self._signal_installed = True

    def uninstall_signal(self) -> None:
        # Ignored rather than default: a late wake-up must never terminate the process.
        if self._signal_installed and threading.current_thread() is threading.main_thread():
            signal.signal(WAKE_SIGNAL, signal.SIG_IGN)
            self._signal_installed = False

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        if self.state == self.RAISED:
            self.state = self.DONE
            raise RankShouldRestart(self.message)

    def _clear_async(self) -> None:
        if not self._signal_installed:
            async_raise(self.main_ident, None)

    def reset(self) -> None:
        """Start of a round: nothing requested yet."""
        with self.lock:
            self.round += 1
            self.state = self.IDLE
            self.requested.clear()
            self.message = ""

    def enter_user(self) -> None:
        with self.lock:
            if self.requested.is_set():
                self.state = self.DONE
                raise RankShouldRestart(self.message)
            self.state = self.USER

    def leave_user(self) -> None:
        """User code is over (normally or by a local fault); a restart already raised is taken now."""
        with self.lock:
            raised = self.state == self.RAISED
            self.state = self.IDLE
            if raised:
                self._clear_async()
        if raised:
            self.state = self.DONE
            raise RankShouldRestart(self.message)

    def caught(self) -> None:
        """The main thread caught RankShouldRestart: drop any second copy still scheduled."""
        self.state = self.DONE
        self._clear_async()

    def settle(self) -> None:
        """Like ``caught``, for an exit path: a restart raised right now is absorbed here."""
        try:
            self.caught()
        except RankShouldRestart:
            self.caught()

    def begin_wait(self) -> None:
        """From now on the restart is awaited here, never raised asynchronously."""
        with self.lock:
            if self.state == self.RAISED:
                self._clear_async()
            self.state = self.WAITING

    def await_restart(self, timeout: float) -> NoReturn:
        """Block until the monitor thread requests the restart, then raise it here."""
        self.begin_wait()
        if not self.requested.wait(timeout):
            from .exception import InternalError

            raise InternalError(
                f"no restart request within {timeout:g} s after a fault was recorded"
            )
        self.state = self.DONE
        raise RankShouldRestart(self.message)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Hold off a restart while the block runs (blocks on a lock, never spins)."""
        with self.atomic_lock:
            if self.state == self.RAISED:
                self.state = self.DONE
                self._clear_async()
                raise RankShouldRestart(self.message)
            yield

    # monitor thread -------------------------------------------------------------
    def deliver(self, message: str, of_round: int) -> bool:
        """Request the restart of round ``of_round`` (``round`` when its thread started); False,
        and nothing requested, when the main thread went on to a later round meanwhile (the
        thread's abort outlasted the main thread's wait for it)."""
        with self.lock:
            if of_round != self.round:
                return False
            self.message = message
            self.requested.set()  # before the raise: the main thread that takes it reads it
            if self.state == self.USER:
                self.state = self.RAISED
                if self._signal_installed:
                    # The handler raises in the main thread at its next bytecode, and the
                    # signal also interrupts a blocking system call (sleep, select, ...).
                    signal.pthread_kill(self.main_ident, WAKE_SIGNAL)
                else:
                    async_raise(self.main_ident, RankShouldRestart)
        return True

    def keep_waking(self) -> None:
        """Signal the main thread again while it has not taken the restart raised by
        ``deliver`` (``RESIGNAL_FOR_S`` at most): the first signal may have landed just
        before a blocking call, which it then did not interrupt."""
        delay, deadline = RESIGNAL_FIRST_S, time.monotonic() + RESIGNAL_FOR_S
        while self._signal_installed and not self.taken.wait(delay):
            with self.lock:
                if self.state != self.RAISED or time.monotonic() > deadline:
                    return
                signal.pthread_kill(self.main_ident, WAKE_SIGNAL)
            delay = min(2 * delay, RESIGNAL_MAX_S)


class MonitorThread(threading.Thread):
    """Waits for the round's interruption and turns it into a restart of this rank."""

    def __init__(
        self,
        store: Any,
        delivery: Delivery,
        abort: Callable[[Any], Any] | None,
        frozen_state: Any,
        chunk: float = WAIT_CHUNK_S,
        on_rejected: Callable[[rounds.Interruption], None] | None = None,
    ) -> None:
        super().__init__(name="nvrx-monitor-thread", daemon=True)
        self.store = store
        self.on_rejected = on_rejected  # an interruption whose seal did not verify
        self.delivery = delivery
        self.round = delivery.round  # the round this thread watches
        self.abort = abort
        self.frozen_state = frozen_state
        self.chunk = chunk
        self.stop = threading.Event()
        self.woke = threading.Event()
        self.seen_mono: float | None = None
        self.abort_s: float | None = None
        self.abort_ok = True
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self._wait_for_fault():
                self.seen_mono = time.monotonic()
                rounds.wake_completion(self.store)  # ranks waiting to complete, and spares
                self._restart_main_thread("a rank faulted: restarting")
        except BaseException as exc:  # its store connection failed: this rank sees no fault now
            # Restarted as for a fault (the abort included: its main thread may be blocked in
            # a collective), it records the failure (``RoundRun``), which restarts the others,
            # and its next round watches on a new connection (``round_run.restart``).
            self.error = exc
            log.error("monitor thread failed: %r", exc)
            self._let_go_of_store(exc)
            if self.stop.is_set():  # the rank is done with the round: an abort would only
                return  # tear down the groups that its finalize, or its code after the call, uses
            self._restart_main_thread(f"monitor thread failed: {exc!r}")

    def _let_go_of_store(self, exc: BaseException) -> None:
        """Drop the references this thread holds to its failed connection: its own and those
        of the ended frames in ``exc``'s traceback (the store view that raised). ``error``
        keeps that traceback, which refers back to this thread: a cycle that would hold the
        connection open until a garbage collection; now it closes when the rank replaces it."""
        self.store = None
        traceback.clear_frames(exc.__traceback__)  # the running frame (``run``) stays as it is

    def _wait_for_fault(self) -> bool:
        """Block until the round is interrupted; True for a fault, False when it completed or
        we stop. An interruption that does not unseal is passed over (``on_rejected``)."""
        generation = 1
        while generation <= rounds.MAX_GENERATIONS:
            key = rounds.interrupted_key(generation)
            try:
                self.store.wait([key], timedelta(seconds=self.chunk))
            except store_errors.timeouts():
                if self.stop.is_set():
                    return False
                continue
            found = rounds.read_interruption(self.store, generation)
            if found.value is not None:
                break
            log.warning("passed over an interruption of the round with no valid seal at %s", found.key)
            if self.on_rejected is not None:
                self.on_rejected(found)
            generation += 1
        else:  # as ``rounds.interrupt`` gives up: a fault, so that the round ends somehow
            log.error("every generation of the round's interruption holds a forged value")
            found = rounds.Interruption(generation, "fault", key, 0)
        self.woke.set()
        return found.value != rounds.DONE and not self.stop.is_set()

    def finish(self, timeout: float = RESTART_WAIT_S) -> bool:
        """This rank leaves: let an abort in progress end (up to ``timeout``); True when the thread ended.

        A rank's leave interrupts its round, which wakes the thread at once. A
        thread that still has not woken after ``WAKE_WAIT_S`` waits for a round
        that nobody interrupted (a rank without a rank number left): it is left
        to end at its next renewal, ``WAIT_CHUNK_S`` at most.
        """
        self.stop.set()
        deadline = time.monotonic() + timeout
        self.join(min(timeout, WAKE_WAIT_S))  # at once for a thread that ended (its store failed)
        if self.is_alive() and self.woke.is_set():  # an abort in progress
            self.join(max(0.0, deadline - time.monotonic()))
        return not self.is_alive()

    def _restart_main_thread(self, message: str) -> None:
        """Run ``abort`` (the main thread may be blocked in a collective), deliver the restart."""
        seen = self.seen_mono or time.monotonic()
        with self.delivery.atomic_lock:
            t0 = time.monotonic()
            if self.round == self.delivery.round:  # not a later round's commits
                tell_kept_state(seen)
            try:
                if self.abort is not None:
                    self.abort(self.frozen_state)
            except Exception as exc:
                self.abort_ok = False
                log.critical("abort failed: %r", exc)
            late = self.round != self.delivery.round  # the main thread went on meanwhile
            if not late:  # (a later round's commits are no copies this fault spoilt)
                tell_kept_state(seen)  # the copies queued while the abort ran
            self.abort_s = time.monotonic() - t0
            if late or not self.delivery.deliver(message, self.round):
                log.warning("the abort ended after this rank went on to a later round: no restart")
                return
        self.delivery.keep_waking()


def tell_kept_state(since: float) -> None:
    """Tell this process's kept states that a fault at ``since`` interrupted the step, so
    that no device copy it spoilt becomes a commit (``kept_state.interrupted``): the
    monitor thread before its abort and after it, the main thread once it took the
    restart (no commit follows). Nothing where none was made (the module is imported
    where one is). A failure here is logged: it never keeps the abort from running."""
    kept = sys.modules.get("nvrx.inprocess.kept_state")
    if kept is None:
        return
    try:
        kept.interrupted(since)
    except Exception as exc:  # a CUDA error a query raises, a set changed while read
        log.error("kept state not told of the fault: %r", exc)


@contextlib.contextmanager
def reraise_if_unraisable(exc_type: type[BaseException]) -> Iterator[None]:
    """Re-raise ``exc_type`` in the main thread when Python reports it as unraisable.

    A restart raised while the main thread ran a ``__del__`` or a weakref
    callback is printed and dropped by Python; this puts it back.
    """
    previous = sys.unraisablehook
    main = threading.main_thread().ident

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, exc_type) and main is not None:
            delayed_async_raise(main, exc_type)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
