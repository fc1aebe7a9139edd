"""Sealed values: a control value that only the job's own processes can have written.

The store (a torch ``TCPStore``) lets anyone who reaches its port read, write and list
keys. A value that steers the job is therefore written *sealed*: the payload, then
``SEPARATOR``, then ``mac=`` and an HMAC-SHA256 (first 32 hex digits) over the key, the
job's run and the payload, keyed by the job's secret (``$NVRX_JOB_SECRET``, hex, at least
16 bytes; ``nvrx.supervisor.job_secret`` says where it comes from). A reader unseals it:
a value whose MAC does not verify (forged, or written by a process without the secret)
is refused, and so is a sealed value copied under another key or from another run of the
job (a replay): the key and the run are inside the MAC.

The secret itself is never written to the store, the events, the logs or the report.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from nvrx import jobenv

SEPARATOR = "\x1f"  # ASCII unit separator: never in the JSON payloads sealed here
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


def run_of_job(env: dict[str, str] | None = None) -> int:
    """This run of the job: SLURM's count of its requeues (0 for the first run, or outside SLURM)."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    return int(jobenv.seconds_from(env, "SLURM_RESTART_COUNT", 0))


def seal(secret: bytes, key: str, payload: str, run: int) -> str:
    """``payload`` sealed for ``key`` in run ``run``."""
    if SEPARATOR in payload:
        raise ValueError("a sealed payload cannot hold the separator \\x1f")
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


def _mac(secret: bytes, key: str, payload: str, run: int) -> str:
    message = f"{key}\0{run}\0{payload}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:_DIGITS]


__all__ = ["MIN_SECRET_BYTES", "SEPARATOR", "new_secret", "parse_secret", "run_of_job", "seal", "unseal"]
