"""A generation (nvrx.store.rounds): a generation's initial barrier with ranks that will not come
(real TCPStore on loopback)."""

from __future__ import annotations

import pytest

from nvrx.store import barrier, client, rounds


@pytest.fixture()
def store():
    server = client.serve("127.0.0.1", 0, timeout=10)
    yield server
    del server


def test_an_arrival_for_a_gone_rank_may_open_the_generation(store) -> None:
    store.set(rounds.TORCH_DEFAULT_PG_PREFIX + "0", "stale address")
    assert not rounds.arrive_generation(store, 0, 0, 3)
    assert not rounds.arrive_generation(store, 0, 2, 3)
    rounds.mark_gone(store, [1])
    rounds.arrive_for_gone(store, 0, 3)  # the declarer's arrival completes the barrier
    assert barrier.is_released(store, rounds.initial_barrier(0))
    assert rounds.current_round(store) == 0
    assert rounds.gone_at_start(store, 0) == {1}
    assert not store.check([rounds.TORCH_DEFAULT_PG_PREFIX + "0"])
    assert rounds.job_restarts(store) == 0  # the job's first generation is no restart


def test_arrivals_for_gone_ranks_count_once_and_a_later_generation_counts_a_restart(store) -> None:
    rounds.publish_round(store, 3)  # a generation ran before: the next one starts at 100
    generation = rounds.generation_base(store)
    assert generation == 100
    rounds.mark_gone(store, [0, 3])
    for _ in range(2):  # every rank arrives for the gone ones: each counts once
        rounds.arrive_for_gone(store, generation, 4)
    assert not barrier.is_released(store, rounds.initial_barrier(generation))
    assert not rounds.arrive_generation(store, generation, 1, 4)
    assert rounds.arrive_generation(store, generation, 2, 4)
    assert rounds.gone_at_start(store, generation) == {0, 3}
    assert rounds.current_round(store) == generation
    assert rounds.job_restarts(store) == 1


def test_ranks_outside_the_world_and_unopened_generations(store) -> None:
    rounds.mark_gone(store, [5, 1])
    assert rounds.gone_in(store, 4) == {1}
    assert rounds.gone_at_start(store, 0) == set()  # never opened in this store
    assert [rounds.generation_of(store, r) for r in (0, 99, 100, 257)] == [0, 0, 100, 200]


def test_a_generation_of_more_rounds_than_the_step_keeps_its_record(store) -> None:
    """Generation 100 runs 150 in-process rounds: round 250 is still its, not generation
    200's (which never opened), and the ranks gone at its start are still known there."""
    rounds.publish_round(store, 7)
    generation = rounds.generation_base(store)
    rounds.mark_gone(store, [2])
    rounds.arrive_for_gone(store, generation, 3)
    assert not rounds.arrive_generation(store, generation, 0, 3)
    assert rounds.arrive_generation(store, generation, 1, 3)
    rounds.publish_round(store, generation + 150)
    assert rounds.generation_of(store, generation + 150) == generation == 100
    assert rounds.gone_at_start(store, rounds.generation_of(store, 250)) == {2}
    assert rounds.generation_base(store) == 300  # the next one starts above round 250


def test_a_supervisor_does_not_take_out_a_rank_that_was_gone_when_a_long_generation_began(
    store,
) -> None:
    """Rank 2 was gone when generation 100 opened and round 250 of it runs without it: a late
    declaration about rank 2 must not take it out of that round (its arrival would count
    for a rank that is not there)."""

    rounds.publish_round(store, 7)
    generation = rounds.generation_base(store)
    rounds.mark_gone(store, [2])
    rounds.arrive_for_gone(store, generation, 3)
    rounds.arrive_generation(store, generation, 0, 3)
    rounds.arrive_generation(store, generation, 1, 3)
    rounds.publish_round(store, generation + 150)
    assert rounds.leave_round(store, [2], 3, "node lost", gone=False)["ranks"] == []


def test_a_rank_registered_terminated_whose_node_died_before_it_arrived_is_arrived_for(store) -> None:
    """Rank 1's monitor registered it terminated (a hard timeout), and its node died before
    the monitor arrived for it at the iteration barrier: the supervisor that declares the
    node lost arrives for it, or the others would wait there until the barrier's timeout."""
    rounds.publish_round(store, 7)
    view = rounds.round_store(store, 7)
    for rank in range(3):  # each started the round
        _state(view, rank, rank, 3)
    rounds.register_terminated(view, 1)
    for rank in (0, 2):
        rounds.arrive_one(store, "iteration", view.iteration, rank, 3)
    assert not rounds.await_barrier(store, "iteration", view.iteration, 3, 0.0)
    rounds.leave_round(store, [1], 3, "node lost", gone=False)
    assert rounds.await_barrier(store, "iteration", view.iteration, 3, 10.0)


def test_a_terminated_entry_is_written_though_its_first_registrant_died_before_writing_it(
    store,
) -> None:
    """The rank counted itself first (its flag) and was killed before its entry went in: its
    monitor's registration writes the entry, or the round's decision keeps a dead rank."""
    view = rounds.round_store(store, 7)
    view.add(rounds.terminated_flag(0), 1)  # the rank's own registration, cut short
    assert rounds.register_terminated(view, 0)
    assert rounds.terminated_ranks(view) == {0}
    assert not rounds.register_terminated(view, 0)  # once there, not again


def _state(view, rank: int, initial: int, world_size: int) -> None:
    rounds._set_rank_state(view, rank, {"rank": rank, "world_size": world_size, "initial_rank": initial})


