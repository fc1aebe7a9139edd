"""Every rank assignment class, applied to synthetic inputs: the mapping each computes.

Renumberings and filters run directly on a ``RankAssignmentCtx``; the classes that
coordinate through the store (``FilterCountGroupedByKey``, ``Tree``) run with one thread
per rank, each with its own client of one real TCPStore, whose class puts the
implementation's ``StoreMixin`` first. Each outcome is the resulting state's fields and
the terminated ranks passed on, or the type of the exception raised. CASE is unused.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import common

WORLD_SIZES = (1, 2, 4, 8)
TERMINATED = ((), (0,), (1,), (3,), (1, 4, 5), (0, 7), (6, 7))


def outcome(fn: Any, ctx: Any) -> dict[str, Any]:
    try:
        ctx = fn(ctx)
    except Exception as exc:  # the type is the outcome
        return {"raised": type(exc).__name__}
    return {"state": common.state_fields(ctx.state), "terminated": sorted(ctx.terminated_ranks)}


def renumberings(inprocess: Any) -> dict[str, Any]:
    ra = inprocess.rank_assignment
    classes = {
        "ShiftRanks": ra.ShiftRanks(),
        "FillGaps": ra.FillGaps(),
        "ActivateAllRanks": ra.ActivateAllRanks(),
        "MaxActiveWorldSize(3)": ra.MaxActiveWorldSize(3),
        "MaxActiveWorldSize()": ra.MaxActiveWorldSize(),
        "ActiveWorldSizeDivisibleBy(2)": ra.ActiveWorldSizeDivisibleBy(2),
        "ActiveWorldSizeDivisibleBy(3)": ra.ActiveWorldSizeDivisibleBy(3),
        "Compose(ActivateAllRanks,ShiftRanks)": inprocess.Compose(ra.ActivateAllRanks(), ra.ShiftRanks()),
        "Compose(MaxActiveWorldSize(3),FillGaps)": inprocess.Compose(ra.MaxActiveWorldSize(3), ra.FillGaps()),
    }
    results = {}
    for name, fn in classes.items():
        for ws in WORLD_SIZES:
            for terminated in TERMINATED:
                if any(t >= ws for t in terminated):
                    continue
                for rank in range(ws):
                    state = inprocess.state.State(rank=rank, world_size=ws)
                    ctx = ra.RankAssignmentCtx(state, None, set(terminated))
                    results[f"{name} ws={ws} terminated={list(terminated)} rank={rank}"] = outcome(fn, ctx)
    return results


def rank_filters(inprocess: Any) -> dict[str, Any]:
    """The older ``rank_filter`` classes, which take and return a ``State``."""
    rf = inprocess.rank_filter
    classes = {
        "MaxActiveWorldSize(3)": rf.MaxActiveWorldSize(3),
        "ActiveWorldSizeDivisibleBy(3)": rf.ActiveWorldSizeDivisibleBy(3),
        "WorldSizeDivisibleBy(2)": rf.WorldSizeDivisibleBy(2),
    }
    results = {}
    for name, fn in classes.items():
        for ws in WORLD_SIZES:
            for rank in range(ws):
                state = inprocess.state.State(rank=rank, world_size=ws, active_world_size=ws)
                try:
                    results[f"{name} ws={ws} rank={rank}"] = common.state_fields(fn(state))
                except Exception as exc:
                    results[f"{name} ws={ws} rank={rank}"] = {"raised": type(exc).__name__}
    return results


def over_store(inprocess: Any, make: Any, ws: int, terminated: Any, rounds: int = 1) -> list[Any]:
    """``make()`` once per rank, called on ``rounds`` successive contexts in one thread per rank;
    ``terminated`` (a set) are terminated in the last of them, or, a list, one set per round
    (current rank numbers, as the Wrapper reports them).

    The store given is the base store, not the Wrapper's per-round ``PrefixStore``: the
    reference's ``PrefixStore`` puts torch's own ``Store.barrier`` first (see
    ``prefix_store_barrier``), and the mapping is what is compared here."""
    import torch.distributed as dist

    class Store(inprocess.store.StoreMixin, dist.TCPStore):
        pass

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: list[Any] = [None] * ws
    counters = [c for c in vars(inprocess.rank_assignment).values() if hasattr(c, "instance_count")]
    first = {c: c.instance_count for c in counters}
    made = []
    for _ in range(ws):  # as in separate processes: every rank's instance gets the same name
        for c in counters:
            c.instance_count = first[c]
        made.append(make())

    schedule = terminated if isinstance(terminated, list) else [set()] * (rounds - 1) + [terminated]

    def rank_main(rank: int) -> None:
        store = Store("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        state = inprocess.state.State(rank=rank, world_size=ws)
        seen = []
        for it, dead in enumerate(schedule):
            ctx = inprocess.rank_assignment.RankAssignmentCtx(state, store, set(dead))
            seen.append(outcome(made[rank], ctx))
            if "raised" in seen[-1]:
                break
            state = ctx.state
            state.iteration = it + 1
        results[rank] = seen

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if any(t.is_alive() for t in threads):
        raise AssertionError("a rank of the store-coordinated assignment hung for 60 s")
    return results


def prefix_store_barrier(inprocess: Any) -> dict[str, Any]:
    """What the Wrapper's per-round ``PrefixStore`` does with ``barrier(ranks=..., ...)``."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = inprocess.store.PrefixStore(0, server)
    try:
        store.barrier(ranks=[0], group_name="g", rendezvous_count=1, timeout=datetime.timedelta(seconds=5))
    except Exception as exc:
        return {"raised": type(exc).__name__}
    return {"raised": None}


