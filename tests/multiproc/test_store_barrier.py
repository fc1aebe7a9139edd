"""nvrx.store barriers across real processes against a store service process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvrx.store import client
from nvrx.store.barrier import missing_ranks
from nvrx.store.service import StoreService

pytestmark = pytest.mark.timeout(120)

_RANK = r"""
import json, sys, time
from nvrx.store import client
from nvrx.store.barrier import missing_ranks
from nvrx.store.barrier import barrier, BarrierTimeout
host, port, rank, n, rounds, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
store = client.connect(host, port, timeout=30)
out = []
for r in range(rounds):
    if rank == skip and r == rounds - 1:
        break
    try:
        barrier(store, f"mp/{r}", rank, n, 10.0 if r < rounds - 1 else 2.0, reentrant=(r % 2 == 1))
        out.append([r, "ok", time.monotonic()])
    except BarrierTimeout as exc:
        out.append([r, "timeout", exc.missing])
print(json.dumps(out))
"""


def _run(port: int, n: int, rounds: int, skip: int = -1) -> list[list]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RANK,
                "127.0.0.1",
                str(port),
                str(r),
                str(n),
                str(rounds),
                str(skip),
            ],
            stdout=subprocess.PIPE,
            start_new_session=True,
            env=dict(os.environ),
        )
        for r in range(n)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0
        results.append(json.loads(out))
    return results


def test_barriers_across_processes_release_together_and_name_missing_ranks():
    with StoreService("127.0.0.1", 0, node=None) as service:
        n, rounds = 6, 5
        results = _run(service.port, n, rounds, skip=4)
        for rank, out in enumerate(results):
            if rank == 4:
                assert [o[1] for o in out] == ["ok"] * (rounds - 1)
                continue
            assert [o[1] for o in out[:-1]] == ["ok"] * (rounds - 1)
            assert out[-1] == [rounds - 1, "timeout", [4]]
        # Nobody leaves barrier r before everyone arrived at it: releases of
        # round r come after the arrivals, so round r+1 cannot start early.
        for r in range(rounds - 2):
            assert max(o[r][2] for o in results) <= min(o[r + 1][2] for o in results)
        store = client.connect("127.0.0.1", service.port, timeout=10)
        assert missing_ranks(store, "mp/0", range(n)) == []  # plain barrier: arrival keys
        assert int(store.add("mp/1/n", 0)) == n  # reentrant barrier: one count per rank
