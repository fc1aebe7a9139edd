"""The job's store as one supervisor sees it: what names it, how to reach it, who hosts it.

A store failover (``failover``) replaces most of it at once: the configuration
(the next store's address), the link, the service when this slot hosts the
next store, and the slots; the supervisor's parts all read it here, so they
never hold a stale link or address.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nvrx.store import sealed_keys
from nvrx.store.seal import Sealer
from nvrx.store.service import StoreService

from .config import RESTARTS_KEY, SupervisorConfig
from .node_roles import NodeRoles
from .stop_flag import StopFlag
from .store_link import StoreLink, StoreLinkError


@dataclass
class JobStore:
    """Where the job's store is now, and this slot's link to it."""

    config: SupervisorConfig  # its master_addr/store_port name the store now
    link: StoreLink | None = None  # None until the node agent starts
    service: StoreService | None = None  # the store service this slot hosts, if any
    roles: NodeRoles | None = None  # this slot's role, kept in the store; None until it starts
    epoch: int = 0  # store failovers so far
    slot: int = 0  # the slot hosting the store now
    lost_slot: int = 0  # the slot that hosted it before the last failover
    relinks: int = 0  # times the link was aimed at another store: the main loop re-registers it
    beats_fd: int | None = None  # the socket of the node's rank beats, which each agent reads
    stop: StopFlag | None = None  # the job's stop flag, once the job's secret is known
    #: Records a value refused for its seal: (key, reason, size) -> the supervisor's event.
    rejected: Callable[[str, str, int], None] | None = None
    _told: dict[str, int] = field(default_factory=dict)  # key -> hash of the value told last

    @property
    def sealer(self) -> Sealer | None:
        """What seals the job's control keys, once the job's secret is known."""
        return None if self.stop is None else self.stop.sealer

    @property
    def usable(self) -> bool:
        """A link that was started and has not lost its store."""
        return self.link is not None and self.link.lost is None

    def known_sealer(self) -> Sealer:
        """The job's sealer; ``StoreLinkError`` while the job's secret is not known yet."""
        if self.sealer is None:
            raise StoreLinkError("the job's secret is not known yet: no control value can be sealed")
        return self.sealer

    def set_sealed(self, key: str, payload: str) -> None:
        """Set ``key`` to ``payload`` sealed for it (a value polled, not watched)."""
        if self.link is None:
            raise StoreLinkError("no store link")
        self.link.set(key, self.known_sealer().seal(key, payload))

    def get_sealed(self, key: str, tell: bool = True) -> str | None:
        """The payload ``key`` holds if the job sealed it, else None (not set, or refused:
        each refused value is told once, through ``rejected``, when ``tell``)."""
        if self.link is None:
            raise StoreLinkError("no store link")
        value = self.link.get(key)
        if value is None:
            return None
        payload = self.known_sealer().unseal(key, value)
        if payload is None and tell and self.rejected is not None and self._told.get(key) != hash(value):
            self._told[key] = hash(value)
            self.rejected(key, sealed_keys.NO_VALID_SEAL, len(value.encode(errors="replace")))
        return payload

    def spend_restart(self) -> int:
        """Count one restart in the job-wide budget (a sealed list: a client without the
        job's secret cannot spend it); the count so far."""
        if self.link is None:
            raise StoreLinkError("no store link")
        return sealed_keys.count_up(self.link, self.known_sealer(), RESTARTS_KEY, self.config.node_rank)
