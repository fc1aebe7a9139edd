"""``Tree``: topology-aware rank assignment and activation in one step."""

from __future__ import annotations

import bisect
import dataclasses
import enum
import heapq
import itertools
import json
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from ..state import Mode, State
from .base import (
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    group_key,
    positive_int,
    terminated_set,
)


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
        positive_int("Layer", "max_ranks", self.max_ranks, allow_none=True)
        if self.flag is not None and not isinstance(self.flag, LayerFlag):
            raise TypeError(
                f"Layer: flag must be a LayerFlag (RESERVE, BACKFILL, or both joined with |) "
                f"or None, got {self.flag!r}"
            )


class _Node:
    """A branch (layer set) or a leaf (state set) of the topology tree."""

    __slots__ = (
        "parent",
        "key",
        "layer",
        "state",
        "children",
        "spares",
        "active_count",
        "backfill_domain",
    )

    def __init__(
        self, parent: _Node | None, layer: Layer | None, state: State | None, key: Any = None
    ) -> None:
        self.parent = parent
        self.key = key  # under its parent (a leaf: its initial rank)
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

    def branches(self) -> Iterable[_Node]:
        """This branch and every branch below it, depth first, parents first."""
        yield self
        for child in self.children.values():
            if child.children:
                yield from child.branches()

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


def _layer_list(layers: Iterable[Layer]) -> list[Layer]:
    """``layers`` as a list, read once (a generator checked first would be spent), or a
    ``ValueError`` naming what was given when it is not a non-empty sequence of ``Layer``."""
    bad = ValueError(f"Tree: layers must be a non-empty list of Layer, got {layers!r}")
    if isinstance(layers, Layer) or not isinstance(layers, Iterable):
        raise bad
    listed = list(layers)
    if not listed or not all(isinstance(x, Layer) for x in listed):
        raise bad
    return listed


def _plain(state: State) -> State:
    """A ``State`` of ``state``'s fields (a subclass's, or another class's with those fields,
    made plain): the leaves' states are copies of it."""
    return State(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)})


