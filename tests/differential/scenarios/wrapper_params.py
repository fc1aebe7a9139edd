"""``Wrapper``'s parameters, without running a call: defaults kept as attributes, every
parameter given a value other than its default, refused values, ``enabled=False``; and
``Compose`` as NVRx's guides and examples compose the plug-ins (the order its steps run
in, the plug-in type a composition is, which compositions the ``Wrapper`` takes); and two
plug-in behaviours that differ on purpose, run directly: ``ThreadedFinalize`` on a host
without CUDA, and the ``RANK`` a spare's ``State.set_distributed_vars()`` leaves.

Each outcome is the attribute's value (timedeltas in seconds, objects by class name) or
the exception a construction raised, as the names of its classes a caller can catch.
CASE is unused.
"""

from __future__ import annotations

import datetime
import inspect
import os
import warnings
from typing import Any

import common

TIMEDELTAS = (
    "monitor_thread_interval", "monitor_process_interval", "heartbeat_interval",
    "progress_watchdog_interval", "soft_timeout", "hard_timeout", "heartbeat_timeout",
    "barrier_timeout", "completion_timeout", "last_call_wait", "termination_grace_time",
)  # fmt: skip
#: Submodules of the reference's ``inprocess``; the record keeps those reachable as attributes
#: of the package right after ``import <package>.inprocess``, as NVRx's guides use them.
SUBMODULES = (
    "abort", "attribution", "completion", "compose", "exception", "finalize", "health_check",
    "initialize", "monitor_process", "monitor_thread", "nested_restarter", "param_utils",
    "progress_watchdog", "rank_assignment", "rank_filter", "sibling_monitor", "state", "store",
    "terminate", "tools", "utils", "wrap",
)  # fmt: skip
OTHERS = ("store_kwargs", "initialize", "abort", "finalize", "health_check", "rank_assignment",
          "rank_filter", "monitor_process_logfile", "enabled", "completion", "terminate")  # fmt: skip


def value(v: Any) -> Any:
    if isinstance(v, datetime.timedelta):  # its type too: code written for NVRx calls its methods
        return ["timedelta", v.total_seconds()]
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


def refusal(fn: Any) -> Any:
    """``fn()``'s value, or the builtin classes of what it raised (what a caller can catch)."""
    try:
        return fn()
    except Exception as exc:  # the type is the outcome
        return {"raised": [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]}


def compositions(inprocess: Any) -> dict[str, Any]:
    """What ``Compose`` does, as NVRx's usage guides use it: the order its steps run in
    (``order``), the warnings when a step returns None (``none_returned_warns``), what
    ``Compose()`` of nothing raises (``empty``), which hook class a composition of hooks
    of one class is (``is_*``), and which compositions ``Wrapper(...)`` takes as a hook
    (``wrapper_takes``: True when it raised nothing) and refuses (``wrapper_refuses``: what
    it raised)."""
    calls: list[str] = []

    class Step(inprocess.initialize.Initialize):
        def __init__(self, name: str, returns: bool = True) -> None:
            self.name, self.returns = name, returns

        def __call__(self, state: Any) -> Any:
            calls.append(self.name)
            return state if self.returns else None

    def order() -> list[str]:
        inprocess.Compose(Step("a"), Step("b"), Step("c"))(inprocess.state.State(rank=0, world_size=1))
        return list(calls)

    def none_returned() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inprocess.Compose(Step("x"), Step("y", returns=False))(inprocess.state.State(rank=0, world_size=1))
        return [type(w.message).__name__ for w in caught]

    hc, ab, ra = inprocess.health_check, inprocess.abort, inprocess.rank_assignment
    return {
        "order": order(),
        "none_returned_warns": none_returned(),
        "empty": refusal(inprocess.Compose),
        "is_initialize": isinstance(
            inprocess.Compose(inprocess.initialize.RetryController(), Step("z")), inprocess.initialize.Initialize
        ),
        "is_health_check": isinstance(inprocess.Compose(hc.CudaHealthCheck(), hc.FaultCounter()), hc.HealthCheck),
        "is_abort": isinstance(inprocess.Compose(ab.AbortTransformerEngine(), ab.AbortTorchDistributed()), ab.Abort),
        "wrapper_takes": {  # accepted: no exception to record
            "health_check": "raised" not in construct(inprocess, health_check=inprocess.Compose(
                hc.CudaHealthCheck(), hc.FaultCounter(max_rank_faults=3))),
            "abort": "raised" not in construct(inprocess, abort=inprocess.Compose(
                ab.AbortTransformerEngine(), ab.AbortTorchDistributed())),
            "rank_assignment": "raised" not in construct(inprocess, rank_assignment=inprocess.Compose(
                ra.ActiveWorldSizeDivisibleBy(2), ra.MaxActiveWorldSize(4), ra.ShiftRanks())),
        },
        "wrapper_refuses": {
            "mixed_as_initialize": construct(inprocess, initialize=inprocess.Compose(
                inprocess.initialize.RetryController(), hc.FaultCounter())),
            "health_check_as_initialize": construct(inprocess, initialize=hc.FaultCounter()),
        },
    }  # fmt: skip


def plugin_behaviours(inprocess: Any) -> dict[str, Any]:
    """Two plug-ins called on their own: ``threaded_finalize``,
    what ``ThreadedFinalize(fn, args, kwargs)`` returned (or raised) and the arguments its
    ``fn`` was called with; and the ``RANK`` and ``WORLD_SIZE`` a spare's
    ``State.set_distributed_vars()`` leaves in the environment."""
    ran: list[Any] = []
    finalize = inprocess.finalize.ThreadedFinalize(
        timeout=datetime.timedelta(seconds=5), fn=lambda a, b=0: ran.append([a, b]), args=(1,), kwargs={"b": 2}
    )
    state = inprocess.state.State(rank=0, world_size=1)
    threaded = refusal(lambda: type(finalize(state.freeze())).__name__)
    os.environ.update(RANK="1", WORLD_SIZE="2")
    spare = inprocess.state.State(
        rank=1, world_size=2, active_rank=None, active_world_size=1, mode=inprocess.state.Mode.INACTIVE
    )
    spare.set_distributed_vars()
    return {
        "threaded_finalize": {"returned": threaded, "fn_called_with": ran},
        "spare_environment": {"RANK": os.environ.get("RANK"), "WORLD_SIZE": os.environ.get("WORLD_SIZE")},
    }


def main() -> int:
    impl, out, _ = common.arguments()
    inprocess = common.module(impl, "inprocess")
    # before any submodule is imported: what ``import ...inprocess as inprocess`` reaches
    reachable = sorted(n for n in SUBMODULES if hasattr(inprocess, n))
    for sub in ("rank_assignment", "store", "initialize", "finalize", "health_check", "completion",
                "terminate", "rank_filter", "abort", "state"):
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
        "wrapped_keeps_name": [inprocess.Wrapper()(fn).__name__, inprocess.Wrapper()(fn).__wrapped__ is fn],
        "compose": compositions(inprocess),
        "reachable_submodules": reachable,
        "plugins": plugin_behaviours(inprocess),
        # parameters of this Wrapper that ``non_defaults`` leaves at their default
        "left_default": sorted(
            set(inspect.signature(inprocess.Wrapper).parameters) - set(non_defaults(inprocess))
        ),
    }
    common.write(out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
