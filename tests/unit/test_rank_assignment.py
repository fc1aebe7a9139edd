"""Rank assignment: renumbering, spares, divisibility, Tree topologies, grouped filtering."""

from __future__ import annotations

import contextlib

import pytest

from nvrx.inprocess.compose import Compose
from nvrx.inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignmentCtx,
    RankDiscarded,
    RankFilter,
    ShiftRanks,
    Tree,
)
from nvrx.inprocess.state import Mode, State
from tests.support.store_ranks import run_ranks_with_store


def _assign(assignment, world_size, terminated, states=None):
    """Run ``assignment`` for every rank; returns {old rank: new state or 'discarded'}."""
    out = {}
    for rank in range(world_size):
        state = states[rank] if states else State(rank=rank, world_size=world_size)
        try:
            ctx = assignment(RankAssignmentCtx(state, None, set(terminated)))
            assert ctx.terminated_ranks == set()
            out[rank] = ctx.state
        except RankDiscarded:
            out[rank] = "discarded"
    return out


def test_shift_ranks_keeps_order_and_discards_terminated():
    out = _assign(ShiftRanks(), 8, {1, 4, 5})
    assert {r: s if s == "discarded" else s.rank for r, s in out.items()} == {
        0: 0, 1: "discarded", 2: 1, 3: 2, 4: "discarded", 5: "discarded", 6: 3, 7: 4,
    }  # fmt: skip
    assert {s.world_size for s in out.values() if s != "discarded"} == {5}
    assert {s.initial_rank for s in out.values() if s != "discarded"} == {0, 2, 3, 6, 7}


def test_terminated_ids_from_a_store_are_ints_and_bad_ones_named():
    ctx = ShiftRanks()(RankAssignmentCtx(State(rank=3, world_size=4), None, {b"1", "2"}))
    assert (ctx.state.rank, ctx.state.world_size) == (1, 2)
    with pytest.raises(ValueError, match="'x'"):
        ShiftRanks()(RankAssignmentCtx(State(rank=3, world_size=4), None, {"x"}))


def test_fill_gaps_moves_only_the_highest_ranks_into_gaps():
    out = _assign(FillGaps(), 8, {1, 4, 5})
    ranks = {r: s.rank for r, s in out.items() if s != "discarded"}
    assert ranks == {0: 0, 2: 2, 3: 3, 6: 1, 7: 4}
    assert sorted(ranks.values()) == list(range(5))


def test_default_composition_activates_all_after_shift():
    out = _assign(Compose(ActivateAllRanks(), ShiftRanks()), 4, {0})
    live = [s for s in out.values() if s != "discarded"]
    assert sorted(s.active_rank for s in live) == [0, 1, 2]
    assert {(s.mode, s.active_world_size) for s in live} == {(Mode.ACTIVE, 3)}


def test_max_active_world_size_keeps_spares_and_activates_them_after_a_fault():
    assignment = Compose(MaxActiveWorldSize(4), ShiftRanks())
    first = _assign(assignment, 6, set())
    assert [first[r].mode for r in range(6)] == [Mode.ACTIVE] * 4 + [Mode.INACTIVE] * 2
    assert first[5].active_rank is None and first[5].active_world_size == 4
    # Active rank 1 dies: the first spare (old rank 4) becomes active rank 3.
    second = _assign(assignment, 6, {1}, states=first)
    assert second[1] == "discarded"
    assert second[4].mode == Mode.ACTIVE and second[4].active_rank == 3
    assert second[5].mode == Mode.INACTIVE
    assert sorted(
        s.active_rank for s in second.values() if s != "discarded" and s.active_rank is not None
    ) == [0, 1, 2, 3]


