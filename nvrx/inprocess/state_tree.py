"""Nested training state: the dicts, lists, tuples and namedtuples of tensors and plain
values that ``state_dict()`` returns, rebuilt with each tensor mapped.

Containers keep their type and attributes (a module's state dict carries its versions in
``_metadata``); plain values are deep-copied, so a rebuilt tree shares nothing mutable with
the one it came from.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch


def map_leaves(value: Any, fn: Callable[[Any, Any], Any], like: Any = None, leaf: type = torch.Tensor) -> Any:
    """``value`` with each ``leaf`` instance ``x`` replaced by ``fn(x, counterpart)``, where
    ``counterpart`` is what stands at the same place in ``like`` (None where nothing does)."""
    if isinstance(value, leaf):
        return fn(value, like if isinstance(like, leaf) else None)
    if isinstance(value, dict):
        old = like if isinstance(like, dict) else {}
        return _mapping_like(value, [(k, map_leaves(v, fn, old.get(k), leaf)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        same = isinstance(like, (list, tuple)) and len(like) == len(value)
        old = like if same else [None] * len(value)
        items = [map_leaves(v, fn, o, leaf) for v, o in zip(value, old, strict=True)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return copy.deepcopy(value)


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
    """A mapping of ``mapping``'s type and attributes holding ``items`` (a plain dict where
    that type cannot be built from pairs, as ``defaultdict``)."""
    try:
        out = type(mapping)(items)
    except TypeError:
        return dict(items)
    attributes = getattr(mapping, "__dict__", None)
    if attributes:
        out.__dict__.update(copy.deepcopy(attributes))
    return out


__all__ = ["map_leaves", "nbytes", "tensors"]
