"""``--nproc-per-node N|auto|cpu|gpu``: torchrun's keywords, without importing torch.

``cpu`` is the CPUs this process may run on (its affinity mask, as torchrun
counts them); ``gpu`` the NVIDIA GPUs this process may use; ``auto`` the GPUs
when there are any, else the CPUs. GPUs are counted the way the CUDA driver
will show them to the children: ``CUDA_VISIBLE_DEVICES`` when set, else the
devices the NVIDIA driver lists under ``/proc/driver/nvidia/gpus``. The
supervisor imports no torch, so it does not ask torch.
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


def gpu_count(env: Mapping[str, str], driver_dir: Path = NVIDIA_GPUS) -> int:
    """NVIDIA GPUs visible to the children: ``CUDA_VISIBLE_DEVICES``, else the driver's list."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA stops at the first entry that is not a device ("-1", empty): count up to it
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    try:
        return sum(1 for _ in driver_dir.iterdir())
    except OSError:
        return 0


def resolve(value: str, env: Mapping[str, str], driver_dir: Path = NVIDIA_GPUS) -> int:
    """The number of processes ``value`` asks for; ValueError naming the problem."""
    if value.strip().lstrip("-").isdigit():
        count = int(value)
        if count < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {count}")
        return count
    if value not in KEYWORDS:
        raise ValueError(
            f"--nproc-per-node must be a number or one of {', '.join(KEYWORDS)}, got {value!r}"
        )
    gpus = 0 if value == "cpu" else gpu_count(env, driver_dir)
    if value == "gpu" and gpus == 0:
        raise ValueError(
            "--nproc-per-node gpu: no GPU visible (CUDA_VISIBLE_DEVICES empty or unset, and no "
            f"NVIDIA driver devices under {driver_dir}); give a number instead"
        )
    return gpus if gpus > 0 else cpu_count()
