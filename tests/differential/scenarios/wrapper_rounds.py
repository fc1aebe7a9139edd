"""One rank of a 2-rank ``Wrapper`` call: a fault in the wrapped function or in one hook, and what follows.

Started by the test harness once per rank with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; the Wrapper's store is on MASTER_PORT + 1 (``store_kwargs``), the
training's own store (for ``init_process_group``) on MASTER_PORT + 2, hosted by rank 0.
Every hook is a recording one; CASE names what goes wrong:

* ``restart``: rank 1's function raises in round 0; round 1 succeeds.
* ``max_iterations``: rank 1's function raises in rounds 0 and 1; ``RetryController``
  stops rank 1 in ``initialize`` of round 2 with ``RestartAbort``; rank 0, waiting in
  ``initialize`` of round 2 until then, restarts without it and stops at round 3 the
  same way.
* ``should_restart``: every rank's function raises ``RankShouldRestart`` itself in round 0
  to ask for a restart; round 1 succeeds.
* ``fault_<hook>[+<hook>]``: as ``restart``, and each hook named raises on rank 1 in
  round 0 (``completion`` and ``terminate``, which run once at the end, then;
  ``terminate``: as ``max_iterations``).
* ``hot_spare``: one active rank (``MaxActiveWorldSize(1)``), rank 1 waits as a spare;
  rank 0's health check fails in round 0, so it leaves and the spare runs round 1 as
  active rank 0.
* ``dist_initialized``: torch.distributed is initialized already when the call starts.
* ``local_store_class``: ``store_factory`` is a store class defined in a function.
* ``nested_restarter``: as ``restart``, with the nested-restarter callbacks composed into
  ``initialize``, ``abort``, ``completion`` and ``terminate`` as the reference's example
  wires them; the record keeps the ``[NestedRestarter]`` lines the rank printed.
* ``nested_restarter_abort``: as ``max_iterations``, with those callbacks.
* ``hang_protection_off``: soft, hard and heartbeat timeouts of days, which turn hang
  detection off; rank 1 is silent in round 0 for longer than the timeouts of the other
  cases (no ``ping``, no progress), and nothing restarts.
* ``rank_filter_logfile``: as ``restart``, with an old-style ``rank_filter`` (a recording
  ``rank_filter.RankFilter``) and ``monitor_process_logfile`` (absolute, with ``{rank}``);
  the record says whether the rank's monitor log file exists after the call.
* ``health_check_compose``: the health check of NVRx's examples and of Megatron-style
  configurations, ``Compose(<recording>, CudaHealthCheck(timeout), FaultCounter(1))``, with
  ``RetryController(max_iterations=4, min_active_world_size=1)``; rank 1's function raises in
  rounds 0 and 1, so its fault counter stops it after round 1 and rank 0 runs round 2 alone.
* ``keyboard_interrupt``: rank 1's function raises ``KeyboardInterrupt`` in round 0: rank 1
  leaves with it, rank 0 runs round 1 alone.
* ``ping_timeout``: rank 1 calls ``ping()`` once in round 0 and then steps without pinging:
  the manual heartbeat runs past ``soft_timeout``, every rank restarts, round 1 succeeds
  (``hard_timeout`` far past the soft one here: ``PING_TIMEOUT``).
* ``call_arguments``: as ``restart``, the function called as NVRx's examples call theirs:
  positional and keyword arguments, a list it appends to, and the ``CallWrapper`` injected
  through ``Optional[inprocess.CallWrapper]``; the record keeps what each round received,
  the public attribute names of the ``CallWrapper`` (whether its ``base_store`` is a torch
  ``Store`` too, the classes of its ``wrapper`` and ``atomic_lock``) and, each round, what
  its ``store``, ``base_store`` and ``state`` are (``store_facts``).

A rank whose round has a fault elsewhere waits in a step loop for the Wrapper to
interrupt it, as training code would be; a round without a fault runs a gloo all-reduce
inside ``CallWrapper.atomic()`` and then ``ping()``s.
"""

# No `from __future__ import annotations`: the reference finds `CallWrapper` by the annotation object.

import datetime
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import common

