"""A rank of a training script laid out on ports as NVRx's documentation lays it out.

The application opens its own ``torch.distributed.TCPStore`` on ``MASTER_PORT + 1``
(hosted by rank 0) and gives the Wrapper ``store_kwargs={'port': MASTER_PORT + 2}``.
Rank 1 raises in the first round, so the Wrapper restarts once in-process. Each rank
writes ``{"rank", "iteration", "peers"}`` as JSON to ``<argv[1]>/rank-<rank>.json`` when
its wrapped function returns; ``peers`` is what the other rank wrote to the app's store.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import nvrx.inprocess as inprocess

RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
MASTER_PORT = int(os.environ["MASTER_PORT"])
OUT = Path(sys.argv[1])

app_store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    MASTER_PORT + 1,
    WORLD_SIZE,
    is_master=RANK == 0,
    timeout=datetime.timedelta(seconds=60),
    wait_for_workers=False,
)
app_store.set(f"hello/{RANK}", f"rank {RANK}")


@inprocess.Wrapper(
    store_kwargs={"port": MASTER_PORT + 2},
    initialize=inprocess.initialize.RetryController(max_iterations=3),
)
def train(call_wrapper: inprocess.CallWrapper = None) -> dict:
    if RANK == 1 and call_wrapper.iteration == 0:
        raise RuntimeError("injected fault in round 0")
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    assert int(total.item()) == WORLD_SIZE
    peer = (RANK + 1) % WORLD_SIZE
    return {"iteration": call_wrapper.iteration, "peers": app_store.get(f"hello/{peer}").decode()}


result = train()
(OUT / f"rank-{RANK}.json").write_text(json.dumps({"rank": RANK, **result}))
