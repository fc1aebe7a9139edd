"""Copying a state into host buffers kept from one commit to the next, and out again.

A CPU tensor is copied into a buffer of the same shape and dtype (allocated again only
when they change). A CUDA tensor is first cloned on the device, on the current stream, so
that the next step's in-place updates do not race the copy, then copied into a pinned host
buffer on a side stream; ``Copier.finish`` gives the CUDA event that copy ends with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nvrx.inprocess import state_tree


class Copier:
    """Copies one commit's states into a slot's buffers, reusing them where shapes match."""

    def __init__(self, side_stream: Callable[[], Any]) -> None:
        self._side_stream = side_stream
        self._stream: Any = None

    def copy(self, value: Any, into: Any) -> Any:
        return state_tree.map_leaves(value, self._tensor, into)

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
    return state_tree.map_leaves(value, lambda t, _: t.clone())


__all__ = ["Copier", "fresh"]
