"""``CallWrapper``: one call of a wrapped function, its store, monitors and restart rounds.

The round protocol is described in ``nvrx.inprocess.wrap``; this module runs it.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import faulthandler
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from nvrx import events
from nvrx.store import barrier as nvrx_barrier
from nvrx.store import client as store_client
from nvrx.store import faults as nvrx_faults
from nvrx.store import keys, rounds

from . import rendezvous
from . import store as rstore
from .exception import HealthCheckError, InternalError, RestartAbort
from .logging import monitor_logfile_path, setup_logger
from .monitor_process import STACK_SIGNAL, MonitorConfig, MonitorProcess
from .monitor_thread import DONE, Delivery, MonitorThread, RankShouldRestart, reraise_if_unraisable
from .param_utils import substitute_param_value
from .progress_watchdog import FLAG_SHUTDOWN, FLAG_TIMEOUTS_OFF, ProgressBoard, ProgressWatchdog
from .rank_assignment import (
    RankAssignmentCtx,
    RankDiscarded,
)
from .state import Mode, State

if TYPE_CHECKING:
    from .wrap import Wrapper

log = logging.getLogger(__name__)

_RESTART_WAIT_S = 60.0  # bound on a main thread waiting for its monitor thread's restart request
_FOREVER_S = 365 * 86400.0


def _state_json(state: State) -> str:
    import json

    fields = (
        "rank",
        "world_size",
        "active_rank",
        "active_world_size",
        "initial_rank",
        "initial_world_size",
    )
    data = {name: getattr(state, name) for name in fields}
    data["mode"] = state.mode.name
    return json.dumps(data)


def _supervised() -> bool:
    return (
        os.environ.get("NVRX_SUPERVISED") == "1"
        or store_client.external_store_address() is not None
    )


def _restarted_process() -> bool:
    try:
        return int(os.environ.get("NVRX_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        raise ValueError(
            f"NVRX_RESTART_COUNT must be an integer, got {os.environ['NVRX_RESTART_COUNT']!r}"
        ) from None


class CallWrapper:
    """One call of a wrapped function: its store, monitors and restart rounds.

    Passed to the wrapped function through any parameter annotated
    ``CallWrapper``; offers ``iteration``, ``ping()``, ``atomic()`` and
    ``disable_hang_protection()``.
    """

    def __init__(self, wrapper: Wrapper) -> None:
        import torch.distributed as dist

        setup_logger()
        if dist.is_available() and dist.is_initialized():
            raise InternalError(
                "torch.distributed is already initialized: the wrapped function must call "
                "init_process_group itself (destroy the process group before calling the Wrapper)"
            )
        self.wrapper = wrapper
        self.state = State.from_env()
        self.initial_rank: int = self.state.initial_rank  # type: ignore[assignment]
        self.initial_world_size: int = self.state.initial_world_size  # type: ignore[assignment]
        self.writer = events.EventWriter(
            events.job_log_dir(), "wrapper", dict(events.context_from_env(), rank=self.initial_rank)
        )
        self.host_store = False
        self.store_address = None
        self._monitor: MonitorProcess | None = None
        self._watchdog: ProgressWatchdog | None = None
        self._stack_fd: int | None = None
        self.board = ProgressBoard()
        self.delivery = Delivery()
        self.atomic_lock = self.delivery.atomic_lock
        self.base_store: Any = None
        self.store: Any = None
        self.round = 0
        self.generation = 0
        self._pending_latency_from: float | None = None
        try:
            self._setup()
        except BaseException:
            self.shutdown(completed=False)
            raise

    # -- setup ------------------------------------------------------------------------
    def _resolve_store(self) -> None:
        """Where the store is, and whether this rank's monitor process hosts it."""
        w = self.wrapper
        kwargs = dict(w.store_kwargs)
        self.host_store = False
        self.store_address: tuple[str, int] | None = None
        if issubclass(w.store_factory, rstore.TCPStore):
            host, port = rstore.resolve_address(
                kwargs.pop("host_name", None), kwargs.pop("port", None)
            )
            host_rank = kwargs.get("tcp_store_host_rank", rstore.TCPStore.TCP_STORE_HOST_RANK)
            self.host_store = (
                store_client.external_store_address() is None and host_rank == self.initial_rank
            )
            self.store_address = (host, port)
            kwargs.update(host_name=host, port=port)
        self._store_kwargs = kwargs

    def _connect_store(self) -> None:
        w = self.wrapper
        if self.store_address is not None and not self.host_store:
            from nvrx.store.service import wait_for_store

            wait_for_store(*self.store_address, w.barrier_timeout)
        self.base_store = w.store_factory(**self._store_kwargs)
        try:  # the monitor thread blocks in wait(): it needs a connection of its own
            self._mt_store = self.base_store.clone()
        except (RuntimeError, AttributeError, NotImplementedError):
            self._mt_store = w.store_factory(**self._store_kwargs)

    def _start_monitor(self) -> None:
        w = self.wrapper
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # a dump never blocks the rank if nobody reads
        self._stack_fd = write_fd
        faulthandler.register(STACK_SIGNAL, file=write_fd, all_threads=True, chain=False)
        config = MonitorConfig(
            target_pid=os.getpid(),
            board_path=self.board.path,
            initial_rank=self.initial_rank,
            monitor_process_interval=w.monitor_process_interval,
            heartbeat_interval=w.heartbeat_interval,
            heartbeat_timeout=w.heartbeat_timeout,
            soft_timeout=w.soft_timeout,
            hard_timeout=w.hard_timeout,
            termination_grace_time=w.termination_grace_time,
            logfile=monitor_logfile_path(w.monitor_process_logfile, self.initial_rank),
            events_dir=str(self.writer.directory),
            events_context=dict(self.writer.context),
            initial_world_size=self.initial_world_size,
            host_store=self.host_store,
            keeper_timeout=max(w.barrier_timeout, w.completion_timeout) * 2,
        )
        if self.store_address is not None:
            config.store_host, config.store_port = self.store_address
        else:
            config.store_factory = base64.b64encode(
                pickle.dumps((w.store_factory, self._store_kwargs))
            ).decode()
        self._monitor = MonitorProcess(config, read_fd)
        self._monitor.start()
        ready = self._monitor.wait_ready(w.barrier_timeout)
        if self.host_store and self.store_address is not None:
            self.store_address = (self.store_address[0], int(ready["port"]))
            self._store_kwargs["port"] = self.store_address[1]
        if w.monitor_process_pidfile is not None and self._monitor.proc is not None:
            path = monitor_logfile_path(w.monitor_process_pidfile, self.initial_rank)
            with open(path, "w") as fh:  # type: ignore[arg-type]
                fh.write(f"{self._monitor.proc.pid}\n")

    def _setup(self) -> None:
        w = self.wrapper
        self._resolve_store()
        self.board.set_round(-1, self.state.rank, self.state.world_size, self.initial_rank)
        self._start_monitor()
        self._connect_store()
        self._first_terminated: set[int] = set()
        admission = self._try_rejoin() if _restarted_process() and _supervised() else None
        self._watchdog = ProgressWatchdog(self.board, w.progress_watchdog_interval)
        self._watchdog.start()
        self.delivery.install_signal()
        if admission is not None:
            self.generation = int(admission["generation"])
            self.board.set_generation(self.generation)
            self.round = int(admission["round"])
            fields = dict(admission["state"], mode=Mode[admission["state"]["mode"]])
            self.state = State(**fields)
            self.state.initial_rank, self.state.initial_world_size = (
                self.initial_rank,
                self.initial_world_size,
            )
            self.state.iteration = int(admission["job_restarts"])
            self._first_terminated = {int(r) for r in admission["terminated"]}
            self._emit(
                "rejoin",
                local_rank=int(os.environ["LOCAL_RANK"])
                if os.environ.get("LOCAL_RANK", "").isdigit()
                else None,
                round=self.round,
                rank=self.state.rank,
            )
            return
        self.generation = rounds.generation_base(self.base_store, _restarted_process())
        self.round = self.generation
        self.board.set_generation(self.generation)
        name = f"{keys.ROOT}g{self.generation}/initial"

        def open_generation() -> None:
            rendezvous.clear_torch_keys(self.base_store)
            if self.generation > 0:
                rounds.count_job_restart(self.base_store)
            rounds.publish_round(self.base_store, self.generation)

        t0 = time.monotonic()
        nvrx_barrier.barrier(
            self.base_store,
            name,
            self.initial_rank,
            self.initial_world_size,
            w.barrier_timeout,
            reentrant=True,
            before_release=open_generation,
        )
        self._emit(
            "restart_phase", phase="initial_barrier", duration_s=time.monotonic() - t0, ok=True
        )
        self.state.iteration = rounds.job_restarts(self.base_store)

    # -- rejoin (replacement of a dead process, under a supervisor) -----------------------
    def _job_alive(self) -> bool:
        """Whether other ranks' monitors still beat (a bounded look at the job's alive counter)."""
        if rounds.current_round(self.base_store) is None:
            return False
        before = int(self.base_store.add(keys.ALIVE, 0))
        time.sleep(2 * self.wrapper.heartbeat_interval)  # heartbeats cannot be awaited: look twice
        return int(self.base_store.add(keys.ALIVE, 0)) != before

    def _try_rejoin(self) -> dict[str, Any] | None:
        """Ask a running job to take this replacement process back; its admission, or None."""
        import json

        from torch.distributed import DistStoreError

        w = self.wrapper
        if w.rejoin_timeout <= 0 or not self._job_alive():
            return None
        pid = os.getpid()
        self.base_store.set(keys.join_request(self.initial_rank), str(pid))
        t0 = time.monotonic()
        try:
            self.base_store.wait(
                [keys.admission(self.initial_rank, pid)],
                datetime.timedelta(seconds=w.rejoin_timeout + w.barrier_timeout + w.soft_timeout),
            )
        except DistStoreError:
            log.warning("not admitted back into the running job: starting a new generation")
            self.base_store.delete_key(keys.join_request(self.initial_rank))
            return None
        admission = json.loads(self.base_store.get(keys.admission(self.initial_rank, pid)))
        self._emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
        return admission

    def _admit_replacements(self, store: Any, terminated: set[int]) -> set[int]:
        """Wait up to ``rejoin_timeout`` for replacements of dead ranks; returns the ranks that came back."""
        import json

        from torch.distributed import DistStoreError

        w = self.wrapper
        if not terminated or w.rejoin_timeout <= 0 or not _supervised():
            return set()
        survivors = [r for r in range(self.state.world_size) if r not in terminated]
        if not survivors:
            return set()
        stopped = {
            rec.rank
            for rec in rstore.fault_records(store)
            if rec.kind == "exit" and (rec.exc_type or "").endswith("RestartAbort")
        }
        candidates = sorted(t for t in terminated if t not in stopped)
        if not candidates:
            return set()
        t0 = time.monotonic()
        if self.state.rank == min(survivors):
            states = {t: json.loads(store.get(keys.rank_state(t))) for t in candidates}
            joins = {t: keys.join_request(states[t]["initial_rank"]) for t in candidates}
            try:
                self.base_store.wait(
                    list(joins.values()), datetime.timedelta(seconds=w.rejoin_timeout)
                )
            except DistStoreError:
                pass  # some did not come back in time
            back = [t for t in candidates if self.base_store.check([joins[t]])]
            final = sorted(terminated - set(back))
            for t in back:
                pid = int(self.base_store.get(joins[t]))
                self.base_store.delete_key(joins[t])
                admission = {
                    "generation": self.generation,
                    "round": self.round + 1,
                    "state": states[t],
                    "terminated": final,
                    "job_restarts": self.state.iteration + 1,
                }
                self.base_store.set(
                    keys.admission(states[t]["initial_rank"], pid), json.dumps(admission)
                )
            store.set(keys.REJOIN, json.dumps(back))
        else:
            store.wait(
                [keys.REJOIN], datetime.timedelta(seconds=w.rejoin_timeout + w.barrier_timeout)
            )
        rejoined = {int(t) for t in json.loads(store.get(keys.REJOIN))}
        self._emit("restart_phase", phase="rejoin_wait", duration_s=time.monotonic() - t0, ok=True)
        for t in sorted(rejoined):
            self._emit("rejoin", rank_rejoined=t, wait_s=time.monotonic() - t0)
        return rejoined

    # -- public API -------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """Index of the current restart iteration (job restarts so far)."""
        return self.state.iteration

    def ping(self) -> None:
        """Report progress by hand: from the first ping of a round, silence longer than the timeouts is a hang."""
        self.board.stamp_manual()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Run a block that a restart must not interrupt (the restart waits for it to end)."""
        with self.delivery.atomic():
            yield

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """Turn the soft and hard timeouts off for the block (exceptions still restart)."""
        self.board.set_flag(FLAG_TIMEOUTS_OFF, True)
        try:
            yield
        finally:
            self.board.stamp_auto()
            self.board.set_flag(FLAG_TIMEOUTS_OFF, False)

    @property
    def monitor_process(self) -> MonitorProcess | None:
        return self._monitor

    @property
    def progress_watchdog(self) -> ProgressWatchdog | None:
        return self._watchdog

    # -- events -------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        self.writer.emit(kind, initial_rank=self.initial_rank, **fields)

    @contextlib.contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        t0 = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._emit("restart_phase", phase=phase, duration_s=time.monotonic() - t0, ok=ok)

    # -- the restart loop ---------------------------------------------------------------
    def __call__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        w = self.wrapper
        rounds_run = 0
        outcome = "error"
        try:
            with reraise_if_unraisable(RankShouldRestart), rendezvous.preserved_environment():
                self.store = rstore.round_store(self.base_store, self.round)
                with self._phase("rank_assignment"):
                    self._assign(self._first_terminated)
                while True:
                    rounds_run += 1
                    done, ret = self._round(fn, args, kwargs)
                    if done:
                        break
            if w.completion is not None:
                try:
                    w.completion(self.state.freeze())
                except Exception as exc:
                    log.error("completion callback failed (ignored): %r", exc)
            outcome = "completed"
            return ret
        except RestartAbort:
            outcome = "restart_abort"
            raise
        finally:
            self._emit("wrapper_end", outcome=outcome, rounds=rounds_run)

    def _assign(self, terminated: set[int]) -> None:
        old = dataclasses.replace(self.state)
        ctx = self.wrapper.rank_assignment(
            RankAssignmentCtx(self.state, self.store, set(terminated))
        )
        new = ctx.state
        if new.rank is not None and new.active_rank is None and new.mode == Mode.INITIALIZED:
            new = dataclasses.replace(
                new, mode=Mode.ACTIVE, active_rank=new.rank, active_world_size=new.world_size
            )
        self.state = new if isinstance(new, State) else State(**dataclasses.asdict(new))
        self.state.set_distributed_vars()
        if (old.rank, old.active_rank, old.world_size) != (
            new.rank,
            new.active_rank,
            new.world_size,
        ):
            self._emit(
                "rank_change",
                old_rank=old.rank,
                new_rank=new.rank,
                active=new.active_rank is not None,
                active_rank=new.active_rank,
                world_size=new.world_size,
            )

    def _round(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        w = self.wrapper
        state = self.state
        store = self.store = rstore.round_store(self.base_store, self.round)
        t_round = time.monotonic()
        self.board.set_round(self.round, state.rank, state.world_size, self.initial_rank)
        self.writer.update(rank=state.rank, round=self.round)
        if self.store_address is not None:
            env = rendezvous.round_env(
                *self.store_address, state.active_rank, state.active_world_size, self.round
            )
        else:  # a custom store: the function brings its own rendezvous
            env = {"RANK": None if state.active_rank is None else str(state.active_rank)}
            env["WORLD_SIZE"] = (
                None if state.active_world_size is None else str(state.active_world_size)
            )
        rendezvous.apply(env)
        if self.round > self.generation:
            rstore.commit_round_start(store, self.base_store, state.iteration)
        store.set(keys.rank_state(state.rank), _state_json(state))  # for a replacement of this rank
        latency = (
            None if self._pending_latency_from is None else t_round - self._pending_latency_from
        )
        self._emit(
            "round_start",
            world_size=state.world_size,
            active_world_size=state.active_world_size,
            active_rank=state.active_rank,
            iteration=state.iteration,
            restart_latency_s=latency,
        )
        self.delivery.reset()
        monitor = MonitorThread(
            rstore.round_store(self._mt_store, self.round),
            keys.INTERRUPTED,
            [nvrx_barrier.release_key(rstore.COMPLETION_BARRIER), keys.COMPLETED],
            self.delivery,
            w.abort,
            state.freeze(),
            w.monitor_thread_interval,
        )
        monitor.start()
        local_fault: BaseException | None = None
        recorded = False
        t_call = time.monotonic()
        in_call = False  # between call_start and call_end: goodput counts this time
        try:
            try:
                try:
                    self.delivery.enter_user()
                    self.board.enter_user()
                    if w.initialize is not None:
                        w.initialize(state.freeze())
                    if w.health_check is not None:
                        try:
                            w.health_check(state.freeze())
                        except Exception as exc:
                            raise HealthCheckError(
                                f"health check failed at round start: {exc!r}"
                            ) from exc
                    ret = None
                    if state.mode == Mode.ACTIVE and state.active_rank is not None:
                        self._emit("call_start", note="the wrapped function is entered")
                        t_call, in_call = time.monotonic(), True
                        call_args, call_kwargs = substitute_param_value(
                            fn, args, kwargs, {CallWrapper: self}
                        )
                        ret = fn(*call_args, **call_kwargs)
                except RankShouldRestart:
                    raise
                except Exception as exc:
                    local_fault = exc
                    self.delivery.begin_wait()
                    self.board.leave_user()
                    recorded = self._record_local_fault(store, exc, monitor)
                    if in_call:
                        in_call = False
                        self._emit(
                            "call_end", duration_s=time.monotonic() - t_call, outcome="fault"
                        )
                    self.delivery.await_restart(_RESTART_WAIT_S)
                self.board.leave_user()
                self.delivery.leave_user()
                if state.active_rank is not None:
                    if in_call:
                        in_call = False
                        self._emit(
                            "call_end", duration_s=time.monotonic() - t_call, outcome="completed"
                        )
                    store.set(keys.COMPLETED, "1")
                else:  # a spare waits for the active ranks (or a fault) without a time limit
                    store.wait([keys.COMPLETED], datetime.timedelta(seconds=_FOREVER_S))
                self._complete(store)
            except RankShouldRestart:
                raise
            except Exception as exc:  # the completion barrier failed: everyone restarts
                local_fault = local_fault or exc
                self.delivery.begin_wait()
                if not recorded:
                    recorded = self._record_local_fault(store, exc, monitor)
                self.delivery.await_restart(_RESTART_WAIT_S)
            monitor.join(w.monitor_thread_interval + 5)
            self._emit("round_end", outcome="completed", duration_s=time.monotonic() - t_round)
            return True, ret
        except RankShouldRestart as restart:
            self.delivery.caught()
            self.board.leave_user()
            if in_call:  # a peer's fault cut the call short
                self._emit("call_end", duration_s=time.monotonic() - t_call, outcome="restart")
            if local_fault is None and isinstance(restart.__context__, Exception):
                local_fault = restart.__context__
            if local_fault is not None and not recorded:
                recorded = self._record_local_fault(store, local_fault, monitor)
            self._restart(monitor, local_fault, t_round)
            return False, None
        except BaseException as exc:
            self.delivery.settle()  # a restart requested meanwhile is moot: this rank leaves
            self.board.leave_user()
            self._leave(store, exc, recorded)
            raise

    def _complete(self, store: Any) -> None:
        """Completion barrier; a fault of any rank before it completes turns into a restart."""
        w = self.wrapper
        name = rstore.COMPLETION_BARRIER
        nvrx_barrier.arrive(
            store,
            name,
            self.state.rank,  # type: ignore[arg-type]
            self.state.world_size,
            before_release=lambda: rstore.interrupt(store, DONE),
        )
        nvrx_barrier.wait(
            store, name, self.state.world_size, w.completion_timeout, range(self.state.world_size)
        )
        if store.get(keys.INTERRUPTED).decode(errors="replace") != DONE:
            self.delivery.await_restart(_RESTART_WAIT_S)

    def _record_local_fault(self, store: Any, exc: BaseException, monitor: MonitorThread) -> bool:
        """Record an exception of this rank: its own fault, or the consequence of a peer's.

        Once the monitor thread has seen another rank's fault it aborts the
        process groups, which makes pending collectives here fail: such an
        exception is written as a ``peer`` fault naming the rank that faulted
        first, and is not counted against this rank in the store.
        """
        record = nvrx_faults.from_exception(
            self.state.rank if self.state.rank is not None else -1, exc
        )
        if monitor.seen_mono is not None:
            origins = []
            with contextlib.suppress(Exception):
                origins = rstore.fault_records(store)  # in the order the store received them
            self._emit(
                "fault",
                fault_kind="peer",
                origin_rank=origins[0].rank if origins else None,
                exc_type=record.exc_type,
                message=record.message,
                traceback=record.traceback,
                signature=record.signature,
                detected_mono=monitor.seen_mono,
            )
            return True
        self._emit(
            "fault",
            fault_kind="exception",
            origin_rank=self.state.rank,
            exc_type=record.exc_type,
            message=record.message,
            traceback=record.traceback,
            signature=record.signature,
            detected_mono=record.detected_mono,
            detection_s=0.0,
        )
        try:
            rstore.record_fault(store, record)
        except Exception as store_exc:
            log.error("could not record the fault in the store: %r", store_exc)
            return False
        return True

    def _restart(
        self, monitor: MonitorThread, local_fault: BaseException | None, t_round: float
    ) -> None:
        w = self.wrapper
        store = self.store
        monitor.join(_RESTART_WAIT_S)
        seen = monitor.seen_mono or time.monotonic()
        self._pending_latency_from = seen
        self._emit(
            "restart_phase", phase="abort", duration_s=monitor.abort_s or 0.0, ok=monitor.abort_ok
        )
        self.state.fn_exception = local_fault if isinstance(local_fault, Exception) else None
        try:
            if w.finalize is not None:
                with self._phase("finalize"):
                    w.finalize(self.state.freeze())
            if w.health_check is not None:
                with self._phase("health_check"):
                    try:
                        w.health_check(self.state.freeze())
                    except Exception as exc:
                        raise HealthCheckError(f"restart health check failed: {exc!r}") from exc
            remaining = seen + w.last_call_wait - time.monotonic()
            if remaining > 0:
                with self._phase("last_call_wait"):
                    time.sleep(remaining)  # the documented window for concurrent faults
            with self._phase("iteration_barrier"):
                rstore.arrive_iteration(
                    store, self.base_store, self.state.rank, self.state.world_size
                )
                decision = rstore.wait_iteration(store, self.state.world_size, w.barrier_timeout)
            terminated = {int(r) for r in decision["terminated"]}
            terminated -= self._admit_replacements(store, terminated)
            if terminated:
                self._emit("ranks_terminated", ranks=sorted(terminated))
            self._emit(
                "round_end",
                outcome="restart",
                duration_s=time.monotonic() - t_round,
                faults=[
                    dataclasses.asdict(r) | {"traceback": None} for r in rstore.fault_records(store)
                ][:16],
            )
            self.round += 1
            self.store = rstore.round_store(self.base_store, self.round)
            with self._phase("rank_assignment"):
                self._assign(terminated)
            self.state.iteration = int(decision["job_restarts"])
            self.state.fn_exception = None
        except BaseException as exc:
            self._leave(store, exc, recorded=True)
            raise

    def _leave(self, store: Any, exc: BaseException, recorded: bool) -> None:
        """This rank leaves the job for good: let the others go on without it."""
        rank = self.state.rank
        try:
            if rank is not None:
                if not recorded and not isinstance(exc, RankDiscarded):
                    record = nvrx_faults.from_exception(rank, exc, kind="exit")
                    nvrx_faults.append_record(store, keys.FAULT_LIST, record)
                    self._emit(
                        "fault",
                        fault_kind="exit",
                        origin_rank=rank,
                        exc_type=record.exc_type,
                        message=record.message,
                        traceback=record.traceback,
                        signature=record.signature,
                        detected_mono=record.detected_mono,
                    )
                rstore.register_terminated(store, rank)
                rstore.interrupt(store, "fault")
                rstore.arrive_iteration(store, self.base_store, rank, self.state.world_size)
        except Exception as store_exc:
            log.error("could not register rank %s as terminated: %r", rank, store_exc)
        self._emit(
            "round_end",
            outcome="abort" if isinstance(exc, RestartAbort) else "terminated",
            duration_s=0.0,
        )
        self.state.mode = Mode.TERMINATED
        if self.wrapper.terminate is not None:
            try:
                self.wrapper.terminate(self.state.freeze())
            except Exception as term_exc:
                log.error("terminate callback failed (ignored): %r", term_exc)

    # -- shutdown -----------------------------------------------------------------------
    def shutdown(self, completed: bool = True) -> None:
        """Termination barrier (the store host waits for everyone), then stop monitors and the store."""
        w = self.wrapper
        if self.base_store is not None:
            name = f"{keys.ROOT}g{self.generation}/termination"
            try:
                nvrx_barrier.arrive(
                    self.base_store,
                    name,
                    self.initial_rank,
                    self.initial_world_size,
                    reentrant=True,
                )
                if self.host_store:  # the store must serve until every rank is done
                    nvrx_barrier.wait(
                        self.base_store, name, self.initial_world_size, w.barrier_timeout
                    )
            except Exception as exc:
                log.warning("termination barrier: %r", exc)
        self.board.set_flag(FLAG_SHUTDOWN, True)
        if self._monitor is not None:
            self._monitor.stop()
        if self._watchdog is not None:
            self._watchdog.shutdown(timeout=w.progress_watchdog_interval + 5)
        if self._stack_fd is not None:
            faulthandler.unregister(STACK_SIGNAL)
            os.close(self._stack_fd)
            self._stack_fd = None
        self.delivery.uninstall_signal()
        self.board.close()
        self.base_store = None
        self._mt_store = None

    def __enter__(self) -> CallWrapper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
