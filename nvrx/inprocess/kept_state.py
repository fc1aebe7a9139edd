"""Kept state: the training progress copied into host memory at the end of a step.

An in-process restart keeps every rank's process, so what a rank copied into its own
memory survives the fault: restoring it loses at most the step that was running, where a
file checkpoint loses every step since it was written. ``KeptState`` holds what defines
the progress (model, optimizer, scheduler, data position, RNG states: anything with
``state_dict``/``load_state_dict``), registered once by name, and copies it on ``commit``:

    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    kept.register("rng", RngState(), per_rank=True)
    start = kept.restore_agreed(checkpoint=load_checkpoint)  # in every round
    for step in range(start or 0, steps):
        train_step()
        kept.commit(step + 1)

Two slots: a commit writes the slot that is not the last complete commit, and makes it the
last only once every object was copied, so a fault during a commit (an exception, a
restart raised in the middle) leaves the previous commit whole. Tensors are copied into
buffers kept from one commit to the next (allocated again only when a shape or dtype
changes). A CUDA tensor is first cloned on the device (on the current stream, so the next
step's in-place updates do not race the copy), then copied to a pinned host buffer on a
side stream; the slot becomes the last complete commit when that copy has finished
(checked at the next commit or restore), so the step does not wait for the host copy, but
the next commit waits for the previous one.

Ranks may hold different steps after a fault (one was committing when it came):
``restore_agreed`` restores the newest step that a holder of every shard holds, through
one collective of the new process group, and hands it point to point (``state_handover``)
to the ranks that do not hold it (a replacement process, a spare, a rank a commit behind,
a rank renumbered into another replica group), each from a holder of the shard its group
holds: any rank in data parallelism, a rank that committed that shard in a sharded job
(``state_plan`` says who sends what to whom). Objects registered ``per_rank`` (RNG states, a data position)
are not handed over; those ranks keep their own. A rank that receives the step keeps it
as its commit of that step, of its new group's shard, so that it can serve it in turn if
a second fault comes before its next commit. When a shard has no holder left, the ranks
fall back to the user's checkpoint, through a callback.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from nvrx.inprocess import state_handover, state_plan, state_tree

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """What ``KeptState`` keeps: an object that gives and takes its state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class EventSink(Protocol):
    """Where ``restore_agreed`` records what it did: a ``CallWrapper`` or an ``EventWriter``."""

    def emit(self, kind: str, **fields: Any) -> Any: ...


class _Unknown:
    """Not looked at yet."""


class _Slot:
    """One copy of every registered object's state, with the buffers its tensors live in."""

    def __init__(self) -> None:
        self.step: int | None = None  # set only once the copy is complete
        self.pending_step: int | None = None  # the step of a device copy that may still run
        self.states: dict[str, Any] = {}
        self.copied: Any = None  # the CUDA event that device copy ends with
        self.device_queued: float | None = None  # when that copy was queued (time.monotonic())
        self.interrupted = False  # a fault came before that copy finished: it is no commit
        self.received_until: float | None = None  # when a hand-over's receive into it ended
        self.unpicklable: str | None | type[_Unknown] = _Unknown  # why pickle refuses it
        self.wall: float | None = None  # when the step was committed or received (time.time())

    def finished(self) -> bool:
        """Whether the copy into this slot is complete (waits for nothing). A device that
        cannot say raises its error: the main thread's commit and restore must see it, where
        a fault's look (``_finished``) only needs a no."""
        copied = self.copied  # once: the main thread may settle it meanwhile
        return copied is None or copied.query()

    def wait(self) -> None:
        """Wait for the device copy into this slot, if one runs."""
        if self.copied is not None:
            self.copied.synchronize()


#: Every kept state of this process, told of a fault around the abort of its collectives.
_LIVE: weakref.WeakSet[KeptState] = weakref.WeakSet()


def interrupted(since: float) -> None:
    """A fault at ``since`` (``time.monotonic()``) interrupted the round: every kept state
    of this process drops the device copies it may have spoilt (``KeptState.interrupted``)."""
    for kept in list(_LIVE):
        kept.interrupted(since)