def test_active_world_size_divisible_by():
    out = _assign(Compose(ActiveWorldSizeDivisibleBy(4), ShiftRanks()), 8, {2})
    live = [s for s in out.values() if s != "discarded"]
    assert {s.active_world_size for s in live} == {4}
    assert sum(s.mode == Mode.ACTIVE for s in live) == 4
    assert all((s.rank < 4) == (s.mode == Mode.ACTIVE) for s in live)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MaxActiveWorldSize(0), "max_active_world_size"),
        (lambda: MaxActiveWorldSize(2.5), "max_active_world_size"),
        (lambda: MaxActiveWorldSize(True), "max_active_world_size"),
        (lambda: ActiveWorldSizeDivisibleBy(0), "divisor"),
        (lambda: ActiveWorldSizeDivisibleBy(True), "divisor"),
        (lambda: ActiveWorldSizeDivisibleBy(2.0), "divisor"),
        (lambda: Layer(max_ranks=0), "max_ranks"),
        (lambda: Layer(max_ranks=1.5), "max_ranks"),
        (lambda: Layer(max_ranks=True), "max_ranks"),
        (lambda: Layer(min_ranks=-1), "min_ranks"),
        (lambda: Layer(min_ranks=1.5), "min_ranks"),
        (lambda: Layer(min_ranks=True), "min_ranks"),
        (lambda: Layer(min_ranks=None), "min_ranks"),
        (lambda: Tree([]), "layers"),
        (lambda: Tree(None), "layers"),
        (lambda: Tree(Layer(key_or_fn="root")), "layers"),
        (lambda: Tree([Layer(key_or_fn="root"), "host"]), "layers"),
        (lambda: Tree([Layer(key_or_fn="root")], world_size_filter=4), "world_size_filter"),
        (lambda: Layer(key_or_fn="root", flag="RESERVE"), "flag must be a LayerFlag"),
        (lambda: Layer(key_or_fn="root", flag=1), "flag must be a LayerFlag"),
        (lambda: Layer(key_or_fn="root", flag=0), "flag must be a LayerFlag"),
        (lambda: Layer(key_or_fn="root", flag=False), "flag must be a LayerFlag"),
        (lambda: Layer(key_or_fn="root", flag=""), "flag must be a LayerFlag"),
        (lambda: FilterCountGroupedByKey("k", condition=3), "condition"),
    ],
)
def test_bad_parameters_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


# -- Tree ------------------------------------------------------------------------


def _simulate_tree(make_tree, world_size, host_of, rounds):
    """Every rank's own Tree, built from the same entries; returns states after each round."""
    proto = make_tree()
    entries = []
    for rank in range(world_size):
        st = State(rank=rank, world_size=world_size)
        entries.append({"rank": rank, "initial_rank": rank, "keys": proto.keys_of(st)})
    trees, states = {}, {}
    for rank in range(world_size):
        trees[rank] = make_tree()
        trees[rank].build(State(rank=rank, world_size=world_size), entries)
        states[rank] = State(rank=rank, world_size=world_size)
    history = []
    for terminated in [set()] + rounds:
        # ``terminated`` names initial ranks; the Wrapper reports current ranks.
        current = {states[r].rank for r in terminated if states[r] != "discarded"}
        for rank, tree in trees.items():
            if states[rank] == "discarded":
                continue
            try:
                states[rank] = tree(RankAssignmentCtx(states[rank], None, set(current))).state
            except RankDiscarded:
                states[rank] = "discarded"
        history.append(dict(states))
    return history


def _host_layers(host_min, host_max, flag=LayerFlag.RESERVE):
    return [
        Layer(min_ranks=1, key_or_fn="root", flag=LayerFlag.RESERVE),
        Layer(
            min_ranks=host_min, max_ranks=host_max, key_or_fn=lambda s: f"h{s.rank // 4}", flag=flag
        ),
    ]


def test_tree_activates_up_to_max_per_host_and_replaces_from_the_same_host():
    history = _simulate_tree(lambda: Tree(_host_layers(1, 3)), 8, None, [{1}])
    first, second = history
    assert [first[r].mode for r in range(8)] == ([Mode.ACTIVE] * 3 + [Mode.INACTIVE]) * 2
    assert [first[r].active_rank for r in range(8)] == [0, 1, 2, None, 3, 4, 5, None]
    # Rank 1 dies: host 0's spare (rank 3) takes active rank 1; nothing else moves.
    assert second[1] == "discarded"
    assert second[3].active_rank == 1 and second[3].mode == Mode.ACTIVE
    assert [second[r].active_rank for r in (0, 2, 4, 5, 6, 7)] == [0, 2, 3, 4, 5, None]
    assert {second[r].world_size for r in second if second[r] != "discarded"} == {7}
    assert sorted(second[r].rank for r in second if second[r] != "discarded") == list(range(7))