HOOKS = ("initialize", "abort", "finalize", "health_check", "completion", "terminate")
TIMEOUTS = dict(
    soft_timeout=6,
    hard_timeout=9,
    heartbeat_timeout=6,
    heartbeat_interval=0.5,
    monitor_process_interval=0.2,
    monitor_thread_interval=0.2,
    progress_watchdog_interval=0.2,
    barrier_timeout=30,
    completion_timeout=30,
    last_call_wait=0.1,
    termination_grace_time=1,
)
#: Days: timeouts no training step reaches, which is how a caller turns hang protection off.
HANG_PROTECTION_OFF = dict(soft_timeout=1, hard_timeout=2, heartbeat_timeout=1, barrier_timeout=3)
#: ``ping_timeout``'s hard timeout, far past the soft one of ``TIMEOUTS`` that restarts the
#: ranks, so a loaded machine never reaches it (a monitor would end the rank instead); the
#: barrier and completion timeouts must stay above it.
PING_TIMEOUT = dict(hard_timeout=30, barrier_timeout=60, completion_timeout=60)
#: Longer than the hard timeout of ``TIMEOUTS``, which would restart the rank.
SILENCE_S = TIMEOUTS["hard_timeout"] + 1


def fault_rounds(case: str) -> set[int]:
    """Rounds in which the faulting rank's function fails."""
    if case in ("max_iterations", "fault_terminate", "nested_restarter_abort", "health_check_compose"):
        return {0, 1}
    if case in ("dist_initialized", "local_store_class", "hang_protection_off"):
        return set()
    return {0}


def fault_rank(case: str) -> int:
    """The rank whose function (and named hooks) fail: rank 0, the active one, with a spare."""
    return 0 if case == "hot_spare" else 1


def hooks(
    inprocess: Any, journal: list[Any], case: str, peer: tuple[Any, Any], stopping: Any
) -> dict[str, Any]:
    """A recording instance of each hook; those ``case`` names raise on the faulting rank,
    after ``before_fault(iteration)``; a hot spare says ``entered(iteration)`` once its
    health check of the round ran (it never runs the function). ``initialize`` calls
    ``stopping(iteration)`` in the round where ``RetryController`` stops the call."""
    if case == "health_check_compose":
        retry = inprocess.initialize.RetryController(max_iterations=4, min_active_world_size=1)
    else:
        retry = inprocess.initialize.RetryController(max_iterations=2)
    plugins = recording_hooks(inprocess, hook_recorder(journal, case, peer), retry, stopping)
    plugins["rank_assignment"] = recording_assignment(inprocess, journal, case)
    if case == "health_check_compose":  # the last one runs first
        plugins["health_check"] = inprocess.Compose(
            plugins["health_check"],
            inprocess.health_check.CudaHealthCheck(timeout=datetime.timedelta(seconds=10)),
            inprocess.health_check.FaultCounter(max_rank_faults=1),
        )
    return plugins


def hook_recorder(journal: list[Any], case: str, peer: tuple[Any, Any]) -> Any:
    """``note(hook, state)``: journals the call of ``hook``, and raises where ``case`` has
    that hook fail on the faulting rank (see ``hooks``)."""
    entered, before_fault = peer

    def note(hook: str, state: Any) -> None:
        journal.append([hook, common.state_fields(state)])
        if case == "hot_spare" and hook == "health_check" and state.initial_rank != fault_rank(case):
            entered(state.iteration)
        named = ["health_check"] if case == "hot_spare" else case.removeprefix("fault_").split("+")
        once = hook in ("terminate", "completion")  # each runs once, at the end
        if hook in named and state.initial_rank == fault_rank(case) and (once or state.iteration == 0):
            if hook in ("initialize", "health_check"):
                before_fault(state.iteration)
            raise RuntimeError(f"{hook} fails on purpose")

    return note


