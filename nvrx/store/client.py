"""Connecting to the nvrx store: a torch ``TCPStore`` server and its clients.

The store port never defaults to ``MASTER_PORT`` (torch's own rendezvous uses
that port); it comes from ``NVRX_STORE_PORT``, an explicit argument, or a free
port picked by the host.
"""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from nvrx import jobenv

STORE_HOST_ENV = jobenv.STORE_HOST
STORE_PORT_ENV = jobenv.STORE_PORT
DEFAULT_TIMEOUT_S = 300.0


def wait_span(seconds: float) -> timedelta:
    """A store wait of ``seconds``, 1 ms at least: a shorter one rounds to a timedelta of 0,
    which torch's stores take for no bound (or their own default timeout)."""
    return timedelta(seconds=max(seconds, 0.001))


def external_store_address(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``(host, port)`` of the external store named by ``NVRX_STORE_HOST``/``NVRX_STORE_PORT``, if set."""
    env = os.environ if env is None else env
    host, port = env.get(STORE_HOST_ENV), env.get(STORE_PORT_ENV)
    if not host and not port:
        return None
    if not host or not port:
        raise ValueError(
            f"set both {STORE_HOST_ENV} and {STORE_PORT_ENV} or neither; got "
            f"{STORE_HOST_ENV}={host!r} {STORE_PORT_ENV}={port!r}"
        )
    try:
        port_number = int(port)
    except ValueError:
        raise ValueError(f"{STORE_PORT_ENV} must be an integer port, got {port!r}") from None
    if not 0 < port_number < 65536:
        raise ValueError(f"{STORE_PORT_ENV} must be in 1..65535, got {port_number}")
    return host, port_number


def factory_store(encoded: str) -> Any:
    """The store that ``encoded`` (base64 of a pickled ``(factory, kwargs)``, a store of the
    user's that the Wrapper was given) makes, in a process of nvrx's own."""
    factory, kwargs = pickle.loads(base64.b64decode(encoded))
    return factory(**kwargs)


def connect(host: str, port: int, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """A client of the store at ``host:port`` (no worker registration: clients come and go)."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        int(port),
        world_size=None,
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def serve(host: str, port: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """A store server inside this process (``port=0`` picks a free port; see ``.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        int(port),
        world_size=None,
        is_master=True,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def clone(store: Any) -> Any:
    """A second connection to the same store, for a thread that blocks in ``wait``.

    A torch store client serializes its requests on one socket, so a thread
    that waits must not share its client with one that needs to make progress.
    """
    return store.clone()


def delete_prefix(store: Any, prefix: str) -> int:
    """Delete every key that starts with ``prefix``; returns how many were deleted."""
    deleted = 0
    for key in store.list_keys():
        if key.startswith(prefix):
            deleted += int(bool(store.delete_key(key)))
    return deleted
