"""KeptState.restore_agreed with replica groups: 2 replicas x 2 shards on 4 gloo ranks.

Ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1 (``replica_groups=[[0, 2], [1, 3]]``):
each shard is its own model, trained on its own data, the same on both of its replicas.
A rank that holds nothing (a replacement process: a model of its own seed, never trained)
must end with the bits of its replica, not of the other shard's ranks. When both replicas
of shard 1 are lost, no peer holds it: every rank drops its commits and runs the checkpoint
callback. Replica groups that do not cover every rank are refused on every rank, before
any collective.

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
        dist.destroy_process_group()
        return
    state = optimizer.state_dict()["state"].values()
    moments = torch.cat([s["exp_avg"].flatten() for s in state]).tolist() if state else []
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    print(json.dumps({"restored": restored, "params": params, "moments": moments, "kept": kept.steps()}))
    dist.barrier()  # no rank tears its group down while others still hand state over
    dist.destroy_process_group()


def _run(case: str, port: int, events_dir: str) -> list[dict]:
    from helpers_inprocess import run_rank_scripts

    return run_rank_scripts(__file__, WORLD, [str(port), case], {"EVENTS_DIR": events_dir})


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


def test_replica_groups_that_miss_a_rank_are_refused_on_every_rank(tmp_path):
    from helpers_inprocess import free_port_pair

    ranks = _run("groups_missing_a_rank", free_port_pair(), str(tmp_path))
    for got in ranks:
        assert "replica_groups must cover the group's ranks 0..3" in got["error"]
        assert "(missing: [3])" in got["error"]
    assert _restores(tmp_path) == {}


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
