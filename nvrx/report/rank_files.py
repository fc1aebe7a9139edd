"""A failed process's own files: its error file and its log files.

A supervisor gives each process it starts a directory of its own
(``nvrx.supervisor.rank_logs``) and names it in the ``child_start`` event;
the ``child_exit`` event names the error file when the process wrote one
(torch's ``@record`` writes the exception that ended it). A process that died
before it could write an event of its own (a script without the Wrapper)
still tells its cause there. This module reads those files for the rows of
failed processes.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from nvrx.events.failures import exception_signature, parse_traceback

from .model import ProcessRestart, RecordedError

#: The streams a supervisor writes for a rank (``--redirects``/``--tee``).
LOG_FILES = ("stdout.log", "stderr.log")
#: Longest error file read; torch writes a traceback, a few KiB.
MAX_ERROR_FILE_BYTES = 1 << 20


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


def attach_rank_files(rows: list[ProcessRestart], job_dir: Path, notes: list[str]) -> None:
    """Fill each row's error (read from its file) and its log files (those that exist)."""
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
    if unreadable:
        notes.append("error files that could not be read: " + ", ".join(unreadable[:5]))
