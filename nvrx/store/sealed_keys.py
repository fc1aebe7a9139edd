"""Control keys a client without the job's secret cannot steer: sealed chains and sealed lists.

Both are built on ``nvrx.store.seal`` (an HMAC over key, run and payload) and on a store
link with ``get`` (None when not set), ``append``, ``compare_set`` and ``watch`` (the
supervisor's ``StoreLink``).

**A sealed chain** holds one value that watchers wait for (a stop request, a spare's
assignment, a job restart's announcement): keys ``<base>/g1``, ``g2``, ..., each set at
most once, to a value sealed for its own key.

* A writer puts its value into the first generation, from the one it watches itself
  (``g1`` for a writer that does not watch the chain), whose key is not set
  (``compare_set`` against "not set", after a ``get``: torch takes an empty value for
  "not set"); it stops where a key already holds a value that unseals (another writer
  came first: that value is the chain's). A key holding anything else (forged, replayed,
  empty) is passed over. A writer that watches the chain never writes behind its own
  watch, even where a forged key it passed was deleted since; one that does not watch it
  can, once a forged key was deleted (deleting keys is open to anyone, as said below).
* A watcher watches one generation, from ``g1``. A value that unseals is the chain's; any
  other is rejected and the watch moves to the next generation, where the writer wrote.
* ``read`` walks the chain from ``g1`` to the first key not set.

**A sealed list** is one key that many append entries to (``Sealer.entry``): a claim (the
first entry that unseals wins: a slot's end, a restart, a spare), or a count (the distinct
entries that unseal: restarts spent, nodes ready; an appender learns its own entry's
place, as from an atomic ``add``). Entries carry a random nonce, so a valid entry copied
again counts once, and a forged one counts never.

What stays open (``docs/security.md``): a client can still delete or overwrite a key, and
fill a chain's ``MAX_GENERATIONS`` ahead (a denial of service, as flooding the store is).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from .seal import SealedList, Sealer

log = logging.getLogger(__name__)

#: Generations a writer passes over at most before it gives up (a flood of forged values).
MAX_GENERATIONS = 1000
#: Why a value or an entry is refused, as ``rejected_write`` events say it.
NO_VALID_SEAL = "no valid seal: not written by this job's processes in this run"


@dataclass
class ChainValue:
    """What a watched generation held: the chain's payload, or a value rejected."""

    payload: str | None
    rejected: str | None = None  # why, when rejected


class SealedChain:
    """One chain as one process sees it: the generation it watches, and how to seal."""

    def __init__(self, base: str, sealer: Sealer) -> None:
        self.base, self.sealer = base, sealer
        self.watching = 1

    def key(self, generation: int) -> str:
        """The key of ``generation`` of this chain."""
        return key_of(self.base, generation)

    def owns(self, key: object) -> bool:
        """Whether ``key`` is one of this chain's."""
        return owned_by(self.base, key)

    def write(self, link: Any, payload: str) -> str | None:
        """Put ``payload`` into the first free generation from the one watched; the chain's
        payload after (``payload``, or the one another writer put first); None when every
        generation up to ``MAX_GENERATIONS`` holds a forged value."""
        for generation in range(self.watching, MAX_GENERATIONS + 1):
            key = self.key(generation)
            held = link.get(key)
            if held is None:
                sealed = self.sealer.seal(key, payload)
                held = link.compare_set(key, "", sealed)
                if held == sealed:
                    return payload
            found = self.sealer.unseal(key, held)
            if found is not None:
                return found
        log.error("could not write %s: %d generations hold forged values", self.base, MAX_GENERATIONS)
        return None

    def watch(self, link: Any) -> None:
        """Watch the generation this process waits on."""
        link.watch(self.key(self.watching))

    def on_value(self, key: str, value: str) -> ChainValue:
        """What the watched ``key`` holds; a rejected value moves the watch on (the caller
        watches again)."""
        payload = self.sealer.unseal(key, value)
        if payload is not None:
            return ChainValue(payload)
        if key == self.key(self.watching):
            self.watching += 1
        return ChainValue(None, NO_VALID_SEAL)

    def read(self, link: Any) -> str | None:
        """The chain's payload if one was written (walking the chain), else None."""
        for generation in range(1, MAX_GENERATIONS + 1):
            key = self.key(generation)
            value = link.get(key)
            if value is None:
                return None
            payload = self.sealer.unseal(key, value)
            if payload is not None:
                return payload
        return None


def key_of(base: str, generation: int) -> str:
    """The key of ``generation`` of the chain at ``base``."""
    return f"{base}/g{generation}"


def owned_by(base: str, key: object) -> bool:
    """Whether ``key`` is a generation of the chain at ``base``."""
    prefix = f"{base}/g"
    return isinstance(key, str) and key.startswith(prefix) and key[len(prefix) :].isdigit()


def entry_payload(by: int, **fields: Any) -> str:
    """An entry's payload: who appends it, what it says, and a nonce that makes it unique."""
    return json.dumps({"by": by, **fields, "nonce": secrets.token_hex(8)}, separators=(",", ":"))


def read_list(link: Any, sealer: Sealer, key: str) -> SealedList:
    """The sealed list at ``key`` as it is now (``link``: a store link, which answers text
    or None, or a store client, which answers bytes)."""
    value = link.get(key)
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return sealer.entries(key, text)


def append_entry(link: Any, sealer: Sealer, key: str, payload: str) -> SealedList:
    """Append ``payload`` to the sealed list at ``key``; the list after."""
    link.append(key, sealer.entry(key, payload))
    return read_list(link, sealer, key)


def claim(link: Any, sealer: Sealer, key: str, by: int) -> bool:
    """Claim ``key`` for ``by``; True when this claim is the first that unseals."""
    mine = entry_payload(by)
    return append_entry(link, sealer, key, mine).first == mine


def claimed(link: Any, sealer: Sealer, key: str) -> bool:
    """Whether anyone claimed ``key`` (an entry that unseals)."""
    return bool(read_list(link, sealer, key).valid)


def count(link: Any, sealer: Sealer, key: str) -> int:
    """The distinct entries of the sealed list at ``key`` that unseal."""
    return len(set(read_list(link, sealer, key).valid))


def count_up(link: Any, sealer: Sealer, key: str, by: int, **fields: Any) -> int:
    """Append one entry for ``by`` to the count at ``key``; its place among the distinct
    valid entries, from 1: the count the store's ``add`` would have returned to it, so
    that two appending at once never read the same count."""
    mine = entry_payload(by, **fields)
    valid = list(dict.fromkeys(append_entry(link, sealer, key, mine).valid))
    return valid.index(mine) + 1 if mine in valid else len(valid)


__all__ = [
    "MAX_GENERATIONS",
    "NO_VALID_SEAL",
    "ChainValue",
    "SealedChain",
    "append_entry",
    "claim",
    "claimed",
    "count",
    "count_up",
    "entry_payload",
    "key_of",
    "owned_by",
    "read_list",
]
