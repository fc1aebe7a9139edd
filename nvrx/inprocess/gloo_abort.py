"""Interrupt gloo collectives that block another thread, by shutting down their TCP connections.

A gloo collective blocked in C++ ignores ``ProcessGroup.abort()``,
``destroy_process_group()`` and Python async exceptions: it returns only when
its timeout expires or one of its connections fails. Shutting down the
reading side of a connected socket (``shutdown(2)``, from any thread, through
a duplicate descriptor) makes the pending read fail at once, so the collective
raises within milliseconds and the blocked thread is back in Python; why only
reads, see ``shutdown_sockets``.

To touch only gloo's connections, process group constructions are observed
while tracking is on (``install``/``uninstall``, or ``with tracking():``; the
Wrapper tracks for the length of each call of the wrapped function, and puts
torch's own group factory back when it ends, unless something wrapped it
meanwhile, see ``uninstall``): the sockets this process owns right before
and right after ``torch.distributed``'s group factory ran are compared, and
the new TCP sockets are recorded for that group (by inode, so a descriptor
number reused later never points us at an unrelated socket). Sockets that belong to stores
are never recorded: accepted connections of listeners that existed before the
group (a store server in this process) and connections to a protected port
(``NVRX_STORE_PORT``, ``MASTER_PORT`` and ports given to ``protect_port``).
See docs/abort.md for the limits.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from nvrx import jobenv

log = logging.getLogger(__name__)

_PROC_FD = "/proc/self/fd"
_PROTECTED_PORT_ENVS = (jobenv.STORE_PORT, "MASTER_PORT")
_FACTORY = "_new_process_group_helper"  # torch's group factory (private)

#: How long an abort lets a group creation in flight end by itself before it cuts its
#: connections (``await_creations``).
CREATION_GRACE_S = 5.0

_lock = threading.Lock()
_creations_ended = threading.Condition(_lock)  # notified as each creation in flight ends
_installs = 0  # install() calls not yet undone by uninstall()
_patched: Any = None  # our tracking factory, from the first install() until it is restored
_original: Any = None  # the factory it wraps (put back by the last uninstall())
_groups: dict[str, set[int]] = {}  # group name -> inodes of its TCP sockets
_protected_ports: set[int] = set()
_opened_before: set[int] = set()  # socket inodes open when user code began (the Wrapper's own)
_creating: dict[int, set[int]] = {}  # group creations in flight -> socket inodes open at their start
_refusing = 0  # aborts in progress: while any is, no creation starts (``await_creations``)
_held: list[socket.socket] = []  # duplicates of shut-down connections, kept open (shutdown_sockets)
_advice: list[float] = []  # hard timeouts a gloo group's timeout should be shorter than (tracking)
_advised = False  # the advice was logged (once per process)


@dataclass(frozen=True)
class _Conn:
    inode: int
    fd: int
    local_port: int
    remote_port: int | None  # None for a listening socket
    listening: bool


def protect_port(port: int) -> None:
    """Never record (hence never shut down) connections to or from ``port``."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"protect_port: port must be an int in 1..65535, got {port!r}")
    with _lock:
        _protected_ports.add(port)


def _protected() -> set[int]:
    ports = set(_protected_ports)
    for name in _PROTECTED_PORT_ENVS:
        raw = os.environ.get(name, "")
        if raw.isdigit():
            ports.add(int(raw))
    return ports


