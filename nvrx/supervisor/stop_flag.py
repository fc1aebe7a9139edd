"""The job's stop flag: sealed, in a chain of keys that a forged value cannot block.

Keys ``nvrx_supervisor/stop/g1``, ``g2``, ...; each holds at most one value, a
``StopRequest`` sealed for its key and the job's run (``nvrx.store.seal``).

* A supervisor that stops the job puts its sealed request into the first generation,
  from the one it watches itself, whose key is not set (``compare_set`` against "not
  set", after a ``get``: torch takes an empty value for "not set"); it stops there too
  when the key already holds a request that unseals (another node stopped the job
  first). A key holding anything else (forged, replayed, empty) is passed over. Starting
  from its own watch, it never writes behind the watchers, even where a forged key they
  passed was deleted since.
* Every supervisor watches one generation, from ``g1``. When the watched key is set, a
  value that unseals is the job's stop; any other value is rejected (the supervisor that
  hosts the store records one ``rejected_write`` event for it) and the watch moves to the
  next generation, where the stopping node will have written.
* ``read`` walks the chain from ``g1`` to the first key not set, for a supervisor that
  must know now (a child failed: was the job stopped by another node?).

What stays open (``docs/security.md``): a client without the secret can still overwrite
a key after a valid request was written and before a node read it (as it can delete any
key), and fill generations ahead: past ``MAX_GENERATIONS`` a stop is no longer written
(a denial of service, as deleting keys is). A supervisor records the first
``MAX_REJECTIONS_TOLD`` rejections as events, then only counts them in its log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from nvrx.store.seal import Sealer, seal, unseal

from .config import STOP_KEY, StopRequest

log = logging.getLogger(__name__)

#: Generations a writer passes over at most before it gives up (a flood of forged values).
MAX_GENERATIONS = 1000
#: Rejected values a supervisor records as events (the rest only in its log).
MAX_REJECTIONS_TOLD = 100
_PREFIX = STOP_KEY + "/g"


@dataclass
class StopValue:
    """What a watched stop key held: a request (the job stops), or a value rejected."""

    request: StopRequest | None
    rejected: str | None = None  # why, when rejected


class StopFlag:
    """This supervisor's view of the chain: the generation it watches, and how to seal."""

    def __init__(self, secret: bytes, run: int) -> None:
        self.secret, self.run = secret, run
        self.sealer = Sealer(secret, run)  # the same secret seals the job's other control keys
        self.watching = 1
        self.rejections = 0

    @staticmethod
    def key(generation: int) -> str:
        return f"{_PREFIX}{generation}"

    @staticmethod
    def owns(key: object) -> bool:
        """Whether ``key`` is one of the chain's."""
        return isinstance(key, str) and key.startswith(_PREFIX) and key[len(_PREFIX) :].isdigit()

    def write(self, link: Any, request: StopRequest) -> None:
        """Put ``request`` into the first free generation from the one watched (see the module)."""
        for generation in range(self.watching, MAX_GENERATIONS + 1):
            key = self.key(generation)
            held = link.get(key)
            if held is None:
                sealed = seal(self.secret, key, request.encode(), self.run)
                held = link.compare_set(key, "", sealed)
                if held == sealed:
                    return
            if unseal(self.secret, key, held, self.run) is not None:
                return
        log.error("could not write the stop flag: %d generations hold forged values", MAX_GENERATIONS)

    def watch(self, link: Any) -> None:
        """Watch the generation this supervisor waits on."""
        link.watch(self.key(self.watching))

    def on_value(self, key: str, value: str, default_exit: int) -> StopValue:
        """What the watched ``key`` holds; a rejected value moves the watch on (the caller
        watches again)."""
        request = self.request_of(key, value, default_exit)
        if request is not None:
            return StopValue(request)
        if key == self.key(self.watching):
            self.watching += 1
        self.rejections += 1
        return StopValue(None, "no valid seal: not written by this job's supervisors in this run")

    def request_of(self, key: str, value: str, default_exit: int) -> StopRequest | None:
        """The request ``value`` holds if it was sealed for ``key`` in this run, else None."""
        payload = unseal(self.secret, key, value, self.run)
        return None if payload is None else StopRequest.decode(payload, default_exit)

    def read(self, link: Any, default_exit: int) -> StopRequest | None:
        """The job's stop request if one was written (walking the chain), else None."""
        for generation in range(1, MAX_GENERATIONS + 1):
            key = self.key(generation)
            value = link.get(key)
            if value is None:
                return None
            request = self.request_of(key, value, default_exit)
            if request is not None:
                return request
        return None


__all__ = ["MAX_GENERATIONS", "MAX_REJECTIONS_TOLD", "StopFlag", "StopValue"]
