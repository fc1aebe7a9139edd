"""A client of torch's ``TCPStore`` server in plain Python, for processes that need no torch.

nvrx's helper processes (a rank's monitor, the supervisor's node agent) talk to the job's
store and to nothing else of torch, and a node starts many of them at once, just when its
ranks import torch themselves: an import of torch in each would slow the job's start
and hold memory for nothing (``docs/architecture.md`` has the figures). This client speaks the server's wire protocol itself, with the method names and
semantics of ``torch.distributed.TCPStore``'s client, so that nvrx's store code runs
unchanged on either.

The protocol, as torch 2.13's server reads it (``TCPStoreBackend.hpp`` names the query
types; every integer is in the host's byte order, as torch's client sends it): a request is one query-type byte followed by its arguments; a string or a byte
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
connection, or it broke). A connection broken in the middle of a request stays broken,
as torch's does: every later request raises ``StoreGone``.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta

MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = range(10, 14)
LIST_KEYS = 17
READY = 0
STOP_WAITING, WAIT_CANCELED = 0, 1

_U8, _U32, _U64, _I64 = (struct.Struct(f"={c}") for c in "BIQq")  # host order, fixed sizes
#: ``poll`` takes at most this many milliseconds.
_POLL_MAX_MS = 2**31 - 1
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
    takes its own timeout; connecting is tried again until ``timeout`` while the server is
    not up; a server that does not answer a request within ``timeout`` is taken for gone.
    As with torch's client, a connection that broke stays broken: every later request
    raises ``StoreGone`` (``clone`` connects anew). One request at a time goes over the
    connection (a lock), so a thread that blocks in ``wait`` holds up the others: give it
    its own ``clone``.
    """

    def __init__(self, host: str, port: int, timeout: timedelta | float = 300.0) -> None:
        if not 0 < int(port) < 65536:
            raise ValueError(f"store port must be in 1..65535, got {port}")
        self.host, self.port = host, int(port)
        self._timeout = _seconds(timeout)
        self._lock = threading.Lock()
        self._broken: StoreGone | None = None
        self._sock = self._connect()

    # -- the connection -------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """The default wait of ``get``, ``multi_get`` and ``wait`` (and of connecting)."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """The new default, applied from the next request on."""
        self._timeout = _seconds(timeout)

    def clone(self) -> WireStore:
        """A new connection to the same server, with the same timeout."""
        return WireStore(self.host, self.port, self._timeout)

    def close(self) -> None:
        self._break(StoreGone(f"store client of {self.host}:{self.port} closed"))

    def __enter__(self) -> WireStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> socket.socket:
        """A validated connection, tried again until the timeout while the server is not up
        or drops the connection during the greeting (its listen backlog full)."""
        deadline = time.monotonic() + self._timeout
        pause = 0.05
        while True:
            try:
                return self._greet(deadline)
            except OSError as exc:
                if time.monotonic() + pause >= deadline:
                    raise StoreGone(
                        f"no store answered at {self.host}:{self.port} within "
                        f"{self._timeout:g} s: {exc}"
                    ) from exc
            time.sleep(pause)
            pause = min(2 * pause, CONNECT_PAUSE_MAX_S)

    def _greet(self, deadline: float) -> socket.socket:
        left = max(deadline - time.monotonic(), 0.001)
        sock = socket.create_connection((self.host, self.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.getpid() & 0xFFFFFFFF
            sock.sendall(_U8.pack(VALIDATE) + _U32.pack(MAGIC) + _U8.pack(PING) + _U32.pack(nonce))
            answer = _recv_exact(sock, _U32.size)
            if _U32.unpack(answer)[0] != nonce:
                raise ConnectionError(
                    "the server answered the greeting wrongly: not a torch TCPStore"
                )
        except BaseException:
            sock.close()
            raise
        return sock

    def _break(self, error: StoreGone) -> None:
        if self._broken is None:
            self._broken = error
        self._sock.close()

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[socket.socket]:
        """The connection, for one request and its whole answer, under the lock. A request
        cut short (a broken connection, no answer in time, a signal handler's exception)
        leaves the stream out of step: the connection is broken for good then."""
        with self._lock:
            if self._broken is not None:
                raise StoreGone(str(self._broken))
            self._sock.settimeout(self._timeout)
            try:
                yield self._sock
            except StoreTimeout:
                raise  # a wait ran out and was cancelled: the stream is in step
            except OSError as exc:
                gone = StoreGone(f"store at {self.host}:{self.port}: {exc!r}")
                self._break(gone)
                raise gone from exc
            except BaseException as exc:
                self._break(
                    StoreGone(f"a request to {self.host}:{self.port} was cut short: {exc!r}")
                )
                raise

    # -- requests -------------------------------------------------------------------

    @staticmethod
    def _key(key: str) -> bytes:
        return _string((KEY_PREFIX + key).encode())

    def _keys(self, keys: Iterable[str]) -> bytes:
        keys = list(keys)
        return _U64.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    def set(self, key: str, value: str | bytes) -> None:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(SET) + self._key(key) + _string(_bytes(value)))

    def append(self, key: str, value: str | bytes) -> None:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(APPEND) + self._key(key) + _string(_bytes(value)))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set needs one value per key, got {len(keys)} keys, {len(values)} values"
            )
        pairs = b"".join(
            self._key(k) + _string(_bytes(v)) for k, v in zip(keys, values, strict=True)
        )
        with self._exchange() as sock:
            sock.sendall(_U8.pack(MULTI_SET) + _U64.pack(len(keys)) + pairs)

    def add(self, key: str, amount: int) -> int:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(ADD) + self._key(key) + _I64.pack(int(amount)))
            return _recv_value(sock, _I64)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` where the value is ``expected`` (or absent and ``expected`` empty);
        the value held afterwards."""
        body = self._key(key) + _string(_bytes(expected)) + _string(_bytes(desired))
        with self._exchange() as sock:
            sock.sendall(_U8.pack(COMPARE_SET) + body)
            return _recv_bytes(sock)

    def check(self, keys: Iterable[str]) -> bool:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(CHECK) + self._keys(keys))
            return _recv_value(sock, _U8) == READY

    def delete_key(self, key: str) -> bool:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(DELETE_KEY) + self._key(key))
            return _recv_value(sock, _I64) == 1

    def num_keys(self) -> int:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(GETNUMKEYS))
            return _recv_value(sock, _I64)

    def list_keys(self) -> list[str]:
        with self._exchange() as sock:
            sock.sendall(_U8.pack(LIST_KEYS))
            names = [_recv_bytes(sock) for _ in range(_recv_value(sock, _I64))]
        texts = [n.decode(errors="replace") for n in names]
        return [n[len(KEY_PREFIX) :] if n.startswith(KEY_PREFIX) else n for n in texts]

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it is there (``StoreTimeout`` after ``timeout``)."""
        with self._exchange() as sock:
            self._wait(sock, [key], self._timeout)
            sock.sendall(_U8.pack(GET) + self._key(key))
            return _recv_bytes(sock)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = list(keys)
        with self._exchange() as sock:
            self._wait(sock, keys, self._timeout)
            sock.sendall(_U8.pack(MULTI_GET) + self._keys(keys))
            return [_recv_bytes(sock) for _ in keys]

    def wait(self, keys: Iterable[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key of ``keys`` is there; ``StoreTimeout`` after ``timeout``
        (default: the client's)."""
        seconds = self._timeout if timeout is None else _seconds(timeout)
        with self._exchange() as sock:
            self._wait(sock, list(keys), seconds)

    def _wait(self, sock: socket.socket, keys: list[str], timeout: float) -> None:
        """WAIT, answered by the server once the keys are there; cancelled after ``timeout``.
        The keys coming just before the cancel count as there (torch raises then)."""
        sock.sendall(_U8.pack(WAIT) + self._keys(keys))
        if _answered_within(sock, timeout):
            _expect(sock, STOP_WAITING, "WAIT")
            return
        sock.sendall(_U8.pack(CANCEL_WAIT))
        answer = _recv_value(sock, _U8)
        if answer == STOP_WAITING:
            _expect(sock, WAIT_CANCELED, "CANCEL_WAIT")
            return
        if answer != WAIT_CANCELED:
            raise ConnectionError(f"the server answered CANCEL_WAIT with {answer}")
        raise StoreTimeout(f"keys {keys} not in the store within {timeout:g} s")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_value(sock: socket.socket, kind: struct.Struct) -> int:
    return kind.unpack(_recv_exact(sock, kind.size))[0]


def _recv_bytes(sock: socket.socket) -> bytes:
    return _recv_exact(sock, _recv_value(sock, _U64))


def _expect(sock: socket.socket, value: int, query: str) -> None:
    answer = _recv_value(sock, _U8)
    if answer != value:
        raise ConnectionError(f"the server answered {query} with {answer}, not {value}")


def _answered_within(sock: socket.socket, timeout: float) -> bool:
    """Whether the server's answer arrives within ``timeout`` seconds (a wait of weeks is
    polled in slices: ``poll`` takes at most 2**31 - 1 ms)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        left_ms = (deadline - time.monotonic()) * 1000
        if poller.poll(min(max(left_ms, 0.0), _POLL_MAX_MS)):
            return True
        if left_ms <= _POLL_MAX_MS:
            return False
