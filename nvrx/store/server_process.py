"""The store server process: ``python -m nvrx.store.service`` (see ``nvrx.store.service``).

It binds a torch ``TCPStore`` server, restores the snapshot it was given,
keeps the snapshot up to date, reports its port on the ready descriptor and
serves until SIGTERM/SIGINT or until the process that started it dies. A
``--held`` server imports torch first and binds only when a line arrives on
its stdin (it exits at the end of stdin without one).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import ipaddress
import json
import logging
import os
import select
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from nvrx import jobenv
from nvrx.help_format import HelpFormatter
from nvrx.signal_pipe import SignalPipe

from . import snapshot
from .snapshot import SnapshotSpec

log = logging.getLogger(__name__)


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP server could bind ``host:port`` now."""
    return _can_bind(socket.AF_INET, (host, port))


def store_port_is_free(host: str, port: int, bind: str | None = None) -> bool:
    """Whether the store that clients reach at ``host`` could listen at ``port`` now, where it
    will listen: ``bind`` (default ``$NVRX_STORE_BIND``, else ``host``), every interface for a
    name that does not resolve here (``_listener``). OSError (EADDRNOTAVAIL) for an address
    of no interface of this machine."""
    entry, _ = _listen_address(bind or os.environ.get(jobenv.STORE_BIND) or host, port)
    if entry is None:
        return _can_bind(socket.AF_INET, ("", port))
    family, _, _, _, address = entry
    return _can_bind(family, address)


def _can_bind(family: int, address: tuple[Any, ...]) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _die_with_parent() -> None:
    """Ask the kernel to send SIGTERM to this process when its parent dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _report(ready_fd: int | None, message: dict) -> None:
    """Tell the starting process, once, how the start went (its port, or the error)."""
    if ready_fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(ready_fd, (json.dumps(message) + "\n").encode())
        os.close(ready_fd)


#: ``--bind`` (or ``$NVRX_STORE_BIND``) value that listens on every interface.
BIND_ALL = "all"


def _listener(bind: str, port: int) -> socket.socket | None:
    """A listening socket on ``bind:port`` for the store; None to let torch listen on every
    interface (its own behaviour): ``bind`` is ``all``, a name that does not resolve here,
    or a host name that resolves to a loopback address here although it is not
    ``localhost`` (as a Debian ``/etc/hosts`` maps a machine's own name to 127.0.1.1,
    where the other nodes could not reach it)."""
    entry, why = _listen_address(bind, port)
    if why is not None:
        log.warning("store: %s", why)
    if entry is None:
        return None
    family, kind, proto, _, address = entry
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _listen_address(bind: str, port: int) -> tuple[tuple[Any, ...] | None, str | None]:
    """The ``getaddrinfo`` entry the store listens on for ``bind``, None for every interface
    (``_listener``'s rule); and why every interface, where ``bind`` did not ask for it."""
    if bind in (BIND_ALL, "0.0.0.0", "::"):
        return None, None
    try:
        entry = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return None, f"{bind} does not resolve here ({exc}): listening on every interface"
    if _names_loopback(bind, entry[4][0]):
        return None, (
            f"{bind} resolves to {entry[4][0]} here, which other nodes cannot reach: listening on "
            "every interface (set NVRX_STORE_BIND to this node's address to listen on it alone)"
        )
    return entry, None


def _names_loopback(bind: str, resolved: str) -> bool:
    """Whether ``bind`` is a host name (not an address, not ``localhost``) of a loopback address."""
    try:
        ipaddress.ip_address(bind)
        return False
    except ValueError:
        return bind != "localhost" and ipaddress.ip_address(resolved).is_loopback


def _bind(host: str, port: int, bind: str) -> tuple[Any, str]:
    """A torch ``TCPStore`` server listening on ``bind`` at ``port`` (clients reach it at
    ``host``) and the address it listens on (``all``); or None and why it could not bind."""
    import torch.distributed as dist

    try:
        listener = _listener(bind, port)
        listening = listener.getsockname()[0] if listener is not None else BIND_ALL
        store = dist.TCPStore(
            host,
            listener.getsockname()[1] if listener is not None else port,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=30),
            wait_for_workers=False,
            master_listen_fd=listener.detach() if listener is not None else None,
        )
    except Exception as exc:  # torch raises DistNetworkError/RuntimeError on bind failures
        in_use = "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower()
        return None, "in_use" if in_use else f"{type(exc).__name__}: {exc}"
    return store, listening


