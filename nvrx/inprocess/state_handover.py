"""Handing kept state from one rank to others over a process group: the wire format.

The source sends, in order: one object (``broadcast_object_list``), the state with each
tensor replaced by its shape and dtype; then each tensor (``broadcast``), in the order
``state_tree.map_leaves`` visits them. Every rank of the group takes part; the ranks that
receive build the tensors from the shapes. NCCL moves device tensors only: there each
tensor travels through the current CUDA device.
"""

from __future__ import annotations

from typing import Any

import torch

from nvrx.inprocess import state_tree


class _TensorSpec:
    """A tensor's place in the object sent first: its shape and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        self.tensor: torch.Tensor | None = tensor  # on the source only: never pickled

    def __getstate__(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "tensor": None}


def broadcast_state(state: Any, source: int, group: Any = None) -> Any:
    """``state`` of the rank ``source`` of ``group`` (the default group when None), on every
    rank; the source passes its state, the others anything (ignored). A collective."""
    import torch.distributed as dist

    me = dist.get_rank(group)
    src = source if group is None else dist.get_global_rank(group, source)
    skeleton = [state_tree.map_leaves(state, lambda t, _: _TensorSpec(t)) if me == source else None]
    dist.broadcast_object_list(skeleton, src=src, group=group)
    nccl = dist.get_backend(group) == "nccl"
    return state_tree.map_leaves(
        skeleton[0], lambda spec, _: _move(spec, src, group, me == source, nccl), leaf=_TensorSpec
    )


def _move(spec: _TensorSpec, src: int, group: Any, sending: bool, nccl: bool) -> torch.Tensor:
    import torch.distributed as dist

    tensor = spec.tensor if sending and spec.tensor is not None else torch.empty(spec.shape, dtype=spec.dtype)
    if not nccl:
        dist.broadcast(tensor, src=src, group=group)
        return tensor
    on_device = tensor.to(torch.cuda.current_device())
    dist.broadcast(on_device, src=src, group=group)
    return on_device.cpu()


__all__ = ["broadcast_state"]
