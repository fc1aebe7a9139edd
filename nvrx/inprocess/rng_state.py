"""The random number generators' states as one object that ``KeptState`` can keep."""

from __future__ import annotations

import random
from typing import Any

import torch


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


__all__ = ["RngState"]
