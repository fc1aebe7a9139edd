"""What the two fault-tolerance examples share: options, a tiny DDP step, checkpoints, an injected hang.

Not an API: ``ft_heartbeats.py`` and ``ft_sections.py`` import it so that each
shows only how it talks to ``nvrx.fault_tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: Set to 1 in the environment of a node's supervisor whose ranks ``--slow`` slows down.
SLOW_ENV = "FT_EXAMPLE_SLOW_NODE"


def options(description: str, hang_places: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of 'compute' per step")
    parser.add_argument("--checkpoint-dir", default="ft_checkpoints", help="where each rank saves")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--calc-after", type=int, default=None, metavar="STEP",
                        help="compute the timeouts from what was observed at this step")  # fmt: skip
    parser.add_argument("--hang", default=None, metavar="RANK:STEP" + (":WHERE" if hang_places else ""),
                        help="this rank hangs once at this step (first attempt only)"
                        + (f"; WHERE is one of {', '.join(hang_places)}" if hang_places else ""))  # fmt: skip
    parser.add_argument("--fail", default=None, metavar="RANK:STEP",
                        help="this rank raises once at this step (first attempt only)")  # fmt: skip
    parser.add_argument("--slow", default=None, metavar="STEP:FACTOR",
                        help="from this step on, the 'compute' of the ranks started with "
                        f"${SLOW_ENV}=1 in their environment (a node's supervisor started with "
                        "it) takes FACTOR times as long: a slow node")  # fmt: skip
    parser.add_argument("--control", default=None, metavar="RANK:STEP:ACTION",
                        help="this rank sends a workload-control request (ExcludeThisNode or "
                        "ShutdownWorkload) at this step (first attempt only)")  # fmt: skip
    return parser.parse_args()


def setup() -> tuple[int, int]:
    """Join the process group (a new one after every process restart); (rank, attempt)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return dist.get_rank(), int(os.environ.get("NVRX_RESTART_COUNT", "0"))


def train_step(weights: torch.Tensor, step_time: float, client: Any = None) -> None:
    """One data-parallel step: local 'compute', then the gradient all_reduce; with a
    ``RankMonitorClient``, the compute's time (not the all_reduce's wait) is recorded."""
    if client is None:
        time.sleep(step_time)
    else:
        with client.timed_step():
            time.sleep(step_time)
    grad = torch.ones_like(weights)
    dist.all_reduce(grad)
    weights -= 0.01 * grad / dist.get_world_size()


def step_time(base: float, spec: str | None, step: int) -> float:
    """The 'compute' time of ``step``: ``base``, times FACTOR of ``--slow`` on a slow node."""
    if spec is None or os.environ.get(SLOW_ENV) != "1":
        return base
    start, factor = spec.split(":")
    return base * float(factor) if step >= int(start) else base


def should_hang(spec: str | None, rank: int, attempt: int, step: int, where: str | None = None) -> bool:
    if spec is None or attempt > 0:
        return False
    parts = spec.split(":")
    return int(parts[0]) == rank and int(parts[1]) == step and (where is None or parts[2] == where)


def maybe_fail(spec: str | None, rank: int, attempt: int, step: int) -> None:
    if should_hang(spec, rank, attempt, step):
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")


def maybe_control(client: Any, spec: str | None, rank: int, attempt: int, step: int) -> None:
    """Send the workload-control request of ``--control`` when this rank reaches its step."""
    if spec is None or attempt > 0:
        return
    want_rank, want_step, action = spec.split(":")
    if int(want_rank) == rank and int(want_step) == step:
        from nvrx.fault_tolerance import WorkloadAction, WorkloadControlRequest

        request = WorkloadControlRequest(WorkloadAction[action], f"asked by rank {rank} at step {step}")
        client.send_workload_control_request(request)
        print(f"rank {rank}: sent {action}", flush=True)


def hang() -> None:
    print(f"rank {dist.get_rank()}: hanging (injected)", flush=True)
    time.sleep(3600)


def _files(directory: str, rank: int) -> tuple[Path, Path]:
    """This rank's latest save and the one before it."""
    return Path(directory, f"rank{rank}.json"), Path(directory, f"rank{rank}.prev.json")


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _write(path: Path, checkpoint: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(checkpoint))
    tmp.replace(path)


def load(directory: str, rank: int) -> dict[str, Any] | None:
    """The checkpoint of the newest step that every rank saved; None: start from step 0.

    A collective: every rank calls it once after ``setup``. Each rank saves its own file
    after the step's all_reduce, so a restart that stops the ranks between their saves
    finds some of them one save ahead of the others (never more: a rank that saved a step
    had its peers in that step's all_reduce, past their previous save). Each rank keeps
    its previous save too, the ranks agree on the oldest of their newest steps, and a
    rank that was ahead drops its newer save, so every rank resumes from the same step.
    """
    latest, previous = _files(directory, rank)
    held = {c["step"]: c for c in (_read(latest), _read(previous)) if c is not None}
    agreed = torch.tensor([max(held, default=-1)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    step = int(agreed.item())
    if step < 0:
        return None
    if step not in held:
        raise RuntimeError(f"rank {rank}: the ranks agreed on step {step}, whose checkpoint "
                           f"this rank no longer holds (it holds {sorted(held)}) in {directory}")
    if max(held) != step:  # this rank was one save ahead: that save goes
        previous.replace(latest)
    return held[step]


def save(directory: str, rank: int, step: int, weights: torch.Tensor, ft_state: dict[str, Any]) -> None:
    """This rank's checkpoint of ``step``; the one it replaces is kept as the previous one."""
    latest, previous = _files(directory, rank)
    latest.parent.mkdir(parents=True, exist_ok=True)
    held = _read(latest)
    if held is not None and held["step"] < step:
        latest.replace(previous)
    _write(latest, {"step": step, "weights": weights.tolist(), "ft": ft_state})
