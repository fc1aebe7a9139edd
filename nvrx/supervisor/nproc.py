"""``--nproc-per-node N|auto|cpu|gpu``: torchrun's keywords, without importing torch.

``cpu`` is the CPUs this process may run on (its affinity mask, as torchrun
counts them); ``gpu`` the NVIDIA GPUs this process may use; ``auto`` the GPUs
when there are any, else the CPUs. GPUs are the devices the NVIDIA driver lists
under ``/proc/driver/nvidia/gpus``, narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA
reads it. The supervisor imports no torch, so it does not ask torch; other
accelerators (AMD, ...) are not counted: ``auto`` then means the CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

KEYWORDS = ("auto", "cpu", "gpu")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def cpu_count() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _visible(entries: str) -> list[str]:
    """The devices ``CUDA_VISIBLE_DEVICES`` names, as CUDA reads it: ordinals or ``GPU-``/
    ``MIG-`` identifiers up to the first entry that is neither; a repeated one hides all."""
    devices: list[str] = []
    for entry in (e.strip() for e in entries.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        if entry in devices:
            return []
        devices.append(entry)
    return devices


def installed_gpus(driver_dir: Path = NVIDIA_GPUS) -> int:
    """The NVIDIA GPUs the driver lists (none where there is no driver)."""
    try:
        return sum(1 for _ in driver_dir.iterdir())
    except OSError:
        return 0


def gpu_count(env: Mapping[str, str], driver_dir: Path = NVIDIA_GPUS) -> int:
    """NVIDIA GPUs visible to the children: the driver's devices, narrowed by
    ``CUDA_VISIBLE_DEVICES`` when it is set."""
    installed = installed_gpus(driver_dir)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    devices = _visible(visible)
    if installed:  # CUDA also stops at an ordinal the machine does not have
        for k, device in enumerate(devices):
            if device.isdigit() and int(device) >= installed:
                return k
    return len(devices) if installed else 0


def resolve(value: str, env: Mapping[str, str], driver_dir: Path = NVIDIA_GPUS) -> int:
    """The number of processes ``value`` asks for; ValueError naming the problem."""
    try:
        count = int(value)
    except ValueError:
        count = None
    if count is not None:
        if count < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {count}")
        return count
    if value not in KEYWORDS:
        raise ValueError(
            f"--nproc-per-node must be a number or one of {', '.join(KEYWORDS)}, got {value!r}"
        )
    gpus = 0 if value == "cpu" else gpu_count(env, driver_dir)
    if value == "gpu" and gpus == 0:
        hidden = env.get("CUDA_VISIBLE_DEVICES")
        why = f"the NVIDIA driver lists none under {driver_dir}"  # first: the variable only narrows
        if hidden is not None:
            why = (
                f"CUDA_VISIBLE_DEVICES={hidden!r} names none"
                if installed_gpus(driver_dir)
                else f"{why}, and CUDA_VISIBLE_DEVICES={hidden!r} only narrows what it lists"
            )
        raise ValueError(f"--nproc-per-node gpu: no GPU visible ({why}); give a number instead")
    return gpus if gpus > 0 else cpu_count()
