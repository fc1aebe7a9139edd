"""``RankMonitorClient``: a training rank tells its supervisor that it is alive and where it is.

A script started by ``nvrx-supervise`` (directly or through ``nvrx-srun``)
creates one client, calls ``init_workload_monitoring()``, then either sends
heartbeats (``send_heartbeat()`` once per step, say) or wraps its phases in
sections (``start_section("step")`` ... ``end_section("step")``), or both. The
supervisor checks the timeouts in force; a rank that misses one is declared
hung: its stack goes into a ``hang`` event, then its process group gets the
configured termination signal (SIGKILL after the supervisor's grace period)
and the supervisor's restart policy takes over.

``record_step(seconds)`` (or a ``timed_step()`` block around the step's own work, not
its wait in collectives) gives the supervisor the step times it scores stragglers by.

A section change is one packet on a local socket, sent without waiting unless the channel
is full (the supervisor lags): then it waits for room, ``SEND_WAIT_S`` at most, and past
that changes are held back, the next packet of any kind the rank sends once the supervisor
reads again telling it first the sections open then and for how long (its timers go on
from when they began), then the computed or restored
timeouts and workload-control requests held back too (the latest timeouts only: each
holds them all); nothing is ever answered. Step times
are kept here and sent together at most every ``STEP_PACKET_INTERVAL_S``. Heartbeats are
counted in the rank and sent at most every ``HEARTBEAT_PACKET_INTERVAL_S`` (0.1 s, or
1/50 of the heartbeat timeout when that is shorter), so a loop may call
``send_heartbeat()`` at any rate.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import math
import os
import select
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from nvrx import jobenv

from . import channel
from .config import FaultToleranceConfig
from .data import HeartbeatTimeouts, SectionTimeouts, WorkloadAction, WorkloadControlRequest
from .timeouts import CHECKPOINT_KEY, Observations, Timeouts

log = logging.getLogger("nvrx.fault_tolerance")

#: How long a message may wait for room on the channel: past it, section changes are held
#: back (``_send_section``), and so are timeouts and workload-control requests (``_send``).
SEND_WAIT_S = 5.0
#: Heartbeats closer together than this (or than 1/50 of the heartbeat timeout, if shorter)
#: are counted here but not sent: the supervisor's view lags the rank by less than that.
HEARTBEAT_PACKET_INTERVAL_S = 0.1
#: Step times are sent together, at most this often (and when ``STEP_BATCH`` are kept).
STEP_PACKET_INTERVAL_S, STEP_BATCH = 0.25, 256


class RankMonitorClientError(RuntimeError):
    """The client cannot do what was asked; the message says what to change."""


class RankMonitorClient:
    """The rank's side of launcher-side hang detection (NVRx's ``RankMonitorClient``)."""

    #: The key of ``state_dict()``'s entry, as NVRx names it.
    CURRENT_TIMEOUTS_STATE_KEY = CHECKPOINT_KEY

    def __init__(self) -> None:
        self.cfg: FaultToleranceConfig | None = None
        self.timeouts: Timeouts | None = None  # in force, once monitoring began
        self.dropped_heartbeats = 0
        self.dropped_steps = 0
        self.held_back = 0  # times section changes were held back for a lagging supervisor
        self._restored: Timeouts | None = None  # from load_state_dict() before init
        self._sock: socket.socket | None = None
        self._stack_out: Any = None
        self._obs: Observations | None = None
        self._lost = False
        self._behind = False  # section changes held back while the supervisor lags
        self._unsent: list[tuple[str, bytes]] = []  # (verb, message) held back meanwhile, in order
        self._next_packet = 0.0
        self._packet_interval = HEARTBEAT_PACKET_INTERVAL_S
        self._steps: list[float] = []
        self._next_steps = 0.0
        self._gpu: _GpuTimes | None = None  # timed_step(cuda=True)'s events
        self._timed_section: str | None = None  # $NVRX_STRAGGLER_SECTION: its time is a step's
        self._host_timer = _StepTimer(self, None)

    # -- NVRx's view of the state ---------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        """Monitoring is on (between ``init_workload_monitoring`` and its shutdown)."""
        return self._sock is not None

    @property
    def hb_timeouts(self) -> HeartbeatTimeouts | None:
        """The heartbeat timeouts in force; None before ``init_workload_monitoring``."""
        return self.timeouts.heartbeat_view() if self.timeouts is not None else None

    @property
    def section_timeouts(self) -> SectionTimeouts | None:
        """The section timeouts in force; None before ``init_workload_monitoring``."""
        return self.timeouts.section_view() if self.timeouts is not None else None

    # -- life ---------------------------------------------------------------------------
    def init_workload_monitoring(self) -> None:
        """Connect to this node's supervisor and start being monitored."""
        if self._sock is not None:
            raise RankMonitorClientError("init_workload_monitoring() was called already")
        self._behind, self._unsent = False, []  # what an earlier session held back ended with it
        self._lost = False
        path = os.environ.get(jobenv.FT_SOCKET)
        if not path:
            raise RankMonitorClientError(
                f"init_workload_monitoring: no supervisor to report to (${jobenv.FT_SOCKET} is "
                "not set): start the script with nvrx-supervise or nvrx-srun"
            )
        raw = os.environ.get(jobenv.FT_CONFIG)
        try:
            self.cfg = FaultToleranceConfig.from_json(raw) if raw else FaultToleranceConfig()
        except (TypeError, ValueError) as exc:  # the supervisor's, or one set by hand
            raise RankMonitorClientError(
                f"init_workload_monitoring: ${jobenv.FT_CONFIG} is no valid configuration: {exc}"
            ) from None
        self._timed_section = os.environ.get(jobenv.STRAGGLER_SECTION) or None
        log.setLevel(self.cfg.log_level)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise RankMonitorClientError(
                f"init_workload_monitoring: cannot reach the supervisor at {path}: "
                f"{exc.strerror or exc}"
            ) from None
        read_fd, write_fd = os.pipe()
        self._stack_out = os.fdopen(write_fd, "w")
        faulthandler.register(channel.STACK_SIGNAL, file=self._stack_out, all_threads=True)
        self.timeouts = self._initial_timeouts(self.cfg)
        hello = {
            "local_rank": _env_int(jobenv.supervisor_local_rank_variable()),
            "rank": _env_int("RANK"),
            "attempt": _env_int(jobenv.RESTART_COUNT),
            "pid": os.getpid(),
            "timeouts": self.timeouts.to_dict(),
            "source": "config" if self._restored is None else "restored",
        }
        try:
            socket.send_fds(sock, [channel.encode(channel.INIT, hello)], [read_fd])
        finally:
            os.close(read_fd)
        self._sock = sock
        self._obs = Observations()
        self._next_packet = 0.0
        self._update_packet_interval()
        log.info("workload monitoring started (supervisor socket %s)", path)

    def shutdown_workload_monitoring(self) -> None:
        """Stop being monitored (the supervisor forgets this rank's timeouts). Idempotent.
        What the channel held back (the supervisor lags) gets ``SEND_WAIT_S`` to go out;
        what still does not is named in an error log: it is lost."""
        if self._sock is not None:
            self._flush_steps(time.perf_counter())
            self._last_catch_up()
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.send(channel.encode(channel.SHUTDOWN), socket.MSG_DONTWAIT)
        sock.close()
        faulthandler.unregister(channel.STACK_SIGNAL)
        with contextlib.suppress(OSError):
            self._stack_out.close()
        self._stack_out = None

    # -- heartbeats and sections -----------------------------------------------------
    def send_heartbeat(self) -> None:
        """This rank is alive and progressing."""
        obs = self._monitoring("send_heartbeat")
        now = time.monotonic()
        obs.heartbeat(now)
        if now < self._next_packet:
            return
        self._next_packet = now + self._packet_interval
        if self._behind:
            self._catch_up()
        try:
            self._sock.send(b"h", socket.MSG_DONTWAIT)  # type: ignore[union-attr]
        except BlockingIOError:
            self.dropped_heartbeats += 1  # the supervisor lags; the next one will do
        except OSError as exc:
            self._lose(exc)

    def record_step(self, seconds: float) -> None:
        """One step took ``seconds`` of this rank's own work (not its wait for peers in
        collectives): what straggler scores compare. Cheap enough for every step."""
        if self._sock is None:
            raise RankMonitorClientError("record_step: call init_workload_monitoring() first")
        value = float(seconds)
        if not 0 <= value < math.inf:
            raise ValueError(f"record_step: seconds must be a finite number ≥ 0, got {seconds!r}")
        self._add_step(value, time.perf_counter())

    def _add_step(self, seconds: float, now: float) -> None:
        """Keep one step time; send what is kept when due (``now``: ``time.perf_counter()``)."""
        self._steps.append(seconds)
        if now >= self._next_steps or len(self._steps) >= STEP_BATCH:
            self._flush_steps(now)

    def timed_step(self, cuda: bool = False) -> _StepTimer:
        """A ``with`` block whose time is ``record_step``-ed (wrap the step's compute in it).

        ``cuda``: the time the GPU spends on the block's work, between two CUDA events on
        the current stream, not the host's time (the host only queues kernels). Its time is
        recorded once the GPU has passed the second event, seen at a later step: the step
        never waits for it."""
        if self._sock is None:
            raise RankMonitorClientError("timed_step: call init_workload_monitoring() first")
        if not cuda:
            return self._host_timer  # one for every step: not nested, nothing to allocate
        if self._gpu is None:
            self._gpu = _GpuTimes()
        return _StepTimer(self, self._gpu)

    def _flush_steps(self, now: float) -> None:
        steps, self._steps = self._steps, []
        self._next_steps = now + STEP_PACKET_INTERVAL_S
        if self._behind and self._sock is not None:
            self._catch_up()
        if steps and self._sock is not None:
            try:
                self._sock.send(channel.encode(channel.STEPS, steps), socket.MSG_DONTWAIT)
            except BlockingIOError:
                self.dropped_steps += len(steps)  # the supervisor lags: these are not scored
            except OSError as exc:
                self._lose(exc)

    def start_section(self, section: str) -> None:
        """Section ``section`` begins; its timeout (if any) runs until ``end_section``."""
        obs = self._monitoring("start_section")
        _check_section_name("start_section", section)
        if section in obs.open:
            raise RankMonitorClientError(f"start_section({section!r}): the section is open already")
        obs.section_start(section, time.monotonic())
        self._send_section(channel.encode(channel.SECTION_START, section))

    def end_section(self, section: str) -> None:
        """Section ``section`` ends."""
        obs = self._monitoring("end_section")
        if section not in obs.open:
            raise RankMonitorClientError(f"end_section({section!r}): the section is not open")
        now, began = time.monotonic(), obs.open[section]
        obs.section_end(section, now)
        self._send_section(channel.encode(channel.SECTION_END, section))
        if section == self._timed_section:
            self.record_step(now - began)

    def end_all_sections(self) -> None:
        """Every open section ends."""
        obs = self._monitoring("end_all_sections")
        obs.end_all(time.monotonic())
        self._send_section(channel.encode(channel.END_ALL))

    # -- computed timeouts -------------------------------------------------------------
    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Heartbeat timeouts from what was observed (see ``timeouts``); a collective where
        torch.distributed runs. False (with ``skip_if_not_ready``) before two heartbeats."""
        obs = self._monitoring("calculate_and_set_hb_timeouts")
        values = [obs.first_heartbeat_s, obs.max_heartbeat_gap_s]
        first, gap = _all_max([-1.0 if v is None else v for v in values])
        if first < 0 or gap < 0:
            if skip_if_not_ready:
                return False
            raise RankMonitorClientError(
                "calculate_and_set_hb_timeouts: send at least two heartbeats first (or pass "
                "skip_if_not_ready=True)"
            )
        t, factor = self.timeouts, self.cfg.safety_factor  # type: ignore[union-attr]
        assert t is not None
        t.initial_heartbeat = t.merge("initial_heartbeat", first * factor)
        t.heartbeat = t.merge("heartbeat", gap * factor)
        self._mark_computed("initial_heartbeat", "heartbeat")
        self._update_packet_interval()
        self._send_timeouts(t, "computed")
        return True

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Iterable[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Section timeouts (each selected section; default: the configured ones and those
        any rank observed) and the out-of-section one from what was observed; a collective
        where torch.distributed runs, and ``selected_sections`` must then be the same on
        every rank. False (with ``skip_if_not_ready``) while one was never seen."""
        obs = self._monitoring("calculate_and_set_section_timeouts")
        t, factor = self.timeouts, self.cfg.safety_factor  # type: ignore[union-attr]
        assert t is not None
        if selected_sections is None:  # a section only some ranks open (a save) counts too
            names = _all_names(set(t.sections) | set(obs.max_section_s))
        else:
            names = sorted(set(selected_sections))
        values = [obs.max_section_s.get(n, -1.0) for n in names]
        values.append(-1.0 if obs.max_out_of_section_s is None else obs.max_out_of_section_s)
        maxima = _all_max(values)
        missing = [n for n, v in zip(names, maxima, strict=False) if v < 0]
        if calc_out_of_section and maxima[-1] < 0:
            missing.append("(out of section)")
        if missing:
            if skip_if_not_ready:
                return False
            raise RankMonitorClientError(
                f"calculate_and_set_section_timeouts: never observed yet: {', '.join(missing)} "
                "(or pass skip_if_not_ready=True)"
            )
        for name, value in zip(names, maxima, strict=False):
            t.sections[name] = t.merge(f"section:{name}", value * factor)
            self._mark_computed(f"section:{name}")
        if calc_out_of_section:
            t.out_of_section = t.merge("out_of_section", maxima[-1] * factor)
            self._mark_computed("out_of_section")
        self._send_timeouts(t, "computed")
        return True

    # -- workload control --------------------------------------------------------------
    def send_workload_control_request(self, req: WorkloadControlRequest) -> None:
        """Ask the supervisor to exclude this node or to shut the whole workload down."""
        self._monitoring("send_workload_control_request")
        if not isinstance(req, WorkloadControlRequest) or not isinstance(req.action, WorkloadAction):
            raise RankMonitorClientError(
                f"send_workload_control_request: expected a WorkloadControlRequest, got {req!r}"
            )
        payload = {"action": req.action.name, "description": str(req.description)}
        self._send(channel.encode(channel.CONTROL, payload), channel.CONTROL)

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The computed timeouts in force, to save in the training checkpoint (NVRx's format:
        ``{"current_timeouts": {"heartbeat": ..., "section": ...}}``, each part only once computed)."""
        t = self.timeouts or self._restored
        return t.to_checkpoint() if t is not None else {CHECKPOINT_KEY: {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the saved timeouts in force (now, or at ``init_workload_monitoring``). Takes what
        ``state_dict()`` returned here or under NVRx, and the ``{"timeouts": ...}`` of nvrx < 0.5."""
        restored = _restored_from(state)
        if restored is None:
            return
        if self._sock is None:
            self._restored = restored
            return
        self.timeouts = _overlay(self.timeouts, restored)
        self._update_packet_interval()
        self._send_timeouts(self.timeouts, "restored")

    # -- helpers ---------------------------------------------------------------------------
    def _initial_timeouts(self, cfg: FaultToleranceConfig) -> Timeouts:
        configured = Timeouts(
            initial_heartbeat=cfg.initial_rank_heartbeat_timeout,
            heartbeat=cfg.rank_heartbeat_timeout,
            sections=dict(cfg.rank_section_timeouts),
            out_of_section=cfg.rank_out_of_section_timeout,
        )
        return configured if self._restored is None else _overlay(configured, self._restored)

    def _update_packet_interval(self) -> None:
        limit = self.timeouts.heartbeat if self.timeouts is not None else None
        self._packet_interval = min(HEARTBEAT_PACKET_INTERVAL_S, limit / 50 if limit else HEARTBEAT_PACKET_INTERVAL_S)

    def _mark_computed(self, *names: str) -> None:
        assert self.timeouts is not None
        for name in names:
            if name not in self.timeouts.computed:
                self.timeouts.computed.append(name)

    def _monitoring(self, what: str) -> Observations:
        if self._sock is None or self._obs is None:
            raise RankMonitorClientError(f"{what}: call init_workload_monitoring() first")
        return self._obs

    def _send_section(self, message: bytes) -> None:
        """A section change. While the channel is full it waits for room (``SEND_WAIT_S`` at
        most: the supervisor lags); past that, changes are held back without waiting, and
        the next packet this client sends once the supervisor reads again (of any kind) is
        preceded by the sections open then, with how long each has been (``_catch_up``)."""
        if self._behind:
            self._catch_up()
        elif not self._sent(message) and not self._sent_after_wait(message):
            self._fall_behind()

    def _fall_behind(self) -> None:
        self._behind = True
        self.held_back += 1
        if self.held_back == 1:  # it may lag often: said once
            log.warning(
                "the supervisor read nothing for %.0f s: section changes, timeouts and "
                "requests are held back until it reads again", SEND_WAIT_S,
            )  # fmt: skip

    def _sent_after_wait(self, message: bytes) -> bool:
        """Send once the channel has room, waiting ``SEND_WAIT_S`` at most."""
        return self._room_within(SEND_WAIT_S) and self._sent(message)

    def _room_within(self, seconds: float) -> bool:
        """Whether the channel has room for a packet within ``seconds``."""
        return bool(select.select([], [self._sock], [], seconds)[1])

    def _last_catch_up(self) -> None:
        deadline = time.monotonic() + SEND_WAIT_S
        while self._behind and not self._lost:
            left = deadline - time.monotonic()
            if left <= 0 or not self._room_within(left):
                break
            self._catch_up()
        if self._unsent and not self._lost:
            log.error(
                "the supervisor read nothing for %.0f s as monitoring ended: lost %s",
                SEND_WAIT_S, ", ".join(repr(message[:60]) for _, message in self._unsent),
            )  # fmt: skip
        self._behind, self._unsent = False, []

    def _catch_up(self) -> None:
        """Tell the sections open now, with how long each has been (a timer the supervisor
        started already must not start again), then the messages held back, as far as the
        channel takes them: what it did not take waits for the next packet."""
        obs = self._obs
        assert obs is not None
        now = time.monotonic()
        state = {
            "open": {name: max(0.0, now - began) for name, began in obs.open.items()},
            "outside": None if obs.open or obs.outside_since is None else max(0.0, now - obs.outside_since),
        }
        packets = [channel.encode(channel.SECTIONS_NOW, state)]
        if len(packets[0]) > channel.MAX_MESSAGE:  # too many to tell with their ages: their
            packets = [channel.encode(channel.END_ALL)]  # timers start again, told one by one
            packets += [channel.encode(channel.SECTION_START, name) for name in obs.open]
        if not all(self._sent(packet) for packet in packets):
            return
        while self._unsent:
            if not self._sent(self._unsent[0][1]):
                return
            del self._unsent[0]
        self._behind = False

    def _sent(self, message: bytes) -> bool:
        """Send without waiting: False when the channel is full (a lost socket counts as sent:
        nothing more can be done)."""
        try:
            self._sock.send(message, socket.MSG_DONTWAIT)  # type: ignore[union-attr]
        except BlockingIOError:
            return False
        except OSError as exc:
            self._lose(exc)
        return True

    def _send(self, message: bytes, kind: str) -> None:
        """Send a message that must arrive (``kind``: ``channel.TIMEOUTS`` or ``CONTROL``):
        waits (at most SEND_WAIT_S) while the channel is full; past that it is held back and
        sent after the sections at the next catch-up. Timeouts held back before are
        replaced: each message holds all of them."""
        assert self._sock is not None
        if self._behind:
            self._catch_up()
        if not self._behind and (self._sent(message) or self._sent_after_wait(message)):
            return
        if kind == channel.TIMEOUTS:
            self._unsent = [held for held in self._unsent if held[0] != channel.TIMEOUTS]
        self._unsent.append((kind, message))
        self._fall_behind()

    def _send_timeouts(self, timeouts: Timeouts, source: str) -> None:
        payload = {"timeouts": timeouts.to_dict(), "source": source}
        self._send(channel.encode(channel.TIMEOUTS, payload), channel.TIMEOUTS)

    def _lose(self, exc: OSError) -> None:
        if not self._lost:
            self._lost = True
            log.error("lost the supervisor's socket (%s): this rank is no longer monitored", exc)


