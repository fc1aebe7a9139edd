"""Tolerant reading of event files.

A job's log directory may hold torn last lines (a process killed mid-write),
lines of two writers run together, kinds from a newer nvrx, and files that
are not events at all, and events whose common fields have impossible values
(``validation``). Reading never fails on such input and never modifies the
files: every line that could not be used is reported as ``Skipped``.
"""

from __future__ import annotations

import errno
import heapq
import json
import math
import os
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, BinaryIO

from .schema import KINDS
from .validation import common_field_problem
from .writer import file_glob

EVENT_SUFFIX = ".jsonl"
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class Skipped:
    """A line (or a whole file when ``line`` is 0) that was not read as an event."""

    path: str
    line: int
    reason: str


@dataclass
class ReadStats:
    files: int = 0
    events: int = 0
    unknown_kinds: dict[str, int] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)


def _objects_in_line(text: str) -> Iterator[Any]:
    """Yield every JSON value in one line; several when two writes ran together."""
    pos, end = 0, len(text)
    while pos < end:
        while pos < end and text[pos].isspace():
            pos += 1
        if pos >= end:
            return
        value, pos = _decoder.raw_decode(text, pos)
        yield value


def read_regular_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a regular file (through symlinks); ``OSError`` for anything else.

    A FIFO or a device in place of an event file would block or never end a read.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    with open(path, "rb") as fh:
        return fh.read()


def _open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading, through symlinks; ``OSError`` for anything but a regular
    file (a FIFO or a device in place of an event file would block or never end a read)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    return open(path, "rb")


#: How the writer starts every line (``EventWriter.emit``: the kind first, no spaces).
_KIND_HEAD = b'{"kind":"'


def _other_kind(raw: bytes, kinds: frozenset[str]) -> bool:
    """Whether line ``raw``, as the writer writes one (one object, its kind first), holds an
    event of none of ``kinds``: told without decoding it. False when it may hold anything else
    (two writes run together, another spelling), which is then decoded."""
    if not raw.startswith(_KIND_HEAD) or raw.count(b'"kind"') != 1:
        return False
    end = raw.find(b'"', len(_KIND_HEAD))
    name = raw[len(_KIND_HEAD) : end]
    if end < 0 or b"\\" in name:
        return False
    return name.decode("utf-8", "replace") not in kinds


