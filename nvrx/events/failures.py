"""The failure vocabulary: failure kinds and the one signature format of each.

Producers (the restart policy, the store's fault records, monitors) and
readers (``nvrx-report``) spell failures the same way, so that "the same bug
again" is the same string everywhere: the loop breaker compares signatures,
and the report groups by them. A signature is short and stable:

=============  ==========================================  =====================
kind           signature                                   example
=============  ==========================================  =====================
exception      type, and its innermost frame of user code  ``ValueError at train.py:12 in step``
hang           which timeout fired                         ``hang (soft timeout)``
dead           a monitor saw the process vanish            ``dead process``
unresponsive   a monitor lost the process's heartbeat      ``unresponsive (no heartbeat)``
signal         the signal that ended a process             ``signal SIGKILL``
exit           the exit code a process ended with          ``exit code 1``
peer           another rank's fault stopped this one       ``peer fault``
slurm          what SLURM did to the job                   ``slurm: time limit``
node           a node's supervisor fell silent             ``node lost``
=============  ==========================================  =====================

Older logs spell some of them differently (``signal:SIGKILL``, ``exit:1``,
``hang_soft``, ``dead``, ``module.Type@file.py:func``): ``normalize_signature``
reads them all, with one limit: an old exception signature names the frame's
function but not its line (``pkg.Type@train.py:step`` reads as ``pkg.Type at
train.py in step``), so it is not the same string as a new one of the same
failure (``pkg.Type at train.py:12 in step``). Formatted tracebacks are read into
signatures here too.

A rank's fault is kept as a ``FaultRecord`` (the store's fault list of a round holds them
as JSON, never as a parsed ``repr``: ``nvrx.store.rounds``), and its ``fault`` event is
built from the record here (``emit_fault``), so that the record and its event have one
shape, and a monitor process can write a fault's event before its link to the store is
made. This module is ground layer (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import builtins
import json
import os
import re
import socket
import time
import traceback as tb
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from dataclasses import fields as fields_of
from pathlib import PurePath
from typing import Any

EXCEPTION, HANG, DEAD, UNRESPONSIVE = "exception", "hang", "dead", "unresponsive"
SIGNAL, EXIT, PEER, SLURM, NODE = "signal", "exit", "peer", "slurm", "node"
FAILURE_KINDS = (EXCEPTION, HANG, DEAD, UNRESPONSIVE, SIGNAL, EXIT, PEER, SLURM, NODE)

#: ``fault_kind`` values of ``fault`` events and store fault records, and the kind of each.
FAULT_KINDS: dict[str, str] = {
    "exception": EXCEPTION,
    "exit": EXCEPTION,  # the rank leaves the job because of an exception
    "hang_soft": HANG,
    "hang_hard": HANG,
    "dead": DEAD,
    "unresponsive": UNRESPONSIVE,
    "signal": SIGNAL,
    "peer": PEER,
    "node_lost": NODE,  # the rank's whole node was lost (its supervisor fell silent)
    "monitor_exception": EXCEPTION,  # recorded as Interruption.MONITOR_PROCESS_EXCEPTION
}

DEAD_SIGNATURE = "dead process"
UNRESPONSIVE_SIGNATURE = "unresponsive (no heartbeat)"
PEER_SIGNATURE = "peer fault"
NODE_LOST_SIGNATURE = "node lost"
_SIGNAL_PREFIX, _EXIT_PREFIX, _HANG_PREFIX, _SLURM_PREFIX = (
    "signal ",
    "exit code ",
    "hang (",
    "slurm: ",
)
TRACEBACK_HEADER = "Traceback (most recent call last):"
_SIGNAL_NAME = re.compile(r"SIG[A-Z0-9]{2,12}")

#: Most digits of a number read from text (a line number, an exit code, a task): int() of
#: thousands of digits is slow, and Python refuses more than 4300.
MAX_DIGITS = 9
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>[0-9]{1,9}), in (?P<func>.+)$')
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# What the last part of an exception type looks like: a builtin exception's name, or a
# CamelCase name with one of these endings (``DistBackendError``, ``InjectedFault``).
_BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)
_CAMEL_CASE = re.compile(r"_*[A-Z][A-Za-z0-9_]*")
_EXCEPTION_ENDINGS = ("Error", "Exception", "Exit", "Interrupt", "Warning", "Fault")
# Paths of code that is not the user's: the standard library, installed packages and nvrx.
_LIBRARY_MARKERS = (
    "site-packages",
    "dist-packages",
    "/lib/python3",
    "<frozen ",
    *(f"/nvrx/{pkg}/" for pkg in ("inprocess", "supervisor", "store", "events", "slurm", "report")),
)
# Signatures of older nvrx versions.
_OLD_SPELLINGS = {
    "dead": DEAD_SIGNATURE,
    "unresponsive": UNRESPONSIVE_SIGNATURE,
    "peer": PEER_SIGNATURE,
    "hang_soft": "hang (soft timeout)",
    "hang_hard": "hang (hard timeout)",
    "node_lost": NODE_LOST_SIGNATURE,
}


# -- signatures of each kind ------------------------------------------------------------
def type_name(exc_type: str) -> str:
    """An exception type as Python prints it: ``builtins.KeyError`` -> ``KeyError``."""
    for prefix in ("builtins.", "__main__."):
        if exc_type.startswith(prefix):
            return exc_type[len(prefix) :]
    return exc_type


def short_type(exc_type: str) -> str:
    """``torch.distributed.DistBackendError`` -> ``DistBackendError``."""
    return exc_type.rsplit(".", 1)[-1]


def exception_signature(
    exc_type: str, file: str | None = None, line: int | None = None, func: str | None = None
) -> str:
    """``ValueError at train.py:12 in step``, or the type alone when no frame is known."""
    name = type_name(exc_type)
    if file is None:
        return name
    where = PurePath(file).name + (f":{line}" if line is not None else "")
    return f"{name} at {where}" + (f" in {func}" if func else "")


def signal_signature(name: str) -> str:
    return f"{_SIGNAL_PREFIX}{name}"


def exit_signature(code: int | None) -> str:
    return f"{_EXIT_PREFIX}{code if code is not None else 'unknown'}"


def process_end_signature(exit_code: int | None, signal: str | None) -> str:
    """How a process ended: ``signal SIGKILL`` when a signal killed it, else ``exit code N``."""
    return signal_signature(signal) if signal else exit_signature(exit_code)


def hang_signature(timeout: str | None) -> str:
    """``hang (soft timeout)``: which timeout declared the hang."""
    return f"{_HANG_PREFIX}{timeout or 'unknown'} timeout)"


def slurm_signature(what: str) -> str:
    """``slurm: time limit``: what SLURM did to the job."""
    return f"{_SLURM_PREFIX}{what}"


def kind_of(signature: str) -> str:
    """The failure kind a signature of this vocabulary belongs to (old spellings included)."""
    signature = normalize_signature(signature)
    prefixes = (
        (_SIGNAL_PREFIX, SIGNAL),
        (_EXIT_PREFIX, EXIT),
        (_HANG_PREFIX, HANG),
        (_SLURM_PREFIX, SLURM),
    )
    for prefix, kind in prefixes:
        if signature.startswith(prefix):
            return kind
    fixed = {
        DEAD_SIGNATURE: DEAD,
        UNRESPONSIVE_SIGNATURE: UNRESPONSIVE,
        PEER_SIGNATURE: PEER,
        NODE_LOST_SIGNATURE: NODE,
    }
    return fixed.get(signature, EXCEPTION)


def signature_type(signature: str) -> str | None:
    """The exception type of an exception signature (``ValueError at ...`` -> ``ValueError``)."""
    if kind_of(signature) != EXCEPTION:
        return None
    head = signature.split(" at ", 1)[0]
    return head if _DOTTED.fullmatch(head) else None


def normalize_signature(signature: str) -> str:
    """A signature in this vocabulary, whichever nvrx version (or application) wrote it."""
    sig = signature.strip()
    if sig in _OLD_SPELLINGS:
        return _OLD_SPELLINGS[sig]
    if sig.startswith("signal:"):  # the restart policy's old "signal:SIGKILL"
        return signal_signature(sig[len("signal:") :].strip())
    if sig.startswith("exit:"):  # and "exit:1"
        return exit_signature(parse_int(sig[len("exit:") :]))
    head, at, where = sig.partition("@")
    if at and _DOTTED.fullmatch(head):  # "pkg.Type@file.py:func" or "Type@file.py:12"
        file, _, tail = where.rpartition(":")
        if not file:
            return exception_signature(head, where or None)
        line = parse_int(tail)
        return exception_signature(head, file, line, None if line is not None else tail)
    return sig


def parse_int(text: str, max_digits: int = MAX_DIGITS) -> int | None:
    """A short decimal integer written in ASCII (``-12``), else None: not ``²``, not 5000 digits."""
    text = text.strip()
    digits = text[1:] if text.startswith("-") else text
    if not 0 < len(digits) <= max_digits or not digits.isascii() or not digits.isdigit():
        return None
    return int(text)


def is_canonical(signature: str) -> bool:
    """Whether ``signature`` is already spelled as this vocabulary spells it."""
    return bool(signature) and normalize_signature(signature) == signature


# -- tracebacks --------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedTraceback:
    """What a formatted Python traceback says: exception type, message, innermost user frame."""

    exc_type: str
    message: str
    file: str | None
    line: int | None
    func: str | None

    def signature(self) -> str:
        return exception_signature(self.exc_type, self.file, self.line, self.func)


def is_user_frame(path: str) -> bool:
    """True for a frame of the user's code (not stdlib, site-packages or nvrx internals)."""
    norm = path.replace("\\", "/")
    return not any(marker in norm for marker in _LIBRARY_MARKERS)


