"""The Wrapper with an external store (as under an nvrx supervisor): process generations."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from helpers_inprocess import launch, spawn
from test_wrapper import FAST

from nvrx.store import client, rounds
from nvrx.store.service import StoreService

pytestmark = pytest.mark.timeout(300)  # three generations of ranks, each importing torch


@contextlib.contextmanager
def _supervised_store() -> Iterator[dict[str, str]]:
    """A job's store service on loopback, as a supervisor runs it; the environment that
    points a rank at it as a supervised rank."""
    with StoreService("127.0.0.1", 0, node=None) as service:
        yield {
            "NVRX_STORE_HOST": "127.0.0.1",
            "NVRX_STORE_PORT": str(service.port),
            "NVRX_SUPERVISED": "1",
        }


def test_restarted_processes_get_a_fresh_key_space_and_count_job_restarts(tmp_path):
    with _supervised_store() as env:
        first = launch(
            tmp_path / "gen0", 2, wrapper=FAST, fault="exception", fault_ranks=[1], env=env
        )
        assert first.wait(60) == [0, 0], first.logs()
        assert [c["iteration"] for c in first.calls(0)] == [0, 1]
        store = client.connect("127.0.0.1", int(env["NVRX_STORE_PORT"]), timeout=10)
        assert rounds.current_round(store) == 1
        assert rounds.job_restarts(store) == 1

        # Every process restarted (NVRX_RESTART_COUNT > 0): a new generation at round 100.
        second = launch(tmp_path / "gen1", 2, wrapper=FAST, env=dict(env, NVRX_RESTART_COUNT="1"))
        assert second.wait(60) == [0, 0], second.logs()
        assert [c["iteration"] for c in second.calls(0)] == [2]  # 1 in-process + 1 process restart
        starts = [e for e in second.events() if e["kind"] == "round_start"]
        assert {e["round"] for e in starts} == {100}
        assert rounds.current_round(store) == 100

        # The job restart counter feeds RetryController: the new generation is
        # restart 3, so max_iterations=4 allows exactly one more call.
        third = launch(
            tmp_path / "gen2",
            2,
            wrapper=FAST,
            max_iterations=4,
            fault="exception",
            fault_ranks=[0],
            fault_rounds=99,
            env=dict(env, NVRX_RESTART_COUNT="2"),
        )
        assert third.wait(60) == [130, 130], third.logs()
        assert [c["iteration"] for c in third.calls(0)] == [3]
        # 4; or 5 where rank 1 started round 201 only after rank 0 stopped and left it: rank 1
        # then restarts once more, alone, and stops at round 202's start (no call either)
        alone = [e["rank"] for e in third.events() if e["kind"] == "round_start" and e["round"] == 202]
        assert alone in ([], [0]), third.logs()
        assert rounds.job_restarts(store) == (5 if alone else 4)
        assert [c["iteration"] for c in third.calls(1)] == [3]


def test_replacement_of_a_dead_process_rejoins_and_the_job_keeps_its_size(tmp_path):
    with _supervised_store() as env:
        wrapper = dict(FAST, rejoin_timeout=40)
        ranks = launch(tmp_path, 3, wrapper=wrapper, fault="sigkill", fault_ranks=[1], env=env)
        dead = ranks.procs[1]
        assert dead.wait(60) == -9, ranks.logs()
        # What the supervisor does: start the local rank again with a restart count.
        ranks.procs[1] = spawn(
            ranks, 1, {"wrapper": wrapper, "env": env}, {"NVRX_RESTART_COUNT": "1"}
        )
        assert ranks.wait(90) == [0, 0, 0], ranks.logs()
        for rank in range(3):
            result = ranks.result(rank)
            assert result["world"] == 3 and result["peers"] == [0, 1, 2], ranks.logs()
            assert result["rank"] == str(rank)
        assert [c["iteration"] for c in ranks.calls(1)] == [
            0,
            1,
        ]  # first process, then the replacement
        events = ranks.events()
        assert any(e["kind"] == "rejoin" and e.get("rank_rejoined") == 1 for e in events)
        assert not [e for e in events if e["kind"] == "ranks_terminated"]



def test_a_replacement_that_does_not_come_within_rejoin_timeout_leaves_the_job_smaller(tmp_path):
    """docs/inprocess.md: the lowest survivor waits ``rejoin_timeout`` for the replacement of a
    dead process; when none comes (its supervisor could not start one), the rank assignment
    decides: ``ShiftRanks``, the default, goes on without it."""
    with _supervised_store() as env:
        ranks = launch(tmp_path, 3, wrapper=dict(FAST, rejoin_timeout=2), fault="sigkill", fault_ranks=[1], env=env)
        assert ranks.procs[1].wait(60) == -9, ranks.logs()
        codes = ranks.wait(90)
        assert (codes[0], codes[2]) == (0, 0), ranks.logs()
        for rank in (0, 2):
            result = ranks.result(rank)
            assert result["world"] == 2 and result["peers"] == [0, 2], ranks.logs()  # initial ranks
        waits = [e for e in ranks.events() if e["kind"] == "restart_phase" and e["phase"] == "rejoin_wait"]
        assert waits and all(e["duration_s"] >= 2 for e in waits if e["rank"] == 0), waits
        assert not [e for e in ranks.events() if e["kind"] == "rejoin" and e.get("rank_rejoined") == 1]


def _replace_killed(ranks: Any, rank: int, params: dict[str, Any]) -> None:
    """Once ``rank``'s process was SIGKILLed, start its replacement as a supervisor would."""
    assert ranks.procs[rank].wait(60) == -9, ranks.logs()
    ranks.procs[rank] = spawn(ranks, rank, params, {"NVRX_RESTART_COUNT": "1"})


