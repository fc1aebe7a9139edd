"""A plain data-parallel script (no Wrapper) watched by its supervisor through heartbeats.

    nvrx-supervise --nproc-per-node 2 --max-restarts 3 \\
        --ft-initial-rank-heartbeat-timeout 60 --ft-rank-heartbeat-timeout 10 \\
        -- python examples/ft_heartbeats.py --calc-after 5 --hang 1:12

Each step sends one heartbeat, and records the time of its compute (not of its wait in
the all_reduce) for the supervisor's straggler scores. After ``--calc-after`` steps the ranks compute
the heartbeat timeouts from the gaps they saw (times ``--ft-safety-factor``)
and keep them in their checkpoints: a restarted process loads them, so the
tighter timeouts stay in force. ``--hang 1:12`` makes rank 1 stop at step 12
once: its supervisor declares it hung when the timeout passes, records its
stack and ends it, and the job resumes from the last checkpoint.
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
    args = ft_common.options(__doc__.splitlines()[0], hang_places=[])
    rank, attempt = ft_common.setup()
    client = RankMonitorClient()
    weights, start = torch.zeros(4), 0
    saved = ft_common.load(args.checkpoint_dir, rank)
    if saved is not None:
        weights, start = torch.tensor(saved["weights"]), saved["step"] + 1
        client.load_state_dict(saved["ft"])  # the timeouts computed before the restart
    client.init_workload_monitoring()
    for step in range(start, args.steps):
        ft_common.maybe_fail(args.fail, rank, attempt, step)
        ft_common.maybe_control(client, args.control, rank, attempt, step)
        ft_common.train_step(weights, ft_common.step_time(args.step_time, args.slow, step), client)
        if ft_common.should_hang(args.hang, rank, attempt, step):
            ft_common.hang()  # before this step's heartbeat: the peers send theirs, then wait
        client.send_heartbeat()
        if step == args.calc_after:
            client.calculate_and_set_hb_timeouts()  # a collective: every rank calls it here
        if step % args.checkpoint_every == 0:
            ft_common.save(args.checkpoint_dir, rank, step, weights, client.state_dict())
    client.shutdown_workload_monitoring()
    print(f"rank {rank}: done, attempt {attempt}, timeouts {client.timeouts}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