def recording_hooks(inprocess: Any, note: Any, retry: Any, stopping: Any) -> dict[str, Any]:
    """One instance of each hook class of ``inprocess`` that tells ``note`` it ran; ``initialize``
    then runs ``retry``, ``abort`` the stock ``AbortTorchDistributed``."""
    stock_abort = inprocess.abort.AbortTorchDistributed()

    class Init(inprocess.initialize.Initialize):
        def __call__(self, state: Any) -> Any:
            note("initialize", state)
            if state.iteration == retry.max_iterations:
                stopping(state.iteration)
            return retry(state)

    class Abort(inprocess.abort.Abort):
        def __call__(self, state: Any) -> Any:
            note("abort", state)
            return stock_abort(state)

    class Finalize(inprocess.finalize.Finalize):
        def __call__(self, state: Any) -> Any:
            note("finalize", state)
            return state

    class Health(inprocess.health_check.HealthCheck):
        def __call__(self, state: Any) -> Any:
            note("health_check", state)
            return state

    class Completion(inprocess.completion.Completion):
        def __call__(self, state: Any) -> Any:
            note("completion", state)
            return state

    class Terminate(inprocess.terminate.Terminate):
        def __call__(self, state: Any) -> Any:
            note("terminate", state)
            return state

    return dict(
        initialize=Init(), abort=Abort(), finalize=Finalize(), health_check=Health(),
        completion=Completion(), terminate=Terminate(),
    )  # fmt: skip


def recording_assignment(inprocess: Any, journal: list[Any], case: str) -> Any:
    """``Compose(ActivateAllRanks() (hot spare: MaxActiveWorldSize(1)), ShiftRanks())``, each
    call journaled with the state it was given, the ranks terminated, and what it returned
    or raised."""
    ra = inprocess.rank_assignment

    class Assignment(ra.RankAssignment):
        first = ra.MaxActiveWorldSize(1) if case == "hot_spare" else ra.ActivateAllRanks()
        inner = inprocess.Compose(first, ra.ShiftRanks())

        def __call__(self, ctx: Any) -> Any:
            entry = {"in": common.state_fields(ctx.state), "terminated": sorted(ctx.terminated_ranks)}
            journal.append(["rank_assignment", entry])
            try:
                ctx = self.inner(ctx)
            except BaseException as exc:
                entry["raised"] = type(exc).__name__
                raise
            entry["out"] = common.state_fields(ctx.state)
            return ctx

    return Assignment()


def peer_in_function(case: str, store: Any) -> tuple[Any, Any]:
    """``(entered, before_fault)``: the waiting rank calls ``entered(it)`` once in the function
    of round ``it``; the faulting rank calls ``before_fault(it)`` before it fails, so its fault
    never overtakes its peer on the way into the function (that order is timing, not outcome)."""

    def entered(it: int) -> None:
        store.set(f"entered{it}", "1")

    def before_fault(it: int) -> None:
        store.wait([f"entered{it}"], datetime.timedelta(seconds=60))

    return entered, before_fault


def nested_restarter(inprocess: Any, hooks: dict[str, Any]) -> dict[str, Any]:
    """``hooks`` with the nested-restarter callbacks composed in, in the reference example's
    order: ``initialize``'s runs after the hook, ``abort``'s before it."""
    nested = inprocess.nested_restarter
    compose = inprocess.Compose
    return dict(
        hooks,
        initialize=compose(nested.NestedRestarterHandlingCompleted(), hooks["initialize"]),
        abort=compose(hooks["abort"], nested.NestedRestarterHandlingStarting()),
        completion=compose(nested.NestedRestarterFinalized(), hooks["completion"]),
        terminate=compose(nested.NestedRestarterAborted(), hooks["terminate"]),
    )


def rank_filter(inprocess: Any, journal: list[Any]) -> Any:
    """An old-style rank filter that records the state it is given and changes nothing."""

    class Recording(inprocess.rank_filter.RankFilter):
        def __call__(self, state: Any) -> Any:
            journal.append(["rank_filter", common.state_fields(state)])
            return state

    return Recording()


def stop_in_turn(store: Any, case: str) -> Any:
    """``stopping(it)``, called in ``initialize`` of the round ``it`` where ``RetryController``
    first stops a rank: the faulting rank returns (and stops) once every other rank is in
    that ``initialize`` too; the others wait there for the restart its leave causes, and
    stop in round ``it + 1``.

    A rank's leave restarts every rank still in the round, so two ranks that each stopped
    by themselves would race: one that is slow to raise after the other left restarts
    instead. In turn, each rank's rounds are the same in every run."""
    rank, world_size = common.rank_env()

    def stopping(it: int) -> None:
        if rank == fault_rank(case):
            others = [f"stopping{it}/{r}" for r in range(world_size) if r != rank]
            store.wait(others, datetime.timedelta(seconds=60))
            return
        store.set(f"stopping{it}/{rank}", "1")
        wait_for_restart()

    return stopping


