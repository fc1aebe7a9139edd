"""Inject a fault into some ranks of a job after a delay, to test the restart machinery.

``inject_fault(faults, num_faults, keep_alive, delay, seed)`` is called on
every rank with the same arguments. With the seed it draws, identically on
every rank, how many ranks fault (``num_faults``, at most ``WORLD_SIZE -
keep_alive``), which ones (never the first ``keep_alive`` ranks), which kind
of fault and (for a ``(low, high)`` delay) when. On a chosen rank a daemon
thread waits ``delay`` seconds, calls ``callback`` and injects the fault;
``inject_fault`` itself returns at once.

The kinds (``Fault``) and what the rank then sees:

* ``ASYNC_EXC``: ``InjectedException`` raised asynchronously in the main thread;
* ``SIGNAL_EXC``: ``SIGUSR1``, whose handler raises ``InjectedException`` (it
  interrupts a blocking system call such as ``time.sleep``);
* ``WORKLOAD_EXC``: the next ``maybe_raise_workload_exception()`` call of the
  workload raises ``InjectedException``;
* ``LOCK_GIL``: a thread holds the GIL forever (every Python thread stops);
* ``SEGFAULT``: an invalid memory read (``SIGSEGV``); ``OS_ABORT``: ``os.abort()``
  (``SIGABRT``);
* ``SIGINT``, ``SIGKILL``, ``SIGTERM``, ``SIGSTOP``: that signal to the process;
* ``GPU_ERROR`` (a device-side assert) and ``GPU_SLEEP`` (a kernel that never
  ends): need CUDA; without it ``inject_fault`` raises ``RuntimeError``.

The older names of the kinds (``GPU``, ``ABORT``, ``GIL``, ``INT``, ``KILL``,
``TERM``, ``STOP``) are aliases. Signals are sent by a thread of the process
itself, not by a forked helper process as in the reference.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import random
import re
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


class Fault(enum.Enum):
    """Kinds of injected faults (see the module doc)."""

    GPU_ERROR = 1
    GPU_SLEEP = 2
    ASYNC_EXC = 3
    SIGNAL_EXC = 4
    OS_ABORT = 5
    LOCK_GIL = 6
    SEGFAULT = 7
    SIGINT = 8
    SIGKILL = 9
    SIGTERM = 10
    SIGSTOP = 11
    WORKLOAD_EXC = 12
    # older names of the same kinds
    GPU = 1
    ABORT = 5
    GIL = 6
    INT = 8
    KILL = 9
    TERM = 10
    STOP = 11


GPU_FAULTS = frozenset({Fault.GPU_ERROR, Fault.GPU_SLEEP})

_SIGNALS = {
    Fault.SIGINT: signal.SIGINT,
    Fault.SIGKILL: signal.SIGKILL,
    Fault.SIGTERM: signal.SIGTERM,
    Fault.SIGSTOP: signal.SIGSTOP,
}


class InjectedException(Exception):
    """The exception that the exception kinds of ``Fault`` raise in the workload."""


_workload_raise = threading.Event()


def maybe_raise_workload_exception() -> None:
    """Raise ``InjectedException`` once if a ``WORKLOAD_EXC`` fault fired since the last call."""
    if _workload_raise.is_set():
        _workload_raise.clear()
        raise InjectedException("injected workload exception (Fault.WORKLOAD_EXC)")


def _raise_in_main_thread(_signum: int, _frame: Any) -> None:
    raise InjectedException("injected exception (Fault.SIGNAL_EXC)")


def _async_raise_main() -> None:
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = [ctypes.c_ulong, ctypes.py_object]
    set_async.restype = ctypes.c_int
    main = threading.main_thread().ident
    if main is None or set_async(main, InjectedException) != 1:
        raise RuntimeError("inject_fault: could not raise InjectedException in the main thread")


def _hold_gil() -> None:
    # The regex engine never releases the GIL; this pattern backtracks through
    # about 2**64 ways of splitting the subject before it could fail.
    re.match(r"(?:q|qq)+(?:q|qq)+(?:q|qq)+$", "q" * 96 + "!")


def _read_invalid_address() -> None:
    ctypes.c_char.from_address(8).value  # noqa: B018 - the read is the fault


def _gpu_error(device: int) -> None:
    import torch

    values = torch.zeros(2, device=f"cuda:{device}")
    values[torch.tensor([7], device=f"cuda:{device}")] = 1.0  # device-side assert
    torch.cuda.synchronize(device)


def _gpu_sleep(device: int) -> None:
    import torch

    torch.cuda.set_device(device)
    torch.cuda._sleep(1 << 62)


def _require_cuda(faults: Sequence[Fault]) -> int | None:
    """The current CUDA device when a GPU kind is requested; raises without CUDA."""
    gpu = sorted(f.name for f in set(faults) & GPU_FAULTS)
    if not gpu:
        return None
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"inject_fault: Fault.{', Fault.'.join(gpu)} needs CUDA, but torch.cuda.is_available() "
            f"is False on this host (torch {torch.__version__}); use a CPU fault kind"
        )
    return torch.cuda.current_device()


def _action(fault: Fault, device: int | None) -> Callable[[], None]:
    """What the injecting thread does when the delay is over."""
    pid = os.getpid()
    if fault in _SIGNALS:
        return lambda: os.kill(pid, _SIGNALS[fault])
    actions: dict[Fault, Callable[[], None]] = {
        Fault.ASYNC_EXC: _async_raise_main,
        Fault.SIGNAL_EXC: lambda: os.kill(pid, signal.SIGUSR1),
        Fault.WORKLOAD_EXC: _workload_raise.set,
        Fault.LOCK_GIL: _hold_gil,
        Fault.SEGFAULT: _read_invalid_address,
        Fault.OS_ABORT: os.abort,
        Fault.GPU_ERROR: lambda: _gpu_error(device or 0),
        Fault.GPU_SLEEP: lambda: _gpu_sleep(device or 0),
    }
    return actions[fault]


def _fire(
    fault: Fault, delay: float, action: Callable[[], None], callback: Callable[[], Any] | None
) -> None:
    threading.Event().wait(delay)
    log.critical("injecting %s after %.3f s", fault, delay)
    if callback is not None:
        callback()
    action()


def _bounds(name: str, value: Any, kind: type | tuple[type, ...]) -> tuple[Any, Any, bool]:
    """``(low, high, drawn)``: a number is its own range; a pair is drawn from."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return value, value, False
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1], True
    raise TypeError(f"inject_fault: {name} must be a number or a (low, high) pair, got {value!r}")


