"""``Wrapper``'s parameters, without running a call: defaults kept as attributes, every
parameter given a value other than its default, refused values, ``enabled=False``.

Each outcome is the attribute's value (timedeltas in seconds, objects by class name) or
the exception a construction raised, as the names of its classes a caller can catch.
CASE is unused.
"""

from __future__ import annotations

import datetime
import inspect
import warnings
from typing import Any

import common

TIMEDELTAS = (
    "monitor_thread_interval", "monitor_process_interval", "heartbeat_interval",
    "progress_watchdog_interval", "soft_timeout", "hard_timeout", "heartbeat_timeout",
    "barrier_timeout", "completion_timeout", "last_call_wait", "termination_grace_time",
)  # fmt: skip
OTHERS = ("store_kwargs", "initialize", "abort", "finalize", "health_check", "rank_assignment",
          "rank_filter", "monitor_process_logfile", "enabled", "completion", "terminate")  # fmt: skip


def value(v: Any) -> Any:
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    if v is None or isinstance(v, (bool, int, float, str, dict)):
        return v
    return type(v).__name__


def construct(inprocess: Any, **kwargs: Any) -> Any:
    """The attributes of ``Wrapper(**kwargs)``, or what a caller could catch of its refusal."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            w = inprocess.Wrapper(**kwargs)
    except Exception as exc:  # the type is the outcome
        return {"raised": [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]}
    found = {n: value(getattr(w, n, "<absent>")) for n in TIMEDELTAS + OTHERS}
    # the default's class is built on the fly in the reference: compare what it is an instance of
    found["rank_assignment"] = [
        isinstance(w.rank_assignment, inprocess.Compose),
        isinstance(w.rank_assignment, inprocess.rank_assignment.RankAssignment),
    ]
    return found


def non_defaults(inprocess: Any) -> dict[str, Any]:
    """A value other than the default for every parameter of the reference's ``Wrapper``."""
    s = datetime.timedelta(seconds=1)

    class Store(inprocess.store.TCPStore):
        pass

    class Finalize(inprocess.finalize.Finalize):
        def __call__(self, state: Any) -> Any:
            return state

    class Health(inprocess.health_check.HealthCheck):
        def __call__(self, state: Any) -> Any:
            return state

    class Completion(inprocess.completion.Completion):
        def __call__(self, state: Any) -> Any:
            return state

    class Terminate(inprocess.terminate.Terminate):
        def __call__(self, state: Any) -> Any:
            return state

    class Filter(inprocess.rank_filter.RankFilter):
        def __call__(self, state: Any) -> Any:
            return state

    ra = inprocess.rank_assignment
    return dict(
        store_factory=Store, store_kwargs={"port": 4000, "timeout": 7 * s},
        initialize=inprocess.initialize.RetryController(max_iterations=3), abort=None,
        finalize=Finalize(), health_check=Health(),
        rank_assignment=inprocess.Compose(ra.MaxActiveWorldSize(2), ra.ShiftRanks()),
        rank_filter=Filter(), monitor_thread_interval=2 * s, monitor_process_interval=2 * s,
        heartbeat_interval=2 * s, progress_watchdog_interval=2 * s, soft_timeout=30 * s,
        hard_timeout=40 * s, heartbeat_timeout=20 * s, barrier_timeout=50 * s,
        completion_timeout=60 * s, last_call_wait=2 * s, termination_grace_time=3 * s,
        monitor_process_logfile="/tmp/monitor-{rank}.log", enabled=False,
        completion=Completion(), terminate=Terminate(),
    )  # fmt: skip


def main() -> int:
    impl, out, _ = common.arguments()
    inprocess = common.module(impl, "inprocess")
    for sub in ("rank_assignment", "store", "initialize", "finalize", "health_check", "completion",
                "terminate", "rank_filter"):
        common.module(impl, f"inprocess.{sub}")
    s = datetime.timedelta(seconds=1)
    refused = {
        "soft_not_below_hard": dict(soft_timeout=5 * s, hard_timeout=5 * s),
        "hard_not_below_barrier": dict(hard_timeout=200 * s),
        "heartbeat_interval_not_below_timeout": dict(heartbeat_interval=40 * s),
        "seconds_as_float": dict(soft_timeout=5.0),
        "relative_logfile": dict(monitor_process_logfile="monitor-{rank}.log"),
        "store_factory_not_a_store": dict(store_factory=dict),
        "store_kwargs_not_a_dict": dict(store_kwargs=[("port", 1)]),
        "enabled_not_a_bool": dict(enabled=1),
        "abort_not_an_abort": dict(abort=lambda state: state),
    }

    def fn(x: int) -> int:
        return x + 1

    record = {
        "defaults": construct(inprocess),
        "non_defaults": construct(inprocess, **non_defaults(inprocess)),
        "refused": {name: construct(inprocess, **kw) for name, kw in refused.items()},
        "disabled_returns_fn_itself": inprocess.Wrapper(enabled=False)(fn) is fn,
        # parameters of this Wrapper that ``non_defaults`` leaves at their default
        "left_default": sorted(
            set(inspect.signature(inprocess.Wrapper).parameters) - set(non_defaults(inprocess))
        ),
    }
    common.write(out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