RUNNING_KEY = "nvrx_tree/running"  # the tree a replacement takes over (in the round's store)
_HANDED_OVER = ("initial_rank", "rank", "active_rank", "active_world_size", "world_size")


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
    ``Mode.INITIALIZED``), never reused from an earlier call. Under a supervisor,
    the replacement of a dead process taken back into the job
    (``RankAssignmentCtx.rejoined_ranks``) holds no tree: the lowest survivor hands
    its tree over in the round's store, and the replacement takes it over before
    the round's terminations are applied, so every rank works on the same one.

    Args:
        layers: levels of the topology, root first.
        world_size_filter: optional reduction of the active world size.
    """

    def __init__(
        self,
        layers: list[Layer],
        world_size_filter: Callable[[int], int] | None = None,
    ) -> None:
        self.layers = _layer_list(layers)
        if world_size_filter is not None and not callable(world_size_filter):
            raise TypeError(
                f"Tree: world_size_filter must be callable or None, got {world_size_filter!r}"
            )
        self.world_size_filter = world_size_filter
        self.tree: _Node | None = None
        self._used = False  # the tree served a call; a new Wrapper call rebuilds it
        self.rank_map: dict[int, _Node] = {}
        self.init_rank_map: dict[int, _Node] = {}
        self._builds = 0

    # -- building -------------------------------------------------------------
    def keys_of(self, state: State) -> list[str]:
        """This rank's grouping key at each layer."""
        return [group_key(layer.key_or_fn, state) for layer in self.layers]

    def _exchange(self, state: State, store: Any, gone: set[int]) -> list[dict[str, Any]]:
        """Every rank's entry but those of the ``gone`` ranks, which post none (ordered by rank)."""
        ns = f"nvrx_tree/{self._builds}"
        mine = {"rank": state.rank, "initial_rank": state.initial_rank, "keys": self.keys_of(state)}
        store.set(f"{ns}/{state.rank}", json.dumps(mine))
        names = [f"{ns}/{r}" for r in range(state.world_size) if r not in gone]
        store.wait(names)
        return [json.loads(raw) for raw in store.multi_get(names)]

    def _build_from_store(self, state: State, store: Any, gone: set[int]) -> State:
        """Exchange keys through the store and build the tree of the ranks present: ranks
        ``gone`` before the tree is built (the first round of a process generation opened
        without them) have no key to place them by, so the others are numbered as if they
        never were. Returns the caller's state in that numbering."""
        if state.rank in gone:
            raise RankDiscarded(f"rank {state.rank} is terminated (terminated ranks: {sorted(gone)})")
        entries = self._exchange(state, store, gone)
        self._builds += 1
        entries = [dict(entry, rank=index) for index, entry in enumerate(entries)]
        state = dataclasses.replace(
            state,
            rank=state.rank - sum(1 for r in gone if r < state.rank),
            world_size=len(entries),
        )
        self.build(state, entries)
        return state

    def build(self, state: State, entries: list[dict[str, Any]]) -> None:
        """Build the tree from every rank's ``{rank, initial_rank, keys}`` (ordered by rank).

        Called by the first ``__call__`` of each Wrapper call after the ranks
        exchanged their entries through the store; callable directly to compute
        the whole job's assignment from one process (tests, planning tools).
        """
        self._used = False
        state = _plain(state)
        roots = {tuple(e["keys"][:1]) for e in entries}
        if len(roots) != 1:
            raise RuntimeError(
                f"Tree: every rank must share the root key (first layer), got {sorted(roots)}"
            )
        self.tree = _Node(None, self.layers[0], None, entries[0]["keys"][0])
        self.rank_map, self.init_rank_map = {}, {}
        for entry in entries:
            if len(entry["keys"]) != len(self.layers):
                raise ValueError(
                    f"Tree: rank {entry['rank']} sent {len(entry['keys'])} keys for "
                    f"{len(self.layers)} layers"
                )
            leaf_state = dataclasses.replace(
                state,
                rank=entry["rank"],
                initial_rank=entry["initial_rank"],
                active_rank=None,
                mode=Mode.INITIALIZED,
                fn_exception=None,
            )
            self.rank_map[entry["rank"]] = self._place(entry["keys"], leaf_state)
        for index, leaf in enumerate(self.tree.leaves()):
            if index != leaf.state.rank:
                warnings.warn(
                    f"Tree: rank {leaf.state.rank} is leaf {index} of the topology; the "
                    "environment's rank order does not match the layers' grouping",
                    stacklevel=3,
                )
                break
        self._activate_leaves()

    def _place(self, keys: list[str], leaf_state: State) -> _Node:
        """Add the leaf of ``leaf_state`` under the branches of its ``keys`` (made as needed)."""
        node = self.tree
        for key, layer in zip(keys[1:], self.layers[1:], strict=True):
            node = node.children.setdefault(key, _Node(node, layer, None, key))
        leaf = _Node(node, None, leaf_state, leaf_state.initial_rank)
        node.children[("leaf", leaf_state.initial_rank)] = leaf
        self.init_rank_map[leaf_state.initial_rank] = leaf
        return leaf

    def _activate_leaves(self) -> None:
        """Make leaves active in tree order while every layer above them has room, the others
        inactive; then give each leaf its backfill domain."""
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
        self._set_backfill_domains()

    def _set_backfill_domains(self) -> None:
        """Give each leaf its backfill domain: its outermost run of ``BACKFILL`` ancestors
        from the leaf up."""
        for leaf in self.tree.leaves():
            domain = None
            for anc in leaf.ancestors():
                if not anc._flagged(LayerFlag.BACKFILL):
                    break
                domain = anc
            leaf.backfill_domain = domain

    # -- the tree of a call -------------------------------------------------------
    def _tree_for(
        self, ctx: RankAssignmentCtx, state: State, terminated: set[int]
    ) -> tuple[State, set[int]]:
        """Have the tree this call works on: built at the start of a Wrapper call, taken over
        from the survivors by a replacement process, handed over by the lowest survivor
        when replacements came back. Returns the rank's state and the terminated ranks in
        the tree's numbering."""
        rejoined = terminated_set(ctx.rejoined_ranks)
        if self.tree is None and state.rank in rejoined:
            self._take_over(state, ctx.store)
        elif self.tree is None or (state.mode == Mode.INITIALIZED and self._used):
            return self._build_from_store(state, ctx.store, terminated), set()
        elif rejoined and state.rank == min(
            set(range(state.world_size)) - terminated - rejoined, default=None
        ):
            ctx.store.set(RUNNING_KEY, json.dumps(self._running()))
        return state, terminated

    def _running(self) -> dict[str, Any]:
        """The tree as it stands (JSON), for a replacement process to hold the same one: each
        leaf with its keys and state in tree order, each branch's spares in the order they
        are taken, the current numbering."""
        leaves = []
        for leaf in self.tree.leaves():
            s = leaf.state
            leaves.append(
                {
                    "keys": [anc.key for anc in reversed(list(leaf.ancestors()))],
                    "initial_rank": s.initial_rank,
                    "rank": s.rank,
                    "mode": s.mode.name,
                    "active_rank": s.active_rank,
                    "active_world_size": s.active_world_size,
                    "world_size": s.world_size,
                }
            )
        return {
            "builds": self._builds,
            "leaves": leaves,
            "spares": [list(branch.spares) for branch in self.tree.branches()],
            "rank_map": [[i, leaf.state.initial_rank] for i, leaf in self.rank_map.items()],
        }

    def _take_over(self, state: State, store: Any) -> None:
        """A replacement process, in the round it was taken back into: hold the tree that
        the lowest survivor handed over there (``_running``)."""
        store.wait([RUNNING_KEY])
        running = json.loads(store.get(RUNNING_KEY))
        state = _plain(state)
        self._builds = running["builds"]
        self.tree = _Node(None, self.layers[0], None, running["leaves"][0]["keys"][0])
        self.init_rank_map = {}
        for entry in running["leaves"]:
            leaf_state = dataclasses.replace(
                state,
                **{k: entry[k] for k in _HANDED_OVER},
                mode=Mode[entry["mode"]],
                fn_exception=None,
            )
            self._place(entry["keys"], leaf_state)
        for branch, spares in zip(self.tree.branches(), running["spares"], strict=True):
            branch.spares = {i: self.init_rank_map[i] for i in spares}
        self.rank_map = {i: self.init_rank_map[initial] for i, initial in running["rank_map"]}
        self._set_backfill_domains()

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
        terminated = terminated_set(ctx.terminated_ranks)
        unknown = {r for r in terminated if r >= state.world_size}
        if unknown:
            raise ValueError(f"Tree: terminated ranks {sorted(unknown)} are not ranks of this job")
        state, terminated = self._tree_for(ctx, state, terminated)
        self._used = True
        for leaf in self.tree.leaves():
            leaf.state.iteration = state.iteration
            leaf.state.fn_exception = state.fn_exception

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
