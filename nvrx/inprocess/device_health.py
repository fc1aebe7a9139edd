"""Health checks of a rank's GPU, its NVLinks and the node's InfiniBand ports.

The reference's ``ChainedGPUHealthCheck``, ``ChainedNVLHealthCheck`` and
``ChainedNicHealthCheck``, under their names in ``inprocess.health_check``. The
Wrapper never adds them by itself: a job opts in through ``health_check=``.
Where what they read is missing (no ``pynvml``, no NVIDIA driver, a driver
without the recovery-action field, no InfiniBand), each says so once in the log
and passes, instead of failing every restart as the reference's GPU check does
on such hosts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from . import exception
from .health_check_base import HealthCheck
from .state import FrozenState

log = logging.getLogger(__name__)

#: NVML's names of the GPU recovery actions (``NVML_GPU_RECOVERY_ACTION_*``).
RECOVERY_ACTIONS = {
    0: "NONE",
    1: "GPU_RESET",
    2: "NODE_REBOOT",
    3: "DRAIN_P2P",
    4: "DRAIN_AND_RESET",
    5: "RECOVER_IMEX_DOMAIN",
    6: "BUS_RESET",
    7: "SYSTEM_REBOOT",
}
#: Where Linux lists InfiniBand devices.
INFINIBAND_SYSFS = "/sys/class/infiniband"

_said: set[str] = set()


def _say_once(key: str, message: str, *args: Any) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(message, *args)


def _device_index(device_index: int | None) -> int:
    if device_index is not None:
        return int(device_index)
    local_rank = os.environ.get("LOCAL_RANK", "")
    return int(local_rank) if local_rank.isdigit() else 0


class _Nvml:
    """One NVML session for a check: ``with _Nvml() as nvml`` (None without pynvml or a driver)."""

    def __enter__(self) -> ModuleType | None:
        try:
            import pynvml
        except ImportError:
            _say_once("pynvml", "GPU health checks skipped: pynvml is not installed (pip install nvidia-ml-py)")
            self.nvml = None
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            _say_once("nvmlInit", "GPU health checks skipped: NVML could not start (%s)", exc)
            self.nvml = None
            return None
        self.nvml = pynvml
        return pynvml

    def __exit__(self, *exc_info: object) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)


def _handle(nvml: ModuleType, index: int) -> Any:
    """The NVML handle of CUDA device ``index``, through ``CUDA_VISIBLE_DEVICES`` when it is set."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(index)


class ChainedGPUHealthCheck(HealthCheck):
    """The GPU is healthy when NVML asks for no recovery action on it.

    Reads NVML's ``GPU_RECOVERY_ACTION`` field of the rank's device (driver
    r570 or newer) and raises ``HealthCheckError`` naming the action NVML asks
    for (a GPU reset, a node reboot, ...).

    Args:
        device_index: CUDA device of the rank; None: ``LOCAL_RANK`` (else 0).
    """

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index

    def __call__(self, state: FrozenState) -> FrozenState:
        index = _device_index(self.device_index)
        with _Nvml() as nvml:
            if nvml is None:
                return state
            field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
            if field is None:
                _say_once("field", "GPU health check skipped: this pynvml has no GPU_RECOVERY_ACTION field")
                return state
            value = nvml.nvmlDeviceGetFieldValues(_handle(nvml, index), [field])[0]
            if value.nvmlReturn != nvml.NVML_SUCCESS:
                _say_once(
                    "driver", "GPU health check skipped: the driver does not report the GPU "
                    "recovery action (NVML return code %s; needs driver r570 or newer)",
                    value.nvmlReturn,
                )  # fmt: skip
                return state
            action = int(value.value.uiVal)
        if action != 0:
            name = RECOVERY_ACTIONS.get(action, str(action))
            raise exception.HealthCheckError(
                f"GPU {index}: NVML asks for recovery action {name} ({action})"
            )
        return state


class ChainedNVLHealthCheck(HealthCheck):
    """Log the NVLinks of the rank's GPU that went down since the first check; never raises.

    As in the reference, a link that is down does not take the rank out (its
    traffic falls back to other paths); the log names each link that was up
    at the first check and is not now.

    Args:
        device_index: CUDA device of the rank; None: ``LOCAL_RANK`` (else 0).
    """

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index
        self.links_up: set[int] | None = None

    def __call__(self, state: FrozenState) -> FrozenState:
        index = _device_index(self.device_index)
        with _Nvml() as nvml:
            if nvml is None:
                return state
            handle = _handle(nvml, index)
            up = set()
            for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                        up.add(link)
                except nvml.NVMLError:
                    continue  # no such link on this GPU
        if self.links_up is None:
            self.links_up = up
        elif down := sorted(self.links_up - up):
            log.warning("GPU %d: NVLink(s) %s went down (ignored, as in the reference)", index, down)
        return state


class ChainedNicHealthCheck(HealthCheck):
    """The node's InfiniBand ports are healthy while their ``link_downed`` counters stay put.

    The first call records each port's counter; a later call that finds one
    higher raises ``HealthCheckError`` naming the port and how often its link
    went down. Every port of the node is watched (the reference watches the
    NIC nearest to the GPU). No InfiniBand: passes.

    Args:
        device_index: kept for the reference's signature (every port is watched).
        sysfs_root: where the InfiniBand devices are listed.
    """

    def __init__(self, device_index: int | None = None, sysfs_root: str = INFINIBAND_SYSFS) -> None:
        self.device_index = device_index
        self.sysfs_root = Path(sysfs_root)
        self.baseline: dict[str, int] | None = None

    def _counters(self) -> dict[str, int]:
        counters = {}
        for path in sorted(self.sysfs_root.glob("*/ports/*/counters/link_downed")):
            port = f"{path.parents[3].name} port {path.parents[1].name}"
            try:
                counters[port] = int(path.read_text().strip())
            except (OSError, ValueError) as exc:
                log.warning("NIC health check: cannot read %s: %s", path, exc)
        return counters

    def __call__(self, state: FrozenState) -> FrozenState:
        now = self._counters()
        if not now:
            _say_once("ib", "NIC health check: no InfiniBand port under %s", self.sysfs_root)
        if self.baseline is None:
            self.baseline = now
            return state
        downed = {p: n - self.baseline.get(p, n) for p, n in now.items() if n > self.baseline.get(p, n)}
        self.baseline = now
        if downed:
            detail = ", ".join(f"{port}: {n} time(s)" for port, n in sorted(downed.items()))
            raise exception.HealthCheckError(f"InfiniBand link went down since the last check ({detail})")
        return state


__all__ = ["ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck"]
