"""What runs beside a rank for one Wrapper call: store connections, monitor process, progress watchdog.

Started in this order: the progress board, the monitor process (which starts
the store service when this rank hosts the store, so that the store outlives
the rank; a rank that does not host it first waits for an earlier call's
store at the same address to close), the store connections (one for the main thread, one for the
monitor thread, which blocks in ``wait``), then the progress watchdog.
Stopped in this order (``stop``, then ``close``): the board's shutdown flag
is set, the monitor process is stopped and reaped, the watchdog stopped (and
the stack pipe closed), then the board is closed, the store connections
dropped and the call's event file closed.
"""

from __future__ import annotations

import base64
import dataclasses
import faulthandler
import logging
import os
import pickle
import time
from typing import Any

from nvrx import events, jobenv
from nvrx.node_agent.host import HostConfig, agent_address
from nvrx.node_agent.rank_wire import (
    HostBarrierClient,
    relay_address,
    socket_path,
    supervised_relay_address,
)
from nvrx.store import client as store_client
from nvrx.store import seal

from . import store as rstore
from .logging import monitor_logfile_path
from .monitor_process import STACK_SIGNAL, MonitorConfig, MonitorProcess
from .progress_watchdog import FLAG_SHUTDOWN, ProgressBoard, ProgressWatchdog
from .wrapper_settings import WrapperSettings

log = logging.getLogger(__name__)