def test_a_lost_rank_that_had_not_started_a_renumbered_round_is_not_taken_for_another() -> None:
    """Round 5 ended rank 0 for good; round 6 numbers the others 0, 1, 2 (initial 1, 2, 3).
    The node of initial rank 2 is lost before it wrote its state in round 6: its number
    there is 1, not 2 (initial rank 3's, a healthy rank): it is not taken out by a guess,
    before any state is written there (round 5 ended a rank) or after (a state shows the
    ranks renumbered); once it wrote its own, it is taken out at its number there."""
    server = client.serve("127.0.0.1", 0, timeout=10)
    try:
        rounds.publish_round(server, 5)
        rounds.register_terminated(rounds.round_store(server, 5), 0)
        rounds.publish_round(server, 6)
        view = rounds.round_store(server, 6)
        assert rounds.leave_round(server, [2], 4, "node lost", gone=False)["ranks"] == []
        _state(view, 0, 1, 3)  # initial rank 1 is rank 0 now
        assert rounds.leave_round(server, [2], 4, "node lost", gone=False)["ranks"] == []
        assert rounds.terminated_ranks(view) == set()  # initial rank 3 left alone
        _state(view, 1, 2, 3)
        assert rounds.leave_round(server, [2], 4, "node lost", gone=False)["ranks"] == [1]
        assert rounds.terminated_ranks(view) == {1}
    finally:
        del server


def test_lost_ranks_that_had_not_started_a_round_nobody_left_are_at_their_initial_ranks(store) -> None:
    """A restart that ended nobody: round 1 numbers ranks as they began, which the states
    written there show. The lost node's ranks 2 and 3, with no state yet, are taken out
    at 2 and 3."""
    rounds.publish_round(store, 1)
    view = rounds.round_store(store, 1)
    for rank in (0, 1):
        _state(view, rank, rank, 4)
    assert rounds.leave_round(store, [2, 3], 4, "node lost", gone=True)["ranks"] == [2, 3]
    assert rounds.terminated_ranks(view) == {2, 3}


def test_a_wait_of_less_than_a_microsecond_is_bounded(monkeypatch) -> None:
    """A wait whose time left is below a microsecond (the last pass of a rejoin's wait)
    rounds to a timedelta of 0, which a store takes for no bound: it waits 1 ms instead."""
    import threading
    from types import SimpleNamespace

    from torch.distributed import HashStore

    monkeypatch.setattr(rounds, "time", SimpleNamespace(monotonic=lambda: 100.0))  # time stands
    store, got = HashStore(), []
    waiter = threading.Thread(
        target=lambda: got.append(rounds.await_admission(store, 1, 5, 4e-7)), daemon=True
    )
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and got == [None]


def test_a_renumbering_rounds_ago_is_seen_in_the_round_before(store) -> None:
    """Round 5 ended initial rank 0; rounds 6 and 7 restarted with nobody ending, and the
    keys of round 5 are gone. Round 7's states (initial 1 at rank 0, ...) still show the
    numbering, so a lost rank without a state in round 8 is not given its initial number."""
    rounds.publish_round(store, 8)
    seven = rounds.round_store(store, 7)
    for rank, initial in enumerate((1, 2, 3)):
        _state(seven, rank, initial, 3)
    assert rounds.leave_round(store, [2], 4, "node lost", gone=False)["ranks"] == []
    assert rounds.terminated_ranks(rounds.round_store(store, 8)) == set()


def test_a_rank_whose_replacement_came_back_renumbers_nobody(store) -> None:
    """Round 5 registered rank 2 terminated, and its replacement was taken back into round
    6 (``rejoin``): round 6 numbers the ranks as they began, and a lost node's rank 3 with
    no state there yet is taken out at 3."""
    five = rounds.round_store(store, 5)
    rounds.register_terminated(five, 2)
    five.set(rounds.REJOIN, rounds._sealed(rounds._round_key(five, rounds.REJOIN), "[2]"))
    rounds.publish_round(store, 6)
    assert rounds.leave_round(store, [3], 4, "node lost", gone=True)["ranks"] == [3]


def test_a_state_written_in_the_round_shows_a_renumbering_nothing_before_told(store) -> None:
    """Nothing on record before round 3 says the ranks were numbered anew, but a state
    written in round 3 does (initial rank 1 at number 0): a lost rank without a state there
    is not given its initial number."""
    rounds.publish_round(store, 3)
    three = rounds.round_store(store, 3)
    _state(three, 0, 1, 3)
    assert rounds.leave_round(store, [2], 4, "node lost", gone=False)["ranks"] == []


def test_the_store_host_waits_for_the_termination_barrier_while_a_host_beats(base) -> None:
    """Renewed while the ring's counters move; ended by a whole wait with the job standing
    still, or by the barrier completing."""
    from nvrx.store import host_ring

    slot = host_ring.register(base, "h0")
    beating = host_ring.HostsBeating(base)
    looks: list[bool] = []

    def moving() -> bool:
        if len(looks) < 2:  # the host beats through the first two waits, then stands still
            base.add(host_ring.RING.alive(slot), 1)
        looks.append(beating())
        return looks[-1]

    rounds.arrive_one(base, "termination", 0, 0, 2)
    assert not rounds.keep_until_terminated(base, 0, 2, 0.05, moving)
    assert looks == [True, True, False]
    rounds.arrive_one(base, "termination", 0, 1, 2)
    assert rounds.keep_until_terminated(base, 0, 2, 0.05, lambda: False)