def _serve_until(
    signals: SignalPipe,
    store: Any,
    where: tuple[str, str],
    ready_fd: int | None,
    spec: SnapshotSpec | None,
) -> None:
    """Restore the snapshot, keep it up to date and serve ``store`` until a stop signal;
    ``where``: the address clients reach it at, and the address it listens on."""
    from nvrx import events

    writer = events.configure("store")
    restored = _restore(store, spec)
    keeper = None
    if spec is not None:
        keeper = snapshot.Keeper(store, spec.path, spec.prefixes, spec.exclude)
        keeper.start()
    writer.emit(
        "store_start", addr=where[0], listen=where[1], port=store.port, restored_keys=restored
    )
    _report(ready_fd, {"port": store.port, "pid": os.getpid()})
    _stopped(signals)
    if keeper is not None:
        keeper.stop()
    writer.emit("store_end", reason="stopped by signal")


def _stopped(signals: SignalPipe, other: int | None = None) -> bool:
    """Wait until a stop signal came (True) or ``other`` is readable (False). Waiting on the
    signal pipe, not in a handler: see ``nvrx.signal_pipe``."""
    watched = [signals.fileno()] if other is None else [signals.fileno(), other]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if signals.read():
            return True
        if other in ready:
            return False


def _serve(
    host: str,
    port: int,
    ready_fd: int | None,
    parent_pid: int | None,
    spec: SnapshotSpec | None = None,
    held: bool = False,
    bind: str | None = None,
) -> int:
    signals = SignalPipe((signal.SIGTERM, signal.SIGINT)).install()
    _die_with_parent()
    if parent_pid is not None and os.getppid() != parent_pid:
        return 1  # the parent died before the death signal was armed
    if port and not store_port_is_free(host, port, bind):
        _report(ready_fd, {"error": "in_use"})
        return 2
    import torch.distributed  # noqa: F401  (a held server has torch imported before its release)

    if held:
        if _stopped(signals, sys.stdin.fileno()) or not sys.stdin.buffer.readline():
            return 0  # stopped, or never released: not needed
    store, listening = _bind(host, port, bind or host)
    if store is None:
        _report(ready_fd, {"error": listening})
        return 2
    _serve_until(signals, store, (host, listening), ready_fd, spec)
    del store
    return 0


def _restore(store: object, spec: SnapshotSpec | None) -> int | None:
    """Restore the keys of the snapshot ``spec`` starts from; how many, None when none."""
    if spec is None or spec.restore_from is None:
        return None
    keys = snapshot.read(spec.restore_from)
    snapshot.restore(store, keys)
    return len(keys)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m nvrx.store.service``."""
    parser = argparse.ArgumentParser(
        prog="python -m nvrx.store.service",
        description="Serve an nvrx store (torch TCPStore) until SIGTERM or the parent dies.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--host", default="0.0.0.0", help="address clients reach the store at (default: all)"
    )
    parser.add_argument(
        "--bind",
        default=os.environ.get(jobenv.STORE_BIND) or None,
        metavar="ADDR",
        help=f"address to listen on, '{BIND_ALL}' for every interface (default: "
        "$NVRX_STORE_BIND, else the --host address only)",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--snapshot", type=Path, default=None, help="keep a copy of job-level keys in this file"
    )
    parser.add_argument(
        "--snapshot-prefix", action="append", default=[], help="key prefix to copy (repeatable)"
    )
    parser.add_argument(
        "--snapshot-exclude", action="append", default=[], help="key prefix never copied"
    )
    parser.add_argument(
        "--restore", type=Path, default=None, help="start from the keys saved in this file"
    )
    parser.add_argument(
        "--held",
        action="store_true",
        help="import torch, then serve only once a line arrives on stdin (exit at its end)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s nvrx-store %(levelname)s %(message)s"
    )
    spec = None
    if args.snapshot is not None:
        spec = SnapshotSpec(
            args.snapshot,
            tuple(args.snapshot_prefix),
            tuple(args.snapshot_exclude),
            args.restore,
        )
    return _serve(args.host, args.port, args.ready_fd, args.parent_pid, spec, args.held, args.bind)