def looks_like_exception_type(name: str) -> bool:
    """``pkg.SomeError``: a dotted name whose last part is a builtin exception's name
    (``KeyboardInterrupt``, ``StopIteration``) or CamelCase ending in Error, Exception,
    Exit, Interrupt, Warning or Fault. ``Epoch`` of a log line ``Epoch: 3`` is not."""
    if not _DOTTED.fullmatch(name):
        return False
    last = name.rsplit(".", 1)[-1]
    if last in _BUILTIN_EXCEPTIONS:
        return True
    return bool(_CAMEL_CASE.fullmatch(last)) and last.endswith(_EXCEPTION_ENDINGS)


def is_exception_line(line: str) -> bool:
    """Whether ``line`` can end a traceback: ``pkg.SomeError`` or ``pkg.SomeError: message``."""
    head, colon, rest = line.strip().partition(":")
    if colon and rest and not rest[0].isspace():
        return False
    return looks_like_exception_type(head)


def _ends_traceback(line: str, known_type: str | None) -> bool:
    """An exception line, or one naming ``known_type`` (the type its writer recorded)."""
    if is_exception_line(line):
        return True
    if not known_type:
        return False
    head = line.strip().partition(":")[0]
    return head in (known_type, type_name(known_type), short_type(known_type))


def _innermost_user(
    frames: list[tuple[str, int | None, str]],
) -> tuple[str, int | None, str] | None:
    user = [f for f in frames if is_user_frame(f[0])]
    return user[-1] if user else (frames[-1] if frames else None)


