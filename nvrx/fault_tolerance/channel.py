"""The local channel from a rank's ``RankMonitorClient`` to its node's supervisor.

A Unix ``SOCK_SEQPACKET`` socket that the supervisor listens on
(``$NVRX_FT_SOCKET``): one connection per monitored process, one message per
packet, nothing dropped, and the end of the connection tells the supervisor the
process stopped being monitored. The first message (``init``) carries the
read end of a pipe on which the rank's ``faulthandler`` writes its stack when
it receives ``STACK_SIGNAL``. Messages are a verb, then a space and a payload:

* ``init {json}``: local rank, attempt, pid and the timeouts in force;
* ``h``: a heartbeat;  ``s NAME`` / ``e NAME``: a section starts / ends;
  ``E``: every open section ends;
* ``S {json}``: the sections open now (``open``: name -> seconds since it started) and,
  when none is, the seconds since the last one ended (``outside``): sent when the client
  catches up after the supervisor lagged, so that no timer restarts;
* ``t {json}``: new timeouts (computed by the client);
* ``w {json}``: a workload-control request (``action``, ``description``);
* ``T [s, ...]``: the durations of the rank's last steps (its own work, in seconds),
  batched by ``record_step``, for straggler scores;
* ``bye``: monitoring ends (``shutdown_workload_monitoring``).
"""

from __future__ import annotations

import json
import signal
from typing import Any

INIT, HEARTBEAT, SECTION_START, SECTION_END, END_ALL, TIMEOUTS, CONTROL, STEPS, SHUTDOWN = (
    "init", "h", "s", "e", "E", "t", "w", "T", "bye",
)  # fmt: skip
SECTIONS_NOW = "S"
VERBS = (INIT, HEARTBEAT, SECTION_START, SECTION_END, END_ALL, SECTIONS_NOW, TIMEOUTS, CONTROL, STEPS, SHUTDOWN)
#: Largest message; a section name or the timeouts must fit.
MAX_MESSAGE = 64 * 1024
#: Asks a monitored rank for its Python stack (faulthandler, every thread).
STACK_SIGNAL = signal.SIGRTMIN + 7


def encode(verb: str, payload: Any = None) -> bytes:
    """One message: ``verb``, and a section name (str) or JSON (anything else)."""
    if payload is None:
        return verb.encode()
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"{verb} {text}".encode()


def decode(data: bytes) -> tuple[str, Any]:
    """``(verb, payload)``; JSON payloads are parsed, section names kept as text. ValueError if malformed."""
    text = data.decode("utf-8", errors="replace")
    verb, _, rest = text.partition(" ")
    if verb not in VERBS:
        raise ValueError(f"unknown fault-tolerance message {text[:60]!r}")
    if verb in (INIT, SECTIONS_NOW, TIMEOUTS, CONTROL, STEPS):
        try:
            return verb, json.loads(rest)
        except RecursionError:  # nested past the parser's depth: no message of ours
            raise ValueError(f"fault-tolerance message nested too deep: {text[:60]!r}") from None
    return verb, rest if rest else None
