"""Nested training state: the dicts, lists, tuples and namedtuples of tensors and plain
values that ``state_dict()`` returns, rebuilt with each tensor mapped, and copied into host
buffers kept from one commit to the next.

Containers keep their type, attributes and order (a module's state dict carries its
versions in ``_metadata``, a ``defaultdict`` its default factory); plain values are
deep-copied, so a rebuilt tree shares nothing mutable with the one it came from.

``Copier``: a CPU tensor is copied into a buffer of the same shape and dtype (allocated
again only when they change). A CUDA tensor is first cloned on the device, on the current
stream, so that the next step's in-place updates do not race the copy, then copied into a
pinned host buffer on a side stream; ``Copier.finish`` gives the CUDA event that copy ends
with.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch


def map_leaves(value: Any, fn: Callable[[Any, Any], Any], like: Any = None, leaf: type = torch.Tensor) -> Any:
    """``value`` with each ``leaf`` instance ``x`` replaced by ``fn(x, counterpart)``, where
    ``counterpart`` is what stands at the same place in ``like`` (None where nothing does).
    A plain value that cannot be deep-copied is refused with its place in ``value``."""
    try:
        return _map(value, fn, like, leaf)
    except _Refused as refused:
        raise refused.error() from refused.cause


class _Refused(Exception):
    """A plain value ``copy.deepcopy`` refused, or a tensor no buffer takes (sparse, meta,
    quantized). Each container it is in adds its key as the exception passes through, so
    that no place is built while every copy succeeds."""

    def __init__(self, value: Any, cause: Exception) -> None:
        super().__init__()
        self.value, self.cause = value, cause
        self.keys: list[str] = []  # innermost first

    def error(self) -> TypeError:
        """The error the caller gets: the value's type, its place and why it was refused."""
        kind = f"{type(self.value).__module__}.{type(self.value).__qualname__}"
        place = "".join(reversed(self.keys)) or "the top"
        return TypeError(
            f"the value at {place} (a {kind}) cannot be copied: kept state copies dense tensors "
            f"and deep-copies every other value ({type(self.cause).__name__}: {self.cause})"
        )


def _map(value: Any, fn: Callable[[Any, Any], Any], like: Any, leaf: type) -> Any:
    """``map_leaves`` inside its top: a value deepcopy refuses passes up as ``_Refused``."""
    if isinstance(value, leaf):
        return fn(value, like if isinstance(like, leaf) else None)
    if isinstance(value, dict):
        old = like if isinstance(like, dict) else {}
        pairs: list[tuple[Any, Any]] = []
        try:
            for key, item in value.items():
                pairs.append((key, _map(item, fn, old.get(key), leaf)))
        except _Refused as refused:
            refused.keys.append(f"[{key!r}]")
            raise
        return _mapping_like(value, pairs)
    if isinstance(value, (list, tuple)):
        same = isinstance(like, (list, tuple)) and len(like) == len(value)
        olds = like if same else [None] * len(value)
        items = []
        try:
            for item, old_item in zip(value, olds, strict=True):
                items.append(_map(item, fn, old_item, leaf))
        except _Refused as refused:
            refused.keys.append(f"[{len(items)}]")  # the items before it were mapped
            raise
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    try:
        return copy.deepcopy(value)
    except Exception as error:  # a lock, a generator, an open file: state_dict() must not hold one
        raise _Refused(value, error) from error


class _SkeletonPickler(pickle.Pickler):
    """Pickles what a hand-over pickles of a state (``state_handover``), tensors aside."""

    def persistent_id(self, obj: Any) -> Any:
        return 0 if isinstance(obj, torch.Tensor) else None


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickles(value: Any) -> BaseException | None:
    try:
        _SkeletonPickler(_Sink(), protocol=pickle.DEFAULT_PROTOCOL).dump(value)  # as torch's
    except Exception as error:  # pickle raises what the object's reduction raises
        return error
    return None


def why_unpicklable(value: Any) -> str | None:
    """Where and why pickle refuses ``value``, its tensors aside (a local class, a lambda
    as a default factory): a hand-over to another rank sends a state so. None when it
    takes it."""
    error = _pickles(value)
    if error is None:
        return None
    place, refused = "", value
    while True:
        inner = _refused_item(refused)
        if inner is None:
            break
        step, refused = inner
        place += step
        error = _pickles(refused) or error
    kind = f"{type(refused).__module__}.{type(refused).__qualname__}"
    return f"pickle refuses the value at {place or 'the top'} (a {kind}): {type(error).__name__}: {error}"


