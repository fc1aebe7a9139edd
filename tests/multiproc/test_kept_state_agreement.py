"""KeptState.restore_agreed: the ranks of a gloo group restore the newest step a holder
holds, and a rank that holds none of it receives it from a peer.

Three real processes on loopback. Each trains the same model from the same seed and commits
steps; the ranks' last commits differ as after a fault during a commit (rank 2 lost its last
one), and every rank must restore the newest step with bit-identical parameters and optimizer
state (rank 2 receives it from a peer), although each rank changed its parameters
differently after its last commit. A
rank that holds nothing (a replacement process: a model of its own seed, never trained, an
optimizer without state) must end with the same bits as the others, and keep its own
per-rank state; when no rank holds anything, every rank gets None. An object registered
after the step kept was committed is named in the error of every rank, the receiver's too.

Run as a script (``python test_kept_state_agreement.py RANK PORT CASE``) it is one rank.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import pytest

WORLD = 3
CASES = {
    # case: steps each rank commits
    "one_behind": {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2]},
    "one_replaced": {0: [1, 2], 1: [1, 2], 2: None},  # None: a new process, nothing trained
    "none_kept": {0: [], 1: [], 2: []},
}


class _Position:
    """A per-rank state (where the rank's data shard stands): never handed to another rank."""

    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def _rank(rank: int, port: int, case: str) -> None:
    import torch
    import torch.distributed as dist

    from nvrx.events import EventWriter
    from nvrx.inprocess.kept_state import KeptState

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    commits = CASES[case][rank]
    torch.manual_seed(0 if commits is not None else 99)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    position = _Position(100 * rank)
    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    kept.register("position", position, per_rank=True)
    at_step: dict[int, list[float]] = {}
    for step in range(1, 4) if commits is not None else ():
        optimizer.zero_grad()
        model(torch.full((2, 4), float(step))).sum().backward()
        optimizer.step()
        if step in commits:
            kept.commit(step)
        at_step[step] = _params(model)
    with torch.no_grad():  # what each rank did after its last commit differs: restore must undo it
        for p in model.parameters():
            p.add_(rank + 1)
    position.at += 1
    restored = kept.restore_agreed(events=EventWriter(os.environ["EVENTS_DIR"], "app", {"rank": rank}))
    state = optimizer.state_dict()["state"].values()
    moments = torch.cat([s["exp_avg"].flatten() for s in state]) if state else torch.empty(0)
    print(json.dumps({"restored": restored, "params": _params(model), "at_step": at_step,
                      "moments": moments.tolist(), "position": position.at}))
    dist.barrier()  # no rank tears its group down while others still hand state over
    dist.destroy_process_group()


def _params(model) -> list[float]:
    import torch

    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _registered_late(rank: int, port: int) -> None:
    """Ranks 0 and 1 commit steps 1 and 2, then register a scheduler; rank 2, a replacement,
    registers it from the start: step 2 holds no scheduler state, which every rank says."""
    import torch
    import torch.distributed as dist

    from nvrx.inprocess.kept_state import KeptState

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = KeptState()
    kept.register("model", model)
    for step in (1, 2) if rank < 2 else ():
        kept.commit(step)
    kept.register("scheduler", torch.optim.lr_scheduler.StepLR(optimizer, step_size=2))
    try:
        kept.restore_agreed()
    except Exception as exc:  # reported, not raised: the test shows each rank's outcome
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    else:
        print(json.dumps({"error": None}))
    dist.barrier()
    dist.destroy_process_group()


def _unpicklable(rank: int, port: int) -> None:
    """Ranks 0 and 1 commit step 2 of a state holding a ``defaultdict`` whose default factory
    is a lambda (copy.deepcopy takes it, pickle does not); rank 2 is a replacement: no
    holder can hand the step over, and every rank falls back to the checkpoint."""
    import collections

    import torch
    import torch.distributed as dist

    from nvrx.inprocess.kept_state import KeptState

    class Counts:
        def __init__(self) -> None:
            self.seen = collections.defaultdict(lambda: 0)

        def state_dict(self) -> dict:
            return {"seen": self.seen, "weight": torch.ones(2)}

        def load_state_dict(self, state: dict) -> None:
            self.seen = state["seen"]

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    counts = Counts()
    kept = KeptState()
    kept.register("counts", counts)
    for step in (1, 2) if rank < 2 else ():
        counts.seen["batches"] += 1
        kept.commit(step)
    restored = kept.restore_agreed(checkpoint=lambda: 0)
    print(json.dumps({"restored": restored, "steps": kept.steps()}))
    dist.barrier()
    dist.destroy_process_group()


def _run(case: str, port: int, events_dir: str) -> list[dict]:
    from helpers_inprocess import run_rank_scripts

    return run_rank_scripts(__file__, WORLD, [str(port), case], {"EVENTS_DIR": events_dir})


@pytest.mark.parametrize(("case", "expected"), [("one_behind", 3), ("one_replaced", 2), ("none_kept", None)])
def test_every_rank_restores_the_newest_step_all_holders_hold(case, expected, tmp_path):
    from helpers_inprocess import free_port_pair

    from nvrx.events.reader import read_dir

    ranks = _run(case, free_port_pair(), str(tmp_path))
    assert [r["restored"] for r in ranks] == [expected] * WORLD
    restores = {e["rank"]: e for e in read_dir(tmp_path)[0] if e["kind"] == "state_restored"}
    assert sorted(restores) == list(range(WORLD))
    sources = {
        r: "none" if expected is None else "memory" if expected in (CASES[case][r] or ()) else "peer"
        for r in range(WORLD)
    }
    newest = max((max(c) for c in CASES[case].values() if c), default=None)
    for rank, event in restores.items():
        assert (event["source"], event["step"], event["newest_step"]) == (sources[rank], expected, newest)
        assert event["duration_s"] >= 0
    if expected is None:
        return
    assert ranks[0]["moments"]
    for rank, got in enumerate(ranks):  # the restored step's bits everywhere
        assert got["params"] == ranks[0]["at_step"][str(expected)], rank
        assert got["moments"] == ranks[0]["moments"], rank
    holders = [r for r in range(WORLD) if expected in (CASES[case][r] or ())]
    assert [ranks[r]["position"] for r in range(WORLD)] == [  # a receiver keeps its own
        100 * r if r in holders else 100 * r + 1 for r in range(WORLD)  # not handed over
    ]


def test_an_object_registered_after_the_step_kept_is_named_on_every_rank(tmp_path):
    from helpers_inprocess import free_port_pair

    ranks = _run("registered_late", free_port_pair(), str(tmp_path))
    for rank, got in enumerate(ranks):  # ranks 0 and 1 hold step 2, rank 2 received it
        assert got["error"] is not None, f"rank {rank} restored without an error"
        assert got["error"].startswith("ValueError: "), (rank, got["error"])
        assert "no state of ['scheduler']" in got["error"], (rank, got["error"])
        assert "step 2" in got["error"] and "registered after" in got["error"], (rank, got["error"])


def test_a_step_no_holder_can_hand_over_falls_back_to_the_checkpoint_on_every_rank(tmp_path):
    """Pickle refuses the kept state: rank 2 would have waited for a hand-over its source
    could not send, until the round was aborted, round after round. Every rank falls back
    to the checkpoint instead (its step 0), and the holders said why."""
    from helpers_inprocess import free_port_pair

    ranks = _run("unpicklable", free_port_pair(), str(tmp_path))
    assert [got["restored"] for got in ranks] == [0, 0, 0]
    assert [got["steps"] for got in ranks] == [[], [], []]  # the commits of that course dropped


if __name__ == "__main__":
    if sys.argv[3] == "registered_late":
        _registered_late(int(sys.argv[1]), int(sys.argv[2]))
    elif sys.argv[3] == "unpicklable":
        _unpicklable(int(sys.argv[1]), int(sys.argv[2]))
    else:
        _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
