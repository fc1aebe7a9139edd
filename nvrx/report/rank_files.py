"""A failed process's own files: its error file and its log files.

A supervisor gives each process it starts a directory of its own
(``nvrx.supervisor.rank_logs``) and names it in the ``child_start`` event;
the ``child_exit`` event names the error file when the process wrote one
(torch's ``@record`` writes the exception that ended it). A process that died
before it could write an event of its own (a script without the Wrapper)
still tells its cause there: in its error file, or, when it wrote none (a script
without ``@record``), in the traceback the interpreter printed to its ``stderr.log``.
This module reads those files for the rows of failed processes, and names the cause
of a round that such a process's end explains.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from nvrx.events.failures import (
    EXCEPTION,
    exception_signature,
    parse_traceback,
    process_end_signature,
)

from .model import ProcessRestart, RecordedError, RoundRow
from .output_scan import TRACEBACK, scan_lines

#: The streams a supervisor writes for a rank (``--redirects``/``--tee``).
LOG_FILES = ("stdout.log", "stderr.log")
#: Longest error file read; torch writes a traceback, a few KiB.
MAX_ERROR_FILE_BYTES = 1 << 20
#: How much of the end of a ``stderr.log`` is searched for the traceback that ended it.
STDERR_TAIL_BYTES = 256 << 10
STDERR_LOG = "stderr.log"


def read_error_file(path: Path, name: str) -> RecordedError:
    """What ``path`` (named ``name`` in the report) says; ValueError says why it cannot be read.

    torch writes ``{"message": {"message": "Type: text", "extraInfo": {"py_callstack":
    TRACEBACK, ...}}}``; an older format puts the text directly under ``message``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ERROR_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if len(data) > MAX_ERROR_FILE_BYTES:
        raise ValueError(f"larger than {MAX_ERROR_FILE_BYTES} bytes")
    try:
        doc = json.loads(data)
    except ValueError:
        raise ValueError("not JSON (cut short?)") from None
    message: Any = doc.get("message") if isinstance(doc, dict) else None
    extra: Any = {}
    if isinstance(message, dict):
        extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
        message = message.get("message")
    if not isinstance(message, str):
        raise ValueError("no 'message' in it")
    stack = extra.get("py_callstack")
    traceback = stack if isinstance(stack, str) and stack.strip() else None
    head, _, text = message.partition(": ")
    parsed = parse_traceback(traceback, head) if traceback else None
    if parsed is not None:
        return RecordedError(name, parsed.exc_type, parsed.message, parsed.signature(), traceback)
    exc_type = head if text else None
    return RecordedError(
        name, exc_type, text or message, exception_signature(exc_type) if exc_type else None, traceback
    )


def _inside(name: str) -> bool:
    """Whether an event's path stays inside the job's directory (relative, no ``..``)."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _tail(path: Path, size: int) -> str:
    """The last ``size`` bytes of ``path`` as text, from its first whole line."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        f.seek(max(0, end - size))
        data = f.read(size)
    text = data.decode("utf-8", errors="replace")
    return text if end <= size else text.partition("\n")[2]


def read_stderr_traceback(path: Path, name: str) -> RecordedError | None:
    """The last traceback ``path`` (a process's ``stderr.log``, named ``name`` in the report)
    ends with, read as an error file is; None when it holds none."""
    try:
        text = _tail(path, STDERR_TAIL_BYTES)
    except OSError:
        return None
    items = [i for i in scan_lines(text.splitlines(), name) if i.what == TRACEBACK]
    if not items:
        return None
    last = items[-1]
    parsed = parse_traceback(last.text)
    if parsed is None:
        return None
    return RecordedError(
        name, parsed.exc_type, parsed.message, parsed.signature(), last.text, source="stderr"
    )


def _told_by_stderr(p: ProcessRestart) -> bool:
    """Whether ``p``'s end may be told by its stderr: it exited non-zero on its own (no
    signal, no event of its own saying why, not a peer's or a lost node's consequence)."""
    return (
        p.error is None
        and p.explained_by is None
        and p.signal is None
        and p.exit_code not in (None, 0)
    )


def attach_rank_files(rows: list[ProcessRestart], job_dir: Path, notes: list[str]) -> None:
    """Fill each row's error (read from its file; failing that, from the traceback of its
    ``stderr.log``) and its log files (those that exist)."""
    unreadable: list[str] = []
    for p in rows:
        if p.files:
            directory = p.files[0]
            p.files = [
                f"{directory}/{n}"
                for n in LOG_FILES
                if _inside(directory) and (job_dir / directory / n).is_file()
            ]
        if p.error is not None and not _inside(p.error.path):
            unreadable.append(f"{p.error.path} (outside the job's directory: ignored)")
            p.error = None
        if p.error is not None:
            try:
                p.error = read_error_file(job_dir / p.error.path, p.error.path)
            except ValueError as exc:
                unreadable.append(f"{p.error.path} ({exc})")
                p.error = None
        stderr = next((f for f in p.files if PurePosixPath(f).name == STDERR_LOG), None)
        if stderr is not None and _told_by_stderr(p):
            p.error = read_stderr_traceback(job_dir / stderr, stderr)
    if unreadable:
        notes.append("error files that could not be read: " + ", ".join(unreadable[:5]))


def name_causes(timeline: list[RoundRow], rows: Sequence[ProcessRestart]) -> None:
    """A round whose cause is a process's end (``exit code 1``) takes that process's
    exception instead, when its error file or ``stderr.log`` told it: the process of the
    round's first rank and run that ended so, first in the round (before the run's next
    round started)."""
    told = [p for p in rows if p.explained_by is None and p.error is not None and p.error.signature]
    if not told:
        return
    for i, row in enumerate(timeline):
        later = [t.start_wall for t in timeline[i + 1 :] if t.run == row.run and t.start_wall]
        lo, hi = row.start_wall or float("-inf"), min(later, default=float("inf"))
        ends = [
            p
            for p in told
            if (p.run, p.rank) == (row.run, row.first_rank)
            and row.cause == process_end_signature(p.exit_code, p.signal)
            and p.wall is not None
            and lo <= p.wall < hi
        ]
        error = min(ends, key=lambda p: p.wall or 0.0).error if ends else None
        if error is not None and error.signature:
            row.cause, row.fault_kind = error.signature, EXCEPTION
