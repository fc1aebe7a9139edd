"""Sealed values: a control value that only the job's own processes can have written.

The store (a torch ``TCPStore``) lets anyone who reaches its port read, write and list
keys. A value that steers the job is therefore written *sealed*: the payload, then
``SEPARATOR``, then ``mac=`` and an HMAC-SHA256 (first 32 hex digits) over the key, the
job's run and the payload, keyed by the job's secret (``$NVRX_JOB_SECRET``, hex, at least
16 bytes; ``nvrx.supervisor.job_secret`` says where it comes from). A reader unseals it:
a value whose MAC does not verify (forged, or written by a process without the secret)
is refused, and so is a sealed value copied under another key or from another run of the
job (a replay): the key and the run are inside the MAC.

A control value that many may write once each, where the first one written decides (a
slot's end), is a *sealed list*: each writer appends one entry (``ENTRY``, the sealed
payload, ``ENTRY``) and readers take the entries that unseal, in the order the store
received them. A forged fragment appended among them is skipped, so it can neither
decide nor block the decision; framing each entry on both sides keeps a forged fragment
that lacks its end from swallowing the next real entry.

The secret itself is never written to the store, the events, the logs or the report.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from nvrx import jobenv

SEPARATOR = "\x1f"  # ASCII unit separator: never in the JSON payloads sealed here
ENTRY = "\x1e"  # ASCII record separator: frames each entry of a sealed list
_MAC = "mac="
_DIGITS = 32
#: Least bytes of a secret given in ``$NVRX_JOB_SECRET``.
MIN_SECRET_BYTES = 16


def new_secret() -> str:
    """A fresh secret, as hex (32 random bytes)."""
    return secrets.token_hex(32)


def parse_secret(text: str, where: str) -> bytes:
    """The secret of ``text`` (hex, at least ``MIN_SECRET_BYTES`` bytes); ``where`` names its
    source in the error (never the value)."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{where} must be hexadecimal (e.g. from secrets.token_hex(32))") from None
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} must hold at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
    return raw


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path``, which must be this user's and owner-only (a link is not
    followed); ``OSError`` when it cannot be read, ``ValueError`` naming what to fix."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(f"{path} must be this user's and owner-only (mode 0600)")
        text = file.read()
    return parse_secret(text, str(path))


_job_sealer: tuple[str, Sealer] | None = None  # (the file, what it holds), read once
_job_sealer_lock = threading.Lock()


def job_sealer() -> Sealer | None:
    """The job's sealer in a process a supervisor started (``$NVRX_JOB_SECRET_FILE``); None
    without one (a job under torchrun: nothing is sealed). The file is read when first
    needed, for the supervisor writes it before the store can take any record:
    ``OSError``/``ValueError`` when it cannot be read then."""
    global _job_sealer
    path = os.environ.get(jobenv.JOB_SECRET_FILE)
    if not path:
        return None
    with _job_sealer_lock:
        if _job_sealer is None or _job_sealer[0] != path:
            _job_sealer = (path, Sealer(read_secret_file(path), run_of_job()))
        return _job_sealer[1]


def run_of_job(env: Mapping[str, str] | None = None) -> int:
    """This run of the job: SLURM's count of its requeues (0 for the first run, or outside SLURM).
    ValueError naming ``SLURM_RESTART_COUNT`` when it is not a count: no seal is made for a
    run that is not known (``jobenv.slurm_restart_count``)."""
    return jobenv.slurm_restart_count(env)


def text_of(raw: bytes | str) -> str:
    """A value read from the store as the text a seal covers (bytes decoded, others as text)."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def seal(secret: bytes, key: str, payload: str, run: int) -> str:
    """``payload`` sealed for ``key`` in run ``run``."""
    if SEPARATOR in payload or ENTRY in payload:
        raise ValueError("a sealed payload cannot hold the separators \\x1e or \\x1f")
    return f"{payload}{SEPARATOR}{_MAC}{_mac(secret, key, payload, run)}"


def unseal(secret: bytes, key: str, value: str, run: int) -> str | None:
    """The payload of ``value`` when it was sealed for ``key`` in run ``run`` with
    ``secret``; None otherwise (no seal, a wrong one, another key or run)."""
    payload, sep, mac = value.rpartition(SEPARATOR)
    if not sep or not mac.startswith(_MAC) or not mac.isascii():
        return None
    try:
        expected = _mac(secret, key, payload, run)
    except UnicodeEncodeError:  # a payload no writer of ours makes (lone surrogates)
        return None
    return payload if hmac.compare_digest(mac[len(_MAC) :].encode(), expected.encode()) else None


@dataclass(frozen=True)
class SealedList:
    """What a sealed list holds: the payloads that unsealed, in order, and what did not."""

    valid: tuple[str, ...] = ()
    invalid: int = 0  # fragments that did not unseal
    invalid_bytes: int = 0

    @property
    def first(self) -> str | None:
        """The payload that decides: the first one written that unseals."""
        return self.valid[0] if self.valid else None


@dataclass(frozen=True)
class Sealer:
    """The job's secret and run, to seal and unseal the values of this run.

    Its repr never shows the secret."""

    secret: bytes = field(repr=False)
    run: int = 0

    def seal(self, key: str, payload: str) -> str:
        """``payload`` sealed for ``key`` in this run."""
        return seal(self.secret, key, payload, self.run)

    def unseal(self, key: str, value: str) -> str | None:
        """The payload of ``value`` if it was sealed for ``key`` in this run, else None."""
        return unseal(self.secret, key, value, self.run)

    def entry(self, key: str, payload: str) -> str:
        """``payload`` as one entry of the sealed list at ``key``, to append."""
        return f"{ENTRY}{self.seal(key, payload)}{ENTRY}"

    def entries(self, key: str, value: str | None) -> SealedList:
        """The sealed list ``value`` read at ``key`` (None: not set)."""
        valid, invalid, size = [], 0, 0
        for fragment in (value or "").split(ENTRY):
            if not fragment:
                continue
            payload = self.unseal(key, fragment)
            if payload is None:
                invalid, size = invalid + 1, size + len(fragment.encode(errors="replace"))
            else:
                valid.append(payload)
        return SealedList(tuple(valid), invalid, size)


def _mac(secret: bytes, key: str, payload: str, run: int) -> str:
    message = f"{key}\0{run}\0{payload}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:_DIGITS]


__all__ = ["ENTRY", "MIN_SECRET_BYTES", "SEPARATOR", "SealedList", "Sealer", "job_sealer", "new_secret", "parse_secret", "read_secret_file", "run_of_job", "seal", "text_of", "unseal"]
