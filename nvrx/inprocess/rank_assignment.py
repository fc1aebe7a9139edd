"""Rank assignment: after a fault, give the surviving ranks consecutive indices and pick active ones.

Every plug-in takes and returns a ``RankAssignmentCtx``. Assignments
(``ShiftRanks``, ``FillGaps``) renumber ranks around the terminated ones and
raise ``RankDiscarded`` on a terminated rank; filters (``ActivateAllRanks``,
``MaxActiveWorldSize``, ``ActiveWorldSizeDivisibleBy``) only decide which
ranks run the function. Compose them with ``Compose``, filters first in the
argument list (they run last). ``Tree`` does both from a topology and is used alone.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import datetime
import enum
import heapq
import itertools
import json
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from . import exception
from .finalize import as_seconds
from .state import Mode, State

log = logging.getLogger(__name__)


class RankDiscarded(exception.RestartError):
    """Raised on a rank that the rank assignment removed from the job."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """Input and output of a rank assignment step.

    Args:
        state: the Wrapper's state of this rank.
        store: the store of the current round (torch ``Store`` API).
        terminated_ranks: ranks (current ``state.rank`` numbering) that left.
    """

    state: State
    store: Any
    terminated_ranks: set[int]


def terminated_set(ranks: Iterable[Any]) -> set[int]:
    """``ranks`` as a set of ints; digit strings and bytes from a store are converted."""
    result: set[int] = set()
    for value in ranks:
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"terminated_ranks must hold rank numbers >= 0, got {value!r}")
        result.add(value)
    return result


class RankAssignment(abc.ABC):
    """Base class of the Wrapper's ``rank_assignment``: ``__call__(ctx) -> ctx``.

    Reassigns ranks after terminations, computes the new world size and picks
    the active ranks; inactive ranks wait as spares for a later round.
    """

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


class RankFilter(RankAssignment):
    """A rank assignment that only chooses active and inactive ranks (runs after renumbering)."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


def _activate_below(ctx: RankAssignmentCtx, active_world_size: int) -> RankAssignmentCtx:
    state = ctx.state
    if state.rank is not None and state.rank < active_world_size:
        mode, active_rank = Mode.ACTIVE, state.rank
    else:
        mode, active_rank = Mode.INACTIVE, None
    ctx.state = dataclasses.replace(
        state, mode=mode, active_rank=active_rank, active_world_size=active_world_size
    )
    return ctx