def parse_traceback(text: str, known_type: str | None = None) -> ParsedTraceback | None:
    """Parse the last traceback in ``text`` (chained exceptions: the one raised last).

    It ends at the first unindented line that looks like an exception type (or names
    ``known_type``); other unindented lines (another process's log line) are passed over.
    """
    start = text.rfind(TRACEBACK_HEADER)
    if start < 0:
        return None
    frames: list[tuple[str, int | None, str]] = []
    exc_line = None
    for line in text[start + len(TRACEBACK_HEADER) :].splitlines():
        match = _FRAME.match(line)
        if match:
            frames.append((match["file"], int(match["line"]), match["func"].strip()))
        elif line[:1].strip() and _ends_traceback(line, known_type):
            exc_line = line.strip()
            break
    if exc_line is None:
        return None  # no exception line: not a traceback, or one cut short
    exc_type, _, message = exc_line.partition(":")
    frame = _innermost_user(frames)
    if frame is None:
        return ParsedTraceback(exc_type.strip(), message.strip(), None, None, None)
    return ParsedTraceback(exc_type.strip(), message.strip(), *frame)


def chained_signatures(text: str) -> list[str]:
    """Signatures of every traceback in ``text``: a chained exception prints one per link."""
    found = []
    for block in text.split(TRACEBACK_HEADER)[1:]:
        parsed = parse_traceback(TRACEBACK_HEADER + block)
        if parsed is not None:
            found.append(parsed.signature())
    return found


