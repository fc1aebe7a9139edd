"""Quick start: a training function inside nvrx's in-process Wrapper (gloo, CPU).

Run it as a 2-rank job: ``nvrx-supervise --nproc-per-node 2 -- python quickstart_train.py``.
Rank 1 raises at step 5 of the first round; every rank restarts in-process and the
training finishes. ``nvrx-report nvrx_logs`` then shows the fault and the restart.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

import nvrx.inprocess as inprocess


@inprocess.Wrapper(initialize=inprocess.initialize.RetryController(max_iterations=3))
def train(call_wrapper: inprocess.CallWrapper = None) -> None:
    # RANK, WORLD_SIZE, MASTER_* come from the environment; a timeout shorter than the
    # Wrapper's hard_timeout (90 s), so that a collective gloo leaves stuck ends in-process
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = torch.nn.Linear(8, 1)
    for step in range(20):
        if dist.get_rank() == 1 and call_wrapper.iteration == 0 and step == 5:
            raise RuntimeError("injected fault: rank 1, step 5")
        model(torch.randn(16, 8)).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p -= 0.01 * p.grad / dist.get_world_size()
                p.grad = None
    print(f"rank {dist.get_rank()}: 20 steps done in round {call_wrapper.iteration}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
