"""Kept state: the training progress copied into host memory at the end of a step.

An in-process restart keeps every rank's process, so what a rank copied into its own
memory survives the fault: restoring it loses at most the step that was running, where a
file checkpoint loses every step since it was written. ``KeptState`` holds what defines
the progress (model, optimizer, scheduler, data position, RNG states: anything with
``state_dict``/``load_state_dict``), registered once by name, and copies it on ``commit``:

    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    kept.register("rng", RngState())
    for step in range(kept.restore_agreed() or 0, steps):   # None: nothing every rank kept
        train_step()
        kept.commit(step + 1)

Two slots: a commit writes the slot that is not the last complete commit, and makes it the
last only once every object was copied, so a fault during a commit (an exception, a
restart raised in the middle) leaves the previous commit whole. Tensors are copied into
buffers kept from one commit to the next (allocated again only when a shape or dtype
changes); CUDA tensors go to pinned host buffers on a side stream, and the slot becomes
the last complete commit when that copy has finished (checked at the next commit or
restore), so the step does not wait for it.

Ranks may hold different steps after a fault (one was committing when it came):
``restore_agreed`` restores the newest step every rank that holds kept state holds, through
one collective of the new process group, and broadcasts it to the ranks that hold none (a
replacement process, a spare) from the lowest rank that holds it. That suits data
parallelism, where every rank holds the whole state; sharded state (replica groups) is not
handled here.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


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


class _Slot:
    """One copy of every registered object's state, with the buffers its tensors live in."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.states: dict[str, Any] = {}
        self.copied: Any = None  # a CUDA event while a device-to-host copy may still run

    def finished(self) -> bool:
        """Whether the copy into this slot is complete (waits for nothing)."""
        return self.copied is None or self.copied.query()

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


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
        self._slots = (_Slot(), _Slot())
        self._last: int | None = None  # index of the last complete commit's slot
        self._pending: int | None = None  # index of a slot whose device copy may still run
        self._stream: Any = None
        self._lock = threading.Lock()

    def register(self, name: str, obj: Stateful) -> None:
        """Keep ``obj``'s state under ``name`` from the next commit on."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"KeptState.register: name must be a non-empty str, got {name!r}")
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(
                f"KeptState.register({name!r}): {type(obj).__name__} has no {' or '.join(missing)}; "
                "register objects with state_dict()/load_state_dict(), or wrap the value in one"
            )
        with self._lock:
            if name in self._objects:
                raise ValueError(f"KeptState.register: {name!r} is registered already")
            self._objects[name] = obj

    @property
    def step(self) -> int | None:
        """The step of the last complete commit, None before the first."""
        with self._lock:
            self._settle(wait=False)
            return None if self._last is None else self._slots[self._last].step

    def commit(self, step: int) -> bool:
        """Copy every registered state as that of ``step``, when ``step`` is a multiple of
        ``every``; whether it copied. The previous commit stays whole until this one is."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"KeptState.commit: step must be an int ≥ 0, got {step!r}")
        with self._lock:
            if not self._objects:
                raise RuntimeError("KeptState.commit: nothing is registered; call register(name, obj) first")
            if step % self.every:
                return False
            self._settle(wait=True)
            index = 0 if self._last == 1 else 1
            slot = self._slots[index]
            slot.step = None  # torn until the copy below completes
            copier = _Copier(self._side_stream)
            for name, obj in self._objects.items():
                slot.states[name] = copier.copy(obj.state_dict(), slot.states.get(name))
            slot.copied = copier.finish()
            slot.step = step
            if slot.copied is None:
                self._last = index
            else:
                self._pending = index
            return True

    def steps(self) -> list[int]:
        """The steps of the complete commits held, newest first (at most two)."""
        with self._lock:
            self._settle(wait=True)
            return [step for step in self._complete_steps() if step is not None]

    def restore(self, step: int | None = None) -> int | None:
        """Load a complete commit into the registered objects: that of ``step`` (one of
        ``steps()``), else the last; the step loaded, None when nothing is kept."""
        with self._lock:
            self._settle(wait=True)
            if self._last is None:
                return None
            slot = self._slot_of(step)
            for name, obj in self._objects.items():
                if name in slot.states:
                    obj.load_state_dict(_fresh(slot.states[name]))
            return slot.step

    def restore_agreed(self, group: Any = None) -> int | None:
        """Restore the newest step that every rank of ``group`` (the default process group
        when None) holding kept state holds, and hand it to the ranks that hold none (a
        replacement process, a spare): they receive it from the lowest rank that holds it,
        which suits data parallelism, where every rank holds the whole state. The step
        restored, None when no step is held by every holder, or nobody holds any (restore
        your checkpoint then). A collective: every rank of the group calls it, after
        ``init_process_group`` in the round that follows a fault."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.steps(), group=group)
        holders = [rank for rank, steps in enumerate(everyone) if steps]
        common = set(everyone[holders[0]]).intersection(*(everyone[r] for r in holders[1:])) if holders else set()
        if not common:
            return None
        step = max(common)
        if everyone[dist.get_rank(group)]:
            self.restore(step)
        if len(holders) < len(everyone):
            self._hand_over(step, holders[0], group)
        return step

    def _hand_over(self, step: int, source: int, group: Any) -> None:
        """Broadcast the commit of ``step`` from ``source`` (a rank of ``group``); the ranks
        that hold no kept state load it, the other holders drop what they receive."""
        import torch.distributed as dist

        me = dist.get_rank(group)
        with self._lock:
            states = self._slot_of(step).states if me == source else None
            skeleton = [_skeleton(states)]
            src = source if group is None else dist.get_global_rank(group, source)
            dist.broadcast_object_list(skeleton, src=src, group=group)
            received = _fill(skeleton[0], lambda t: _broadcast(t, src, group, me == source))
            if me == source or self._last is not None:
                return
            for name, obj in self._objects.items():
                if name in received:
                    obj.load_state_dict(received[name])

    def _complete_steps(self) -> list[int | None]:
        if self._last is None:
            return []
        return [self._slots[self._last].step, self._slots[1 - self._last].step]

    def _slot_of(self, step: int | None) -> _Slot:
        if step is None:
            return self._slots[self._last]  # type: ignore[index]
        for slot in self._slots:
            if slot.step == step and slot.step is not None:
                return slot
        held = [s for s in self._complete_steps() if s is not None]
        raise ValueError(f"KeptState.restore: step {step} is not kept; the steps kept are {held}")

    def memory_bytes(self) -> int:
        """Bytes of tensor buffers held by both slots."""
        with self._lock:
            return sum(_tensor_bytes(s.states) for s in self._slots)

    def _settle(self, wait: bool) -> None:
        """Make a pending device copy the last complete commit once it has finished."""
        if self._pending is None:
            return
        slot = self._slots[self._pending]
        if wait:
            slot.wait()
        if slot.finished():
            slot.copied = None
            self._last, self._pending = self._pending, None

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


class _Copier:
    """Copies one commit's states into a slot's buffers, reusing them where shapes match."""

    def __init__(self, side_stream: Callable[[], Any]) -> None:
        self._side_stream = side_stream
        self._stream: Any = None

    def copy(self, value: Any, into: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, into if isinstance(into, torch.Tensor) else None)
        if isinstance(value, dict):
            old = into if isinstance(into, dict) else {}
            return _like(value, [(k, self.copy(v, old.get(k))) for k, v in value.items()])
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            old = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
            return type(value)([self.copy(v, o) for v, o in zip(value, old, strict=True)])
        return copy.deepcopy(value)

    def finish(self) -> Any:
        """A CUDA event the copies end with, None when none ran on a device."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _tensor(self, tensor: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        tensor = tensor.detach()
        on_device = tensor.device.type == "cuda"
        if into is None or into.shape != tensor.shape or into.dtype != tensor.dtype \
                or into.device.type != "cpu" or into.is_pinned() != on_device:
            into = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_device)
        if not on_device:
            into.copy_(tensor)
            return into
        if self._stream is None:
            self._stream = self._side_stream()
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            into.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)
        return into