def _refused_item(value: Any) -> tuple[str, Any] | None:
    """(its key, the item) of the first item of container ``value`` that pickle refuses;
    None when none is (the container itself is refused, or ``value`` is no container)."""
    if isinstance(value, dict):
        items: Iterator[tuple[str, Any]] = ((f"[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next(((step, item) for step, item in items if _pickles(item) is not None), None)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``value``, in the order ``map_leaves`` visits them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


def nbytes(value: Any) -> int:
    """Bytes of the tensors of ``value``."""
    return sum(t.numel() * t.element_size() for t in tensors(value))


def _mapping_like(mapping: dict, items: list[tuple[Any, Any]]) -> dict:
    """A mapping of ``mapping``'s type and attributes holding ``items``, in their order.

    Not built by calling the type with the pairs: a ``Counter`` would count them, a
    ``defaultdict`` takes its default factory first, and a subclass's constructor may take
    other arguments. A subclass is rebuilt from a shallow copy (which keeps what its copy
    protocol keeps: a default factory, the attributes), emptied and filled item by item; one
    that cannot be copied or filled so is refused, by name, rather than turned into another
    type."""
    if type(mapping) is dict:
        return dict(items)
    try:
        out = copy.copy(mapping)
        out.clear()
        for key, value in items:
            out[key] = value
    except Exception as error:
        kind = f"{type(mapping).__module__}.{type(mapping).__qualname__}"
        raise TypeError(
            f"cannot rebuild a {kind} of the kept state: a dict subclass must support "
            f"copy.copy, clear() and item assignment ({type(error).__name__}: {error})"
        ) from error
    attributes = getattr(mapping, "__dict__", None)
    if attributes:
        out.__dict__.update(copy.deepcopy(attributes))
    return out


class Copier:
    """Copies one commit's states into a slot's buffers, reusing them where shapes match."""

    def __init__(self, side_stream: Callable[[], Any]) -> None:
        self._side_stream = side_stream
        self._stream: Any = None

    def copy(self, value: Any, into: Any) -> Any:
        return map_leaves(value, self._copied, into)

    def _copied(self, tensor: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        odd = tensor.layout != torch.strided or tensor.is_nested
        if odd or tensor.is_quantized or tensor.is_meta:
            kind = "nested" if tensor.is_nested else "quantized" if tensor.is_quantized else (
                "meta" if tensor.is_meta else str(tensor.layout))  # fmt: skip
            raise _Refused(tensor, TypeError(f"a {kind} tensor has no dense copy"))
        try:
            return self._tensor(tensor, into)
        except NotImplementedError as error:  # a dtype copy_ does not take (torch.int4, say)
            raise _Refused(tensor, error) from error

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
        reusable = (
            into is not None
            and into.shape == tensor.shape
            and into.dtype == tensor.dtype
            and into.device.type == "cpu"
            and into.is_pinned() == on_device
        )
        if not reusable:
            into = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_device)
        if not on_device:
            into.copy_(tensor)
            return into
        current = torch.cuda.current_device()
        if tensor.device.index not in (None, current):
            # torch would copy it on its own device's stream, which the side stream's event
            # does not cover: the commit could be taken as complete before its copy is
            raise ValueError(
                f"KeptState.commit: a tensor is on {tensor.device} but the current CUDA device "
                f"is cuda:{current}; call torch.cuda.set_device({tensor.device.index}) before "
                "training (kept state copies the current device's tensors)"
            )
        staging = tensor.clone()  # on the current stream: later in-place updates leave it alone
        if self._stream is None:
            self._stream = self._side_stream()
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            into.copy_(staging, non_blocking=True)
        staging.record_stream(self._stream)
        return into


def fresh(value: Any) -> Any:
    """``value`` with every tensor cloned: loaders may keep the tensors they are given
    (an optimizer does), and the slot's buffers are written again by later commits."""
    return map_leaves(value, lambda t, _: t.clone())


__all__ = ["Copier", "fresh", "map_leaves", "nbytes", "tensors"]
