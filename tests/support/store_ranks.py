"""Ranks as threads of the test process, each with its own client of one real TCPStore."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def run_ranks_with_store(
    world_size: int, fn: Callable[[int, Any], Any]
) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """``fn(rank, store_client)`` in one thread per rank: ({rank: result}, {rank: exception})."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        client = dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30)
        )
        try:
            results[rank] = fn(rank, client)
        except BaseException as exc:  # collected for the assertion
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors
