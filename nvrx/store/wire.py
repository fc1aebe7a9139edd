"""A client of torch's ``TCPStore`` server in plain Python, for processes that need no torch.

nvrx's helper processes (a rank's monitor, the supervisor's store agent) talk to the job's
store and to nothing else of torch. Importing torch costs each of them about 1.5 s of CPU
and 200 MB; on a node that starts a dozen of them at once, that is the start-up of the
job. This client speaks the server's wire protocol itself, with the method names and
semantics of ``torch.distributed.TCPStore``'s client, so that nvrx's store code runs
unchanged on either.

The protocol, as torch 2.13's server reads it (``TCPStoreBackend.hpp`` names the query
types; every integer is in the host's byte order, which is little-endian wherever torch
runs): a request is one query-type byte followed by its arguments; a string or a byte
string is a ``uint64`` length and the bytes; a key list is a ``uint64`` count and the
strings. A client first sends ``VALIDATE`` with the magic number, then ``PING`` with a
``uint32`` nonce that the server sends back. torch's client puts ``/`` before every key;
so does this one, so that both see the same keys.

================  =======================================  ==============================
query             arguments                                answer
================  =======================================  ==============================
``SET``           key, value                               none
``COMPARE_SET``   key, expected, desired                   the value now held
``GET``           key (present: the client waited first)   value
``ADD``           key, ``int64`` amount                    ``int64`` new value
``CHECK``         key list                                 ``uint8``: 0 all there, 1 not
``WAIT``          key list                                 ``uint8`` 0 once all are there
``CANCEL_WAIT``   none                                     ``uint8`` 1 (a 0 may come first)
``GETNUMKEYS``    none                                     ``int64``
``DELETE_KEY``    key                                      ``int64`` keys deleted
``APPEND``        key, value                               none
``MULTI_GET``     key list                                 one value per key
``MULTI_SET``     ``uint64`` count, then key, value pairs  none
``LIST_KEYS``     none                                     ``int64`` count, then the keys
================  =======================================  ==============================

Errors are the two kinds nvrx's store code tells apart (``nvrx.store.errors``):
``StoreTimeout`` (a wait ran out; the connection is still good) and ``StoreGone`` (no
connection, or it broke). A connection broken in the middle of a request is not
reused: the next request connects again.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = range(10, 14)
LIST_KEYS = 17
READY = 0
STOP_WAITING, WAIT_CANCELED = 0, 1

_U8, _U32, _U64, _I64 = (
    struct.Struct("<B"),
    struct.Struct("<I"),
    struct.Struct("<Q"),
    struct.Struct("<q"),
)
#: Pause between two tries to connect while the server is not up yet (doubling up to this).
CONNECT_PAUSE_MAX_S = 1.0


class StoreError(RuntimeError):
    """Base of the wire client's errors."""


class StoreTimeout(StoreError):
    """A wait for keys ran out before they were all there."""


class StoreGone(StoreError):
    """No connection to the store: it never answered in time, refused, or broke off."""


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


class WireStore:
    """A client of a torch ``TCPStore`` server at ``host:port``.

    The methods are those of ``torch.distributed.Store`` that nvrx uses, with torch's
    semantics: ``get`` and ``multi_get`` wait for their keys up to ``timeout``; ``wait``
    takes its own timeout. One request at a time goes over the connection (a lock), so a
    thread that blocks in ``wait`` holds up the others: give it its own ``clone``.
    """

    def __init__(self, host: str, port: int, timeout: timedelta | float = 300.0) -> None:
        if not 0 < int(port) < 65536:
            raise ValueError(f"store port must be in 1..65535, got {port}")
        self.host, self.port = host, int(port)
        self._timeout = _seconds(timeout)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        with self._lock:
            self._connect()

    # -- the connection -------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """The default wait of ``get``, ``multi_get`` and ``wait`` (and of connecting)."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: timedelta | float) -> None:
        self._timeout = _seconds(timeout)
        with self._lock:
            if self._sock is not None:
                self._sock.settimeout(self._timeout)

    def clone(self) -> WireStore:
        """A second connection to the same server, with the same timeout."""
        return WireStore(self.host, self.port, self._timeout)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> WireStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> None:
        """Connect, tried again while the server is not up, until the timeout; then validate."""
        deadline = time.monotonic() + self._timeout
        pause = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(left, 0.001))
                break
            except OSError as exc:
                if time.monotonic() + pause >= deadline:
                    raise StoreGone(
                        f"no store answered at {self.host}:{self.port} within "
                        f"{self._timeout:g} s: {exc}"
                    ) from exc
            time.sleep(pause)
            pause = min(2 * pause, CONNECT_PAUSE_MAX_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._timeout)  # a server that stops answering is a server gone
        self._sock = sock
        nonce = os.getpid() & 0xFFFFFFFF
        self._send(_U8.pack(VALIDATE) + _U32.pack(MAGIC) + _U8.pack(PING) + _U32.pack(nonce))
        if self._recv_value(_U32) != nonce:
            self._drop()
            raise StoreGone(f"the server at {self.host}:{self.port} is not a torch TCPStore")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._drop()
            raise StoreGone(f"store at {self.host}:{self.port}: {exc}") from exc

    def _recv_exact(self, size: int) -> bytes:
        assert self._sock is not None
        chunks, left = [], size
        try:
            while left:
                chunk = self._sock.recv(left)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as exc:  # a broken connection, or no answer within the timeout
            self._drop()
            raise StoreGone(f"store at {self.host}:{self.port}: {exc}") from exc
        return b"".join(chunks)

    def _recv_value(self, kind: struct.Struct) -> int:
        return kind.unpack(self._recv_exact(kind.size))[0]

    def _recv_bytes(self) -> bytes:
        return self._recv_exact(self._recv_value(_U64))

    def _request(self, data: bytes) -> None:
        """Send one request on the connection, connecting first if it was dropped."""
        if self._sock is None:
            self._connect()
        self._send(data)

    # -- requests -------------------------------------------------------------------

    @staticmethod
    def _key(key: str) -> bytes:
        return _string((KEY_PREFIX + key).encode())

    def _keys(self, keys: Iterable[str]) -> bytes:
        keys = list(keys)
        return _U64.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._request(_U8.pack(SET) + self._key(key) + _string(_bytes(value)))

    def append(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._request(_U8.pack(APPEND) + self._key(key) + _string(_bytes(value)))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set needs one value per key, got {len(keys)} keys, {len(values)} values"
            )
        pairs = b"".join(
            self._key(k) + _string(_bytes(v)) for k, v in zip(keys, values, strict=True)
        )
        with self._lock:
            self._request(_U8.pack(MULTI_SET) + _U64.pack(len(keys)) + pairs)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._request(_U8.pack(ADD) + self._key(key) + _I64.pack(int(amount)))
            return self._recv_value(_I64)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` where the value is ``expected`` (or absent and ``expected`` empty);
        the value held afterwards."""
        body = self._key(key) + _string(_bytes(expected)) + _string(_bytes(desired))
        with self._lock:
            self._request(_U8.pack(COMPARE_SET) + body)
            return self._recv_bytes()

    def check(self, keys: Iterable[str]) -> bool:
        with self._lock:
            self._request(_U8.pack(CHECK) + self._keys(keys))
            return self._recv_value(_U8) == READY

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._request(_U8.pack(DELETE_KEY) + self._key(key))
            return self._recv_value(_I64) == 1

    def num_keys(self) -> int:
        with self._lock:
            self._request(_U8.pack(GETNUMKEYS))
            return self._recv_value(_I64)

    def list_keys(self) -> list[str]:
        with self._lock:
            self._request(_U8.pack(LIST_KEYS))
            names = [self._recv_bytes().decode() for _ in range(self._recv_value(_I64))]
        return [n[len(KEY_PREFIX) :] if n.startswith(KEY_PREFIX) else n for n in names]

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it is there (``StoreTimeout`` after ``timeout``)."""
        with self._lock:
            self._wait([key], self._timeout)
            self._request(_U8.pack(GET) + self._key(key))
            return self._recv_bytes()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = list(keys)
        with self._lock:
            self._wait(keys, self._timeout)
            self._request(_U8.pack(MULTI_GET) + self._keys(keys))
            return [self._recv_bytes() for _ in keys]

    def wait(self, keys: Iterable[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key of ``keys`` is there; ``StoreTimeout`` after ``timeout``
        (default: the client's)."""
        with self._lock:
            self._wait(list(keys), self._timeout if timeout is None else _seconds(timeout))

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._request(_U8.pack(WAIT) + self._keys(keys))
        if self._await(timeout) and self._recv_value(_U8) == STOP_WAITING:
            return
        self._send(_U8.pack(CANCEL_WAIT))
        if self._recv_value(_U8) == STOP_WAITING:  # the keys came just before the cancel
            self._recv_value(_U8)  # its WAIT_CANCELED
            return
        raise StoreTimeout(f"keys {keys} not in the store within {timeout:g} s")

    def _await(self, timeout: float) -> bool:
        """Whether the server's answer arrives within ``timeout`` seconds."""
        assert self._sock is not None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(max(timeout, 0.0) * 1000))

