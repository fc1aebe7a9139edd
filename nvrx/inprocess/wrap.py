"""``Wrapper`` and ``CallWrapper``: re-run a training function in-process after a fault.

One round of the restart loop (every rank, keys under ``nvrx/r<round>/``):

1. ``initialize``, the user ``health_check``, then the function (active
   ranks) while a ``MonitorThread`` waits for the round's interruption and the
   monitor process watches progress, death and heartbeats;
2. success: the completion barrier, then ``completion`` and return;
3. a fault anywhere: the faulting rank records it (JSON) and interrupts the
   round; every rank's monitor thread runs ``abort`` and raises
   ``RankShouldRestart`` in its main thread; then ``finalize``, the restart
   health check, the iteration barrier (dead ranks arrive by proxy through
   their monitor process; the last arrival publishes the terminated ranks),
   ``rank_assignment``, and the next round;
4. a ``BaseException`` (``RestartAbort``, ``RankDiscarded``, a failed
   ``finalize`` or health check, ``KeyboardInterrupt``...) takes this rank out:
   it registers itself terminated so the others go on, runs ``terminate`` and
   re-raises (a ``terminate`` that raises: its exception, caused by the first).
   Under an nvrx supervisor ``RestartAbort`` exits the process with code 130
   ("stop the job, do not restart"; the supervisors exit 12).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import numbers
import os
import warnings
from collections.abc import Callable
from typing import Any

from . import gloo_abort
from . import store as rstore
from .abort import Abort, AbortTorchDistributed
from .call_wrapper import CallWrapper
from .completion import Completion
from .compose import Compose
from .exception import RestartAbort
from .finalize import Finalize, as_seconds
from .health_check import HealthCheck
from .initialize import Initialize
from .rank_assignment import ActivateAllRanks, RankAssignment, ShiftRanks
from .rank_filter import RankFilter
from .supervision import supervised
from .terminate import Terminate
from .wrapper_settings import Timings

_DEFAULT = object()  # "build a fresh default instance for this Wrapper"
_Timing = datetime.timedelta | float

#: The timings of the Wrapper that may be 0: a ``last_call_wait`` that is not slept, no
#: grace between SIGTERM and SIGKILL, no wait for a replacement process. Every other one
#: must be > 0 (a ``completion_timeout`` of 0 would be a barrier that never waits).
MAY_BE_ZERO = ("last_call_wait", "termination_grace_time", "rejoin_timeout")


def _timing(name: str) -> property:
    """The Wrapper's attribute ``name``: a ``timedelta``, as the reference's is (code written
    for it calls ``total_seconds()``). Set later, its range is checked as the argument's is
    (not its order against the other timings, which may be changed one after the other);
    a call made after that reads it from ``seconds``."""

    def get(self: Wrapper) -> datetime.timedelta:
        return datetime.timedelta(seconds=getattr(self.seconds, name))

    def set_(self: Wrapper, value: _Timing) -> None:
        seconds = as_seconds(value, f"Wrapper: {name}", positive=name not in MAY_BE_ZERO)
        setattr(self.seconds, name, seconds)

    return property(get, set_, doc=f"``{name}`` as a ``timedelta``.")


def _check_instance(name: str, value: Any, cls: type, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, cls):
        raise TypeError(
            f"Wrapper: {name} must be an instance of {cls.__module__}.{cls.__qualname__}"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )


def _host_rank(value: Any, store_factory: type) -> int:
    """``store_kwargs['tcp_store_host_rank']`` as an int: None is the store class's
    ``TCP_STORE_HOST_RANK``, as in the reference; a rank, or -1 for an external store."""
    if value is None:
        return int(store_factory.TCP_STORE_HOST_RANK)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            "Wrapper: store_kwargs['tcp_store_host_rank'] must be an int (the rank whose "
            f"monitor process hosts the store, or -1 for an external store), got {value!r}"
        )
    if value < -1:
        raise ValueError(
            "Wrapper: store_kwargs['tcp_store_host_rank'] must be a rank (>= 0), or -1 for an "
            f"external store, got {value}"
        )
    return int(value)


class Wrapper:
    """Decorator that restarts the wrapped function in-process after a fault on any rank.

    Keyword-only arguments: every argument of the reference, with its name and
    default (the compatibility table of docs/inprocess.md lists them), plus
    ``rejoin_timeout``; timeouts take a ``datetime.timedelta`` or seconds:

    store_factory / store_kwargs: the store class (a ``StoreMixin`` subclass,
        default ``store.TCPStore``) and its arguments. With the default
        factory the store runs in a separate service process started by rank
        ``tcp_store_host_rank`` (default 0), on ``NVRX_STORE_PORT`` or
        ``MASTER_PORT + 1``; with ``NVRX_STORE_HOST``/``NVRX_STORE_PORT`` set
        (an nvrx supervisor) the external store is used, whatever host and port
        ``store_kwargs`` name (said once at INFO), and no rank hosts one.
    initialize, abort, finalize, health_check, rank_assignment, completion,
        terminate: plug-ins (see their modules). ``abort`` defaults to a fresh
        ``AbortTorchDistributed()``, ``rank_assignment`` to a fresh
        ``Compose(ActivateAllRanks(), ShiftRanks())``.
    rank_filter (None, deprecated as in the reference): an old-style
        ``rank_filter.RankFilter`` (State -> State) run after every rank
        assignment; it warns with ``DeprecationWarning``.
    monitor_process_interval (1 s), heartbeat_interval (1 s),
        progress_watchdog_interval (1 s): periods.
    monitor_thread_interval (1 s): accepted and validated as in the reference;
        the monitor thread does not poll: one server-side store wait per round,
        which the round's end or fault ends, so a rank adds no store traffic
        while it trains.
    soft_timeout (60 s): no progress for this long restarts every rank.
    hard_timeout (90 s): no progress for this long terminates the rank
        (SIGCONT+SIGTERM, ``termination_grace_time`` (5 s), SIGKILL).
    heartbeat_timeout (30 s): a rank's monitor silent this long is dead.
    barrier_timeout (120 s), completion_timeout (120 s): barrier limits.
    last_call_wait (1 s): accepted and validated as in the reference, but not
        slept: the window for concurrent faults is the iteration barrier, which
        goes on once every rank of the round reported (itself, or through its
        monitor or supervisor); every fault recorded until then is in the
        restart, one recorded later is not.
    rejoin_timeout (60 s, nvrx addition): under an nvrx supervisor, how long
        peers wait for the replacement of a dead process before the rank
        assignment removes it.
    monitor_process_logfile / monitor_process_pidfile: absolute paths, ``{rank}``
        is replaced by the initial rank.
    enabled (True): False returns the function unchanged.

    Every timing is finite and at most ten years; all but ``last_call_wait``,
    ``termination_grace_time`` and ``rejoin_timeout`` are > 0, those three >= 0. A bad
    value raises ``ValueError`` naming the parameter, the constraint and the value.
    """

    # the timings: ``timedelta``s as the reference has them; ``seconds`` holds them for the call
    seconds: Timings
    monitor_thread_interval = _timing("monitor_thread_interval")
    monitor_process_interval = _timing("monitor_process_interval")
    heartbeat_interval = _timing("heartbeat_interval")
    progress_watchdog_interval = _timing("progress_watchdog_interval")
    soft_timeout = _timing("soft_timeout")
    hard_timeout = _timing("hard_timeout")
    heartbeat_timeout = _timing("heartbeat_timeout")
    barrier_timeout = _timing("barrier_timeout")
    completion_timeout = _timing("completion_timeout")
    last_call_wait = _timing("last_call_wait")
    termination_grace_time = _timing("termination_grace_time")
    rejoin_timeout = _timing("rejoin_timeout")

    def __init__(
        self,
        *,
        store_factory: type = rstore.TCPStore,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Initialize | None = None,
        abort: Abort | None = _DEFAULT,  # type: ignore[assignment]
        finalize: Finalize | None = None,
        health_check: HealthCheck | None = None,
        rank_assignment: RankAssignment = _DEFAULT,  # type: ignore[assignment]
        rank_filter: RankFilter | None = None,
        monitor_thread_interval: datetime.timedelta | float = datetime.timedelta(seconds=1),
        monitor_process_interval: datetime.timedelta | float = datetime.timedelta(seconds=1),
        heartbeat_interval: datetime.timedelta | float = datetime.timedelta(seconds=1),
        progress_watchdog_interval: datetime.timedelta | float = datetime.timedelta(seconds=1),
        soft_timeout: datetime.timedelta | float = datetime.timedelta(seconds=60),
        hard_timeout: datetime.timedelta | float = datetime.timedelta(seconds=90),
        heartbeat_timeout: datetime.timedelta | float = datetime.timedelta(seconds=30),
        barrier_timeout: datetime.timedelta | float = datetime.timedelta(seconds=120),
        completion_timeout: datetime.timedelta | float = datetime.timedelta(seconds=120),
        last_call_wait: datetime.timedelta | float = datetime.timedelta(seconds=1),
        termination_grace_time: datetime.timedelta | float = datetime.timedelta(seconds=5),
        monitor_process_logfile: str | None = None,
        monitor_process_pidfile: str | None = None,
        enabled: bool = True,
        completion: Completion | None = None,
        terminate: Terminate | None = None,
        rejoin_timeout: datetime.timedelta | float = datetime.timedelta(seconds=60),
    ) -> None:
        self._set_store(store_factory, store_kwargs)
        self._set_plugins(
            initialize=initialize,
            abort=AbortTorchDistributed() if abort is _DEFAULT else abort,
            finalize=finalize,
            health_check=health_check,
            rank_assignment=(
                Compose(ActivateAllRanks(), ShiftRanks())
                if rank_assignment is _DEFAULT
                else rank_assignment
            ),
            rank_filter=rank_filter,
            completion=completion,
            terminate=terminate,
        )
        self._set_files(enabled, monitor_process_logfile, monitor_process_pidfile)
        self._set_timings(
            monitor_thread_interval=monitor_thread_interval,
            monitor_process_interval=monitor_process_interval,
            heartbeat_interval=heartbeat_interval,
            progress_watchdog_interval=progress_watchdog_interval,
            soft_timeout=soft_timeout,
            hard_timeout=hard_timeout,
            heartbeat_timeout=heartbeat_timeout,
            barrier_timeout=barrier_timeout,
            completion_timeout=completion_timeout,
            last_call_wait=last_call_wait,
            termination_grace_time=termination_grace_time,
            rejoin_timeout=rejoin_timeout,
        )

    def _set_store(self, store_factory: type, store_kwargs: dict[str, Any] | None) -> None:
        if not (isinstance(store_factory, type) and issubclass(store_factory, rstore.StoreMixin)):
            raise TypeError(
                f"Wrapper: store_factory must be a subclass of nvrx.inprocess.store.StoreMixin, got {store_factory!r}"
            )
        if store_kwargs is not None and not isinstance(store_kwargs, dict):
            raise TypeError(f"Wrapper: store_kwargs must be a dict or None, got {store_kwargs!r}")
        if not issubclass(store_factory, rstore.TCPStore) and store_factory.__module__ == "__main__":
            raise TypeError(
                f"Wrapper: store_factory {store_factory.__qualname__} is defined in the script run "
                "as __main__: the rank's monitor process, which makes its own store of it, cannot "
                "import it there; define it in a module the script imports"
            )
        self.store_factory = store_factory
        self.store_kwargs = dict(store_kwargs or {})
        kwargs = self.store_kwargs
        if issubclass(store_factory, rstore.TCPStore) and "tcp_store_host_rank" in kwargs:
            kwargs["tcp_store_host_rank"] = _host_rank(kwargs["tcp_store_host_rank"], store_factory)

    def _set_plugins(
        self,
        *,
        initialize: Initialize | None,
        abort: Abort | None,
        finalize: Finalize | None,
        health_check: HealthCheck | None,
        rank_assignment: RankAssignment,
        rank_filter: RankFilter | None,
        completion: Completion | None,
        terminate: Terminate | None,
    ) -> None:
        """Check each plug-in's type; an old-style ``rank_filter`` runs after the assignment."""
        _check_instance("initialize", initialize, Initialize)
        _check_instance("abort", abort, Abort)
        _check_instance("finalize", finalize, Finalize)
        _check_instance("health_check", health_check, HealthCheck)
        _check_instance("rank_assignment", rank_assignment, RankAssignment, allow_none=False)
        _check_instance("rank_filter", rank_filter, RankFilter)
        if rank_filter is not None:
            warnings.warn(
                "Wrapper(rank_filter=...) is deprecated: put the filter in rank_assignment "
                "(nvrx.inprocess.rank_assignment.MaxActiveWorldSize, ActiveWorldSizeDivisibleBy)",
                DeprecationWarning,
                stacklevel=3,  # the caller of Wrapper(...)
            )
        _check_instance("completion", completion, Completion)
        _check_instance("terminate", terminate, Terminate)
        self.initialize = initialize
        self.abort = abort
        self.finalize = finalize
        self.health_check = health_check
        self.rank_filter = rank_filter
        self.rank_assignment = rank_assignment
        self.completion = completion
        self.terminate = terminate

    def _set_files(self, enabled: bool, logfile: str | None, pidfile: str | None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"Wrapper: enabled must be a bool, got {enabled!r}")
        for name, path in (
            ("monitor_process_logfile", logfile),
            ("monitor_process_pidfile", pidfile),
        ):
            if path is not None and (not isinstance(path, str) or not os.path.isabs(path)):
                raise ValueError(
                    f"Wrapper: {name} must be an absolute path (may contain {{rank}}), got {path!r}"
                )
        self.enabled = enabled
        self.monitor_process_logfile = logfile
        self.monitor_process_pidfile = pidfile

    def _set_timings(self, **timings: _Timing) -> None:
        """Each period and timeout in seconds (``as_seconds``: finite, at most ten years, > 0
        but for those of ``MAY_BE_ZERO``), then their order checked (``_validate``)."""
        self.seconds = Timings(**{
            name: as_seconds(value, f"Wrapper: {name}", positive=name not in MAY_BE_ZERO)
            for name, value in timings.items()
        })  # fmt: skip
        self._validate()

    def _validate(self) -> None:
        rules = [
            ("soft_timeout", "hard_timeout"),
            ("hard_timeout", "barrier_timeout"),
            ("monitor_process_interval", "barrier_timeout"),
            ("heartbeat_timeout", "barrier_timeout"),
            ("heartbeat_interval", "heartbeat_timeout"),
            ("monitor_process_interval", "heartbeat_timeout"),
            ("monitor_process_interval", "soft_timeout"),
            ("monitor_thread_interval", "soft_timeout"),
            ("progress_watchdog_interval", "soft_timeout"),
        ]
        for small, large in rules:
            a, b = getattr(self.seconds, small), getattr(self.seconds, large)
            if not a < b:
                raise ValueError(f"Wrapper: {small} ({a:g} s) must be < {large} ({b:g} s)")

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.enabled:
            return fn

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._call(fn, args, kwargs)
            except BaseException as exc:
                release_frames(exc)
                abort = RestartAbort.behind(exc)  # also behind a terminate plug-in that raised
                if abort is not None and supervised():
                    raise SystemExit(abort.exit_code) from exc
                raise

        return wrapped

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of ``fn`` under a fresh ``CallWrapper`` (held by this frame only)."""
        # gloo groups created during the call are tracked, so abort can interrupt them
        with gloo_abort.tracking(advise_below=self.seconds.hard_timeout), CallWrapper(self) as call_wrapper:
            return call_wrapper(fn, args, kwargs)


_NVRX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def release_frames(exc: BaseException) -> None:
    """Clear the locals of nvrx's frames in the tracebacks of ``exc`` and of its chain.

    An exception that leaves the Wrapper holds, through those frames, the whole
    call: its store connections, monitor handles and rounds. The restart loop
    also keeps the exception it re-raises, a reference cycle, so without this
    the call would outlive the exception until the garbage collector runs. The
    frames keep their code and line (tracebacks print as before); frames of
    user code keep their locals.
    """
    seen: set[int] = set()
    chain: list[BaseException | None] = [exc]
    while chain:
        current = chain.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_NVRX_DIR):
                with contextlib.suppress(RuntimeError):  # a frame still running
                    tb.tb_frame.clear()
            tb = tb.tb_next
        chain += [current.__context__, current.__cause__]
