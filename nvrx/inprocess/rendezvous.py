"""Environment for a plain ``init_process_group()`` inside the wrapped function.

For every round the Wrapper points torch's ``env://`` rendezvous at its own
store: ``MASTER_ADDR``/``MASTER_PORT`` name the store, and
``TORCHELASTIC_USE_AGENT_STORE=True`` makes every rank a client of it (no rank
tries to host a server, so it works whichever process is rank 0 this round).
``RANK``/``WORLD_SIZE`` are the round's active rank and world size. Torch
writes its rendezvous keys under ``default_pg/``; the Wrapper deletes them
between rounds (after every rank left the previous round's groups) and when a
process generation opens (``nvrx.store.rounds``), so a round never reads
another round's addresses. The previous values come back when the
Wrapper returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

log = logging.getLogger(__name__)

_MANAGED = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
)


def round_env(
    store_host: str,
    store_port: int,
    active_rank: int | None,
    active_world_size: int | None,
    round_: int,
) -> dict[str, str | None]:
    """Variables for one round (None removes a variable, e.g. ``RANK`` on a spare)."""
    return {
        "MASTER_ADDR": store_host,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(round_),
        "RANK": None if active_rank is None else str(active_rank),
        "WORLD_SIZE": None if active_world_size is None else str(active_world_size),
    }


def apply(env: Mapping[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def preserved_environment() -> Iterator[None]:
    """Restore the managed variables to their values at entry."""
    saved = {name: os.environ.get(name) for name in _MANAGED}
    try:
        yield
    finally:
        apply(saved)