class _StepTimer:
    """``RankMonitorClient.timed_step``'s block: its time (host or GPU) recorded at its end."""

    __slots__ = ("_client", "_gpu", "_begin")

    def __init__(self, client: RankMonitorClient, gpu: _GpuTimes | None) -> None:
        self._client, self._gpu, self._begin = client, gpu, None

    def __enter__(self) -> None:
        self._begin = self._gpu.mark() if self._gpu is not None else time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self._gpu is None:
            end = time.perf_counter()
            self._client._add_step(end - self._begin, end)  # type: ignore[operator]
            return
        self._gpu.close(self._begin)
        for seconds in self._gpu.finished():
            self._client.record_step(seconds)


class _GpuTimes:
    """Pairs of CUDA events around timed blocks, read once the GPU has passed them."""

    #: Blocks the GPU may lag behind by before the oldest is waited for (bounded memory).
    MAX_PENDING = 64

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RankMonitorClientError(
                "timed_step(cuda=True): CUDA is not available here; use timed_step()"
            )
        self._torch = torch
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()

    def mark(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def close(self, begin: Any) -> None:
        self._pending.append((begin, self.mark()))
        if len(self._pending) > self.MAX_PENDING:
            self._pending[0][1].synchronize()

    def finished(self) -> list[float]:
        """Seconds of each block the GPU has finished since the last call, oldest first."""
        done = []
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.popleft()
            done.append(begin.elapsed_time(end) / 1000)
        return done


def _restored_from(state: Any) -> Timeouts | None:
    """The computed timeouts a checkpoint entry holds, None when it holds none;
    RankMonitorClientError when it is not one."""
    if not isinstance(state, Mapping) or (state and not ({CHECKPOINT_KEY, "timeouts"} & set(state))):
        raise RankMonitorClientError(
            f"load_state_dict: expected what state_dict() returned, got {state!r:.200}"
        )
    try:
        if state.get(CHECKPOINT_KEY):
            return Timeouts.from_checkpoint(dict(state[CHECKPOINT_KEY])).computed_only()
        if state.get("timeouts"):
            return Timeouts.from_dict(dict(state["timeouts"])).computed_only()
    except (TypeError, ValueError) as exc:
        raise RankMonitorClientError(f"load_state_dict: {exc}") from None
    return None


#: The longest section name: short enough that the messages naming sections (the timeouts,
#: a catch-up's open sections) fit one packet with many of them.
MAX_SECTION_NAME = 1024


def _check_section_name(what: str, section: object) -> None:
    """A section's name is a non-empty string of at most ``MAX_SECTION_NAME`` characters:
    else the supervisor would not see it open, or would see it cut short, and find a false
    hang."""
    if not isinstance(section, str) or not section:
        raise RankMonitorClientError(f"{what}: a section's name must be a non-empty string, got {section!r}")
    if len(section) > MAX_SECTION_NAME:
        raise RankMonitorClientError(
            f"{what}: a section's name must be at most {MAX_SECTION_NAME} characters, got {len(section)}"
        )


def _overlay(base: Timeouts | None, restored: Timeouts) -> Timeouts:
    """``restored`` where it has a value, ``base`` elsewhere; a value is computed as the one
    taken says (a value computed here that ``restored`` has none of stays computed)."""
    if base is None:
        return restored
    merged = Timeouts(
        initial_heartbeat=restored.initial_heartbeat if restored.initial_heartbeat is not None else base.initial_heartbeat,
        heartbeat=restored.heartbeat if restored.heartbeat is not None else base.heartbeat,
        sections={**base.sections, **{k: v for k, v in restored.sections.items() if v is not None}},
        out_of_section=restored.out_of_section if restored.out_of_section is not None else base.out_of_section,
    )
    kept = [n for n in base.computed if _value_of(restored, n) is None]
    merged.computed = kept + [n for n in restored.computed if n not in kept]
    return merged


def _value_of(timeouts: Timeouts, name: str) -> float | None:
    """The value of ``timeouts`` that ``name`` (as in ``Timeouts.computed``) stands for."""
    if name.startswith("section:"):
        return timeouts.sections.get(name[len("section:"):])
    return getattr(timeouts, name, None)


def _all_max(values: list[float]) -> list[float]:
    """Element-wise maximum over every rank where torch.distributed is initialized; else ``values``."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return values
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.cpu().tolist()]


def _all_names(names: set[str]) -> list[str]:
    """The union of every rank's ``names``, sorted, where torch.distributed is initialized
    (each rank then reduces the same list); else ``names``, sorted."""
    try:
        import torch.distributed as dist
    except ImportError:
        return sorted(names)
    if not (dist.is_available() and dist.is_initialized()):
        return sorted(names)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(names))
    return sorted({name for part in every for name in part})


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw.lstrip("-").isdigit() else None


__all__ = ["RankMonitorClient", "RankMonitorClientError"]
