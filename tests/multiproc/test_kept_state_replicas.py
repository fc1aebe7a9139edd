"""KeptState.restore_agreed with replica groups: 2 replicas x 2 shards on 4 gloo ranks.

Ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1 (``replica_groups=[[0, 2], [1, 3]]``):
each shard is its own model, trained on its own data, the same on both of its replicas.
A rank that holds nothing (a replacement process: a model of its own seed, never trained)
must end with the bits of its replica, not of the other shard's ranks. When both replicas
of shard 1 are lost, no peer holds it: every rank drops its commits and runs the checkpoint
callback. Replica groups that do not cover every rank are refused on every rank. Over two
rounds in the same processes, a rank lost and the ranks above it shifted down (a spare
last) moves a holder of each shard into the other replica group: each serves the shard it
holds to the ranks that need it, and no checkpoint is read. Over three rounds, a round of
two ranks restores the step before the last (shard 1 had not committed it) and trains that
step again differently; a replica of shard 0 that sat that round out, holding the abandoned
commit of it, rejoins: it receives the step trained again, not its own abandoned one.

Run as a script (``python test_kept_state_replicas.py RANK PORT CASE``) it is one rank.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

WORLD = 4
REPLICAS = [[0, 2], [1, 3]]
CHECKPOINT_STEP = 1
CASES = {
    # case: (ranks that are replacements and hold nothing, replica groups)
    "shard_from_replica": ({3}, REPLICAS),
    "every_replica_lost": ({1, 3}, REPLICAS),
    "groups_missing_a_rank": ((), [[0, 2], [1]]),
}


def _shard(rank: int) -> int:
    return rank % 2


def _rank(rank: int, port: int, case: str) -> None:
    import torch
    import torch.distributed as dist

    from nvrx.events import EventWriter
    from nvrx.inprocess.kept_state import KeptState

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    replaced, groups = CASES[case]
    fresh = rank in replaced
    torch.manual_seed(100 + rank if fresh else _shard(rank))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    for step in range(1, 4) if not fresh else ():
        optimizer.zero_grad()
        model(torch.full((2, 4), float(step + 10 * _shard(rank)))).sum().backward()
        optimizer.step()
        kept.commit(step)
    with torch.no_grad():  # each rank strays from its last commit in its own way
        for p in model.parameters():
            p.add_(rank + 1)

    def load_checkpoint() -> int:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(CHECKPOINT_STEP))
        return CHECKPOINT_STEP

    events = EventWriter(os.environ["EVENTS_DIR"], "app", {"rank": rank, "round": 1})
    try:
        restored = kept.restore_agreed(events=events, replica_groups=groups, checkpoint=load_checkpoint)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}))
        dist.barrier()  # a rank that tore its group down alone once aborted in gloo at exit
        dist.destroy_process_group()
        return
    state = optimizer.state_dict()["state"].values()
    moments = torch.cat([s["exp_avg"].flatten() for s in state]).tolist() if state else []
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    print(json.dumps({"restored": restored, "params": params, "moments": moments, "kept": kept.steps()}))
    dist.barrier()  # no rank tears its group down while others still hand state over
    dist.destroy_process_group()


SHIFTED = {0: 0, 2: 1, 3: 2, 4: 3}  # process -> rank in round 2: process 1 lost, 4 a spare


def _shifted(process: int, port: int) -> None:
    """Round 1 on port ``port``: processes 0..3 train their shard and commit; round 2 on
    ``port + 1``: the ranks renumbered as ``SHIFTED`` restore, the params of each printed."""
    import torch
    import torch.distributed as dist

    from nvrx.events import EventWriter
    from nvrx.inprocess.kept_state import KeptState

    kept = KeptState()
    torch.manual_seed(100 + process)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    events = EventWriter(os.environ["EVENTS_DIR"], "app", {"rank": process, "round": 1})
    if process < WORLD:
        _join(port, process)
        shard = _shard(process)
        kept.restore_agreed(replica_groups=REPLICAS, checkpoint=lambda: _seed(model, shard))
        for step in range(1, 4):
            optimizer.zero_grad()
            model(torch.full((2, 4), float(step + 10 * shard))).sum().backward()
            optimizer.step()
            kept.commit(step)
        dist.barrier()
        dist.destroy_process_group()
    if process not in SHIFTED:
        print(json.dumps({"left": process}))
        return
    rank = SHIFTED[process]
    _join(port + 1, rank)
    events = EventWriter(os.environ["EVENTS_DIR"], "app", {"rank": rank, "round": 2})
    restored = kept.restore_agreed(events=events, replica_groups=REPLICAS, checkpoint=lambda: 0)
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    momenta = [s["momentum_buffer"].flatten().tolist() for s in optimizer.state_dict()["state"].values()]
    print(json.dumps({"rank": rank, "restored": restored, "params": params, "moments": momenta}))
    dist.barrier()
    dist.destroy_process_group()


def _forked(process: int, port: int) -> None:
    """Round 1 on ``port``: processes 0..3 train; shard 0 commits step 3, shard 1 only step 2.
    Round 2 on ``port + 1``: processes 0 and 1 alone restore step 2 and train step 3 again,
    on other data; 2 and 3 sit it out. Round 3 on ``port + 2``: all four restore."""
    import torch
    import torch.distributed as dist

    from nvrx.events import EventWriter
    from nvrx.inprocess.kept_state import KeptState

    kept, shard = KeptState(), _shard(process)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    rounds = [(port, REPLICAS, range(1, 4)), (port + 1, [[0], [1]], range(3, 4)), (port + 2, REPLICAS, ())]
    for number, (at, groups, steps) in enumerate(rounds, start=1):
        if number == 2 and process >= 2:
            continue
        _join(at, process, sum(map(len, groups)))
        events = EventWriter(os.environ["EVENTS_DIR"], "app", {"rank": process, "round": number})
        restored = kept.restore_agreed(events=events, replica_groups=groups, checkpoint=lambda: _seed(model, shard))
        for step in steps:
            optimizer.zero_grad()
            model(torch.full((2, 4), float(step + 10 * shard + 100 * number))).sum().backward()
            optimizer.step()
            if number > 1 or step < 3 or shard == 0:
                kept.commit(step)
        dist.barrier()
        dist.destroy_process_group()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    momenta = [s["momentum_buffer"].flatten().tolist() for s in optimizer.state_dict()["state"].values()]
    print(json.dumps({"rank": process, "restored": restored, "params": params, "moments": momenta}))


def _join(port: int, rank: int, world: int = WORLD) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip


def _seed(model, shard: int) -> int:
    """The checkpoint of round 1: the same weights on both replicas of a shard."""
    import torch

    torch.manual_seed(shard)
    model.load_state_dict(type(model)(4, 4).state_dict())
    return 0


def _run(case: str, port: int, events_dir: str, world: int = WORLD) -> list[dict]:
    from helpers_inprocess import run_rank_scripts

    return run_rank_scripts(__file__, world, [str(port), case], {"EVENTS_DIR": events_dir})


def _restores(events_dir) -> dict[int, dict]:
    from nvrx.events.reader import read_dir

    return {e["rank"]: e for e in read_dir(events_dir)[0] if e["kind"] == "state_restored"}


def test_a_replacement_takes_its_shard_from_its_replica(tmp_path):
    from helpers_inprocess import free_port_pair

    ranks = _run("shard_from_replica", free_port_pair(), str(tmp_path))
    assert [r["restored"] for r in ranks] == [3] * WORLD
    assert ranks[3]["params"] == ranks[1]["params"] and ranks[3]["moments"] == ranks[1]["moments"]
    assert ranks[2]["params"] == ranks[0]["params"] and ranks[2]["moments"] == ranks[0]["moments"]
    assert ranks[1]["params"] != ranks[0]["params"]  # two shards, not one state everywhere
    assert ranks[3]["moments"]
    restores = _restores(tmp_path)
    assert {r: (e["source"], e["step"], e["newest_step"]) for r, e in restores.items()} == {
        0: ("memory", 3, 3), 1: ("memory", 3, 3), 2: ("memory", 3, 3), 3: ("peer", 3, 3),
    }
    walls = {r: e["committed_wall"] for r, e in restores.items()}
    assert walls[3] is None and all(0 < walls[r] < restores[r]["wall"] for r in range(3)), walls


def test_every_replica_of_a_shard_lost_restores_the_checkpoint_on_every_rank(tmp_path):
    from helpers_inprocess import free_port_pair

    ranks = _run("every_replica_lost", free_port_pair(), str(tmp_path))
    assert [r["restored"] for r in ranks] == [CHECKPOINT_STEP] * WORLD
    for got in ranks:
        assert set(got["params"]) == {float(CHECKPOINT_STEP)}
        assert got["kept"] == []  # the commits of the abandoned course are dropped
    restores = _restores(tmp_path)
    assert {r: (e["source"], e["step"], e["newest_step"]) for r, e in restores.items()} == {
        r: ("checkpoint", CHECKPOINT_STEP, 3) for r in range(WORLD)
    }
    from nvrx.report import build_report

    report = build_report(tmp_path, sacct=False)
    (row,) = report.restores  # the report says where the state came from
    assert (row.sources, row.step, row.newest_step) == ({"checkpoint": WORLD}, CHECKPOINT_STEP, 3)
    assert row.steps_lost == 2  # the steps kept after the checkpoint, on the lost replicas too
    assert "checkpoint (4 ranks)" in report.to_text(width=None)


def test_ranks_shifted_into_the_other_group_serve_the_shard_they_hold(tmp_path):
    from helpers_inprocess import free_port_pair

    got = {r["rank"]: r for r in _run("shifted", free_port_pair(), str(tmp_path), WORLD + 1) if "rank" in r}
    assert sorted(got) == [0, 1, 2, 3] and {r["restored"] for r in got.values()} == {3}
    # rank 2 (old rank 3, shard 1) now in shard 0's group; rank 1 (old 2, shard 0) in shard 1's
    assert got[2]["params"] == got[0]["params"] and got[2]["moments"] == got[0]["moments"]
    assert got[1]["params"] == got[3]["params"] and got[1]["moments"] == got[3]["moments"]
    assert got[1]["params"] != got[0]["params"] and got[1]["moments"]
    second = {e["rank"]: e["source"] for e in _restores_of_round(tmp_path, 2)}
    assert second == {0: "memory", 1: "peer", 2: "peer", 3: "peer"}


def test_a_replica_that_sat_out_a_fork_takes_the_step_trained_again_not_its_abandoned_one(tmp_path):
    from tests.support.ports import free_port_run

    got = {r["rank"]: r for r in _run("forked", free_port_run(3), str(tmp_path))}
    assert {r["restored"] for r in got.values()} == {3}
    assert got[2]["params"] == got[0]["params"] and got[2]["moments"] == got[0]["moments"]
    assert got[3]["params"] == got[1]["params"] and got[1]["params"] != got[0]["params"]
    second = {e["rank"]: (e["source"], e["step"]) for e in _restores_of_round(tmp_path, 2)}
    assert second == {0: ("memory", 2), 1: ("memory", 2)}  # step 3 of shard 0 abandoned
    third = {e["rank"]: e["source"] for e in _restores_of_round(tmp_path, 3)}
    assert third == {0: "memory", 1: "memory", 2: "peer", 3: "peer"}


def _restores_of_round(events_dir, round_: int) -> list[dict]:
    from nvrx.events.reader import read_dir

    return [e for e in read_dir(events_dir)[0] if e["kind"] == "state_restored" and e["round"] == round_]


def test_replica_groups_that_miss_a_rank_are_refused_on_every_rank(tmp_path):
    from helpers_inprocess import free_port_pair

    ranks = _run("groups_missing_a_rank", free_port_pair(), str(tmp_path))
    for got in ranks:
        assert "replica_groups must cover the group's ranks 0..3" in got["error"]
        assert "(missing: [3])" in got["error"]
    assert _restores(tmp_path) == {}


if __name__ == "__main__":
    if sys.argv[3] == "shifted":
        _shifted(int(sys.argv[1]), int(sys.argv[2]))
    elif sys.argv[3] == "forked":
        _forked(int(sys.argv[1]), int(sys.argv[2]))
    else:
        _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
