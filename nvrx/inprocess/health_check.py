"""Health-check plug-ins: decide whether this rank may take part in the next round.

The reference offers every check from this module: the device checks of
``device_health`` too, which build on ``HealthCheck`` of ``health_check_base``.
"""

from __future__ import annotations

import datetime
import os
import threading

from . import exception
from .device_health import ChainedGPUHealthCheck, ChainedNicHealthCheck, ChainedNVLHealthCheck
from .finalize import as_seconds, join_in_slices
from .health_check_base import HealthCheck
from .state import FrozenState


class CudaHealthCheck(HealthCheck):
    """Check that this process's CUDA context still works, by synchronizing with the GPU.

    A no-op unless CUDA is already initialized in this process: it never
    initializes CUDA, never loads NVML and never touches a GPU on a CPU host
    (where the reference's automatic GPU checks fail every restart). The device
    is ``LOCAL_RANK``'s, else the current one. A synchronization that does not
    finish within ``timeout`` raises ``exception.TimeoutError``; a CUDA error
    (a device-side assert, say) is raised in the calling thread as torch raised it.

    Args:
        timeout: limit for the synchronization (timedelta or seconds).
    """

    def __init__(
        self, timeout: datetime.timedelta | float = datetime.timedelta(seconds=30)
    ) -> None:
        self._timeout_s = as_seconds(timeout, "CudaHealthCheck timeout")
        self.timeout = timeout

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            import torch
        except ImportError:
            return state
        if not torch.cuda.is_initialized():
            return state
        local_rank = os.environ.get("LOCAL_RANK")
        device = torch.device(
            "cuda", int(local_rank) if local_rank else torch.cuda.current_device()
        )
        failed: list[BaseException] = []

        def synchronize() -> None:
            try:
                torch.cuda.synchronize(device)
            except BaseException as exc:  # raised again in the calling thread
                failed.append(exc)

        thread = threading.Thread(target=synchronize, name="CudaHealthCheckSync", daemon=True)
        thread.start()
        join_in_slices(thread, self._timeout_s)
        if thread.is_alive():
            raise exception.TimeoutError(
                f"CudaHealthCheck: torch.cuda.synchronize({device}) did not finish within "
                f"{self._timeout_s:g} s"
            )
        if failed:
            raise failed[0]
        return state


class FaultCounterExceeded(exception.RestartError):
    """This rank caused more faults than ``FaultCounter.max_rank_faults`` allows."""


class FaultCounter(HealthCheck):
    """Count the rounds in which THIS rank's function raised; stop the rank past a limit.

    Args:
        max_rank_faults: faults allowed; the next one raises
            ``FaultCounterExceeded``. None: count without limit.
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        if max_rank_faults is not None and (
            isinstance(max_rank_faults, bool)
            or not isinstance(max_rank_faults, int)
            or max_rank_faults < 0
        ):
            raise ValueError(
                f"FaultCounter: max_rank_faults must be an int >= 0 or None, got {max_rank_faults!r}"
            )
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.fn_exception is None:
            return state
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"rank {state.initial_rank} faulted {self.faults_count} times, more than "
                f"max_rank_faults={self.max_rank_faults} (last: {type(state.fn_exception).__name__})"
            )
        return state

    def reset(self) -> None:
        """Forget the faults counted so far."""
        self.faults_count = 0


__all__ = [
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "CudaHealthCheck",
    "FaultCounter",
    "FaultCounterExceeded",
    "HealthCheck",
]
