"""Supervisor side of the node agent: requests over raw pipes, no threads.

See ``nvrx.node_agent.supervised`` for why the store client lives in a process of its own.
The link holds only raw file descriptors and starts no thread, so a process
that owns one can still ``fork`` safely (``fork_and_monitor``): the child
closes the descriptors and inherits no lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from nvrx import jobenv, processes

from . import node_keys, store_failover

log = logging.getLogger(__name__)

#: Seconds the agent may take past a wait's deadline, once, to write what it already has.
_LAST_LOOK_S = 1.0
#: Seconds allowed for the agent to start (its imports, on a busy node) on top of the store timeout.
_AGENT_START_S = 60.0


def _log_level() -> str:
    """The level this supervisor logs at (``--verbose``: INFO), for its agent to log at too."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


class StoreLinkError(RuntimeError):
    """The store could not be reached through the agent, or was lost."""


class _Deadline:
    """When a wait for the agent ends: ``seconds`` from now, then once a last look of
    ``_LAST_LOOK_S`` more. A node whose processes were all stopped (frozen) past the
    deadline finds the answer at the agent, which writes it only once both run again."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self._last_look = False

    def left(self) -> float:
        """Seconds left (at most 0 once past, the last look included)."""
        left = self.at - time.monotonic()
        if left <= 0 and not self._last_look:
            self._last_look, self.at = True, time.monotonic() + _LAST_LOOK_S
            return _LAST_LOOK_S
        return left


class StoreLink:
    """A running node agent for ``host:port``.

    ``fileno()`` becomes readable when the agent has something to say;
    ``read_events()`` then returns unsolicited messages (a watched key was set,
    or the store was lost) for the caller's main loop.
    """

    def __init__(
        self, host: str | None, port: int | None, timeout: float = 60.0, beats_fd: int | None = None
    ) -> None:
        """``host``/``port`` None: the agent starts without them and waits for ``aim``.
        ``beats_fd``: the socket of the node's rank beats, which the agent reads."""
        self.host, self.port, self.timeout = host, port, timeout
        self.beats_fd = beats_fd
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_agent: int | None = None
        self._from_agent: int | None = None
        self._buffer = b""
        self._events: deque[dict[str, Any]] = deque()
        self._next_id = 0
        self.lost: str | None = None
        self.ready = False
        #: When the last request (or the agent's last beat) that the store answered was sent,
        #: wall clock: it was alive then. A loss of its host counts from there.
        self.answered_wall: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        """Whether the agent process still runs."""
        return self._proc is not None and self._proc.poll() is None

    def fds(self) -> tuple[int, ...]:
        """Descriptors a forked child must close."""
        return tuple(fd for fd in (self._to_agent, self._from_agent) if fd is not None)

    def fileno(self) -> int:
        assert self._from_agent is not None, "store link not started"
        return self._from_agent

    def launch(self) -> StoreLink:
        """Start the agent process; ``wait_ready`` (or the main loop) sees it connect."""
        req_r, req_w = os.pipe2(os.O_CLOEXEC)
        ans_r, ans_w = os.pipe2(os.O_CLOEXEC)
        cmd = [
            sys.executable,
            "-W",
            "ignore::UserWarning",  # torch's "Failed to initialize NumPy" on every start
            "-m",
            "nvrx.node_agent",
            "supervised",
            "-" if self.host is None else self.host,
            "-" if self.port is None else str(self.port),
            f"{self.timeout:g}",
        ]
        passed: tuple[int, ...] = ()
        if self.beats_fd is not None:
            cmd.append(str(self.beats_fd))
            passed = (self.beats_fd,)
        try:
            # dies with the supervisor even when blocked on a store that froze
            self._proc = processes.start(
                cmd, stdin=req_r, stdout=ans_w, die_with_parent=True, pass_fds=passed,
                env={**os.environ, jobenv.AGENT_LOG_LEVEL: _log_level()},
            )  # fmt: skip
        finally:
            os.close(req_r)
            os.close(ans_w)
        self._to_agent, self._from_agent = req_w, ans_r
        return self

    def aim(self, host: str, port: int) -> StoreLink:
        """Give an agent launched without an address the store to connect to."""
        assert self.host is None and self._to_agent is not None, (
            "aim a link launched without an address"
        )
        self.host, self.port = host, port
        line = (json.dumps({"host": host, "port": port}) + "\n").encode()
        try:
            os.write(self._to_agent, line)
        except OSError as exc:
            self._lose(f"node agent is gone ({exc.strerror})")
        return self

    def wait_ready(self) -> None:
        """Block until the agent is connected; raise ``StoreLinkError`` when it cannot connect."""
        deadline = _Deadline(self.timeout + _AGENT_START_S)
        while not self.ready and self.lost is None:
            self._read_line_blocking(deadline, "connect")
        if self.lost is not None:
            raise StoreLinkError(f"cannot use the store at {self.host}:{self.port}: {self.lost}")

    def _lose(self, reason: str) -> None:
        """The link can no longer be used: said once, as a ``lost`` event the main loop acts
        on (fail over, else stop), whichever request or read found it."""
        if self.lost is None:
            self.lost = reason
            self._events.append({"event": "lost", "message": reason})

    # -- reading ------------------------------------------------------------------
    def _fill(self) -> bool:
        """Read what the agent wrote; False at end of file (the agent is gone)."""
        try:
            chunk = os.read(self.fileno(), 65536)
        except BlockingIOError:
            return True
        if not chunk:
            self._lose("node agent exited")
            return False
        self._buffer += chunk
        return True

    def _parse(self) -> list[dict[str, Any]]:
        """Complete lines in the buffer; answers returned, events queued."""
        answers = []
        while b"\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n", 1)
            try:
                message = json.loads(raw)
            except ValueError:
                log.warning("node agent wrote a non-JSON line: %r", raw[:200])
                continue
            event = message.get("event")
            if event == "ready":
                self.ready = True
            elif event == "lost":
                if self.lost is None:  # said once, whoever found it first
                    self.lost = str(message.get("message"))
                    self._answered(message.get("answered_wall"))
                    self._events.append(message)
            elif event is not None:
                self._events.append(message)
            else:
                answers.append(message)
        return answers

    def _read_line_blocking(self, deadline: _Deadline, what: str) -> list[dict[str, Any]]:
        """What the agent wrote by ``deadline``; the store counts as lost once it is past
        with nothing more to read."""
        remaining = deadline.left()
        readable, _, _ = select.select([self.fileno()], [], [], max(remaining, 0.0))
        if readable:
            self._fill()
        elif remaining <= 0:
            self._lose(f"no answer to {what} within the store timeout")
            raise StoreLinkError(f"store at {self.host}:{self.port}: {self.lost}")
        return self._parse()

    @property
    def has_events(self) -> bool:
        """Events already read (e.g. while waiting for an answer): the caller must not block on ``fileno()``."""
        return bool(self._events)

    def read_events(self) -> list[dict[str, Any]]:
        """Drain what the agent wrote (call when ``fileno()`` is readable); the pending events."""
        if self._from_agent is not None:
            readable, _, _ = select.select([self._from_agent], [], [], 0)
            if readable:
                self._fill()
            stray = self._parse()
            if stray:
                log.warning("node agent answers nobody waited for: %s", stray)
        events = list(self._events)
        self._events.clear()
        return events

    # -- requests -----------------------------------------------------------------
    def request(self, op: str, key: str, **fields: Any) -> Any:
        """Run one store operation and return its value; raise ``StoreLinkError`` when it fails."""
        if self.lost is not None or self._to_agent is None:
            raise StoreLinkError(f"store at {self.host}:{self.port} is unavailable: {self.lost}")
        self._next_id += 1
        rid = self._next_id
        line = (json.dumps({"id": rid, "op": op, "key": key, **fields}) + "\n").encode()
        sent_wall = time.time()
        try:
            os.write(self._to_agent, line)
        except OSError as exc:
            self._lose(f"node agent is gone ({exc.strerror})")
            raise StoreLinkError(f"store at {self.host}:{self.port}: {self.lost}") from exc
        deadline = _Deadline(self.timeout)
        while True:
            for answer in self._read_line_blocking(deadline, f"{op} {key!r}"):
                if answer.get("id") == rid:
                    if "error" in answer:
                        raise StoreLinkError(
                            f"store {op} {key!r} at {self.host}:{self.port} failed: {answer['error']}"
                        )
                    self._answered(sent_wall)
                    return answer.get("value")
            if self.lost is not None:
                raise StoreLinkError(
                    f"store at {self.host}:{self.port} was lost during {op} {key!r}: {self.lost}"
                )

    def _answered(self, wall: object) -> None:
        """The store answered something sent at ``wall`` (ignored when not a time)."""
        if isinstance(wall, (int, float)) and not isinstance(wall, bool):
            self.answered_wall = max(self.answered_wall or 0.0, float(wall))

    def add(self, key: str, amount: int = 1) -> int:
        return int(self.request("add", key, amount=amount))

    def set(self, key: str, value: str) -> None:
        self.request("set", key, value=value)

    def append(self, key: str, value: str) -> None:
        self.request("append", key, value=value)

    def get(self, key: str) -> str | None:
        return self.request("get", key)

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if it holds ``expected`` ("": if it is not set); the
        value it holds after (``desired`` when this call set it)."""
        return str(self.request("compare_set", key, expected=expected, desired=desired))

    def watch(self, key: str) -> None:
        """Have ``read_events`` return ``{"event": "key", "key": key, "value": ...}`` once ``key`` is set."""
        self.request("watch", key)

    def start_liveness(
        self, slot: int, nslots: int, interval: float, timeout: float, startup: float, job_dir: str
    ) -> None:
        """Have the agent beat for ``slot`` and watch the next slot in the ring of slots
        (``node_keys.RING``, ``nvrx.node_agent.supervised.NodeDuty``); the job folder holds
        the beats of a slot whose counter another client holds still, in a folder per store."""
        self.request(
            "liveness",
            "node",
            ring=node_keys.RING.prefix,
            slot=slot,
            nslots=nslots,
            interval=interval,
            timeout=timeout,
            startup=startup,
            stamps=str(store_failover.beats_dir(Path(job_dir), f"{self.host}-{self.port}")),
        )

    def leave_ranks(
        self, initial_ranks: list[int], world_size: int, message: str, gone: bool
    ) -> dict[str, Any]:
        """Take a lost node's ranks out of the Wrapper's running round (``rounds.leave_round``)."""
        return self.request(
            "leave_ranks",
            "node",
            initial_ranks=initial_ranks,
            world_size=world_size,
            message=message,
            gone=gone,
        )

    def current_round(self) -> int | None:
        """The round the Wrapper's ranks are in (``rounds.current_round``); None before any."""
        value = self.request("current_round", "round")
        return None if value is None else int(value)

    def leave_silent(self, initial_rank: int, world_size: int, message: str) -> bool:
        """Take the rank of ``initial_rank``, whose monitor stopped beating, out of the running
        round (``rounds.leave_silent``); False when it was out already."""
        return bool(
            self.request(
                "leave_silent", "rank", initial_rank=initial_rank, world_size=world_size,
                message=message,
            )  # fmt: skip
        )

    # -- end ----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop the agent (closing its stdin ends it) and reap it; kill its group if it lingers,
        at once when the store was lost: the agent may be stuck in a request to it, which would
        hold up a failover for ``timeout``."""
        proc, self._proc = self._proc, None
        lost, self.lost = self.lost, self.lost or "closed"
        for fd in self.fds():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._to_agent = self._from_agent = None
        if proc is not None:  # closing its stdin asked it to end
            processes.stop(proc, ask=None, grace_s=timeout if lost is None else 0.0)

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptors without touching the agent."""
        for fd in self.fds():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._to_agent = self._from_agent = None
        self._proc = None
        self.lost = "not owned by this process"