def _socket_inodes() -> dict[int, int]:
    """Inode -> descriptor of every socket this process has open (empty without /proc)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_PROC_FD)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_PROC_FD}/{name}")
        except OSError:
            continue  # closed meanwhile, or the listdir descriptor itself
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def _tcp_connections(inodes: dict[int, int]) -> dict[int, _Conn]:
    """TCP details of the given socket inodes, read from /proc/net/tcp{,6}."""
    conns: dict[int, _Conn] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                rows = [_parse_row(line, inodes) for line in fh]
        except OSError:
            continue
        conns.update((conn.inode, conn) for conn in rows if conn is not None)
    return conns


def _parse_row(line: str, inodes: dict[int, int]) -> _Conn | None:
    """One row of /proc/net/tcp as a ``_Conn``, None when its socket is not among ``inodes``."""
    cols = line.split()
    if len(cols) < 10 or int(cols[9]) not in inodes:
        return None
    inode = int(cols[9])
    local_port = int(cols[1].rsplit(":", 1)[1], 16)
    remote_port = int(cols[2].rsplit(":", 1)[1], 16)
    listening = cols[3] == "0A"  # TCP_LISTEN
    return _Conn(inode, inodes[inode], local_port, None if listening else remote_port, listening)


def _new_group_sockets(before: dict[int, int], before_listen_ports: set[int]) -> set[int]:
    """TCP sockets created since ``before`` that are not store connections."""
    now = _socket_inodes()
    fresh = {inode: fd for inode, fd in now.items() if inode not in before}
    protected = _protected() | before_listen_ports
    chosen: set[int] = set()
    for conn in _tcp_connections(fresh).values():
        if conn.listening:
            continue  # gloo's listener: shutting it down would fail its accept loop
        if conn.local_port in protected or conn.remote_port in protected:
            continue  # accepted by a pre-existing server, or a store client
        else:
            chosen.add(conn.inode)
    return chosen


def _listen_ports() -> set[int]:
    return {c.local_port for c in _tcp_connections(_socket_inodes()).values() if c.listening}


def _record(group_name: str, inodes: set[int]) -> None:
    with _lock:
        alive = set(_socket_inodes())
        for name in list(_groups):
            _groups[name] &= alive
            if not _groups[name]:
                del _groups[name]
        if inodes:
            _groups[group_name] = set(inodes)


def _tracking(factory: Any) -> Any:
    """A tracking factory around ``factory``; it only passes calls through unless it is the one installed."""

    @functools.wraps(factory)
    def create_group(*args: Any, **kwargs: Any) -> Any:
        if not _installs or _patched is not create_group:  # left inside someone else's wrapper
            return factory(*args, **kwargs)
        before = _socket_inodes()
        before_listen = _listen_ports()
        token = id(before)
        with _lock:
            if _refusing:
                raise RuntimeError(
                    "no process group is created while an abort is in progress: a restart "
                    "of this rank follows"
                )
            _creating[token] = set(before)
        try:
            result = factory(*args, **kwargs)
            name = _record_new_group(result, before, before_listen)
        finally:
            with _lock:
                del _creating[token]
                _creations_ended.notify_all()
        try:
            _advise(factory, args, kwargs, name)
        except Exception:  # nor may the advice
            log.exception("could not read the timeout of a new process group")
        return result

    return create_group


def _record_new_group(result: Any, before: dict[int, int], before_listen: set[int]) -> str:
    """Record the sockets of the group ``result`` that a creation made; its name. Done
    before the creation counts as ended, so that an abort waiting for it finds them."""
    name = "?"
    try:
        pg = result[0] if isinstance(result, tuple) else result
        name = str(getattr(pg, "group_name", None) or f"unnamed-{id(pg)}")
        _record(name, _new_group_sockets(before, before_listen))
    except Exception:  # tracking must never break group creation
        log.exception("could not record the sockets of a new process group")
    return name


def _advise(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> None:
    """The warning of ``tracking(advise_below=...)`` for a group made by
    ``factory(*args, **kwargs)``, said once per process; nothing where its arguments do not
    say a gloo backend and a timeout. A backend not named (``undefined``) is gloo's on a
    CPU and beside NCCL's on a GPU: gloo is in it."""
    global _advised
    if _advised or not _advice:  # read without the lock: the test-and-set below decides
        return
    try:
        given = inspect.signature(factory).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return  # a factory of another shape: nothing to read
    timeout, backend = given.get("timeout"), str(given.get("backend", "")).lower()
    if ("gloo" not in backend and backend != "undefined") or not isinstance(timeout, timedelta):
        return
    with _lock:
        limit = min(_advice, default=None)
        if _advised or limit is None or timeout.total_seconds() < limit:
            return
        _advised = True
    log.warning(
        "gloo group %s has a %.0f s timeout, not shorter than the Wrapper's hard_timeout "
        "(%.0f s): a rank that gloo keeps in a collective after an abort (docs/abort.md, "
        "Limits) is then ended at the hard timeout instead of restarting in-process; pass "
        "timeout= to init_process_group and new_group",
        name, timeout.total_seconds(), limit,
    )  # fmt: skip