def test_tree_terminates_a_host_below_min_ranks_and_shifts():
    history = _simulate_tree(lambda: Tree(_host_layers(4, None)), 8, None, [{5}])
    second = history[1]
    assert all(second[r] == "discarded" for r in (4, 5, 6, 7))
    assert [second[r].active_rank for r in range(4)] == [0, 1, 2, 3]
    assert {second[r].active_world_size for r in range(4)} == {4}


def test_tree_backfill_moves_highest_active_rank_into_the_gap():
    layers = [
        Layer(min_ranks=1, key_or_fn="root"),
        Layer(min_ranks=1, key_or_fn=lambda s: f"h{s.rank // 4}", flag=LayerFlag.BACKFILL),
    ]
    history = _simulate_tree(lambda: Tree(layers), 8, None, [{1}])
    second = history[1]
    # Host 0's highest active rank (3) fills index 1; host 1 shifts down by one.
    assert [second[r].active_rank for r in (0, 2, 3, 4, 5, 6, 7)] == [0, 2, 1, 3, 4, 5, 6]


def test_tree_world_size_filter_deactivates_surplus():
    history = _simulate_tree(
        lambda: Tree(_host_layers(1, None), world_size_filter=lambda n: n // 4 * 4), 8, None, [{0}]
    )
    second = history[1]
    live = {r: s for r, s in second.items() if s != "discarded"}
    assert {s.active_world_size for s in live.values()} == {4}
    assert sorted(s.active_rank for s in live.values() if s.mode == Mode.ACTIVE) == [0, 1, 2, 3]


def test_tree_takes_its_layers_from_a_generator():
    """``layers`` given as a generator is read once, kept whole, and the tree built from it."""
    layers = _host_layers(1, 3)
    tree = Tree(layer for layer in layers)
    assert tree.layers == layers
    entries = [{"rank": r, "initial_rank": r, "keys": ["root", f"h{r // 4}"]} for r in range(8)]
    tree.build(State(rank=0, world_size=8), entries)
    assert [tree.rank_map[r].state.active_rank for r in range(8)] == [0, 1, 2, None, 3, 4, 5, None]


def test_an_empty_layer_flag_is_taken_as_no_flag():
    """``LayerFlag(0)`` is a ``LayerFlag``: accepted, and a host flagged with it keeps its spare
    when an active rank dies (as without a flag), where ``RESERVE`` would activate it."""
    history = _simulate_tree(lambda: Tree(_host_layers(1, 3, flag=LayerFlag(0))), 8, None, [{1}])
    second = history[1]
    assert [second[r].active_rank for r in (0, 2, 3, 4, 5, 6, 7)] == [0, 1, None, 2, 3, 4, None]
    assert second[3].mode == Mode.INACTIVE and second[0].active_world_size == 5


@pytest.mark.parametrize("result", [-1, 9, 2.5, None])
def test_tree_world_size_filter_result_outside_the_world_is_named(result):
    """``world_size_filter(n)`` must give an int in ``[0, n]``; anything else is named."""
    tree = Tree(_host_layers(1, None), world_size_filter=lambda n: result)
    entries = [{"rank": r, "initial_rank": r, "keys": ["root", f"h{r // 4}"]} for r in range(8)]
    tree.build(State(rank=0, world_size=8), entries)
    with pytest.raises(ValueError, match=r"world_size_filter\(8\) must return an int in \[0, 8\]"):
        tree(RankAssignmentCtx(State(rank=0, world_size=8), None, set()))


def test_tree_rejects_different_root_keys():
    tree = Tree([Layer(key_or_fn=lambda s: str(s.rank))])
    entries = [{"rank": r, "initial_rank": r, "keys": [str(r)]} for r in range(2)]
    with pytest.raises(RuntimeError, match="root key"):
        tree.build(State(rank=0, world_size=2), entries)


# -- with a real store on loopback --------------------------------------------------


@pytest.mark.timeout(120)
def test_filter_count_grouped_by_key_with_real_store():
    world = 6
    terminated = {2}

    # A terminated rank returns at once from the filter and is discarded by ShiftRanks.
    results, errors = run_ranks_with_store(
        world, lambda r, s: _filter_rank(r, s, world, terminated)
    )
    assert set(errors) == {2, 3} and all(isinstance(e, RankDiscarded) for e in errors.values()), (
        errors
    )
    assert {r: s.rank for r, s in results.items()} == {0: 0, 1: 1, 4: 2, 5: 3}
    assert {s.world_size for s in results.values()} == {4}


@pytest.mark.timeout(120)
def test_filter_count_grouped_by_key_takes_keys_that_are_not_strings():
    """An int key (constant or computed) groups by its ``str()``, as in the reference."""
    world = 4

    def rank_main(rank, store, key_or_fn, condition):
        step = FilterCountGroupedByKey(key_or_fn, condition, timeout=20)
        step.name = f"int_key_{key_or_fn if isinstance(key_or_fn, int) else 'fn'}"
        ctx = RankAssignmentCtx(State(rank=rank, world_size=world), store, {0})
        return sorted(step(ctx).terminated_ranks)

    results, errors = run_ranks_with_store(world, lambda r, s: rank_main(r, s, 7, lambda n: n >= 3))
    assert not errors and set(map(tuple, results.values())) == {(0,)}, (results, errors)
    results, errors = run_ranks_with_store(
        world, lambda r, s: rank_main(r, s, lambda st: st.rank // 2, lambda n: n == 2)
    )
    # rank 0, terminated already, passes the filter without learning its group's verdict
    assert not errors and results == {0: [0], 1: [0, 1], 2: [0, 1], 3: [0, 1]}, (results, errors)


def _filter_rank(rank, store, world, terminated):
    step = FilterCountGroupedByKey(
        lambda s: f"g{s.rank // 2}", lambda count: count == 2, timeout=20
    )
    step.name = "filter_under_test"  # the same on every simulated rank of this one process
    state = State(rank=rank, world_size=world, mode=Mode.ACTIVE)
    ctx = RankAssignmentCtx(state, store, set(terminated))
    return Compose(ShiftRanks(), step)(ctx).state


@pytest.mark.timeout(120)
def test_tree_first_call_exchanges_keys_through_real_store():
    world = 8

    def rank_fn(rank, store):
        tree = Tree(_host_layers(1, 3))
        return tree(RankAssignmentCtx(State(rank=rank, world_size=world), store, set())).state

    results, errors = run_ranks_with_store(world, rank_fn)
    assert not errors, errors
    assert [results[r].active_rank for r in range(world)] == [0, 1, 2, None, 3, 4, 5, None]
    assert {results[r].active_world_size for r in range(world)} == {6}


def test_each_assignment_says_how_long_it_may_wait_for_its_peers():
    """Between rounds a rank is ended ``hard_timeout`` after that limit: the default
    assignment, computed locally, gets none (a hang there is ended after ``hard_timeout``),
    one that exchanges through the store its own barriers' limit, any other callable
    (the user's) ``barrier_timeout``."""
    from nvrx.inprocess import rank_filter
    from nvrx.inprocess.rank_assignment import assignment_wait_s

    barrier_s = 30.0
    default = Compose(ActivateAllRanks(), ShiftRanks())
    assert assignment_wait_s(default, barrier_s) == 0.0
    assert assignment_wait_s(Compose(MaxActiveWorldSize(4), FillGaps()), barrier_s) == 0.0
    grouped = FilterCountGroupedByKey(lambda state: "k", lambda count: True, timeout=7)
    assert assignment_wait_s(Compose(grouped, ShiftRanks()), barrier_s) == 14.0
    tree = Tree([Layer(min_ranks=1, key_or_fn="root", flag=LayerFlag.RESERVE)])
    assert assignment_wait_s(tree, barrier_s) == barrier_s
    assert assignment_wait_s(lambda ctx: ctx, barrier_s) == barrier_s
    assert assignment_wait_s(ActiveWorldSizeDivisibleBy(2), barrier_s) == 0.0

    class UsersFilter(RankFilter):  # may exchange keys through ctx.store
        def __call__(self, ctx):
            return ctx

    assert assignment_wait_s(UsersFilter(), barrier_s) == barrier_s
    with pytest.warns(DeprecationWarning):
        old_filter = rank_filter.MaxActiveWorldSize(2)
    assert assignment_wait_s(rank_filter.AfterAssignment(default, old_filter), barrier_s) == 0.0


def test_an_assignment_that_picks_no_active_ranks_keeps_every_rank_active_after_a_shrink(
    monkeypatch,
):
    """``ShiftRanks`` alone chooses no active ranks: every rank is active in the first round,
    and after each shrink (rank 0 leaves, then the rank numbered 0 after it) each rank's active
    rank and world size, and the ``RANK``/``WORLD_SIZE`` the function reads, are its new rank
    and world size (not the previous round's, which name a rank and a world that are gone)."""
    import os
    from types import SimpleNamespace

    from nvrx.inprocess import round_run

    monkeypatch.setenv("RANK", "-1")  # restored after the test: ``assign`` publishes them
    monkeypatch.setenv("WORLD_SIZE", "-1")
    seen = {}
    for rank in range(4):
        call = SimpleNamespace(
            state=State(rank=rank, world_size=4),
            assignment=ShiftRanks(),
            round_store=None,
            emit=lambda kind, **fields: None,
        )
        round_run.assign(call, set(), set(), 0)
        assert (call.state.mode, call.state.active_rank) == (Mode.ACTIVE, rank)
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(rank), "4")
        for shrink in (1, 2):
            if call.state.rank == 0:
                break
            round_run.assign(call, {0}, set(), shrink)
            seen[rank, shrink] = (
                call.state.rank,
                call.state.active_rank,
                call.state.active_world_size,
                os.environ["RANK"],
                os.environ["WORLD_SIZE"],
            )
    assert seen == {
        (1, 1): (0, 0, 3, "0", "3"),
        (2, 1): (1, 1, 3, "1", "3"),
        (2, 2): (0, 0, 2, "0", "2"),
        (3, 1): (2, 2, 3, "2", "3"),
        (3, 2): (1, 1, 2, "1", "2"),
    }


@pytest.mark.timeout(120)
def test_tree_first_call_goes_on_without_the_ranks_gone_before_it():
    """Ranks gone before the first round (a process generation opened without them) post no
    key: the others build the topology of the ranks present, which a host left below its
    ``min_ranks`` by the gone rank leaves too, instead of waiting for keys that never come."""
    world, gone = 6, 3

    def rank_fn(rank, store):
        if rank == gone:
            return None
        layers = [
            Layer(min_ranks=1, key_or_fn="root", flag=LayerFlag.RESERVE),
            Layer(min_ranks=2, key_or_fn=lambda s: f"h{s.initial_rank // 2}"),
        ]
        ctx = Tree(layers)(RankAssignmentCtx(State(rank=rank, world_size=world), store, {gone}))
        assert ctx.terminated_ranks == set()
        return ctx.state

    results, errors = run_ranks_with_store(world, rank_fn)
    assert set(errors) == {2} and isinstance(errors[2], RankDiscarded), errors
    live = {r: s for r, s in results.items() if s is not None}
    assert {r: (s.rank, s.active_rank) for r, s in live.items()} == {
        0: (0, 0), 1: (1, 1), 4: (2, 2), 5: (3, 3),
    }  # fmt: skip
    assert {(s.world_size, s.active_world_size, s.mode) for s in live.values()} == {
        (4, 4, Mode.ACTIVE)
    }


@pytest.mark.timeout(120)
def test_tree_is_rebuilt_when_the_wrapper_starts_a_new_call():
    """A Wrapper called again gives its Tree fresh states (``Mode.INITIALIZED``): the tree is
    built anew from them, not carried over from the call before (where rank 1 left)."""
    world = 4

    def rank_fn(rank, store):
        tree = Tree(_host_layers(1, None))
        state = tree(RankAssignmentCtx(State(rank=rank, world_size=world), store, set())).state
        with pytest.raises(RankDiscarded) if rank == 1 else contextlib.nullcontext():
            tree(RankAssignmentCtx(state, store, {1}))
        fresh = State(rank=rank, world_size=world)
        return tree(RankAssignmentCtx(fresh, store, set())).state

    results, errors = run_ranks_with_store(world, rank_fn)
    assert not errors, errors
    assert {r: (s.rank, s.active_rank, s.world_size) for r, s in results.items()} == {
        r: (r, r, world) for r in range(world)
    }


@pytest.mark.timeout(120)
def test_a_replacement_process_takes_over_the_tree_its_survivors_hold():
    """Rank 1 leaves in round 1 (a spare of its host takes its index). In round 2, rank 0's
    process dies and its replacement is taken back with a Tree of its own that served no
    call, and rank 3 (initial rank 4) leaves: the lowest survivor hands its tree over in
    that round's store, and every rank, the replacement too, gives rank 3's index to the
    same spare of its host (the one taken last of the two). A new Wrapper call then
    rebuilds the tree on every rank alike."""
    import torch.distributed as dist

    world = 8
    layers = _host_layers(1, 2)

    def rank_fn(rank, store):
        def call(tree, state, round_, terminated=(), rejoined=()):
            round_store = dist.PrefixStore(f"round{round_}", store)
            ctx = RankAssignmentCtx(state, round_store, set(terminated), set(rejoined))
            return tree(ctx).state

        tree = Tree(layers)
        state = call(tree, State(rank=rank, world_size=world), 0)
        state = call(tree, state, 1, {1})
        if rank == 0:  # the replacement process: the dead one's state, no tree
            tree = Tree(layers)
        state = call(tree, state, 2, {3}, rejoined={0})
        view = {i: (leaf.state.mode, leaf.state.active_rank) for i, leaf in tree.init_rank_map.items()}
        fresh = State(rank=state.rank, world_size=state.world_size)  # a new Wrapper call
        return state, view, call(tree, fresh, 3)

    results, errors = run_ranks_with_store(world, rank_fn)
    assert set(errors) == {1, 4} and all(isinstance(errors[r], RankDiscarded) for r in (1, 4)), errors
    views = [view for _, view, _ in results.values()]
    assert all(view == views[0] for view in views), views
    assert views[0][3] == (Mode.ACTIVE, 1) and views[0][2] == (Mode.INACTIVE, None)  # round 1
    assert views[0][7] == (Mode.ACTIVE, 2) and views[0][6] == (Mode.INACTIVE, None)
    assert results[0][0].mode == Mode.ACTIVE and results[0][0].active_rank == 0
    actives = sorted(s.active_rank for s, _, _ in results.values() if s.mode == Mode.ACTIVE)
    assert actives == [0, 1, 2, 3]
    rebuilt = {r: (s.rank, s.world_size, s.mode) for r, (_, _, s) in results.items()}
    assert rebuilt == {
        0: (0, 6, Mode.ACTIVE), 2: (1, 6, Mode.ACTIVE), 3: (2, 6, Mode.INACTIVE),
        5: (3, 6, Mode.INACTIVE), 6: (4, 6, Mode.ACTIVE), 7: (5, 6, Mode.ACTIVE),
    }  # fmt: skip (the hosts of the new call: its ranks // 4)


def test_an_assignment_that_returns_no_context_is_named():
    """A plug-in of the user's that forgets ``return ctx`` is named, with what to add."""
    from types import SimpleNamespace

    from nvrx.inprocess import round_run

    def forgets(ctx):
        ctx.state.rank = 0

    call = SimpleNamespace(state=State(rank=0, world_size=1), assignment=forgets, round_store=None)
    with pytest.raises(TypeError, match=r"forgets.* returned None.*return ctx"):
        round_run.assign(call, set(), set(), 0)
