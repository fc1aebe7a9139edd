"""Handing kept state from one rank to others over a process group: the wire format.

Point to point, from the source to each receiving rank in turn, nothing to the others:
one object (``send_object_list``), the state with each tensor replaced by its shape and
dtype; then each tensor (``send``), in the order ``state_tree.map_leaves`` visits them.
The receivers build the tensors from the shapes. Ranks are those of the group. NCCL moves
device tensors only: there each tensor travels through the current CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nvrx.inprocess import state_tree


class _TensorSpec:
    """A tensor's place in the object sent first: its shape and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def send_state(state: Any, receivers: Iterable[int], group: Any = None) -> None:
    """Send ``state`` to each of ``receivers`` (ranks of ``group``, the default group when None)."""
    import torch.distributed as dist

    nccl = dist.get_backend(group) == "nccl"
    skeleton = state_tree.map_leaves(state, lambda t, _: _TensorSpec(t))
    tensors = list(state_tree.tensors(state))
    for rank in receivers:
        dist.send_object_list([skeleton], group=group, group_dst=rank)
        for tensor in tensors:
            dist.send(_on_wire(tensor, nccl), group=group, group_dst=rank)


def recv_state(source: int, group: Any = None) -> Any:
    """The state ``source`` (a rank of ``group``) sends this rank with ``send_state``."""
    import torch.distributed as dist

    nccl = dist.get_backend(group) == "nccl"
    skeleton: list[Any] = [None]
    dist.recv_object_list(skeleton, group=group, group_src=source)

    def receive(spec: _TensorSpec, _: Any) -> torch.Tensor:
        tensor = _on_wire(torch.empty(spec.shape, dtype=spec.dtype), nccl)
        dist.recv(tensor, group=group, group_src=source)
        return tensor.cpu()

    return state_tree.map_leaves(skeleton[0], receive, leaf=_TensorSpec)


def _on_wire(tensor: torch.Tensor, nccl: bool) -> torch.Tensor:
    return tensor.to(torch.cuda.current_device()) if nccl else tensor


__all__ = ["recv_state", "send_state"]