def test_the_replacement_of_a_rank_dead_between_two_rounds_rejoins_at_once(tmp_path):
    """Rank 2 dies in its rank assignment for round 1 (round 0's barrier counted it there):
    its monitor takes it out of round 1, and its replacement, started as a supervisor
    would, rejoins in round 2: full size, no heartbeat or progress timeout on the way."""
    with _supervised_store() as env:
        wrapper = dict(FAST, rejoin_timeout=40, barrier_timeout=60, heartbeat_timeout=40)
        wrapper.update(soft_timeout=20, hard_timeout=40)
        params = dict(wrapper=wrapper, env=env, init_pg=False)
        ranks = launch(
            tmp_path, 3, fault="exception", fault_ranks=[0], die_in_assignment=2, **params
        )
        _replace_killed(ranks, 2, params)
        assert ranks.wait(90) == [0, 0, 0], ranks.logs()
        assert ranks.calls(2)[-1]["world_size"] == "3", ranks.logs()
        faults = [e for e in ranks.events() if e["kind"] == "fault" and e["component"] == "monitor"]
        dead = [(f["origin_rank"], f["round"]) for f in faults if f["fault_kind"] == "dead"]
        assert dead == [(2, 1)], ranks.logs()
        late = [f for f in faults if f["fault_kind"] in ("unresponsive", "hang_soft", "hang_hard")]
        assert not late, ranks.logs()


def test_a_replacement_under_a_tree_assignment_restarts_with_the_survivors(tmp_path):
    """The replacement of a dead rank rejoins a job whose rank assignment is a ``Tree``; a
    later fault restarts every rank, the replacement too, with the same tree."""
    with _supervised_store() as env:
        params = dict(wrapper=dict(FAST, rejoin_timeout=40), env=env, tree=True, raise_at=[[0, 1]])
        ranks = launch(tmp_path, 3, fault="sigkill", fault_ranks=[1], **params)
        _replace_killed(ranks, 1, params)
        assert ranks.wait(120) == [0, 0, 0], ranks.logs()
        for rank in range(3):
            assert ranks.result(rank)["world"] == 3, ranks.logs()
        assert [c["iteration"] for c in ranks.calls(1)] == [0, 1, 2], ranks.logs()


def test_a_replacement_meets_its_survivors_in_a_grouped_filter_and_starts_as_they_do(tmp_path):
    """A ``FilterCountGroupedByKey`` meets the ranks under a name made from the iteration:
    the replacement of a dead rank assigns ranks with the iteration its survivors have
    there (the round before's), then starts the round it joins with the round's own, as
    they do: ``initialize`` sees the same rank, size and iteration as on them."""
    with _supervised_store() as env:
        params = dict(
            wrapper=dict(FAST, rejoin_timeout=40), env=env, grouped=True, record_plugins=True
        )
        ranks = launch(tmp_path, 3, fault="sigkill", fault_ranks=[1], **params)
        _replace_killed(ranks, 1, params)
        assert ranks.wait(90) == [0, 0, 0], ranks.logs()
        for rank in range(3):
            assert ranks.result(rank)["world"] == 3, ranks.logs()
            plugins = (tmp_path / f"plugins-{rank}.jsonl").read_text().splitlines()
            last = [json.loads(line) for line in plugins][-1]
            assert last == {
                "plugin": "initialize", "rank": rank, "world_size": 3, "active_rank": rank,
                "iteration": 1,
            }, plugins  # fmt: skip
        # rank 1 died in round 0 before its finalize, and its replacement joined after that round
        assert "finalize" not in (tmp_path / "plugins-1.jsonl").read_text()
        assert [c["iteration"] for c in ranks.calls(1)] == [0, 1], ranks.logs()
