"""The job's stop flag: a sealed chain (``nvrx.store.sealed_keys``) of stop requests.

Keys ``nvrx_supervisor/stop/g1``, ``g2``, ...; each holds at most one value, a
``StopRequest`` sealed for its key and the job's run. A supervisor that stops the job
writes its request into the chain (or finds another node's there first); every
supervisor watches the chain, and the one that hosts the store records one
``rejected_write`` event for each value it rejects there (the first
``MAX_REJECTIONS_TOLD``, then only its log); ``read`` tells a supervisor that must know
now (a child failed: was the job stopped by another node?).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nvrx.store.seal import Sealer
from nvrx.store.sealed_keys import MAX_GENERATIONS, SealedChain, key_of, owned_by

from .config import STOP_KEY, StopRequest

#: Rejected values a supervisor records as events (the rest only in its log).
MAX_REJECTIONS_TOLD = 100


@dataclass
class StopValue:
    """What a watched stop key held: a request (the job stops), or a value rejected."""

    request: StopRequest | None
    rejected: str | None = None  # why, when rejected


class StopFlag:
    """This supervisor's view of the stop chain, with the job's sealer."""

    def __init__(self, secret: bytes, run: int) -> None:
        self.sealer = Sealer(secret, run)  # the same secret seals the job's other control keys
        self._chain = SealedChain(STOP_KEY, self.sealer)

    @property
    def watching(self) -> int:
        """The generation this supervisor waits on."""
        return self._chain.watching

    @staticmethod
    def key(generation: int) -> str:
        return key_of(STOP_KEY, generation)

    @staticmethod
    def owns(key: object) -> bool:
        """Whether ``key`` is one of the chain's."""
        return owned_by(STOP_KEY, key)

    def write(self, link: Any, request: StopRequest) -> None:
        """Put ``request`` into the chain, unless another node's request is there first."""
        self._chain.write(link, request.encode())

    def watch(self, link: Any) -> None:
        """Watch the generation this supervisor waits on."""
        self._chain.watch(link)

    def on_value(self, key: str, value: str, default_exit: int) -> StopValue:
        """What the watched ``key`` holds; a rejected value moves the watch on (the caller
        watches again)."""
        seen = self._chain.on_value(key, value)
        if seen.payload is None:
            return StopValue(None, seen.rejected)
        return StopValue(StopRequest.decode(seen.payload, default_exit))

    def request_of(self, key: str, value: str, default_exit: int) -> StopRequest | None:
        """The request ``value`` holds if it was sealed for ``key`` in this run, else None."""
        payload = self.sealer.unseal(key, value)
        return None if payload is None else StopRequest.decode(payload, default_exit)

    def read(self, link: Any, default_exit: int) -> StopRequest | None:
        """The job's stop request if one was written (walking the chain), else None."""
        payload = self._chain.read(link)
        return None if payload is None else StopRequest.decode(payload, default_exit)


__all__ = ["MAX_GENERATIONS", "MAX_REJECTIONS_TOLD", "StopFlag", "StopValue"]