def grouped(inprocess: Any) -> dict[str, Any]:
    ra = inprocess.rank_assignment
    timeout = datetime.timedelta(seconds=20)
    cases = {
        "FilterCountGroupedByKey(node of 2, count==2)": (
            lambda: ra.FilterCountGroupedByKey(lambda s: f"node{s.rank // 2}", lambda n: n == 2, timeout), 4, {1}),
        "FilterCountGroupedByKey(int key per node, count==2)": (
            lambda: ra.FilterCountGroupedByKey(lambda s: s.rank // 2, lambda n: n == 2, timeout), 4, {3}),
        "FilterCountGroupedByKey(constant int key, count>=3)": (
            lambda: ra.FilterCountGroupedByKey(7, lambda n: n >= 3, timeout), 4, {0}),
        "Compose(ShiftRanks,FilterCountGroupedByKey)": (
            lambda: inprocess.Compose(
                ra.ShiftRanks(), ra.FilterCountGroupedByKey(lambda s: f"n{s.rank // 2}", lambda n: n == 2, timeout)
            ), 4, {2}),
    }  # fmt: skip
    return {name: over_store(inprocess, make, ws, t) for name, (make, ws, t) in cases.items()}


def trees(inprocess: Any) -> dict[str, Any]:
    ra = inprocess.rank_assignment

    def node(s: Any) -> str:
        return f"node{s.initial_rank // 2}"

    def two_layers(flag: Any, max_ranks: int | None) -> Any:
        return lambda: ra.Tree(
            [ra.Layer(min_ranks=1, max_ranks=max_ranks, key_or_fn="root", flag=flag),
             ra.Layer(min_ranks=1, max_ranks=1, key_or_fn=node, flag=flag)]
        )  # fmt: skip

    def hosts(size: int, flag: Any, min_ranks: int, max_ranks: int | None, ws_filter: Any = None) -> Any:
        def host(s: Any) -> str:
            return f"host{s.initial_rank // size}"

        return lambda: ra.Tree(
            [ra.Layer(min_ranks=1, key_or_fn="root", flag=flag),
             ra.Layer(min_ranks=min_ranks, max_ranks=max_ranks, key_or_fn=host, flag=flag)],
            ws_filter,
        )  # fmt: skip

    def even(n: int) -> int:
        return n // 2 * 2

    cases = {
        "Tree(one leaf per node, RESERVE)": (two_layers(ra.LayerFlag.RESERVE, None), 4, {0}),
        "Tree(one leaf per node, BACKFILL)": (two_layers(ra.LayerFlag.BACKFILL, None), 4, {0}),
        "Tree(max 1 active, RESERVE)": (two_layers(ra.LayerFlag.RESERVE, 1), 4, {0}),
        "Tree(one layer)": (lambda: ra.Tree([ra.Layer(min_ranks=2, key_or_fn="root")]), 4, {3}),
    }
    results = {name: over_store(inprocess, make, ws, t, rounds=2) for name, (make, ws, t) in cases.items()}
    # terminations across several rounds: spares of the host, then of another host, then none;
    # backfill with the active world size kept even; hosts that fall below min_ranks one by one
    reserve, backfill = ra.LayerFlag.RESERVE, ra.LayerFlag.BACKFILL
    several = {
        "Tree(hosts of 4, 3 active each, RESERVE; rounds)": (
            hosts(4, reserve, 2, 3), 8, [set(), {1}, {0}, {0, 1}]),
        "Tree(hosts of 4, BACKFILL, even active world; rounds)": (
            hosts(4, backfill, 1, None, even), 8, [set(), {2}, {5}, {0}]),
        "Tree(hosts of 2, min 2; rounds)": (hosts(2, None, 2, None), 6, [set(), {1}, {2}]),
    }  # fmt: skip
    results.update({name: over_store(inprocess, make, ws, t) for name, (make, ws, t) in several.items()})
    return results


def main() -> int:
    impl, out, _ = common.arguments()
    inprocess = common.module(impl, "inprocess")
    for sub in ("rank_assignment", "rank_filter", "state", "store"):
        common.module(impl, f"inprocess.{sub}")
    record = {
        "renumberings": renumberings(inprocess),
        "rank_filters": rank_filters(inprocess),
        "grouped": grouped(inprocess),
        "trees": trees(inprocess),
        "prefix_store_barrier": prefix_store_barrier(inprocess),
    }
    common.write(out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
