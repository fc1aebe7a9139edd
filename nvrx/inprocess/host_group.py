"""Which monitor process leads a host's ranks without a supervisor: one socket, first bind wins.

The monitors of one job's ranks on one host derive one private directory from
the job's store and the host. Each monitor leaves a member file there while it
beats. The monitor that binds the Unix datagram socket there leads; the others
send it their beats (``nvrx.rank_beats``). The leader names itself in
``leader.json`` and touches that file every heartbeat interval: its stamp.

A leader that ends on purpose removes both files: the next beat of each other
monitor finds no socket, and the first to bind a new one leads. A leader that
died leaves its socket behind (a beat to it is refused); one that froze or
blocks still takes beats, but its stamp stands still. Either is replaced under
a lock, after ``replace_after`` seconds, by the first monitor that finds it
so: the socket it left is removed and a new one bound. A replaced leader that
comes back finds another process named in ``leader.json`` and follows. The
last member to leave removes the directory. No torch, no store here.

Where the directory lives, and how a dead member is told from a live one:
``host_group_dir``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nvrx.atomic_file import replace_file
from nvrx.inprocess.host_group_dir import (
    LEADER,
    MEMBER,
    SOCKET,
    group_locked,
    mark_held,
    members,
    remove_abandoned,
    remove_group,
)
from nvrx.rank_beats import Beat, BeatSender, BeatSocket

log = logging.getLogger(__name__)


def _listening(path: str) -> bool:
    """Whether a socket is bound and open at ``path`` (nothing is sent to it)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` of this host is stopped (SIGSTOP, a debugger): frozen for sure."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] in ("T", "t")


@dataclass(frozen=True)
class Leader:
    """What ``leader.json`` says: the leading monitor and the rank it watches."""

    monitor_pid: int
    initial_rank: int
    rank_pid: int


@dataclass
class Stale:
    """A leader replaced: ``gone`` (its socket refuses: it died) or ``still`` (its stamp
    stood still); ``leader``: the one seen alive, None where unknown or it ended on purpose."""

    why: str
    leader: Leader | None
    stamp: int | None = None  # the stamp that stood still
    silent_s: float = 0.0
    stopped: bool = False  # its monitor process is stopped: frozen, not blocked


class HostGroup:
    """One monitor's place in its host's group: leader (``leading``) or follower. A leader
    whose stamp stood still for ``replace_after`` seconds is replaced."""

    def __init__(self, directory: Path, own: Leader, replace_after: float) -> None:
        self.dir, self.own, self.replace_after = directory, own, replace_after
        self.socket_path = str(directory / SOCKET)
        # a lost beat is told by what follows: a new leader, or the stale one replaced
        self.sender = BeatSender(self.socket_path, "the host's leading monitor", logging.INFO)
        self.socket: BeatSocket | None = None
        self._inode = 0
        self._stamp: tuple[int | None, float] = (None, time.monotonic())
        self._seen_alive: Leader | None = None  # the last leader whose stamp moved
        self._member: int | None = None  # the member file's descriptor
        self._member_locked = False  # it holds the file's lock (as a live member does)

    @property
    def leading(self) -> bool:
        return self.socket is not None

    @property
    def identity(self) -> str:
        """This directory, as no other group's: two private ``/dev/shm`` of one host differ."""
        info = os.stat(self.dir)
        return f"{self.dir.name}-{info.st_dev}-{info.st_ino}"

    # -- joining and leaving ------------------------------------------------------------
    def join(self) -> bool:
        """Become a member; lead if nobody does. Whether this monitor leads. Then the
        directories of groups whose members all died go."""
        with group_locked(self.dir, create=True):
            mark_held(self.dir)
            self._hold_member()
            leads = self._bind()
        remove_abandoned(self.dir.parent, keep=self.dir)
        return leads

    def _hold_member(self) -> None:
        path = self.dir / f"{MEMBER}{self.own.initial_rank}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._member_locked = True
        except BlockingIOError:  # another live monitor of this rank: the file stays its own
            log.warning("another monitor of rank %s is in this host's group", self.own.initial_rank)
        except BaseException:
            os.close(fd)
            raise
        self._member = fd

    def _release_member(self, unlink: bool = True) -> None:
        if unlink and self._member_locked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / f"{MEMBER}{self.own.initial_rank}")
        if self._member is not None:
            os.close(self._member)
        self._member, self._member_locked = None, False

    def leave(self) -> bool:
        """Stop being a member (a leader steps down first). Once no live member is left, the
        directory goes, and with it those of groups on this host whose members all died (a
        crashed node's, where nobody else would join again). Whether this was the last member and every other one left on purpose
        (none was killed, or failed): then nobody is to find the host silent. Never raises."""
        try:
            with group_locked(self.dir):
                self.step_down()
                self._release_member()
                live, dead = members(self.dir)
                if live:
                    return False
                remove_group(self.dir)
            remove_abandoned(self.dir.parent, keep=self.dir)
            return dead == 0
        except OSError as exc:  # the directory went with the last member meanwhile
            log.info("leaving the host's group: %r", exc)
            return False
        finally:
            self._release_member(unlink=False)  # (where the group's lock could not be taken)

    # -- leading ------------------------------------------------------------------------
    def _bind(self) -> bool:
        try:
            sock = BeatSocket(self.socket_path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return False
        try:
            inode = os.stat(self.socket_path).st_ino
            replace_file(self.dir / LEADER, json.dumps(asdict(self.own)), make_parents=False)
        except OSError:  # a full /dev/shm, say: no half leader
            sock.close(unlink=True)
            raise
        self.socket, self._inode = sock, inode
        log.info("leading the heartbeats of this host's ranks (%s)", self.dir)
        return True

    @property
    def fileno(self) -> int | None:
        """The leader's socket, to wait on; None while following."""
        return None if self.socket is None else self.socket.fileno()

    def still_leading(self) -> bool:
        """Whether this leader still leads: a leader that was replaced follows."""
        if self.socket is None:
            return False
        try:
            ours = os.stat(self.socket_path).st_ino == self._inode
        except FileNotFoundError:
            ours = False
        if ours and self.leader() == self.own:
            return True
        log.warning("another monitor leads this host's heartbeats now: following it")
        self.socket.close(unlink=False)
        self.socket = None
        return False

    def touch(self) -> None:
        """The leader's stamp: it is alive, leads, and reached the store."""
        try:
            os.utime(self.dir / LEADER)
        except OSError as exc:
            log.warning("could not stamp %s: %r", self.dir / LEADER, exc)

    def step_down(self) -> None:
        """Leave the lead to the others on purpose: they take it at their next beat."""
        if self.socket is None or not self.still_leading():
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir / LEADER)
        self.socket.close(unlink=True)
        self.socket = None
        log.info("stepped down from leading this host's heartbeats")

    def abandon(self) -> None:
        """Stop leading as if this monitor had died: its rank, named in ``leader.json``, is
        taken out by the monitor that leads next."""
        if self.socket is not None and self.still_leading():
            self.socket.close(unlink=True)
            self.socket = None

    # -- following ----------------------------------------------------------------------
    def leader(self) -> Leader | None:
        """The leader ``leader.json`` names; None while there is none."""
        try:
            return Leader(**json.loads((self.dir / LEADER).read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def _read_stamp(self) -> int | None:
        try:
            return os.stat(self.dir / LEADER).st_mtime_ns
        except FileNotFoundError:
            return None

    def send(self, beat: Beat, now: float) -> Stale | None:
        """Send ``beat`` to the leader; what is wrong with the leader, if anything. A leader
        gone is named only when this monitor saw it stamp: files left by an earlier run of
        the job name a process that was never this job's."""
        if not self.sender.send(beat) and self.sender.listener_gone:
            named = self.leader()
            return Stale("gone", named if named == self._seen_alive else None)
        stamp = self._read_stamp()  # sent, or its queue is full: does it still stamp?
        if stamp != self._stamp[0]:
            if stamp is not None and self._stamp[0] is not None:
                self._seen_alive = self.leader()
            self._stamp = (stamp, now)
            return None
        silent = now - self._stamp[1]
        if stamp is None or silent <= self.replace_after:
            return None
        leader = self.leader()
        stopped = leader is not None and _stopped(leader.monitor_pid)
        return Stale("still", leader, stamp, silent, stopped)

    def replace(self, stale: Stale) -> bool:
        """Lead in place of the ``stale`` leader, unless it was replaced or came back
        meanwhile; whether this monitor leads now. Never raises: a directory gone, or full,
        leaves the lead to others."""
        try:
            with group_locked(self.dir):
                if stale.why == "still":
                    if self.leader() != stale.leader or self._read_stamp() != stale.stamp:
                        return False  # replaced, or stamped again, meanwhile
                elif _listening(self.socket_path):
                    return False  # a new leader listens there already
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
                return self._bind()
        except OSError as exc:  # the group's last member removed it, or /dev/shm is full
            log.info("could not take the lead of this host's heartbeats: %r", exc)
            return False

    def close(self) -> None:
        """Close what this member holds open. One that did not leave counts as killed from
        now on: its member file stays, unlocked."""
        self._release_member(unlink=False)
        if self.socket is not None:  # left behind as a dead leader's is: beats to it fail
            self.socket.close(unlink=False)
            self.socket = None
        self.sender.close()
