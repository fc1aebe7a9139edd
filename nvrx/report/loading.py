"""Finding a job's event files and reading them quickly, without ever writing to them.

The fast path parses a whole well-formed file at once, one JSON value per line (the
report reads millions of events), with msgspec or orjson where one is installed
(``pip install 'nvrx[fast]'``) and the standard library's ``json``
otherwise; any file that is not perfectly formed goes
through the tolerant ``nvrx.events.reader.iter_file`` instead, which skips and
records torn, merged and malformed lines, and events whose common fields are
impossible (``nvrx.events.validation``). ``parse_file`` is the fast path alone,
for a caller that checks the events as it uses them (``file_fold``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

from nvrx import jobenv
from nvrx.events.reader import (
    EVENT_SUFFIX,
    ReadStats,
    event_files,
    iter_file,
    read_regular_file,
)
from nvrx.events.schema import KINDS
from nvrx.events.validation import all_usual, usable_event


def parse_text(line: bytes) -> Any:
    """One line parsed by the standard library, decoded strictly as UTF-8 first, as the reader
    decodes it (``json.loads`` would guess an encoding, and pass a BOM or UTF-16)."""
    return json.loads(line.decode("utf-8"))


# Optional, the same values parsed faster: msgspec (it keeps integers beyond 64 bits exact),
# else orjson (it makes them floats).
try:
    from msgspec.json import decode as parse_json
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from orjson import loads as parse_json
    except ImportError:
        parse_json = parse_text


_KIND = itemgetter("kind")


class ReportError(Exception):
    """Nothing could be reported (missing or empty log directory); the CLI exits 2."""

    exit_code = 2


class LogDirUnreadable(ReportError):
    """The log directory is there but this user may not list it or open its files: a
    failure of the run, not of the arguments; the CLI exits 1."""

    exit_code = 1


def _check_searchable(directory: Path) -> None:
    """``LogDirUnreadable`` naming ``directory`` and the fix, unless its files can be opened."""
    if not os.access(directory, os.R_OK | os.X_OK):
        raise LogDirUnreadable(
            f"cannot read log directory {str(directory)!r}: no permission to list it and open "
            f"its files (make it readable and searchable, e.g. chmod u+rx {shlex.quote(str(directory))}, "
            "or run as its owner)"
        )


@dataclass
class JobDir:
    """The directory whose event files make up one job, and how it was chosen."""

    path: Path
    job: str | None
    files: list[Path]
    notes: list[str] = field(default_factory=list)


def read_whole_lines(path: str | os.PathLike[str]) -> bytes | None:
    """A file's bytes when its last line is whole (it ends with a newline); None for an
    unreadable or empty file, or one whose last line is torn."""
    try:
        data = read_regular_file(path)
    except OSError:
        return None
    return data if data.endswith(b"\n") else None


#: Brackets a line may hold before the fast parsers leave it to the reader: the standard
#: library's parser fails near 1,000 levels deep on Python 3.10 and 3.11 (later ones go
#: deeper), orjson at 1024.
NESTING_BOUND = 500


def split_lines(data: bytes) -> list[bytes] | None:
    """The lines of whole lines ``data`` (``read_whole_lines``), each to be parsed on its own; None
    when one holds what the reader alone can judge: values nested hundreds deep, or an integer of
    more digits than Python reads (``sys.get_int_max_str_digits``). The reader skips such a line;
    a fast parser might read it, or drop the field unread."""
    lines = data[:-1].split(b"\n")
    # 0: no limit (as before Python 3.10.7, which has no such function)
    digits = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    shortest_suspect = min(2 * NESTING_BOUND, digits + 1) if digits else 2 * NESTING_BOUND
    if max(map(len, lines)) < shortest_suspect:  # the usual file: no line long enough for either
        return lines
    # (the look-behind starts each try at a run's start: no quadratic search inside long runs)
    too_many = re.compile(rb"(?<![0-9])[0-9]{%d}" % (digits + 1)) if digits else None
    for line in lines:
        if len(line) >= 2 * NESTING_BOUND and line.count(b"[") + line.count(b"{") >= NESTING_BOUND:
            return None
        if too_many is not None and len(line) > digits and too_many.search(line):
            return None
    return lines


def parse_lines(data: bytes, parse: Callable[[bytes], Any] | None = None) -> list[Any] | None:
    """The values of whole lines ``data`` (``read_whole_lines``), one per line, unchecked; None
    when a line is not exactly one JSON value (blank, torn over lines, or merged with another)
    or is one the reader alone can judge (``split_lines``). ``parse``: one line's parser
    (default ``parse_json``; ``typed_events`` gives its decoder), failing with a ValueError."""
    lines = split_lines(data)
    if lines is None:
        return None
    try:
        return list(map(parse or parse_json, lines))
    except (ValueError, RecursionError):
        return None


def parse_file(path: str | os.PathLike[str]) -> list[Any] | None:
    """The values of a well-formed file's lines, unchecked, one per line; None for a file that
    only the tolerant reader can read (unreadable, empty, with a torn or malformed line)."""
    data = read_whole_lines(path)
    return None if data is None else parse_lines(data)


def read_events(path: str | os.PathLike[str], stats: ReadStats) -> list[dict[str, Any]]:
    """All events of one file in file order; damaged files fall back to the tolerant reader."""
    events = parse_file(path)
    if events is not None and (all_usual(events) or all(map(usable_event, events))):
        stats.files += 1
        stats.events += len(events)
        if not KINDS.keys() >= set(map(_KIND, events)):  # rare: count the kinds unknown here
            for event in events:
                kind = event["kind"]
                if kind not in KINDS:
                    stats.unknown_kinds[kind] = stats.unknown_kinds.get(kind, 0) + 1
        return events
    return list(iter_file(path, stats))  # also records an unreadable file


def _has_events(directory: Path) -> bool:
    return any(p.is_file() for p in directory.glob(f"*{EVENT_SUFFIX}"))


def _newest_mtime(files: list[Path]) -> float:
    best = 0.0
    for path in files:
        try:
            best = max(best, path.stat().st_mtime)
        except OSError:
            continue
    return best


def resolve_job_dir(log_dir: str | os.PathLike[str] | None, job: str | None = None) -> JobDir:
    """Pick the job directory under ``log_dir`` (a job's own directory or the base holding jobs).

    Raises ``ReportError`` naming the directory when there is nothing to read.
    """
    base = Path(log_dir) if log_dir is not None else jobenv.log_dir_from()
    if not base.exists():
        raise ReportError(
            f"log directory {str(base)!r} does not exist (pass LOG_DIR or set {jobenv.LOG_DIR})"
        )
    if not base.is_dir():
        raise ReportError(f"log directory {str(base)!r} is not a directory")
    notes: list[str] = []
    # A shared base may be entered without being listed: only what is listed is checked.
    if job is None or not (base / job).is_dir():
        _check_searchable(base)
    if job is not None and (base / job).is_dir():
        chosen, chosen_job = base / job, job
    elif _has_events(base):
        chosen, chosen_job = base, job
    else:
        try:
            jobs = sorted(d for d in base.iterdir() if d.is_dir() and event_files(d))
        except OSError as exc:
            raise LogDirUnreadable(
                f"cannot list log directory {str(base)!r}: {exc.strerror or exc}"
            ) from exc
        if job is not None:
            names = ", ".join(d.name for d in jobs) or "none"
            raise ReportError(f"no logs of job {job!r} under {str(base)!r} (jobs found: {names})")
        if not jobs:
            raise ReportError(_nothing_found(base))
        if len(jobs) == 1:
            chosen = jobs[0]
        else:
            chosen = max(jobs, key=lambda d: _newest_mtime(event_files(d)))
            others = ", ".join(d.name for d in jobs if d != chosen)
            notes.append(
                f"several jobs under {base}: reporting the newest, {chosen.name} (others: {others}; pass --job)"
            )
        chosen_job = chosen.name
    _check_searchable(chosen)
    files = event_files(chosen)
    if not files:
        raise ReportError(_nothing_found(chosen))
    return JobDir(chosen, chosen_job, files, notes)


def _nothing_found(directory: Path) -> str:
    try:
        others = sum(1 for p in directory.rglob("*") if p.is_file())
    except OSError:
        others = 0
    if others:
        return (
            f"no event files (*{EVENT_SUFFIX}) in {str(directory)!r}: "
            f"{others} other file(s) found, none of them nvrx events"
        )
    return f"no event files (*{EVENT_SUFFIX}) in {str(directory)!r}: the directory is empty"