class KeptState:
    """The registered objects' states, committed into host memory; see the module docstring.

    Args:
        every: copy on every ``every``-th step given to ``commit`` (1: every step).
    """

    def __init__(self, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"KeptState: `every` must be an int ≥ 1, got {every!r}")
        self.every = every
        self._objects: dict[str, Stateful] = {}
        self._per_rank: set[str] = set()
        self._slots = (_Slot(), _Slot())
        self._last: int | None = None  # index of the last complete commit's slot
        self._pending: int | None = None  # index of a slot whose device copy may still run
        self._stream: Any = None
        self._course = 0.0  # the course of the commits: a new one begins at each fallback
        self._shard: int | None = None  # the replica group they are of, once known
        self._fault_told: float | None = None  # the latest fault ``interrupted`` was told of
        self._lock = threading.RLock()  # user state_dict/load_state_dict may ask for step
        _LIVE.add(self)

    def register(
        self, name: str, obj: Stateful, per_rank: bool = False, replace: bool = False
    ) -> None:
        """Keep ``obj``'s state under ``name`` from the next commit on. ``per_rank``: a state
        that differs between ranks by design (RNG states, a data position): not handed to a
        rank that holds none by ``restore_agreed``. ``replace``: ``name`` may be registered
        already, and now means ``obj`` (code that builds its model anew in every round
        registers the new one; the commits kept under the name are restored into it)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"KeptState.register: name must be a non-empty str, got {name!r}")
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise TypeError(
                f"KeptState.register({name!r}): {type(obj).__name__} has no {' or '.join(missing)}; "
                "register objects with state_dict()/load_state_dict(), or wrap the value in one"
            )
        with self._lock:
            if name in self._objects and not replace:
                raise ValueError(
                    f"KeptState.register: {name!r} is registered already (replace=True to rebind it)"
                )
            self._objects[name] = obj
            if per_rank:
                self._per_rank.add(name)
            else:
                self._per_rank.discard(name)

    @property
    def step(self) -> int | None:
        """The step of the last complete commit, None before the first."""
        with self._lock:
            self._settle(wait=False)
            return None if self._last is None else self._slots[self._last].step

    def commit(self, step: int) -> bool:
        """Copy every registered state as that of ``step``, when ``step`` is a multiple of
        ``every``; whether it copied. The previous commit stays whole until this one is.
        Steps never go back (the agreement takes the higher step for the newer): a step
        below the last commit's is refused, unless ``forget`` dropped the commits first."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"KeptState.commit: step must be an int ≥ 0, got {step!r}")
        with self._lock:
            if not self._objects:
                raise RuntimeError(
                    "KeptState.commit: nothing is registered; call register(name, obj) first"
                )
            if step % self.every:
                return False
            self._settle(wait=True)  # a device copy still running is the last commit too
            last = None if self._last is None else self._slots[self._last].step
            if last is not None and step < last:
                raise ValueError(
                    f"KeptState.commit: step {step} is below the last commit's, {last}: steps "
                    "count the training's progress (a per-epoch counter does not); call "
                    "forget() first to count from 0 again"
                )
            self._write(step, {})
            return True

    def _write(self, step: int, given: dict[str, Any]) -> _Slot:
        """Commit ``step`` into the slot that is not the last complete commit: the states in
        ``given`` (a hand-over's), and every other registered object's own; that slot."""
        self._settle(wait=True)
        index = 0 if self._last == 1 else 1
        slot = self._slots[index]
        slot.step, slot.wall = None, time.time()  # torn until the copy below completes
        slot.interrupted, slot.device_queued, slot.received_until = False, None, None
        slot.unpicklable = _Unknown
        copier = state_tree.Copier(self._side_stream)
        for name, obj in self._objects.items():
            state = given[name] if name in given else obj.state_dict()
            try:
                slot.states[name] = copier.copy(state, slot.states.get(name))
            except TypeError as error:
                raise TypeError(
                    f"KeptState: cannot keep {name!r} at step {step}: in what "
                    f"{type(obj).__name__}.state_dict() returned, {error}; return only tensors, "
                    "containers and values copy.deepcopy takes"
                ) from error
        slot.copied = copier.finish()
        if slot.copied is None:
            slot.step, self._last = step, index
        else:
            slot.device_queued = time.monotonic()
            slot.pending_step, self._pending = step, index
        return slot

    def steps(self) -> list[int]:
        """The steps of the complete commits held, newest first (at most two)."""
        with self._lock:
            self._settle(wait=True)
            return self._complete_steps()

    def restore(self, step: int | None = None) -> int | None:
        """Load a complete commit into the registered objects: that of ``step`` (one of
        ``steps()``), else the last; the step loaded, None when nothing is kept. Loading the
        older commit drops the newer one: it belongs to a course the job abandoned."""
        with self._lock:
            self._settle(wait=True)
            if self._last is None:
                return None
            index = self._index_of(step)
            slot = self._slots[index]
            late = [n for n in self._objects if n not in slot.states and n not in self._per_rank]
            if late:
                raise ValueError(
                    f"KeptState.restore: step {slot.step} holds no state of {late}, "
                    "registered after it was committed"
                )
            for name, obj in self._objects.items():
                if name in slot.states:  # a per-rank state registered since stays as it is
                    obj.load_state_dict(state_tree.fresh(slot.states[name]))
            if index != self._last:
                self._slots[self._last].step = None
                self._last = index
            return slot.step

    def restore_agreed(
        self,
        group: Any = None,
        events: EventSink | None = None,
        replica_groups: Sequence[Sequence[int]] | None = None,
        checkpoint: Callable[[], int | None] | None = None,
    ) -> int | None:
        """Restore the newest step that a holder of every shard holds, and hand it to each
        rank that holds none of it (a replacement process, a spare, a rank that now stands
        for another shard) from a rank that holds its group's shard (``state_plan``).

        ``group``: the process group (the default one when None). ``replica_groups``: the
        ranks of ``group`` that hold the same shard, one list per shard, covering every
        rank once (None: one group of every rank, data parallelism). Objects registered
        ``per_rank`` are never handed over. When some shard has no holder of a common step
        (every replica of a shard lost), or nobody holds any (the first round), the
        commits kept are dropped and ``checkpoint()`` runs on every rank: it loads the
        user's checkpoint and returns its step (None: there was none); without
        ``checkpoint`` the result is None and the caller restores its checkpoint itself.

        The step restored is returned. A collective: every rank of the group calls it,
        after ``init_process_group`` at the start of every round (the commits that follow
        belong to the shard it gives the rank). The collectives all come before any local
        load, and what each rank holds and registered is gathered first, so every rank
        takes the same course: the same error on every rank when they registered
        different objects or passed different groups. ``events`` (the ``CallWrapper``,
        say) gets one ``state_restored`` event: source (memory, peer, checkpoint, none),
        step, newest step kept anywhere, when the step was committed, duration."""
        import torch.distributed as dist

        start = time.monotonic()
        world, me = dist.get_world_size(group), dist.get_rank(group)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, self._held(replica_groups), group=group)
        state_plan.check_alike(everyone)
        replicas = state_plan.replica_groups(replica_groups, world)
        shard = next(g for g, ranks in enumerate(replicas) if me in ranks)
        plan = state_plan.plan(everyone, replicas)
        if plan is None:
            step, source = self._fall_back(checkpoint)
            with self._lock:
                self._course, self._shard = state_plan.new_course(everyone), shard
        else:
            step, source = self._follow(plan, group, shard)
        if events is not None:
            events.emit(
                "state_restored",
                source=source,
                step=step,
                newest_step=state_plan.newest_step(everyone),
                committed_wall=self._wall_of(step) if source == "memory" else None,
                duration_s=time.monotonic() - start,
            )
        return step

    def _held(self, groups: Sequence[Sequence[int]] | None) -> state_plan.Held:
        """What this rank brings to the agreement (``state_plan.Held``)."""
        steps = self.steps()
        unsendable = tuple(step for step in steps if not self._sendable(step))
        with self._lock:
            names = tuple(sorted((n, n in self._per_rank) for n in self._objects))
            return state_plan.Held(
                steps=tuple(steps),
                unsendable=unsendable,
                course=self._course,
                shard=self._shard,
                names=tuple(f"{n}{' (per rank)' if per_rank else ''}" for n, per_rank in names),
                groups=tuple(tuple(g) for g in groups) if groups is not None else (),
                now=time.time(),
            )

    def _follow(self, plan: state_plan.HandOver, group: Any, shard: int) -> tuple[int, str]:
        """Send the agreed step to the ranks this one serves and receive it if this rank is
        served, in the plan's order; then load it: from this rank's memory, or as its source
        sent it (this rank's own commits then dropped, those it served included, and what
        it received kept as its commit of the step, of ``shard``). What this rank holds is
        labelled with the plan's course and ``shard`` before anything received is kept, so
        a restart that stops the load halfway leaves no commit under another shard's label;
        a commit newer than the step is dropped first, so that it never bears the label of
        a course the plan begins (``state_plan``: the step that commit was of is abandoned)."""
        import torch.distributed as dist

        me = dist.get_rank(group)
        received: Any = None
        began = time.monotonic()
        for source, receiver in plan.transfers():
            if source == me:
                state_handover.send_state(self._shared(plan.step), [receiver], group)
            elif receiver == me:
                received = state_handover.recv_state(source, group)
        served = me in plan.sources
        if served:  # what it holds is not its group's shard at that step
            self.forget()
        else:  # a newer commit is abandoned: it never takes the label of a course begun here
            self._drop_after(plan.step)
        with self._lock:
            self._course, self._shard = plan.course, shard
        if not served:
            self.restore(plan.step)
            return plan.step, "memory"
        self._take(plan.step, received, plan.sources[me], began)
        return plan.step, "peer"

    def _fall_back(self, checkpoint: Callable[[], int | None] | None) -> tuple[int | None, str]:
        """Drop the commits kept (they belong to a course the job leaves) and run ``checkpoint``."""
        self.forget()
        if checkpoint is None:
            return None, "none"
        step = checkpoint()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise TypeError(
                "KeptState.restore_agreed: checkpoint() must return the step it loaded "
                f"(an int) or None, got {step!r}"
            )
        return step, "none" if step is None else "checkpoint"

    def forget(self) -> None:
        """Drop every commit kept; the buffers stay, for the next commits."""
        with self._lock:
            self._settle(wait=True)
            for slot in self._slots:
                slot.step = None
            self._last = None

    def _drop_after(self, step: int) -> None:
        """Drop the commits newer than ``step``."""
        with self._lock:
            self._settle(wait=True)
            for slot in self._slots:
                if slot.step is not None and slot.step > step:
                    slot.step = None
            self._settle(wait=False)  # the last complete commit is the one left

    def memory_bytes(self) -> int:
        """Bytes of tensor buffers held by both slots."""
        with self._lock:
            return sum(state_tree.nbytes(s.states) for s in self._slots)

    def _sendable(self, step: int) -> bool:
        """Whether a hand-over can send this rank's commit of ``step``: pickle takes what it
        holds besides tensors (not a local class, nor a lambda as a default factory). Where
        it cannot, it says why: a rank that needs the step falls back to the checkpoint."""
        with self._lock:
            slot = self._slots[self._index_of(step)]
            if slot.unpicklable is _Unknown:  # once per commit: its states do not change
                slot.unpicklable = state_tree.why_unpicklable(self._shared(step))
                if slot.unpicklable is not None:
                    log.warning("kept state of step %d cannot be handed over to another rank: %s",
                                step, slot.unpicklable)  # fmt: skip
            return slot.unpicklable is None

    def _shared(self, step: int) -> dict[str, Any]:
        """What the hand-over sends: the commit of ``step`` without the per-rank states."""
        with self._lock:
            states = self._slots[self._index_of(step)].states
            return {name: state for name, state in states.items() if name not in self._per_rank}

    def _take(self, step: int, received: dict[str, Any], source: int, began: float) -> None:
        """Keep a hand-over's states as this rank's commit of ``step``, with its own per-rank
        states, as if it had committed them (so that it holds the step, should its source be
        lost before the next commit), then load them. A registered object the hand-over
        lacks that is not per-rank is an error: every rank registered the same names (the
        agreement checked), so it was registered after ``source`` committed the step. A
        fault told since the receive ``began`` makes it no commit (``interrupted``)."""
        missing = [n for n in self._objects if n not in received and n not in self._per_rank]
        if missing:
            raise ValueError(
                f"KeptState.restore_agreed: step {step}, handed over by rank {source}, holds no "
                f"state of {missing}, registered after that step was committed; register every "
                "object before the commits it is to be restored from"
            )
        with self._lock:
            slot = self._write(step, received)  # copied before a loader can keep or change them
            slot.received_until = time.monotonic()  # (a per-rank state's device copy may run on)
            told = self._fault_told
            if told is not None and told >= began:  # told before this write: dropped here
                slot.interrupted = True
                self._settle(wait=False)
            for name, obj in self._objects.items():
                if name in received:
                    obj.load_state_dict(received[name])

    def _wall_of(self, step: int | None) -> float | None:
        """When the commit of ``step`` that a restore loads was made (the newer of two)."""
        with self._lock:
            if step is None or step not in self._complete_steps():
                return None
            return self._slots[self._index_of(step)].wall

    def _complete_steps(self) -> list[int]:
        return sorted((s.step for s in self._slots if s.step is not None), reverse=True)

    def _index_of(self, step: int | None) -> int:
        if step is None:
            return self._last  # type: ignore[return-value]
        order = [self._last, 1 - self._last] if self._last is not None else [0, 1]
        for index in order:  # the last commit first: a step committed twice is its newer copy
            if self._slots[index].step == step:
                return index
        raise ValueError(
            f"KeptState.restore: step {step} is not kept; the steps kept are {self._complete_steps()}"
        )

    def _settle(self, wait: bool) -> None:
        """Make a pending device copy the last complete commit once it has finished; drop
        the commits a fault spoilt (``interrupted``): the one before stands."""
        if self._pending is not None:
            slot = self._slots[self._pending]
            if wait:
                slot.wait()
            if slot.interrupted:  # it may copy what ran after an aborted collective
                slot.copied, slot.pending_step, slot.interrupted = None, None, False
                self._pending = None
            elif slot.finished():
                slot.copied = None
                slot.step, slot.pending_step = slot.pending_step, None
                self._last, self._pending = self._pending, None
        for index, slot in enumerate(self._slots):
            if index != self._pending and slot.interrupted:
                slot.step, slot.interrupted = None, False
        last = self._last
        if last is not None and self._slots[last].step is None:
            self._last = 1 - last if self._slots[1 - last].step is not None else None

    def interrupted(self, since: float) -> None:
        """A fault at ``since`` interrupted the step; called before the abort of its
        collectives and again after it. A device copy queued behind them would copy what the
        kernels after an aborted collective computed (an optimizer step over gradients never
        reduced): one not finished before the fault (or whose device cannot say), or queued
        after it, becomes no commit (the main thread drops it at its next look, ``_settle``).
        A commit made without a device copy is whole, but for a hand-over's whose receive
        ended after the fault: NCCL's receive returns once the abort lets its kernel end, over
        a buffer it may have filled in part. Takes no lock: the main thread may hold it,
        waiting for that very copy."""
        if self._fault_told is None or since > self._fault_told:
            self._fault_told = since
        pending = self._pending
        for index, slot in enumerate(self._slots):
            queued, received = slot.device_queued, slot.received_until
            late = queued is not None and queued >= since
            cut = received is not None and since <= received
            if late or cut or (index == pending and not _finished(slot)):
                slot.interrupted = True

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


def _finished(slot: _Slot) -> bool:
    """Whether ``slot``'s copy finished; not where the device cannot say (a CUDA error)."""
    try:
        return slot.finished()
    except Exception:
        return False


class RngState:
    """The random number generators' states (Python, torch CPU and CUDA, NumPy) as a Stateful."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        numpy = _numpy()
        if numpy is not None:
            state["numpy"] = numpy.random.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
        numpy = _numpy()
        if "numpy" in state and numpy is not None:
            numpy.random.set_state(state["numpy"])


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


__all__ = ["EventSink", "KeptState", "RngState", "Stateful"]