def wait_for_restart() -> None:
    """Training steps until the Wrapper interrupts this rank (a fault happened elsewhere)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)  # one step
    raise AssertionError("the Wrapper did not interrupt this rank within 60 s")


def training(
    inprocess: Any, case: str, app_store: Any, journal: list[Any], rounds: list[dict[str, Any]], restart: Any
) -> Any:
    """``train(call_wrapper)``, the wrapped function: it fails as ``case`` says in the rounds
    of ``fault_rounds``, else all-reduces over gloo inside ``atomic()`` and ``ping()``s."""
    import torch
    import torch.distributed as dist

    rank, _ = common.rank_env()
    entered, before_fault = peer_in_function(case, app_store)
    failing = fault_rounds(case)

    def train(call_wrapper: inprocess.CallWrapper = None) -> str:
        it = call_wrapper.iteration
        r, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rounds.append({"iteration": it, "RANK": r, "WORLD_SIZE": ws})
        journal.append(["fn", it])
        if it in failing and case == "should_restart":
            raise restart(f"round {it} asks for a restart")
        if it in failing and rank == fault_rank(case):
            before_fault(it)
            if case == "keyboard_interrupt":
                raise KeyboardInterrupt
            if case == "ping_timeout":
                call_wrapper.ping()
                wait_for_restart()  # steps, no more pings
            raise ValueError(f"round {it} fails")
        if it in failing:
            entered(it)
            wait_for_restart()
        if case == "hang_protection_off" and rank == 1:
            time.sleep(SILENCE_S)  # silent: no ping, no step
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{it}", app_store), rank=r, world_size=ws)
        total = torch.ones(1)
        with call_wrapper.atomic():
            dist.all_reduce(total)
        call_wrapper.ping()
        dist.destroy_process_group()
        return f"active rank {r} of {ws}, sum {int(total.item())}, round {it}"

    return train


def store_facts(call_wrapper: Any, first: list[Any]) -> dict[str, Any]:
    """What one round sees of the ``CallWrapper``'s ``store`` and ``base_store``: their
    classes, whether they are one object and the one of the first round (kept in
    ``first``), and whether a key set through ``store`` in an earlier round is there;
    and its ``state``, the rank's ``State``."""
    store, base = call_wrapper.store, call_wrapper.base_store
    first.extend([] if first else [base])
    key = f"differential/set_through_store/{common.rank_env()[0]}"
    seen = bool(store.check([key]))
    store.set(key, "1")
    return {
        "base_store_type": type(base).__name__,
        "store_type": type(store).__name__,
        "store_is_base_store": store is base,
        "same_base_store_every_round": base is first[0],
        "key_from_an_earlier_round": seen,
        "state_type": type(call_wrapper.state).__name__,
        "state": common.state_fields(call_wrapper.state),
    }


def with_arguments(inprocess: Any, train: Any, received: list[Any], facts: list[Any]) -> Any:
    """``train`` called as NVRx's examples call theirs (see ``call_arguments``): the first
    entry of ``received`` is the ``CallWrapper``'s public names, one entry per round after
    that what the round was given; ``facts`` gets ``store_facts`` of every round."""
    import torch.distributed as dist

    first: list[Any] = []

    def train_with_arguments(
        metrics: list,
        tag: str,
        scale: int = 1,
        call_wrapper: Optional[inprocess.CallWrapper] = None,  # noqa: UP045 - as NVRx's examples spell it
    ) -> str:
        if not received:
            received.append({
                "public": sorted(n for n in dir(call_wrapper) if not n.startswith("_")),
                "base_store_is_a_store": isinstance(call_wrapper.base_store, dist.Store),
                "wrapper_type": type(call_wrapper.wrapper).__name__,
                "atomic_lock_type": type(call_wrapper.atomic_lock).__name__,
            })  # fmt: skip
        facts.append(store_facts(call_wrapper, first))
        metrics.append(call_wrapper.iteration)
        received.append({"metrics": list(metrics), "tag": tag, "scale": scale})
        return train(call_wrapper=call_wrapper)

    return train_with_arguments


