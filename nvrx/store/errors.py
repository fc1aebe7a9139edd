"""The two kinds of store error nvrx's store code tells apart, whichever client raised them.

A store client is torch's (``torch.distributed.TCPStore`` and its views, in a rank) or
nvrx's own (``nvrx.store.wire``, in the helper processes that import no torch). Both
tell a wait that ran out from a store that is gone; these tuples name both clients'
classes for each kind, for ``except`` clauses. torch's classes are named only once
``torch.distributed`` is loaded: before that, no torch client exists in the process,
and naming them would import torch for nothing.
"""

from __future__ import annotations

import sys

from .wire import StoreGone, StoreTimeout


def timeouts() -> tuple[type[Exception], ...]:
    """A wait for keys ran out; the connection is still good."""
    dist = sys.modules.get("torch.distributed")
    return (StoreTimeout,) if dist is None else (StoreTimeout, dist.DistStoreError)


def unreachable() -> tuple[type[Exception], ...]:
    """The store did not answer, refused, or broke off."""
    dist = sys.modules.get("torch.distributed")
    return (StoreGone,) if dist is None else (StoreGone, dist.DistNetworkError)
