"""Failures not worth a restart: ``--ft-non-retryable-exception-file`` (NVRx's format).

One case-sensitive substring per line, matched against a failed rank's
exception text (type, message and traceback); lines starting with ``#`` and
empty lines are ignored. The text comes from the rank's error file (torch's
``@record``, ``TORCHELASTIC_ERROR_FILE``) or, failing that, from its last
``fault`` event (the Wrapper, or an application that records its faults).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nvrx.events.reader import ProcessKey

from .policy import last_fault_event


class PatternFileError(ValueError):
    """The patterns file cannot be used; the message names it."""


def load_patterns(path: str | Path) -> list[str]:
    """The patterns of ``path``; PatternFileError naming the file when it is unreadable or empty."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PatternFileError(f"--ft-non-retryable-exception-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PatternFileError(f"--ft-non-retryable-exception-file {path}: not a text file") from None
    patterns = [line.rstrip("\r") for line in text.splitlines()]
    patterns = [p for p in patterns if p.strip() and not p.lstrip().startswith("#")]
    if not patterns:
        raise PatternFileError(f"--ft-non-retryable-exception-file {path}: no pattern in it")
    return patterns


@dataclasses.dataclass(frozen=True)
class Match:
    pattern: str
    line: str  # the line of the exception text that holds the pattern
    source: str  # "error file" or "events"


def exception_text(
    events_dir: str | Path, who: int | ProcessKey, error_file: Path | None
) -> tuple[str, str] | None:
    """``(text, source)`` of the exception that ended process ``who`` (its ``ProcessKey``:
    not another node's or an earlier run's with the same pid); None when nothing tells."""
    if error_file is not None and error_file.is_file():
        # imported here: the report package costs a supervisor's start about 0.4 s
        from nvrx.report.rank_files import read_error_file

        try:
            recorded = read_error_file(error_file, error_file.name)
        except ValueError:
            recorded = None
        if recorded is not None:
            head = f"{recorded.exc_type}: {recorded.message}" if recorded.exc_type else recorded.message
            return "\n".join(t for t in (head, recorded.traceback) if t), "error file"
    event = last_fault_event(events_dir, who)
    if event is None:
        return None
    parts = [event.get("exc_type"), event.get("message"), event.get("traceback")]
    text = "\n".join(str(p) for p in parts if isinstance(p, str) and p)
    return (text, "events") if text else None


def first_match(patterns: list[str], text: str, source: str) -> Match | None:
    """The first pattern found in ``text``, with the line that holds it."""
    for pattern in patterns:
        if pattern in text:
            line = next((ln for ln in text.splitlines() if pattern in ln), pattern)
            return Match(pattern, line.strip(), source)
    return None
