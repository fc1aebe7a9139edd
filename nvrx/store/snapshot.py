"""A copy of the store's job-level keys in a file, so that a successor store can rebuild them.

The store service writes the keys under the prefixes it was given (counters
and flags that must outlive the store host: the job's restart counters, the
round counter, stop requests, node roles) to a JSON file in the job directory,
which every node sees, whenever they change (checked every ``interval``).
A successor store started with that file restores them before it accepts
anyone, so a job that loses its store host goes on with its budget, its stop
flags and a round counter past every round used before. Updates made within
the last ``interval`` before the host died are lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvrx.atomic_file import replace_file

log = logging.getLogger(__name__)

#: Seconds between two looks at the store's keys.
DEFAULT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class SnapshotSpec:
    """Which keys the service keeps a copy of, where, and which copy it starts from."""

    path: Path
    prefixes: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    restore_from: Path | None = None

    def argv(self) -> list[str]:
        args = ["--snapshot", str(self.path)]
        args += [f"--snapshot-prefix={p}" for p in self.prefixes]
        args += [f"--snapshot-exclude={p}" for p in self.exclude]
        if self.restore_from is not None:
            args += ["--restore", str(self.restore_from)]
        return args


def take(store: Any, prefixes: Sequence[str], exclude: Sequence[str] = ()) -> dict[str, str]:
    """The keys of ``store`` under ``prefixes`` (not under ``exclude``) and their values."""
    names = sorted(
        key
        for key in store.list_keys()
        if key.startswith(tuple(prefixes)) and not key.startswith(tuple(exclude))
    )
    if not names:
        return {}
    values = store.multi_get(names)
    return {k: v.decode(errors="replace") for k, v in zip(names, values, strict=True)}


def write(path: Path, keys: dict[str, str]) -> None:
    """Replace ``path`` by ``keys`` atomically (a reader never sees half a file)."""
    replace_file(path, json.dumps(keys, sort_keys=True))


def read(path: Path) -> dict[str, str]:
    """The keys saved at ``path``; empty when there is no (readable) snapshot."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("no usable store snapshot at %s: %s", path, exc)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def restore(store: Any, keys: dict[str, str]) -> None:
    """Set every saved key in a new store (counters come back as counters: ``add`` reads them)."""
    for key, value in keys.items():
        store.set(key, value)


class KeptKeys:
    """A snapshot's keys read as a store client reads them (``get``; ``compare_set`` of a
    value onto itself, a one-request read), for a survivor whose store is gone with no
    successor: what the job knew up to a ``Keeper`` interval before the loss. Nothing is
    written."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys

    def get(self, key: str) -> str | None:
        """The kept value of ``key``; None when it was not set."""
        return self.keys.get(key)

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` was set."""
        return all(key in self.keys for key in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """A read: the kept value of ``key``, else ``desired`` (which must be ``expected``:
        nothing is set here, so a write raises ``ValueError``)."""
        if expected != desired:
            raise ValueError(f"a store snapshot is read-only: cannot set {key!r}")
        return self.keys.get(key, desired)


class Keeper(threading.Thread):
    """Writes the snapshot of ``store`` to ``path`` whenever it changed, until ``stop``."""

    def __init__(
        self,
        store: Any,
        path: Path,
        prefixes: Sequence[str],
        exclude: Sequence[str] = (),
        interval: float = DEFAULT_INTERVAL_S,
    ) -> None:
        super().__init__(name="nvrx-store-snapshot", daemon=True)
        self.store, self.path, self.interval = store, path, interval
        self.prefixes, self.exclude = tuple(prefixes), tuple(exclude)
        self.stopped = threading.Event()

    def run(self) -> None:
        # The first copy at once: a store lost within its first interval still leaves what
        # it was restored from to its successor, which reads this store's file only.
        last: dict[str, str] | None = None
        while True:
            try:
                keys = take(self.store, self.prefixes, self.exclude)
                if keys != last:
                    write(self.path, keys)
                    last = keys
            except Exception as exc:  # a store or file system hiccup: try again next time
                log.warning("could not save the store snapshot to %s: %s", self.path, exc)
            if self.stopped.wait(self.interval):
                return

    def stop(self) -> None:
        self.stopped.set()
        with contextlib.suppress(RuntimeError):
            self.join(timeout=2 * self.interval + 1)
