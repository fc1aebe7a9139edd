"""Failure signatures: one short, stable string per kind of failure.

Two failures with the same signature are "the same bug": the report groups
them, and a signature seen on one host only points at that host. A signature
is the exception type plus the innermost frame of user code, or the signal,
or the exit code, or the hang timeout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

TRACEBACK_HEADER = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
# Paths of code that is not the user's: the standard library, installed
# packages and nvrx itself, so the innermost *user* frame is found.
_LIBRARY_MARKERS = (
    "site-packages",
    "dist-packages",
    "/lib/python3",
    "<frozen ",
    "/nvrx/inprocess/",
    "/nvrx/supervisor/",
    "/nvrx/store/",
    "/nvrx/events/",
    "/nvrx/slurm/",
    "/nvrx/report/",
)


@dataclass(frozen=True)
class ParsedTraceback:
    """What a formatted Python traceback says: exception type, message, innermost user frame."""

    exc_type: str
    message: str
    file: str | None
    line: int | None
    func: str | None

    def signature(self) -> str:
        if self.file is None:
            return self.exc_type
        return f"{self.exc_type} at {PurePath(self.file).name}:{self.line} in {self.func}"


def is_user_frame(path: str) -> bool:
    """True for a frame of the user's code (not stdlib, site-packages or nvrx internals)."""
    norm = path.replace("\\", "/")
    return not any(marker in norm for marker in _LIBRARY_MARKERS)


def parse_traceback(text: str) -> ParsedTraceback | None:
    """Parse the last traceback in ``text`` (chained exceptions: the one raised last)."""
    start = text.rfind(TRACEBACK_HEADER)
    if start < 0:
        return None
    lines = text[start + len(TRACEBACK_HEADER) :].splitlines()
    frames: list[tuple[str, int, str]] = []
    exc_line = None
    for line in lines:
        match = _FRAME.match(line)
        if match:
            frames.append((match["file"], int(match["line"]), match["func"]))
            continue
        if line.strip() and not line[0].isspace():
            exc_line = line.strip()
            break
    if exc_line is None:
        return None
    exc_type, _, message = exc_line.partition(":")
    exc_type = exc_type.strip()
    if (
        " " in exc_type or not exc_type
    ):  # not "Type: message", e.g. "KeyboardInterrupt" alone is fine
        exc_type, message = exc_line, ""
    user = [f for f in frames if is_user_frame(f[0])]
    frame = user[-1] if user else (frames[-1] if frames else None)
    if frame is None:
        return ParsedTraceback(exc_type, message.strip(), None, None, None)
    return ParsedTraceback(exc_type, message.strip(), frame[0], frame[1], frame[2])


def chained_signatures(text: str) -> list[str]:
    """Signatures of every traceback in ``text``: a chained exception prints one per link,
    and output files show each of them."""
    found = []
    for block in text.split(TRACEBACK_HEADER)[1:]:
        parsed = parse_traceback(TRACEBACK_HEADER + block)
        if parsed is not None:
            found.append(parsed.signature())
    return found


def short_type(exc_type: str) -> str:
    """``torch.distributed.DistBackendError`` -> ``DistBackendError``."""
    return exc_type.rsplit(".", 1)[-1]


def fault_signature(
    signature: str | None,
    fault_kind: str | None,
    exc_type: str | None,
    message: str | None,
    traceback: str | None,
) -> str:
    """Signature of a ``fault`` event: its own ``signature`` field, else derived from its fields."""
    if signature:
        return str(signature)
    if traceback:
        parsed = parse_traceback(str(traceback))
        if parsed is not None:
            if exc_type:
                parsed = ParsedTraceback(
                    str(exc_type), parsed.message, parsed.file, parsed.line, parsed.func
                )
            return parsed.signature()
    if exc_type:
        return str(exc_type)
    kind = fault_kind or "fault"
    if kind.startswith("hang_"):  # hang_soft -> the same signature as a "hang" event's
        return hang_signature(kind[len("hang_") :])
    if message and kind in ("signal", "exit", "dead"):
        return f"{kind}: {message}"
    return kind


def exit_signature(exit_code: int | None, signal: str | None) -> str:
    """Signature of a process that ended: ``signal SIGKILL`` or ``exit code 1``."""
    if signal:
        return f"signal {signal}"
    return f"exit code {exit_code}"


def hang_signature(timeout: str | None) -> str:
    return f"hang ({timeout or 'unknown'} timeout)"


def category(signature: str) -> str:
    """Broad class of a signature, for the failures table: signal, exit, hang or exception."""
    if signature.startswith("signal "):
        return "signal"
    if signature.startswith("exit code "):
        return "exit"
    if signature.startswith("hang"):
        return "hang"
    return "exception"