def _line_events(
    spath: str, number: int, raw: bytes, stats: ReadStats, kinds: frozenset[str] | None
) -> Iterator[dict[str, Any]]:
    """The events of line ``number`` (``raw``, its newline included when it has one)."""
    if not raw.strip() or (kinds is not None and _other_kind(raw, kinds)):
        return
    try:
        values = list(_objects_in_line(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError):  # also arrays nested too deep
        # only the last line can lack its newline: a write cut short
        reason = "malformed line" if raw.endswith(b"\n") else "torn last line"
        stats.skipped.append(Skipped(spath, number, reason))
        return
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
            stats.skipped.append(Skipped(spath, number, "not an event object"))
            continue
        problem = common_field_problem(value)
        if problem is not None:
            stats.skipped.append(Skipped(spath, number, problem))
            continue
        kind = value["kind"]
        if kinds is not None and kind not in kinds:
            continue
        if kind not in KINDS:
            stats.unknown_kinds[kind] = stats.unknown_kinds.get(kind, 0) + 1
        stats.events += 1
        yield value


def iter_file(
    path: str | os.PathLike[str],
    stats: ReadStats | None = None,
    kinds: Collection[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the events of one file in file order, recording what was skipped in ``stats``.

    The file is read line by line, as the events are taken: a reader that stops early has
    not read the rest. ``kinds``: only events of these kinds; the writer's lines of other
    kinds are passed over undecoded (neither counted nor checked).
    """
    stats = stats if stats is not None else ReadStats()
    spath = str(path)
    wanted = None if kinds is None else frozenset(kinds)
    try:
        fh = _open_regular(path)
    except OSError as exc:
        stats.skipped.append(Skipped(spath, 0, f"unreadable: {exc.strerror or exc}"))
        return
    stats.files += 1
    number = 0
    with fh:
        try:
            for number, raw in enumerate(fh, start=1):
                yield from _line_events(spath, number, raw, stats, wanted)
        except OSError as exc:  # a read failed part way (an I/O error, a file system gone)
            stats.skipped.append(Skipped(spath, number + 1, f"unreadable: {exc.strerror or exc}"))


def event_files(
    directory: str | os.PathLike[str], unlisted: list[Path] | None = None
) -> list[Path]:
    """Entries named ``*.jsonl`` under ``directory`` (recursively), in a stable order.

    Whatever they are: a directory, a dangling link or a FIFO so named is
    reported as unreadable when read, not silently left out. Symlinked
    directories are not followed. A directory that cannot be listed (``directory``
    itself included) is passed over, and appended to ``unlisted`` when it is given and
    this user may not list it (one that vanished meanwhile is only passed over).
    """

    def passed_over(exc: OSError) -> None:
        # one that vanished while it was listed (a rank's empty attempt folder) held nothing
        if unlisted is not None and isinstance(exc, PermissionError):
            unlisted.append(Path(exc.filename if exc.filename is not None else directory))

    found = []
    for parent, dirs, files in os.walk(directory, onerror=passed_over):
        found.extend(Path(parent, name) for name in (*dirs, *files) if name.endswith(EVENT_SUFFIX))
    return sorted(found)


def iter_dir(
    directory: str | os.PathLike[str], stats: ReadStats | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the events of every file under ``directory``, file by file."""
    stats = stats if stats is not None else ReadStats()
    for path in event_files(directory):
        yield from iter_file(path, stats)


def read_dir(directory: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], ReadStats]:
    """All events under ``directory`` ordered by wall time, and what was skipped."""
    stats = ReadStats()
    events = list(iter_dir(directory, stats))
    events.sort(key=lambda e: e.get("wall") or 0.0)
    return events, stats


@dataclass(frozen=True)
class ProcessKey:
    """One process among a job's event files. Its pid alone does not tell it: pids repeat
    on other nodes and, in a fresh pid namespace (a container), in another run of the job."""

    pid: int
    #: The node rank its files are named with (``-n<node>``: its ``NVRX_NODE_RANK``); None: any.
    node: int | None = None
    #: A wall time (``time.time()``) from before it started: what was written earlier is
    #: another process's that had the same pid. 0: no bound.
    since: float = 0.0
    #: The boot id of the host it runs on (events' ``boot``): an event that names another
    #: is another host's process (a node cut off, still writing, whose node rank a spare took
    #: over), whatever its node and time. None: any; an event that names none counts.
    boot: str | None = None

    @classmethod
    def of(cls, who: int | ProcessKey) -> ProcessKey:
        """``who`` as a key; a bare pid: that pid on any node, at any time."""
        return who if isinstance(who, ProcessKey) else cls(int(who))


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _since(events: Iterator[dict[str, Any]], key: ProcessKey) -> Iterator[tuple[float, dict[str, Any]]]:
    """The events of one file of ``key``'s pid that are its process's, each with where it goes
    in the order that process wrote them: its monotonic clock (one process, one boot); an
    event without one stays after the event before it."""
    at = -math.inf
    for event in events:
        wall = _number(event.get("wall"))
        if key.since and (wall is None or wall < key.since):
            continue  # an earlier process's that had this pid
        boot = event.get("boot")
        if key.boot is not None and isinstance(boot, str) and boot != key.boot:
            continue  # another host's
        mono = _number(event.get("mono"))
        at = at if mono is None else mono
        yield at, event


def process_events(
    directory: str | os.PathLike[str],
    who: int | ProcessKey,
    component: str = "*",
    kinds: Collection[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """The events process ``who`` wrote into ``directory`` (those of ``component``'s files,
    default all; ``kinds``: only those of these kinds), from every file it wrote (one per
    writer: the application's, the Wrapper's, ...), merged in the order it wrote them (by its
    monotonic clock, file order among equals).

    Read as they are taken, never all at once: a reader that stops early (at the first
    event) reads no further, and one that goes through them all holds one at a time.
    """
    key = ProcessKey.of(who)
    folder = Path(directory)
    if not folder.is_dir():
        return iter(())
    paths = sorted(folder.glob(file_glob(key.pid, key.node, component)))
    streams = [_since(iter_file(path, kinds=kinds), key) for path in paths]
    return (event for _, event in heapq.merge(*streams, key=itemgetter(0)))
