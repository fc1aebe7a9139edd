"""The monitor process's link to the store, made beside its watch where nothing needs it yet.

The store client is nvrx's own (``nvrx.store.wire``): the monitor imports no torch,
unless the Wrapper was given a store factory of its own, which it then runs here. Even so
the link is made only once something needs it. A monitor whose rank
beats to its node's supervisor needs the store only once a fault happens, so it
makes the link in a thread of its own (``start``) and watches meanwhile: what
needs the store waits for the link (``wait``, while the monitor keeps beating).
Without a supervisor the monitor beats through the store, and makes the link
before it says it watches (``make``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .monitor_process import MonitorConfig

log = logging.getLogger(__name__)

#: Longest wait for a link made beside the watch (its imports, then the connection), and
#: for the store to answer: connecting again after each timeout of the client until then.
LINK_WAIT_S = 180.0
#: Longest pause between two tries (the pauses double from 50 ms): a client that fails
#: at once, instead of after its own timeout, is not tried in a loop.
RETRY_PAUSE_S = 1.0


class StoreUnavailable(RuntimeError):
    """The link to the store could not be made (the error it met is the cause)."""


def preload() -> None:
    """Import the modules that act on the store (the round protocol): ahead of a wait they
    can overlap (the store service the monitor hosts starting; a standby's monitor started
    ahead). Importing the monitor's program does not import them: under a supervisor its
    link, made beside the watch, imports them there."""
    from nvrx.store import rounds  # noqa: F401


def connect(cfg: MonitorConfig) -> Any:
    """A client of the store ``cfg`` names: its store factory, else its host and port."""
    if cfg.store_factory:
        from nvrx.store.client import factory_store

        return factory_store(cfg.store_factory)
    from nvrx.store.wire import WireStore

    host, port = cfg.store_host or "127.0.0.1", int(cfg.store_port or 0)
    return WireStore(host, port, timeout=60)


def _connect_within(connect: Callable[[], Any], wait_s: float) -> Any:
    """``connect()``, tried again after each timeout of the client until ``wait_s`` has
    passed: node 0's store may come up after this node's monitors."""
    from nvrx.store import errors

    deadline = time.monotonic() + wait_s
    pause = 0.05
    while True:
        try:
            return connect()
        except errors.unreachable() as exc:  # no answer within the client's own timeout
            if time.monotonic() >= deadline:
                raise
            log.info("the store does not answer yet, trying again: %s", exc)
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, RETRY_PAUSE_S)


class StoreLink:
    """One connection to the store, made once by ``make`` or ``start``; ``get`` waits for it."""

    def __init__(self, connect: Callable[[], Any], wait_s: float = LINK_WAIT_S) -> None:
        self._connect = connect
        self.wait_s = wait_s
        self._done = threading.Event()
        self._store: Any = None
        self._rounds: ModuleType | None = None
        self.error: BaseException | None = None  # what making the link met, once it failed

    def make(self) -> StoreLink:
        """Make the link here; raises what that met."""
        self._make()
        if self.error is not None:
            raise self.error
        return self

    def start(self) -> StoreLink:
        """Make the link in a thread of its own (a failure is logged, and kept in ``error``)."""
        threading.Thread(target=self._make, args=(True,), name="store-link", daemon=True).start()
        return self

    def _make(self, beside: bool = False) -> None:
        try:
            from nvrx.store import rounds

            self._rounds = rounds
            self._store = _connect_within(self._connect, self.wait_s)
        except BaseException as exc:  # kept for ``get`` and the watch loop
            if beside:  # no caller to raise it to
                log.error("no link to the store: %r", exc)
            self.error = exc
        finally:
            self._done.set()

    @property
    def made(self) -> bool:
        """Whether the link is there now (``get`` would not wait)."""
        return self._done.is_set() and self.error is None

    def wait(self, meanwhile: Callable[[], None], every_s: float) -> None:
        """Wait for the link, calling ``meanwhile`` every ``every_s`` until it is there;
        ``StoreUnavailable`` when it failed or took longer than ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        while not self._done.wait(every_s):
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"no link to the store within {self.wait_s:g} s")
            meanwhile()
        self.get()

    def get(self) -> Any:
        """The store client, once the link is made; ``StoreUnavailable`` when it failed."""
        self._done.wait()
        if self.error is not None:
            raise StoreUnavailable(f"no link to the store: {self.error!r}") from self.error
        return self._store

    @property
    def rounds(self) -> ModuleType:
        """``nvrx.store.rounds``, the round protocol on the store, once the link is made."""
        self.get()
        assert self._rounds is not None
        return self._rounds
