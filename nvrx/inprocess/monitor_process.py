"""Per-rank monitor process: hangs, dead ranks, unresponsive peers.

Started by the Wrapper as a fresh interpreter (``python -m
nvrx.inprocess.monitor_process``, its own session; never a fork of the
threaded training process), it reads the rank's ``ProgressBoard`` and acts:

* soft timeout (no progress for ``soft_timeout`` in user code): dump the
  rank's stack (faulthandler, through a pipe), record a ``hang_soft`` fault so
  every rank restarts;
* hard timeout: record ``hang_hard``, SIGCONT+SIGTERM, wait
  ``termination_grace_time``, SIGKILL; then leave the round on the rank's behalf;
* the rank's process died (pidfd, no polling): leave the round on its behalf;
* heartbeats: one counter per rank per round; the next rank's counter that
  stops moving for ``heartbeat_timeout`` is declared unresponsive.

The Wrapper stops it by setting the board's shutdown flag and closing its stdin.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGRTMIN + 6
ALIVE_KEY = "nvrx/alive"  # nvrx.store.keys.ALIVE (not imported here: this module starts light)


@dataclass
class MonitorConfig:
    target_pid: int
    board_path: str
    initial_rank: int
    monitor_process_interval: float
    heartbeat_interval: float
    heartbeat_timeout: float
    soft_timeout: float
    hard_timeout: float
    termination_grace_time: float
    logfile: str | None
    store_host: str | None = None
    store_port: int | None = None
    store_factory: str | None = None  # base64 pickle of (factory, kwargs) for a custom store
    stack_fd: int | None = None
    events_dir: str | None = None
    events_context: dict | None = None
    initial_world_size: int = 1
    host_store: bool = False  # start the store service here, so it outlives the rank
    keeper_timeout: float = 600.0  # how long a store host waits for the others after its rank died


class MonitorProcess:
    """Wrapper-side handle of the monitor process: explicit start, stop, reap."""

    def __init__(self, config: MonitorConfig, stack_read_fd: int | None) -> None:
        self.config = config
        self._stack_read_fd = stack_read_fd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cfg = dict(asdict(self.config))
        fds: tuple[int, ...] = ()
        if self._stack_read_fd is not None:
            cfg["stack_fd"] = self._stack_read_fd
            fds = (self._stack_read_fd,)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from nvrx.inprocess.monitor_process import main; sys.exit(main())",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if self.config.logfile is None else None,
            pass_fds=fds,
            start_new_session=True,
            env=dict(os.environ),
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cfg) + "\n").encode())
        self.proc.stdin.flush()
        if self._stack_read_fd is not None:
            os.close(self._stack_read_fd)
            self._stack_read_fd = None

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the monitor process is connected and watching; returns its ready message."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"monitor process {self.proc.pid} not ready within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(5)
            raise RuntimeError(
                f"monitor process exited with {code} before it was ready"
                f" (see monitor_process_logfile {self.config.logfile})"
            )
        return json.loads(line)

    def stop(self, timeout: float = 5.0) -> int | None:
        """Ask it to exit (board flag set by the caller, stdin closed), then reap; kill its group if stuck."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.returncode not in (0, None):
            log.warning("monitor process exited with %s", proc.returncode)
        return proc.returncode


# -- the monitor process itself --------------------------------------------------------