def wrapper_options(inprocess: Any, impl: str, case: str, journal: list[Any]) -> tuple[dict[str, Any], Path]:
    """The ``Wrapper``'s arguments other than its hooks, and where the monitor log of
    ``rank_filter_logfile`` goes (``{rank}`` in it)."""
    timeouts = dict(TIMEOUTS, **PING_TIMEOUT) if case == "ping_timeout" else TIMEOUTS
    options: dict[str, Any] = {k: datetime.timedelta(seconds=v) for k, v in timeouts.items()}
    if case == "hang_protection_off":
        options.update({k: datetime.timedelta(days=v) for k, v in HANG_PROTECTION_OFF.items()})
    options["store_kwargs"] = {"port": int(os.environ["MASTER_PORT"]) + 1}
    logfile = Path.cwd() / f"{impl}-monitor" / "monitor-{rank}.log"
    if case == "rank_filter_logfile":
        logfile.parent.mkdir(exist_ok=True)
        options.update(rank_filter=rank_filter(inprocess, journal), monitor_process_logfile=str(logfile))
    if case == "local_store_class":

        class LocalStore(inprocess.store.TCPStore):
            pass

        options["store_factory"] = LocalStore
    return options, logfile


def main() -> int:
    impl, out, case = common.arguments()
    import torch.distributed as dist

    inprocess = common.module(impl, "inprocess")
    for sub in ("store", "initialize", "abort", "finalize", "health_check", "completion", "terminate",
                "nested_restarter", "rank_filter"):
        common.module(impl, f"inprocess.{sub}")
    restart = common.module(impl, "inprocess.monitor_thread").RankShouldRestart
    rank, _ = common.rank_env()
    app_store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 2, 2, is_master=rank == 0)
    journal: list[Any] = []
    record: dict[str, Any] = {"case": case, "rank": rank, "rounds": [], "received": [], "store_rounds": []}
    train = training(inprocess, case, app_store, journal, record["rounds"], restart)
    if case == "call_arguments":
        train = with_arguments(inprocess, train, record["received"], record["store_rounds"])
    handler = common.attach_user_handler(f"{common.PACKAGES[impl]}.inprocess")
    by_reference_name = handler
    if impl == "nvrx":  # what a script that kept the reference's logger name receives
        by_reference_name = common.attach_user_handler(common.REFERENCE_LOGGER)
    leftovers = common.Leftovers()
    options, logfile = wrapper_options(inprocess, impl, case, journal)
    if case == "dist_initialized":
        dist.init_process_group("gloo", store=dist.PrefixStore("before", app_store), rank=rank, world_size=2)
    plugins = hooks(inprocess, journal, case, peer_in_function(case, app_store), stop_in_turn(app_store, case))
    if case.startswith("nested_restarter"):
        plugins = nested_restarter(inprocess, plugins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # rank_filter is deprecated in both
        wrapper = inprocess.Wrapper(**options, **plugins)
    record.update(call_and_record(wrapper, train, case, Path.cwd() / f"{impl}-{rank}.stdout"))
    record["monitor_logfile"] = Path(str(logfile).format(rank=rank)).is_file()
    record.update(journal=journal, leftovers=leftovers.after())
    received = record["received"]
    record["call_wrapper"], record["received"] = (received[0], received[1:]) if received else (None, [])
    record["user_handler_levels"] = sorted(set(handler.levels))
    record["reference_name_levels"] = sorted(set(by_reference_name.levels))
    common.write(out, record)
    return 0


def call_and_record(wrapper: Any, train: Any, case: str, stdout: Path) -> dict[str, Any]:
    """Calls the wrapped ``train`` (``call_arguments``: with its arguments): what it returned
    or raised, and the nested-restarter lines the rank printed meanwhile."""
    with common.StdoutLines(stdout) as printed:
        try:
            if case == "call_arguments":
                returned, raised = wrapper(train)([], "tag", scale=3), None
            else:
                returned, raised = wrapper(train)(), None
        except BaseException as exc:
            returned, raised = None, common.exception_fields(exc)
    return {"returned": returned, "raised": raised, "restarter_lines": common.restarter_lines(printed.lines())}


if __name__ == "__main__":
    sys.exit(main())