def _group_factory_module() -> Any:
    """torch's ``distributed_c10d`` when groups can be tracked here, else None (logged)."""
    if not os.path.isdir(_PROC_FD):
        log.warning("no %s: gloo collectives cannot be interrupted on this platform", _PROC_FD)
        return None
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return None
    if getattr(c10d, _FACTORY, None) is None:
        log.warning(
            "torch.distributed has no %s (torch %s): gloo collectives cannot be interrupted by abort",
            _FACTORY,
            getattr(__import__("torch"), "__version__", "?"),
        )
        return None
    return c10d


def install() -> bool:
    """Start recording the sockets of process groups created from now on.

    Wraps torch's group factory ``distributed_c10d._new_process_group_helper``.
    Calls nest: each successful ``install`` must be matched by one
    ``uninstall``, and the original factory comes back with the last one.
    Returns whether recording is active (it needs Linux /proc and the factory).
    """
    global _installs, _patched, _original
    with _lock:
        if _installs:
            _installs += 1
            return True
        c10d = _group_factory_module()
        if c10d is None:
            return False
        global _opened_before
        _opened_before = set(_socket_inodes())  # as ``mark_user_code`` (the lock is held)
        factory = getattr(c10d, _FACTORY)
        if factory is not _patched:  # ours is in place only if a restore was skipped, then undone
            _original, _patched = factory, _tracking(factory)
            setattr(c10d, _FACTORY, _patched)
        _installs = 1
        return True


def uninstall() -> None:
    """Undo one ``install``; the last one puts back the factory the first one wrapped.

    Only when torch's factory is still our tracking factory: if something
    replaced it after us (typically a wrapper around ours), restoring would
    drop theirs, so it is left as it is (a warning is logged) and our factory
    inside it stops recording and only passes calls through.
    """
    global _installs, _patched, _original
    with _lock:
        if _installs == 0:
            return
        _installs -= 1
        if _installs:
            return
        _close_held()
        from torch.distributed import distributed_c10d as c10d

        if getattr(c10d, _FACTORY, None) is _patched:
            setattr(c10d, _FACTORY, _original)
            _patched = _original = None
        else:  # someone wrapped it again after us: unwrapping would drop their wrapper
            log.warning("torch's %s was replaced meanwhile: left as it is", _FACTORY)


def installed() -> bool:
    """Whether group creations are recorded now."""
    with _lock:
        return _installs > 0


@contextlib.contextmanager
def tracking(advise_below: float | None = None) -> Iterator[bool]:
    """Record the sockets of groups created inside the block; yields whether recording works.

    With ``advise_below`` (the Wrapper passes its hard timeout), a gloo group created inside
    the block with a timeout of that many seconds or more is named in one warning per
    process: a rank that gloo keeps in a collective after an abort (docs/abort.md, Limits)
    returns only at its group's timeout, and a longer one means the rank is replaced
    instead of restarted in-process. Blocks nest; the shortest advice of those open counts.
    """
    active = install()
    try:
        with _advising(advise_below if active else None):
            yield active
    finally:
        if active:
            uninstall()


@contextlib.contextmanager
def _advising(seconds: float | None) -> Iterator[None]:
    """Hold the advice ``seconds`` (None: none) for the block (``tracking``)."""
    if seconds is None:
        yield
        return
    with _lock:
        _advice.append(seconds)
    try:
        yield
    finally:
        with _lock:
            _advice.remove(seconds)


def mark_user_code() -> None:
    """User code starts now: the store clients open now are never shut down by an abort
    (the Wrapper's own; ``install`` marks its start too)."""
    global _opened_before
    opened = set(_socket_inodes())
    with _lock:
        _opened_before = opened


def creating() -> bool:
    """Whether a process group is being created now (while recording)."""
    with _lock:
        return bool(_creating)


def await_creations(timeout: float = CREATION_GRACE_S) -> bool:
    """Wait up to ``timeout`` seconds for the group creations in flight to end; whether none
    is left.

    A creation whose peers are all in theirs completes within moments; cut halfway, it
    leaves those peers waiting for a connection it will never make, which no abort of
    theirs can end (gloo waits for it on a condition, several times the group's timeout).
    So an abort lets it end first: its group is then recorded and aborted as any other.
    Only a creation still waiting after ``timeout`` (for a peer that died, was restarted
    or is slow to enter its own) is cut (``shutdown_sockets``). From this call until
    ``allow_creations`` no new creation starts (it raises ``RuntimeError``): torch's
    ``new_group`` calls follow each other at once, and one begun while the abort runs
    would be cut halfway. Each call must be matched by one ``allow_creations`` (aborts
    that overlap count).
    """
    global _refusing
    with _creations_ended:
        _refusing += 1
        return _creations_ended.wait_for(lambda: not _creating, timeout)