class RankServices:
    """The store connections, monitor process, progress board and watchdog of one rank."""

    def __init__(
        self,
        wrapper: WrapperSettings,
        initial_rank: int,
        initial_world_size: int,
        writer: events.EventWriter,
    ) -> None:
        self.wrapper = wrapper
        self.initial_rank = initial_rank
        self.initial_world_size = initial_world_size
        self.writer = writer
        self.board = ProgressBoard()
        self.host_store = False  # this rank's monitor process hosts the store
        self.rank_hosted = False  # some rank's monitor process hosts it, for this call only
        self.store_address: tuple[str, int] | None = None
        self.base_store: Any = None
        self.mt_store: Any = None  # the monitor thread's own connection
        self.monitor: MonitorProcess | None = None
        self.watchdog: ProgressWatchdog | None = None
        self._store_kwargs: dict[str, Any] = {}
        self._stack_fd: int | None = None
        #: The way to the round protocol's barriers: through the host's agent (``_relay``),
        #: else at the store itself.
        self.barriers = HostBarrierClient(None)

    # -- start --------------------------------------------------------------------------
    def start(self) -> None:
        """The job's secret read, the store located (and, for a rank that does not host it,
        an earlier call's store there waited out), then the monitor process and the store
        connections (the watchdog comes later: ``start_watchdog``)."""
        self._read_job_secret()
        self._resolve_store()
        self._await_earlier_store_closed()
        self._start_monitor()
        self._connect_store()

    def _resolve_store(self) -> None:
        """Where the store is, and whether this rank's monitor process hosts it."""
        w = self.wrapper
        kwargs = dict(w.store_kwargs)
        if issubclass(w.store_factory, rstore.TCPStore):
            host, port = rstore.wrapper_address(kwargs)
            host_rank = kwargs.get("tcp_store_host_rank", w.store_factory.TCP_STORE_HOST_RANK)
            self.rank_hosted = store_client.external_store_address() is None and host_rank >= 0
            if self.rank_hosted and host_rank >= self.initial_world_size:
                raise ValueError(
                    f"store_kwargs['tcp_store_host_rank'] is {host_rank}, but the job's ranks are "
                    f"0..{self.initial_world_size - 1} (WORLD_SIZE): no rank would host the "
                    "store. Name one of them, or -1 for an external store"
                )
            self.host_store = self.rank_hosted and host_rank == self.initial_rank
            self.store_address = (host, port)
            kwargs.update(host_name=host, port=port)
        self._store_kwargs = kwargs

    def _await_earlier_store_closed(self) -> None:
        """A store a rank hosts serves one call, and its host closes it once every rank
        ended that call: a rank that does not host it and calls again at once could reach
        that store, about to close. Wait until the store at the address is this call's."""
        if not self.rank_hosted or self.host_store or self.store_address is None:
            return
        from nvrx.store.service import wait_for_store

        host, port = self.store_address
        timeout, start = self.wrapper.seconds.barrier_timeout, time.monotonic()
        while True:
            wait_for_store(host, port, timeout, since=start)
            closed = self._earlier_store_closed(start + timeout - time.monotonic())
            if closed is None:
                return
            if not closed:
                raise TimeoutError(
                    f"the store at {host}:{port} still serves this rank's earlier call of the "
                    f"wrapped function after barrier_timeout ({timeout:g} s): the rank that hosts "
                    "it closes it once every rank ended that call. Let every rank end a call "
                    "before any calls again, or raise barrier_timeout"
                )
            log.info("the earlier call's store at %s:%s closed", host, port)

    def _earlier_store_closed(self, remaining: float) -> bool | None:
        """None: the store at the address is this call's. Otherwise it is the one where this
        rank ended its earlier call: True once it closed, False when it is still open after
        ``remaining`` seconds. The client made here is gone when this returns."""
        from nvrx.store import errors, rounds

        limit = store_client.wait_span(remaining)  # for the connect too
        store = None
        try:
            store = self.wrapper.store_factory(**dict(self._store_kwargs, timeout=limit))
            if not rounds.ended_here(store, self.initial_rank):
                return None
            log.info(
                "the store found is this rank's earlier call's, which its host closes once "
                "every rank ended that call: waiting up to %.1f s for it to close", remaining,
            )  # fmt: skip
            return rounds.await_close(store, remaining)
        except errors.unreachable():
            return True  # it closed while this rank connected or read it
        finally:
            store = None  # not kept by the traceback of anything else raised here

    def _monitor_config(self) -> MonitorConfig:
        w = self.wrapper
        config = MonitorConfig(
            target_pid=os.getpid(),
            board_path=self.board.path,
            initial_rank=self.initial_rank,
            monitor_process_interval=w.seconds.monitor_process_interval,
            heartbeat_interval=w.seconds.heartbeat_interval,
            heartbeat_timeout=w.seconds.heartbeat_timeout,
            soft_timeout=w.seconds.soft_timeout,
            hard_timeout=w.seconds.hard_timeout,
            termination_grace_time=w.seconds.termination_grace_time,
            logfile=monitor_logfile_path(w.monitor_process_logfile, self.initial_rank),
            events_dir=str(self.writer.directory),
            events_context=dict(self.writer.context),
            initial_world_size=self.initial_world_size,
            host_store=self.host_store,
            barrier_timeout=w.seconds.barrier_timeout,
            keeper_timeout=max(w.seconds.barrier_timeout, w.seconds.completion_timeout) * 2,
        )
        if self.store_address is not None:
            config.store_host, config.store_port = self.store_address
        else:
            config.store_factory = base64.b64encode(
                pickle.dumps((w.store_factory, self._store_kwargs))
            ).decode()
        return config

    def _start_monitor(self) -> None:
        w = self.wrapper
        self.monitor = MonitorProcess(self._monitor_config())
        self._stack_fd = self.monitor.start()
        faulthandler.register(STACK_SIGNAL, file=self._stack_fd, all_threads=True, chain=False)
        ready = self.monitor.wait_ready(w.seconds.barrier_timeout)
        if self.host_store and self.store_address is not None:
            self.store_address = (self.store_address[0], int(ready["port"]))
            self._store_kwargs["port"] = self.store_address[1]
        self.barriers = HostBarrierClient(self._relay())
        if w.monitor_process_pidfile is not None and self.monitor.pid is not None:
            path = monitor_logfile_path(w.monitor_process_pidfile, self.initial_rank)
            with open(path, "w") as fh:  # type: ignore[arg-type]
                fh.write(f"{self.monitor.pid}\n")

    def _relay(self) -> str | None:
        """Where this host's agent takes barrier arrivals: the supervisor's node agent, else
        the node agent; None with a store factory of the user's (no agent connects to it)."""
        if self.store_address is None or self.monitor is None:
            return None
        beats = socket_path()
        if beats is not None:
            return supervised_relay_address(beats)
        config = dataclasses.replace(self.monitor.config, store_port=self.store_address[1])
        return relay_address(agent_address(HostConfig.of(config), jobenv.host_id()))

    def check_monitor(self) -> None:
        """Raise ``RuntimeError`` when the monitor process ended while this rank runs: nothing
        watches it any more (a monitor whose link to the store failed ends so)."""
        proc = None if self.monitor is None else self.monitor.proc
        if self.monitor is not None and proc is not None and proc.poll() is not None:
            logfile = self.monitor.config.logfile
            see = f"its log {logfile}" if logfile else "its process_end event"
            raise RuntimeError(
                f"monitor process {proc.pid} exited with {proc.returncode}: this rank is not "
                f"watched (see {see})"
            )

    def _connect_store(self) -> None:
        w = self.wrapper
        if self.store_address is not None and not self.host_store:
            from nvrx.store.service import wait_for_store

            wait_for_store(*self.store_address, w.seconds.barrier_timeout)
        self.base_store = w.store_factory(**self._store_kwargs)
        self._connect_monitor_thread()

    def _connect_monitor_thread(self) -> None:
        """The monitor thread blocks in wait(): it needs a connection of its own."""
        try:
            self.mt_store = self.base_store.clone()
        except (RuntimeError, AttributeError, NotImplementedError):
            self.mt_store = self.wrapper.store_factory(**self._store_kwargs)

    def reconnect_monitor_thread(self, error: BaseException) -> None:
        """The monitor thread's connection failed with ``error``: the next round's thread
        gets a new one (a connection broken once stays broken, and every round's thread
        would fail on it at once). Raises what making it met."""
        log.warning("the monitor thread's store connection failed (%r): making a new one", error)
        self.mt_store = None
        self._connect_monitor_thread()

    @staticmethod
    def _read_job_secret() -> None:
        """Under a supervisor, read the job's secret now, which seals this rank's fault
        records (``seal.job_sealer``): a file that cannot be read fails the start, naming
        it, not the first fault."""
        try:
            seal.job_sealer()
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot read the job's secret (${jobenv.JOB_SECRET_FILE}): {exc}") from exc

    def start_watchdog(self) -> None:
        self.watchdog = ProgressWatchdog(
            self.initial_rank, self.board, self.wrapper.seconds.progress_watchdog_interval
        )
        self.watchdog.start()

    # -- stop ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Tell the monitor process this is a normal end, stop it and the watchdog, close the board."""
        self.board.set_flag(FLAG_SHUTDOWN, True)
        if self.monitor is not None:
            self.monitor.stop()
        if self.watchdog is not None:
            self.watchdog.shutdown(timeout=self.wrapper.seconds.progress_watchdog_interval + 5)
        if self._stack_fd is not None:
            faulthandler.unregister(STACK_SIGNAL)
            os.close(self._stack_fd)
            self._stack_fd = None

    def close(self) -> None:
        """Last step: the board, the store connections and the call's event file go.

        The event file is closed here because its descriptor is a plain int that
        no collector closes: each call of a wrapped function would leak one.
        """
        self.board.close()
        self.base_store = None
        self.mt_store = None
        self.writer.close()