def inject_fault(
    faults: Sequence[Fault],
    num_faults: int | tuple[int, int],
    keep_alive: int,
    delay: float | tuple[float, float],
    seed: int,
    callback: Callable[[], Any] | None = None,
) -> Fault | None:
    """Schedule one of ``faults`` on some ranks (see the module doc); the Fault of this rank or None.

    Args:
        faults: kinds to draw from.
        num_faults: how many ranks fault, or a ``(min, max)`` range to draw from.
        keep_alive: the ranks below this number never fault.
        delay: seconds before the fault, or a ``(low, high)`` range to draw from.
        seed: seed of the draw; the same on every rank, so ranks agree.
        callback: called by the injecting thread just before the fault.
    """
    faults = list(faults)
    if not faults or not all(isinstance(f, Fault) for f in faults):
        raise TypeError(
            f"inject_fault: faults must be a non-empty sequence of Fault, got {faults!r}"
        )
    min_faults, max_faults, _ = _bounds("num_faults", num_faults, int)
    low, high, drawn = _bounds("delay", delay, (int, float))
    device = _require_cuda(faults)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    # The draws in the reference's order, so one seed picks the same ranks and kind.
    generator = random.Random(seed)
    delay_s = generator.uniform(low, high) if drawn else float(low)
    count = min(generator.randint(min_faults, max_faults), max(world_size - keep_alive, 0))
    ranks = generator.sample(range(keep_alive, world_size), count)
    fault = generator.sample(faults, 1)[0]
    if rank not in ranks:
        return None

    log.info("seed=%s ranks=%s fault=%s delay=%.3f s", seed, sorted(ranks), fault, delay_s)
    if fault is Fault.SIGNAL_EXC:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("inject_fault: Fault.SIGNAL_EXC must be set up from the main thread")
        signal.signal(signal.SIGUSR1, _raise_in_main_thread)
    thread = threading.Thread(
        target=_fire,
        args=(fault, delay_s, _action(fault, device), callback),
        name=f"nvrx-inject-{fault.name}",
        daemon=True,
    )
    thread.start()
    return fault


__all__ = ["Fault", "InjectedException", "inject_fault", "maybe_raise_workload_exception"]
