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


def _may_not(path: Path) -> str:
    """What stops this user, and the fix, for a folder or file it may not read."""
    return (
        "no permission to list it and open its files (make it readable and searchable, e.g. "
        f"chmod u+rx {shlex.quote(str(path))}, or run as its owner)"
    )


def _check_searchable(directory: Path) -> None:
    """``LogDirUnreadable`` naming ``directory`` and the fix, unless its files can be opened."""
    if not os.access(directory, os.R_OK | os.X_OK):
        raise LogDirUnreadable(f"cannot read log directory {str(directory)!r}: {_may_not(directory)}")


def _check_readable(directory: Path, files: list[Path], unlisted: list[Path]) -> None:
    """``LogDirUnreadable`` naming the first folder under ``directory`` that could not be
    listed (``unlisted``), else the first event file this user may not open: the report
    would leave their events out and say false things (a job "still running" whose
    supervisor's file holds its end)."""
    denied = [f for f in files if f.is_file() and not os.access(f, os.R_OK)]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise LogDirUnreadable(
            f"cannot list folder {str(unlisted[0])!r}{more} of log directory "
            f"{str(directory)!r}: {_may_not(unlisted[0])}"
        )
    if denied:
        more = f" (and {len(denied) - 1} more)" if len(denied) > 1 else ""
        raise LogDirUnreadable(
            f"cannot read event file {str(denied[0])!r}{more}: no permission to open it "
            f"(make it readable, e.g. chmod u+r {shlex.quote(str(denied[0]))}, or run as its owner)"
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


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _newest_mtime(files: list[Path]) -> float:
    return max(map(_mtime, files), default=0.0)


def resolve_job_dir(log_dir: str | os.PathLike[str] | None, job: str | None = None) -> JobDir:
    """Pick the job directory under ``log_dir`` (a job's own directory or the base holding jobs).

    Raises ``ReportError`` naming the directory when there is nothing to read,
    ``LogDirUnreadable`` naming what this user may not read.
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
        jobs, unreadable = _job_folders(base)
        if job is not None:
            names = ", ".join(d.name for d in jobs) or "none"
            raise ReportError(f"no logs of job {job!r} under {str(base)!r} (jobs found: {names})")
        chosen = _newest_job(base, jobs, unreadable, notes)
        chosen_job = chosen.name
    _check_searchable(chosen)
    unlisted: list[Path] = []
    files = event_files(chosen, unlisted)
    _check_readable(chosen, files, unlisted)
    if not files:
        raise ReportError(_nothing_found(chosen))
    return JobDir(chosen, chosen_job, files, notes)


def _job_folders(base: Path) -> tuple[list[Path], list[Path]]:
    """The folders of ``base`` that hold event files (the jobs), and those holding none that
    this user could read but some folder it may not list (a teammate's job folder, 0700)."""
    try:
        folders = sorted(d for d in base.iterdir() if d.is_dir())
    except OSError as exc:
        raise LogDirUnreadable(
            f"cannot list log directory {str(base)!r}: {exc.strerror or exc}"
        ) from exc
    jobs: list[Path] = []
    unreadable: list[Path] = []
    for folder in folders:
        if folder.name == "lost+found":  # a file system's own, never a job's
            continue
        unlisted: list[Path] = []
        if event_files(folder, unlisted):
            jobs.append(folder)
        elif unlisted:
            unreadable.append(folder)
    return jobs, unreadable


def _newest_job(base: Path, jobs: list[Path], unreadable: list[Path], notes: list[str]) -> Path:
    """The job folder with the newest event file; ``LogDirUnreadable`` when there is none
    this user may read, or when a folder it may not read changed after that file (its job is
    newer: reporting an older one unasked would answer the wrong question)."""
    if not jobs:
        if unreadable:
            raise LogDirUnreadable(
                f"no job folder under {str(base)!r} that this user may read: cannot read "
                f"{_folder_list(unreadable)}: {_may_not(unreadable[0])}"
            )
        raise ReportError(_nothing_found(base))
    newest = {d: _newest_mtime(event_files(d)) for d in jobs}
    chosen = max(jobs, key=newest.__getitem__)
    later = [d for d in unreadable if _mtime(d) > newest[chosen]]
    if later:
        raise LogDirUnreadable(
            f"cannot read job folder {_folder_list(later)} under {str(base)!r}, changed after "
            f"the newest job this user may read ({chosen.name}): {_may_not(later[0])}; "
            f"or pass --job {chosen.name} to report that one"
        )
    if len(jobs) > 1:
        others = ", ".join(d.name for d in jobs if d != chosen)
        notes.append(
            f"several jobs under {base}: reporting the newest, {chosen.name} (others: {others}; pass --job)"
        )
    if unreadable:
        notes.append(
            f"job folder(s) under {base} that this user may not read were skipped: "
            f"{', '.join(d.name for d in unreadable)} (none changed after {chosen.name}'s newest "
            "event file, though a file inside may have)"
        )
    return chosen


def _folder_list(folders: list[Path]) -> str:
    shown = ", ".join(repr(str(d)) for d in folders[:3])
    return shown + (f" and {len(folders) - 3} more" if len(folders) > 3 else "")


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