class _TensorSpec:
    """Where a tensor stands in a broadcast skeleton: its shape and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        self.tensor = tensor  # on the source only; not pickled

    def __getstate__(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "tensor": None}


def _skeleton(value: Any) -> Any:
    """``value`` with every tensor replaced by a ``_TensorSpec`` (sent as an object)."""
    if isinstance(value, torch.Tensor):
        return _TensorSpec(value)
    if isinstance(value, dict):
        return _like(value, [(k, _skeleton(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)([_skeleton(v) for v in value])
    return value


def _fill(value: Any, tensor_of: Callable[[_TensorSpec], torch.Tensor]) -> Any:
    """The skeleton ``value`` with each ``_TensorSpec`` replaced by ``tensor_of(spec)``, in order."""
    if isinstance(value, _TensorSpec):
        return tensor_of(value)
    if isinstance(value, dict):
        return _like(value, [(k, _fill(v, tensor_of)) for k, v in value.items()])
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)([_fill(v, tensor_of) for v in value])
    return value


def _broadcast(spec: _TensorSpec, src: int, group: Any, sending: bool) -> torch.Tensor:
    """One tensor of the hand-over, sent from ``src``: ours when sending, else a new one.
    NCCL moves device tensors only: there it travels through the current CUDA device."""
    import torch.distributed as dist

    tensor = spec.tensor if sending else torch.empty(spec.shape, dtype=spec.dtype)
    if dist.get_backend(group) != "nccl":
        dist.broadcast(tensor, src=src, group=group)
        return tensor
    on_device = tensor.to(torch.cuda.current_device())
    dist.broadcast(on_device, src=src, group=group)
    return on_device.cpu()


def _fresh(value: Any) -> Any:
    """``value`` with every tensor cloned: loaders may keep the tensors they are given
    (an optimizer does), and the slot's buffers are written again by later commits."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return _like(value, [(k, _fresh(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)([_fresh(v) for v in value])
    return copy.deepcopy(value)


def _like(mapping: dict, items: list[tuple[Any, Any]]) -> dict:
    """A mapping of ``mapping``'s type holding ``items`` (a plain dict where that type
    cannot be built from pairs, as ``defaultdict``)."""
    try:
        return type(mapping)(items)
    except TypeError:
        return dict(items)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


__all__ = ["KeptState", "RngState", "Stateful"]