class _Monitor:
    def __init__(self, cfg: MonitorConfig) -> None:
        from nvrx import events
        from nvrx.inprocess.progress_watchdog import ProgressBoard

        self.cfg = cfg
        self.board = ProgressBoard(cfg.board_path)
        self.service: Any = None
        if cfg.host_store:
            from nvrx.store.service import StoreService

            self.service = StoreService(
                cfg.store_host or "127.0.0.1", int(cfg.store_port or 0), node=None
            ).start()
            cfg.store_port = self.service.port
        self.base = self._connect()
        self.writer = events.EventWriter(
            cfg.events_dir or events.job_log_dir(),
            "monitor",
            cfg.events_context or events.context_from_env(),
        )
        self.round = -1
        self.store: Any = None
        self.soft_fired = False
        self.hb_count = 0
        self.next_hb = 0.0
        self.peer: int | None = None
        self.peer_value: int | None = None
        self.peer_changed = 0.0

    def _connect(self) -> Any:
        if self.cfg.store_factory:
            factory, kwargs = pickle.loads(base64.b64decode(self.cfg.store_factory))
            return factory(**kwargs)
        from nvrx.store import client

        return client.connect(
            self.cfg.store_host or "127.0.0.1", int(self.cfg.store_port or 0), timeout=60
        )

    # helpers -----------------------------------------------------------------------
    def _sync_round(self, info: dict[str, float]) -> None:
        from nvrx.inprocess import store as rstore

        round_ = int(info["round"])
        if round_ == self.round or round_ < 0:
            return
        self.round = round_
        self.store = rstore.round_store(self.base, round_)
        self.soft_fired = False
        self.writer.update(round=round_, rank=int(info["rank"]) if info["rank"] >= 0 else None)
        ws, rank = int(info["world_size"]), int(info["rank"])
        self.peer = (rank + 1) % ws if ws > 1 and rank >= 0 else None
        self.peer_value = None
        self.peer_changed = time.monotonic()

    def _stack(self) -> str:
        """Stack of every thread of the rank, dumped by faulthandler into our pipe."""
        fd = self.cfg.stack_fd
        if fd is None:
            return ""
        with contextlib.suppress(OSError):
            while select.select([fd], [], [], 0)[0]:  # drop leftovers of an earlier dump
                if not os.read(fd, 65536):
                    break
        try:
            os.kill(self.cfg.target_pid, STACK_SIGNAL)
        except ProcessLookupError:
            return ""
        chunks: list[bytes] = []
        deadline = time.monotonic() + 2.0
        while True:
            wait = 0.2 if chunks else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                break
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode(errors="replace")

    def _record(self, kind: str, message: str, rank: int | None = None) -> Any:
        from nvrx.store.faults import FaultRecord

        return FaultRecord(rank=self.rank if rank is None else rank, kind=kind, message=message)

    @property
    def rank(self) -> int:
        return int(self.board.read()["rank"])

    def _leave(self, rank: int, world_size: int, record: Any) -> None:
        from nvrx.inprocess import store as rstore

        if self.store is None:
            log.error("rank %s left before its first round: nothing to register", rank)
            return
        log.info("leaving round %d on behalf of rank %s (%s)", self.round, rank, record.kind)
        self.writer.emit(
            "fault",
            fault_kind=record.kind,
            origin_rank=rank,
            message=record.message,
            signature=record.kind,
            detected_mono=record.detected_mono,
        )
        rstore.proxy_leave(self.store, self.base, rank, world_size, record)
        if rank == int(self.board.read()["rank"]):
            from nvrx.store import barrier as nvrx_barrier

            nvrx_barrier.arrive(
                self.base,
                self.termination_barrier,
                self.cfg.initial_rank,
                self.cfg.initial_world_size,
                reentrant=True,
            )

    @property
    def termination_barrier(self) -> str:
        from nvrx.store import keys

        return f"{keys.ROOT}g{self.board.generation()}/termination"

    def _keep_store(self) -> None:
        """The rank died but hosts the store: serve until every rank passed the termination barrier."""
        if self.service is None:
            return
        from nvrx.store import barrier as nvrx_barrier

        log.info("rank gone; keeping the store until the other ranks finish")
        try:
            nvrx_barrier.wait(
                self.base,
                self.termination_barrier,
                self.cfg.initial_world_size,
                self.cfg.keeper_timeout,
            )
        except Exception as exc:
            log.warning("stopping the store without the termination barrier: %r", exc)

    def _terminate_target(self, pidfd: int | None) -> None:
        pid = self.cfg.target_pid
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if pidfd is not None and select.select([pidfd], [], [], self.cfg.termination_grace_time)[0]:
            return
        while _alive(pid):
            for sig in (signal.SIGCONT, signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if pidfd is None or select.select([pidfd], [], [], 1.0)[0]:
                break

    def _heartbeat(self, now: float, info: dict[str, float]) -> None:
        if self.store is None or now < self.next_hb:
            return
        self.next_hb = now + self.cfg.heartbeat_interval
        rank = int(info["rank"])
        if rank >= 0:
            self.store.add(f"hb/{rank}", 1)
            self.base.add(ALIVE_KEY, 1)
        if self.peer is None:
            return
        value = int(self.store.add(f"hb/{self.peer}", 0))
        if value == 0 or value != self.peer_value:  # judged only once it has started beating
            self.peer_value, self.peer_changed = value, now
            return
        if now - self.peer_changed > self.cfg.heartbeat_timeout:
            peer, ws = self.peer, int(info["world_size"])
            from nvrx.inprocess import store as rstore

            if not rstore.terminated_ranks(self.store) & {peer}:
                log.warning(
                    "rank %s sent no heartbeat for %.1f s: unresponsive",
                    peer,
                    now - self.peer_changed,
                )
                self._leave(
                    peer,
                    ws,
                    self._record(
                        "unresponsive", f"no heartbeat for {now - self.peer_changed:.1f} s", peer
                    ),
                )
            nxt = (peer + 1) % ws
            self.peer = None if nxt == rank else nxt
            self.peer_value, self.peer_changed = None, now

    # main loop -------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        try:
            pidfd: int | None = os.pidfd_open(cfg.target_pid)
        except (OSError, AttributeError):
            pidfd = None
        poller = select.poll()
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
        stdin_open = True
        sys.stdout.write(
            json.dumps({"ready": True, "pid": os.getpid(), "port": cfg.store_port}) + "\n"
        )
        sys.stdout.flush()
        try:
            self._watch(pidfd, poller, stdin_open)
        finally:
            if self.service is not None:
                self.service.stop()
            if not _alive(cfg.target_pid):  # the rank cannot remove its board any more
                with contextlib.suppress(OSError):
                    os.unlink(cfg.board_path)
        return 0

    def _watch(self, pidfd: int | None, poller: Any, stdin_open: bool) -> None:
        from nvrx.inprocess.progress_watchdog import FLAG_SHUTDOWN, FLAG_TIMEOUTS_OFF, FLAG_USER

        cfg = self.cfg
        while True:
            events = poller.poll(cfg.monitor_process_interval * 1000)
            info = self.board.read()
            if int(info["flags"]) & FLAG_SHUTDOWN:
                return
            self._sync_round(info)
            for fd, _mask in events:
                if fd == sys.stdin.fileno() and stdin_open:
                    if not os.read(fd, 4096):
                        poller.unregister(fd)
                        stdin_open = False
            dead = (pidfd is not None and any(fd == pidfd for fd, _ in events)) or not _alive(
                cfg.target_pid
            )
            if dead or (not stdin_open and not _alive(cfg.target_pid)):
                info = self.board.read()
                if int(info["flags"]) & FLAG_SHUTDOWN:
                    return
                log.warning("rank process %s died", cfg.target_pid)
                self._leave(
                    int(info["rank"]),
                    int(info["world_size"]),
                    self._record("dead", f"process {cfg.target_pid} died"),
                )
                self._keep_store()
                return
            now = time.monotonic()
            self._heartbeat(now, info)
            flags = int(info["flags"])
            if not flags & FLAG_USER or flags & FLAG_TIMEOUTS_OFF:
                continue
            last = info["auto"] if info["manual"] <= 0 else min(info["auto"], info["manual"])
            stale = now - last
            log.debug("round %d: %.2f s since the last progress", self.round, stale)
            if stale > cfg.hard_timeout and self.soft_fired:  # escalate: never hard before soft
                stack = self._stack()
                self.writer.emit("hang", timeout="hard", stack=stack, stale_s=stale)
                log.error("rank %s made no progress for %.1f s: terminating it", self.rank, stale)
                rank, ws = int(info["rank"]), int(info["world_size"])
                record = self._record(
                    "hang_hard",
                    f"no progress for {stale:.1f} s (hard timeout {cfg.hard_timeout:g} s)",
                )
                from nvrx.inprocess import store as rstore

                register = self.store
                if register is not None:
                    rstore.register_terminated(register, rank)
                self._terminate_target(pidfd)
                self._leave(rank, ws, record)
                self._keep_store()
                return
            if stale > cfg.soft_timeout and not self.soft_fired:
                self.soft_fired = True
                stack = self._stack()
                self.writer.emit("hang", timeout="soft", stack=stack, stale_s=stale)
                log.warning("rank %s made no progress for %.1f s: soft timeout", self.rank, stale)
                if self.store is not None:
                    from nvrx.inprocess import store as rstore

                    record = self._record(
                        "hang_soft",
                        f"no progress for {stale:.1f} s (soft timeout {cfg.soft_timeout:g} s)",
                    )
                    rstore.record_fault(self.store, record)
                    self.writer.emit(
                        "fault",
                        fault_kind="hang_soft",
                        origin_rank=self.rank,
                        message=record.message,
                        signature="hang_soft",
                        detected_mono=record.detected_mono,
                        traceback=stack,
                    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> int:
    from nvrx.inprocess.logging import setup_monitor_logging

    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    cfg = MonitorConfig(**json.loads(line))
    setup_monitor_logging(cfg.logfile)
    if cfg.logfile is not None:
        import faulthandler

        faulthandler.enable(open(cfg.logfile, "a"))  # noqa: SIM115 - kept open for fatal errors
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return _Monitor(cfg).run()
    except BaseException:
        log.exception("monitor process failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