def exception_type_of(exc: BaseException) -> str:
    """The qualified type of ``exc`` (``builtins.ValueError``), as fault records store it."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def message_of(exc: BaseException) -> str:
    """``str(exc)``; where that raises (a user's exception whose ``__str__`` fails), a
    placeholder as Python's own tracebacks print one, with the type of the failure: the
    fault is recorded all the same."""
    try:
        return str(exc)
    except Exception as failed:
        return f"<exception str() failed: {type(failed).__name__}>"


def exception_signature_of(exc: BaseException) -> str:
    """Signature of a live exception: the same string its formatted traceback gives."""
    frames: Iterable[tb.FrameSummary] = (
        tb.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    )
    found = _innermost_user([(f.filename, f.lineno, f.name) for f in frames])
    if found is None:
        return exception_signature(exception_type_of(exc))
    return exception_signature(exception_type_of(exc), os.fspath(found[0]), found[1], found[2])


# -- fault events and records ------------------------------------------------------------
def told_signature(
    signature: str | None, exc_type: str | None = None, traceback: str | None = None
) -> str | None:
    """What a fault itself tells of its failure, in this vocabulary, or None when nothing.

    Its own ``signature`` when spelled in the vocabulary; else the one its
    traceback gives (with its ``exc_type``); else its old-spelled signature, or
    its exception type.
    """
    if signature and is_canonical(str(signature)):
        return str(signature)
    parsed = parse_traceback(traceback, exc_type) if traceback else None
    if parsed is not None:
        if exc_type:
            return exception_signature(str(exc_type), parsed.file, parsed.line, parsed.func)
        return parsed.signature()
    if signature:
        return normalize_signature(str(signature))
    return type_name(str(exc_type)) if exc_type else None


def fault_signature(
    signature: str | None,
    fault_kind: str | None,
    exc_type: str | None = None,
    message: str | None = None,
    traceback: str | None = None,
) -> str:
    """Signature of a ``fault`` event: what it tells, else the signature of its kind."""
    told = told_signature(signature, exc_type, traceback)
    if told is not None:
        return told
    kind = fault_kind or "fault"
    if kind.startswith("hang_"):  # hang_soft -> the same signature as a "hang" event's
        return hang_signature(kind[len("hang_") :])
    if kind == SIGNAL:  # the signal's name, when the message is one
        return signal_signature(
            message if message and _SIGNAL_NAME.fullmatch(message) else "unknown"
        )
    return _OLD_SPELLINGS.get(kind, kind)


# -- a rank's fault record and its event ---------------------------------------------
#: Kinds of fault records: every fault kind of the vocabulary but ``peer`` (a rank that only
#: lost its peer records no fault of its own).
RECORD_KINDS = tuple(kind for kind in FAULT_KINDS if kind != PEER)


@dataclass(frozen=True)
class FaultRecord:
    """One fault as every rank sees it: who, what, and when it was detected."""

    rank: int
    kind: str
    exc_type: str | None = None
    message: str = ""
    traceback: str | None = None
    signature: str = ""
    detected_mono: float = field(default_factory=time.monotonic)
    detected_wall: float = field(default_factory=time.time)
    reporter_pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if self.kind not in RECORD_KINDS:
            raise ValueError(f"fault kind must be one of {RECORD_KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, text: str) -> FaultRecord:
        data = json.loads(text)
        names = {f.name for f in fields_of(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def from_exception(rank: int, exc: BaseException, kind: str = "exception") -> FaultRecord:
    """A fault record describing ``exc`` raised on ``rank``."""
    return FaultRecord(
        rank=rank,
        kind=kind,
        exc_type=exception_type_of(exc),
        message=message_of(exc),
        traceback="".join(tb.format_exception(type(exc), exc, exc.__traceback__)),
        signature=exception_signature_of(exc),
    )


#: Writes one event: ``emit(kind, **fields)`` (an ``EventWriter.emit`` or a wrapper of it).
Emit = Callable[..., Any]


def emit_fault(
    emit: Emit,
    record: FaultRecord,
    *,
    fault_kind: str,
    origin_rank: int | None,
    **fields: Any,
) -> None:
    """Emit the ``fault`` event of ``record``: kind, the rank it is blamed on, what and when.

    ``exc_type`` and ``traceback`` are left out when the record has none (a
    record the monitor process made); ``fields`` add to or override the
    record's values (``detected_mono`` of a peer fault, the ``signature`` of a
    monitor fault).
    """
    event: dict[str, Any] = {"fault_kind": fault_kind, "origin_rank": origin_rank}
    if record.exc_type is not None:
        event["exc_type"] = record.exc_type
    event["message"] = record.message
    if record.traceback is not None:
        event["traceback"] = record.traceback
    event["signature"] = record.signature
    event["detected_mono"] = record.detected_mono
    event.update(fields)
    emit("fault", **event)


def announce_leave(emit: Emit, rank: int, record: FaultRecord, **fields: Any) -> None:
    """The event of the monitor taking ``rank`` out of its round (it died, hung or went
    silent); ``store.proxy_leave`` is the store's part. ``fields`` add to the event (the
    ``detection_s`` of a rank found silent: how long it had been)."""
    emit_fault(
        emit, record, fault_kind=record.kind, origin_rank=rank, signature=record.kind, **fields
    )