def allow_creations() -> None:
    """An abort is over: group creations may start again once every abort that called
    ``await_creations`` is."""
    global _refusing
    with _lock:
        _refusing = max(0, _refusing - 1)


def _creation_sockets(starts: list[set[int]]) -> set[int]:
    """The connections a group creation in flight may wait on: store clients opened since
    user code began (torch's rendezvous opens one: its peers' addresses are read there) and
    any other connection opened since a creation began (gloo's, while they connect). Never
    a listener, a connection a server of this process accepted on a protected port, or a
    store client that was open before (the Wrapper's own)."""
    protected = _protected()
    chosen: set[int] = set()
    for conn in _tcp_connections(_socket_inodes()).values():
        if conn.listening or conn.local_port in protected:
            continue
        if conn.remote_port in protected:
            if conn.inode not in _opened_before:
                chosen.add(conn.inode)
        elif any(conn.inode not in before for before in starts):
            chosen.add(conn.inode)
    return chosen


def tracked_groups() -> dict[str, set[int]]:
    """Recorded socket inodes per group name (a copy; for diagnostics and tests)."""
    with _lock:
        return {name: set(inodes) for name, inodes in _groups.items()}


def shutdown_sockets(group_names: Iterable[str] | None = None) -> int:
    """Shut down the recorded connections of the named groups (all when None).

    With None, also those a group creation in flight waits on (``_creation_sockets``):
    ``init_process_group`` waiting in its rendezvous for a rank that died returns too.
    Safe to call from any thread while another thread is blocked on those
    sockets. Returns the number of sockets shut down. Records are dropped.

    gloo fails the operations waiting on a connection when a read on it fails,
    but not a send that is queued because its write failed: that one waits for
    the group's timeout. A write fails once the peer's socket is closed, or shut
    down in both directions (it answers with a reset), so only reads are shut
    down: gloo sees end-of-file, fails the connection and closes its descriptor,
    and a duplicate of each socket is held open until ``release_held`` (the
    Wrapper calls it when the next round starts, by when every peer has run its
    own abort; the last ``uninstall`` too), so that the peers' writes still
    succeed meanwhile. A peer that never aborts is therefore not woken by this
    one: it waits until the release, or its timeout.
    """
    with _lock:
        names = list(_groups) if group_names is None else [n for n in group_names if n in _groups]
        wanted: set[int] = set()
        for name in names:
            wanted |= _groups.pop(name)
        starts = list(_creating.values()) if group_names is None else []
    if starts:
        wanted |= _creation_sockets(starts)
    held: list[socket.socket] = []
    for inode, fd in _socket_inodes().items():
        sock = _hold(inode, fd) if inode in wanted else None
        if sock is not None:
            held.append(sock)
    count = sum(_shutdown_reads(sock) for sock in held)
    with _lock:
        _held.extend(held)
        if not _installs:  # tracking ended meanwhile: nobody would release them
            _close_held()
    return count


def release_held() -> None:
    """Close the sockets ``shutdown_sockets`` kept open: once every peer has aborted."""
    with _lock:
        _close_held()


def _close_held() -> None:
    """``release_held`` with the lock held."""
    for sock in _held:
        sock.close()
    _held.clear()


def _hold(inode: int, fd: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it still is socket ``inode``, else None."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None  # closed since the listing
    if os.fstat(dup).st_ino != inode:
        os.close(dup)  # the descriptor was reused for another socket meanwhile
        return None
    return socket.socket(fileno=dup)


def _shutdown_reads(sock: socket.socket) -> bool:
    """End the socket's reads (the peer is told nothing); False when not connected."""
    try:
        sock.shutdown(socket.SHUT_RD)
        return True
    except OSError:
        return False  # not connected (any more): nothing to interrupt


__all__ = [
    "CREATION_GRACE_S",
    "allow_creations",
    "await_creations",
    "creating",
    "install",
    "installed",
    "mark_user_code",
    "protect_port",
    "release_held",
    "shutdown_sockets",
    "tracked_groups",
    "tracking",
    "uninstall",
]