def _current_active_world_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _positive_int(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "an int >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"{owner}: {name} must be {expected}, got {value!r}")


class ActivateAllRanks(RankFilter):
    """Every healthy rank is active: ``active_rank = rank``, ``active_world_size = world_size``."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        ctx.state = dataclasses.replace(
            ctx.state,
            mode=Mode.ACTIVE,
            active_rank=ctx.state.rank,
            active_world_size=ctx.state.world_size,
        )
        return ctx


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active (the lowest ranks); the rest are spares.

    Args:
        max_active_world_size: limit, None for no limit.
    """

    def __init__(self, max_active_world_size: int | None = None) -> None:
        _positive_int("MaxActiveWorldSize", "max_active_world_size", max_active_world_size, True)
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_world_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return _activate_below(ctx, size)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """Round the active world size down to a multiple of ``divisor``; the rest are spares.

    Args:
        divisor: the active world size is made divisible by it.
    """

    def __init__(self, divisor: int = 1) -> None:
        _positive_int("ActiveWorldSizeDivisibleBy", "divisor", divisor)
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_world_size(ctx.state)
        return _activate_below(ctx, size // self.divisor * self.divisor)


class ShiftRanks(RankAssignment):
    """Close the gaps of terminated ranks by shifting the higher ranks down; order is kept.

    ``0 X 2 3 X X 6 7`` becomes ``0 2 3 6 7`` (new ranks 0..4).
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        terminated = terminated_set(ctx.terminated_ranks)
        rank = ctx.state.rank
        if rank is None or rank in terminated:
            raise RankDiscarded(
                f"rank {rank} is terminated (terminated ranks: {sorted(terminated)})"
            )
        below = sum(1 for t in terminated if t < rank)
        ctx.state = dataclasses.replace(
            ctx.state, rank=rank - below, world_size=ctx.state.world_size - len(terminated)
        )
        ctx.terminated_ranks = set()
        return ctx


class FillGaps(RankAssignment):
    """Keep the lowest ranks in place; the highest healthy ranks move into the gaps.

    ``0 X 2 3 X X 6 7`` becomes ``0 6 2 3 7``: rank ``r >= new_world_size``
    takes the ``(r - new_world_size)``-th lowest terminated index.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        terminated = terminated_set(ctx.terminated_ranks)
        rank = ctx.state.rank
        if rank is None or rank in terminated:
            raise RankDiscarded(
                f"rank {rank} is terminated (terminated ranks: {sorted(terminated)})"
            )
        new_world_size = ctx.state.world_size - len(terminated)
        if rank >= new_world_size:
            gaps = sorted(t for t in terminated if t < new_world_size)
            movers = sorted(
                r for r in range(new_world_size, ctx.state.world_size) if r not in terminated
            )
            rank = gaps[movers.index(rank)]
        ctx.state = dataclasses.replace(ctx.state, rank=rank, world_size=new_world_size)
        ctx.terminated_ranks = set()
        return ctx


def _group_key(key_or_fn: str | Callable[[State], str], state: State) -> str:
    key = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    return str(key)


class FilterCountGroupedByKey(RankAssignment):
    """Mark whole groups terminated when their count of healthy ranks fails ``condition``.

    Ranks are grouped by ``key_or_fn`` (a string, or a function of the State);
    each healthy rank counts itself into its group, and every rank of a group
    whose count makes ``condition(count)`` false is added to
    ``terminated_ranks``. A later step (e.g. ``ShiftRanks``) discards them.
    Coordination uses only ``add``/``set``/``get``/``wait``/``multi_get`` and
    the nvrx store barrier, never torch's ``Store.barrier``.

    Args:
        key_or_fn: grouping key, or a function ``State -> str``.
        condition: ``int -> bool``; False terminates the group's ranks.
        timeout: limit for each of the two barriers (timedelta or seconds).
    """

    instance_count = 0

    def __init__(
        self,
        key_or_fn: str | Callable[[State], str],
        condition: Callable[[int], bool],
        timeout: datetime.timedelta | float = datetime.timedelta(seconds=60),
    ) -> None:
        if not callable(condition):
            raise TypeError(
                f"FilterCountGroupedByKey: condition must be callable, got {condition!r}"
            )
        if not (callable(key_or_fn) or isinstance(key_or_fn, str)):
            raise TypeError(
                f"FilterCountGroupedByKey: key_or_fn must be a str or a callable, got {key_or_fn!r}"
            )
        self._timeout_s = as_seconds(timeout, "FilterCountGroupedByKey timeout")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = f"{type(self).__name__}_{type(self).instance_count}"
        type(self).instance_count += 1

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        from nvrx.store.barrier import barrier

        terminated = terminated_set(ctx.terminated_ranks)
        rank = ctx.state.rank
        if rank is None or rank in terminated:
            ctx.terminated_ranks = terminated
            return ctx
        store = ctx.store
        alive = [r for r in range(ctx.state.world_size) if r not in terminated]
        ns = f"nvrx_filter/{self.name}/it{ctx.state.iteration}"
        key = _group_key(self.key_or_fn, ctx.state)

        store.add(f"{ns}/count/{key}", 1)
        barrier(store, f"{ns}/counted", rank, len(alive), self._timeout_s, participants=alive)
        count = int(store.add(f"{ns}/count/{key}", 0))
        if not self.condition(count):
            slot = int(store.add(f"{ns}/bad_n", 1))
            store.set(f"{ns}/bad/{slot}", str(rank))
        barrier(store, f"{ns}/judged", rank, len(alive), self._timeout_s, participants=alive)
        n_bad = int(store.add(f"{ns}/bad_n", 0))
        bad: set[int] = set()
        if n_bad:
            bad = terminated_set(store.multi_get([f"{ns}/bad/{i}" for i in range(1, n_bad + 1)]))
        ctx.terminated_ranks = terminated | bad
        return ctx


# -- Tree -----------------------------------------------------------------------


class LayerFlag(enum.Flag):
    """Policy flags of a ``Layer``.

    RESERVE: a dead active rank may be replaced by a spare from this branch.
    BACKFILL: a dead active rank's index may be taken by the highest active
    rank of this branch.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


@dataclasses.dataclass
class Layer:
    """One level of the ``Tree`` topology.

    Args:
        min_ranks: fewest healthy ranks a branch may keep; below, the whole branch is terminated.
        max_ranks: most ranks activated in a branch (None: no limit).
        key_or_fn: grouping key of the level, or a function ``State -> str``.
        flag: ``LayerFlag`` policy of the level.
    """

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: str | Callable[[State], str] = ""
    flag: LayerFlag | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.min_ranks, bool)
            or not isinstance(self.min_ranks, int)
            or self.min_ranks < 0
        ):
            raise ValueError(f"Layer: min_ranks must be an int >= 0, got {self.min_ranks!r}")
        _positive_int("Layer", "max_ranks", self.max_ranks, allow_none=True)


class _Node:
    """A branch (layer set) or a leaf (state set) of the topology tree."""

    __slots__ = (
        "parent",
        "layer",
        "state",
        "children",
        "spares",
        "active_count",
        "backfill_domain",
    )

    def __init__(self, parent: _Node | None, layer: Layer | None, state: State | None) -> None:
        self.parent = parent
        self.layer = layer
        self.state = state
        self.children: dict[Any, _Node] = {}
        self.spares: dict[int, _Node] = {}  # initial rank -> inactive leaf below this branch
        self.active_count = 0
        self.backfill_domain: _Node | None = None

    def leaves(self) -> Iterable[_Node]:
        if not self.children:
            yield self
            return
        stack = [iter(self.children.values())]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
            elif child.children:
                stack.append(iter(child.children.values()))
            else:
                yield child

    def ancestors(self) -> Iterable[_Node]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def _flagged(self, flag: LayerFlag) -> bool:
        return bool(self.layer is not None and self.layer.flag and self.layer.flag & flag)

    def set_inactive(self) -> None:
        self.state.mode = Mode.INACTIVE
        self.state.active_rank = None
        for anc in self.ancestors():
            anc.spares[self.state.initial_rank] = self

    def set_active(self, active_rank: int) -> None:
        self.state.mode = Mode.ACTIVE
        self.state.active_rank = active_rank
        for anc in self.ancestors():
            anc.spares.pop(self.state.initial_rank, None)

    def set_terminated(self) -> None:
        self.state.mode = Mode.TERMINATED
        for anc in self.ancestors():
            anc.spares.pop(self.state.initial_rank, None)


class Tree(RankAssignment):
    """Topology-aware assignment and activation in one step (not composable with others).

    The ranks are the leaves of a tree whose levels are ``layers`` (the first
    level's key must be the same on every rank). On the first call the ranks
    exchange their keys through the store, and a depth-first walk activates
    each leaf while no ancestor reached its ``max_ranks``. After terminations:

    1. a branch with fewer than ``min_ranks`` healthy leaves is terminated whole;
    2. a dead active rank is replaced by a spare found by walking up through
       RESERVE branches;
    3. otherwise, inside the outermost BACKFILL branch, the highest active rank
       takes the dead rank's index;
    4. remaining gaps are closed by shifting active ranks down;
    5. ``world_size_filter(active_world_size) -> n`` (n <= input) deactivates surplus ranks.

    The tree is rebuilt whenever the Wrapper starts a new call (the state is
    ``Mode.INITIALIZED``), never reused from an earlier call.

    Args:
        layers: levels of the topology, root first.
        world_size_filter: optional reduction of the active world size.
    """

    def __init__(
        self,
        layers: list[Layer],
        world_size_filter: Callable[[int], int] | None = None,
    ) -> None:
        if not layers or not all(isinstance(layer, Layer) for layer in layers):
            raise ValueError(f"Tree: layers must be a non-empty list of Layer, got {layers!r}")
        if world_size_filter is not None and not callable(world_size_filter):
            raise TypeError(
                f"Tree: world_size_filter must be callable or None, got {world_size_filter!r}"
            )
        self.layers = list(layers)
        self.world_size_filter = world_size_filter
        self.tree: _Node | None = None
        self._used = False  # the tree served a call; a new Wrapper call rebuilds it
        self.rank_map: dict[int, _Node] = {}
        self.init_rank_map: dict[int, _Node] = {}
        self._builds = 0

    # -- building -------------------------------------------------------------
    def keys_of(self, state: State) -> list[str]:
        """This rank's grouping key at each layer."""
        return [_group_key(layer.key_or_fn, state) for layer in self.layers]

    def _exchange(self, state: State, store: Any) -> list[dict[str, Any]]:
        ns = f"nvrx_tree/{self._builds}"
        mine = {"rank": state.rank, "initial_rank": state.initial_rank, "keys": self.keys_of(state)}
        store.set(f"{ns}/{state.rank}", json.dumps(mine))
        names = [f"{ns}/{r}" for r in range(state.world_size)]
        store.wait(names)
        return [json.loads(raw) for raw in store.multi_get(names)]

    def build(self, state: State, entries: list[dict[str, Any]]) -> None:
        """Build the tree from every rank's ``{rank, initial_rank, keys}`` (ordered by rank).

        Called by the first ``__call__`` of each Wrapper call after the ranks
        exchanged their entries through the store; callable directly to compute
        the whole job's assignment from one process (tests, planning tools).
        """
        self._used = False
        state = State(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)})
        roots = {tuple(e["keys"][:1]) for e in entries}
        if len(roots) != 1:
            raise RuntimeError(
                f"Tree: every rank must share the root key (first layer), got {sorted(roots)}"
            )
        self.tree = _Node(None, self.layers[0], None)
        self.rank_map, self.init_rank_map = {}, {}
        for entry in entries:
            if len(entry["keys"]) != len(self.layers):
                raise ValueError(
                    f"Tree: rank {entry['rank']} sent {len(entry['keys'])} keys for "
                    f"{len(self.layers)} layers"
                )
            node = self.tree
            for key, layer in zip(entry["keys"][1:], self.layers[1:], strict=True):
                node = node.children.setdefault(key, _Node(node, layer, None))
            leaf_state = dataclasses.replace(
                state,
                rank=entry["rank"],
                initial_rank=entry["initial_rank"],
                active_rank=None,
                mode=Mode.INITIALIZED,
                fn_exception=None,
            )
            leaf = _Node(node, None, leaf_state)
            node.children[("leaf", entry["initial_rank"])] = leaf
            self.init_rank_map[entry["initial_rank"]] = leaf
            self.rank_map[entry["rank"]] = leaf
        for index, leaf in enumerate(self.tree.leaves()):
            if index != leaf.state.rank:
                warnings.warn(
                    f"Tree: rank {leaf.state.rank} is leaf {index} of the topology; the "
                    "environment's rank order does not match the layers' grouping",
                    stacklevel=3,
                )
                break
        active = 0
        for leaf in self.tree.leaves():
            path = list(leaf.ancestors())
            if all(a.layer.max_ranks is None or a.active_count < a.layer.max_ranks for a in path):
                leaf.set_active(active)
                active += 1
                for a in path:
                    a.active_count += 1
            else:
                leaf.set_inactive()
        for leaf in self.tree.leaves():
            leaf.state.active_world_size = active
            domain = None
            for anc in leaf.ancestors():
                if not anc._flagged(LayerFlag.BACKFILL):
                    break
                domain = anc
            leaf.backfill_domain = domain

    # -- reassignment -----------------------------------------------------------
    def _propagate(self, node: _Node, terminated: set[int]) -> None:
        for child in node.children.values():
            if child.children:
                self._propagate(child, terminated)
        healthy = [
            leaf
            for leaf in node.leaves()
            if leaf.state.mode != Mode.TERMINATED and leaf.state.rank not in terminated
        ]
        if len(healthy) < node.layer.min_ranks:
            terminated.update(
                leaf.state.rank for leaf in node.leaves() if leaf.state.mode != Mode.TERMINATED
            )

    def _replace_from_spares(self, dead_active: set[int]) -> set[int]:
        replaced = set()
        for rank in sorted(dead_active):
            dead = self.rank_map[rank]
            for anc in dead.ancestors():
                if not anc._flagged(LayerFlag.RESERVE):
                    break
                if anc.spares:
                    _, spare = anc.spares.popitem()
                    spare.set_active(dead.state.active_rank)
                    replaced.add(rank)
                    break
        return replaced

    def _backfill(self, unhandled: set[int]) -> set[int]:
        """Fill dead indices inside BACKFILL branches; returns the active indices left vacant."""
        vacant: set[int] = set()
        by_domain: dict[int, tuple[_Node, list[_Node]]] = {}
        for rank in sorted(unhandled):
            dead = self.rank_map[rank]
            if dead.backfill_domain is None:
                vacant.add(dead.state.active_rank)
            else:
                by_domain.setdefault(id(dead.backfill_domain), (dead.backfill_domain, []))[
                    1
                ].append(dead)
        for domain, deads in by_domain.values():
            movers = heapq.nlargest(
                len(deads),
                (leaf for leaf in domain.leaves() if leaf.state.mode == Mode.ACTIVE),
                key=lambda leaf: leaf.state.active_rank,
            )
            for mover, dead in itertools.zip_longest(reversed(movers), deads):
                if mover is None:
                    vacant.add(dead.state.active_rank)
                else:
                    vacant.add(mover.state.active_rank)
                    mover.state.active_rank = dead.state.active_rank
        return vacant

    def _shift(self, vacant: set[int], unhandled: int) -> None:
        gaps = sorted(vacant)
        for leaf in self.tree.leaves():
            leaf.state.active_world_size -= unhandled
            if leaf.state.active_rank is not None:
                leaf.state.active_rank -= bisect.bisect_left(gaps, leaf.state.active_rank)

    def _filter(self) -> None:
        current = next(iter(self.tree.leaves())).state.active_world_size
        wanted = self.world_size_filter(current)
        if isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted <= current:
            raise ValueError(
                f"Tree: world_size_filter({current}) must return an int in [0, {current}], got {wanted!r}"
            )
        for leaf in self.tree.leaves():
            leaf.state.active_world_size = wanted
            if leaf.state.mode == Mode.ACTIVE and leaf.state.active_rank >= wanted:
                leaf.set_inactive()

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        if self.tree is None or (state.mode == Mode.INITIALIZED and self._used):
            entries = self._exchange(state, ctx.store)
            self._builds += 1
            self.build(state, entries)
        self._used = True
        for leaf in self.tree.leaves():
            leaf.state.iteration = state.iteration
            leaf.state.fn_exception = state.fn_exception

        terminated = terminated_set(ctx.terminated_ranks)
        unknown = {r for r in terminated if r >= state.world_size}
        if unknown:
            raise ValueError(f"Tree: terminated ranks {sorted(unknown)} are not ranks of this job")
        self._propagate(self.tree, terminated)
        dead_active = {r for r in terminated if self.rank_map[r].state.mode == Mode.ACTIVE}
        for rank in terminated:
            self.rank_map[rank].set_terminated()
        unhandled = dead_active - self._replace_from_spares(dead_active)
        if unhandled:
            self._shift(self._backfill(unhandled), len(unhandled))
        if self.world_size_filter is not None:
            self._filter()

        world_size = state.world_size - len(terminated)
        for leaf in self.tree.leaves():
            leaf.state.world_size = world_size
            if leaf.state.mode == Mode.TERMINATED:
                leaf.state.active_rank = None
        ordered = sorted(self.tree.leaves(), key=lambda leaf: leaf.state.mode == Mode.TERMINATED)
        self.rank_map = {}
        for index, leaf in enumerate(ordered):
            leaf.state.rank = index if leaf.state.mode != Mode.TERMINATED else None
            self.rank_map[index] = leaf

        mine = self.init_rank_map[state.initial_rank].state
        if mine.mode == Mode.TERMINATED:
            raise RankDiscarded(
                f"rank {state.rank} (initial {state.initial_rank}) is terminated by the Tree "
                f"(terminated ranks: {sorted(terminated)})"
            )
        ctx.state = dataclasses.replace(mine)
        ctx.terminated_ranks = set()
        return ctx


__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "Tree",
    "terminated_set",
]
