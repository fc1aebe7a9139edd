"""A plain data-parallel script (no Wrapper) watched by its supervisor through sections.

    nvrx-supervise --nproc-per-node 2 --max-restarts 3 \\
        --ft-rank-section-timeouts step:10,checkpoint:30 --ft-rank-out-of-section-timeout 20 \\
        -- python examples/ft_sections.py --calc-after 5 --hang 1:12:step

Each step runs in section ``step`` and each checkpoint in section
``checkpoint``; the time between them is out of section. Each has its own
timeout, so a hang is caught as soon as the phase it happens in overruns.
After ``--calc-after`` steps the ``step`` timeout is computed from the longest
step observed (times ``--ft-safety-factor``) and kept in the checkpoints.
``--hang RANK:STEP:WHERE`` (WHERE: step, checkpoint or outside) makes that rank
stop there once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ft_common  # noqa: E402

from nvrx.fault_tolerance import RankMonitorClient  # noqa: E402


@record  # torch's: an exception goes to $TORCHELASTIC_ERROR_FILE, which nvrx-report reads
def main() -> None:
    args = ft_common.options(__doc__.splitlines()[0], hang_places=["step", "checkpoint", "outside"])
    rank, attempt = ft_common.setup()
    client = RankMonitorClient()
    weights, start = torch.zeros(4), 0
    saved = ft_common.load(args.checkpoint_dir, rank)
    if saved is not None:
        weights, start = torch.tensor(saved["weights"]), saved["step"] + 1
        client.load_state_dict(saved["ft"])
    client.init_workload_monitoring()
    for step in range(start, args.steps):
        ft_common.maybe_fail(args.fail, rank, attempt, step)
        ft_common.maybe_control(client, args.control, rank, attempt, step)
        client.start_section("step")
        ft_common.train_step(weights, ft_common.step_time(args.step_time, args.slow, step))
        if ft_common.should_hang(args.hang, rank, attempt, step, "step"):
            ft_common.hang()  # after the all_reduce: the peers end this step and wait in the next
        client.end_section("step")
        if ft_common.should_hang(args.hang, rank, attempt, step, "outside"):
            ft_common.hang()
        if step == args.calc_after:
            # A collective: every rank calls it here. Only "step": a checkpoint and the time
            # between sections last milliseconds here, too little to scale into a safe timeout.
            client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False)
        if step % args.checkpoint_every == 0:
            client.start_section("checkpoint")
            if ft_common.should_hang(args.hang, rank, attempt, step, "checkpoint"):
                ft_common.hang()
            ft_common.save(args.checkpoint_dir, rank, step, weights, client.state_dict())
            client.end_section("checkpoint")
    client.shutdown_workload_monitoring()
    print(f"rank {rank}: done, attempt {attempt}, timeouts {client.timeouts}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
