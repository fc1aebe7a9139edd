"""Submit a small checkpointing training function with ``nvrx.submit`` and print its report.

    python examples/submit_demo.py --nodes 2 --nproc-per-node 2          # on SLURM
    python examples/submit_demo.py --cluster local --nproc-per-node 2    # without SLURM

Each rank averages a gradient with gloo ``all_reduce`` every step. When SLURM
warns the job (time limit or preemption, ``--signal-delay`` seconds ahead),
``nvrx.preemption_requested()`` turns true: rank 0 saves the step and the
weights, every rank returns, and the store's host requeues the job; the next run loads
the checkpoint and goes on. ``--timeout-min 1 --signal-delay 45`` shows a
time-limit requeue within about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import nvrx


def train(ckpt_dir: str, steps: int, step_time: float) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(ckpt_dir) / "ckpt.json"
    weights, step = torch.zeros(4), 0
    if ckpt.exists():
        state = json.loads(ckpt.read_text())
        weights, step = torch.tensor(state["weights"]), state["step"]
        nvrx.record_checkpoint(ckpt, step, action="load")
    try:
        while step < steps:
            if nvrx.preemption_requested():
                if rank == 0:
                    tmp = ckpt.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"step": step, "weights": weights.tolist()}))
                    os.replace(tmp, ckpt)
                    nvrx.record_checkpoint(ckpt, step)
                dist.barrier()
                return {"rank": rank, "stopped_at": step, "info": nvrx.preemption_info()}
            grad = torch.full((4,), float(rank + 1))
            dist.all_reduce(grad)
            weights -= 0.01 * grad / world
            step += 1
            time.sleep(step_time)
        return {"rank": rank, "step": step, "weights": weights.tolist()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default=None, help="slurm, local (default: slurm when srun exists)")
    p.add_argument("--folder", default="nvrx_jobs", help="job folder, shared by all nodes")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--partition", default=None)
    p.add_argument("--timeout-min", type=int, default=5)
    p.add_argument(
        "--signal-delay", type=int, default=60, help="warning seconds before the time limit"
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-time", type=float, default=0.1)
    args = p.parse_args()

    folder = Path(args.folder).absolute()
    ckpt_dir = folder / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    params = {"slurm_partition": args.partition} if args.partition else {}
    job = nvrx.submit(
        train,
        args=(str(ckpt_dir), args.steps, args.step_time),
        folder=folder,
        cluster=args.cluster,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        timeout_min=args.timeout_min,
        signal_delay_s=args.signal_delay,
        cpus_per_task=args.nproc_per_node,
        **params,
    )
    print(f"job {job.job_id}: submitit files in {job.folder}, events in {job.log_dir}")
    print("rank 0 returned:", job.result())
    print(job.report_text())


if __name__ == "__main__":
    main()
