"""A training script written against the API of ``nvidia_resiliency_ext.inprocess``: only the import differs.

It uses nothing but the reference's names, the way a script written for
NVRx's in-process restart uses them:

* ``Wrapper(rank_filter=...)`` with an old-style filter from
  ``inprocess.rank_filter`` (deprecated in the reference, still accepted);
* ``tools.inject_fault.inject_fault`` to inject a CPU fault on one rank in the
  first iteration (``--fault``, ``WORKLOAD_EXC`` by default, which the training
  loop raises at its next ``maybe_raise_workload_exception()``);
* the nested-restarter callbacks wired as the reference's example wires them:
  ``NestedRestarterHandlingCompleted`` in ``initialize`` (listed first, so it
  runs last), ``NestedRestarterHandlingStarting`` in ``abort`` (after the
  torch abort in the list, so it runs first), ``NestedRestarterFinalized`` in
  ``completion`` and ``NestedRestarterAborted`` in ``terminate``; rank 0 prints
  their ``[NestedRestarter]`` lines on stdout;
* a custom store: ``store_factory=`` a subclass of ``inprocess.store.TCPStore``,
  built with ``store_kwargs``.

Every rank trains a tiny linear model with gloo for ``--steps`` steps; after the
fault every rank restarts in-process and trains again. The last line of each
rank is ``reference_api: done rank=R world_size=W iteration=I steps=S``.

Run it with any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, e.g. ``torchrun --nproc-per-node 2 examples/reference_api.py``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

# The Wrapper's monitor thread waits on the store in slices; torch logs the end
# of each slice as a warning.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import nvrx.inprocess as inprocess  # noqa: E402 - the one line that differs from the reference

Fault = inprocess.tools.inject_fault.Fault


class MarkedTCPStore(inprocess.store.TCPStore):
    """The Wrapper's TCP store, plus a marker file per connection in ``marker_dir`` (when given).

    Shows that the Wrapper builds its store with ``store_factory(**store_kwargs)``:
    the marker names this class, the rank and the address it connected to.
    """

    def __init__(self, *args: Any, marker_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if marker_dir is not None:
            rank = os.environ.get("RANK", "?")
            marker = Path(marker_dir) / f"store-{type(self).__name__}-rank{rank}-{id(self):x}"
            marker.write_text(f"{self.host}:{self.port}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="training steps per call (default 50)")
    p.add_argument(
        "--step-time", type=float, default=0.02, help="simulated compute per step, s (0.02)"
    )
    p.add_argument(
        "--fault",
        choices=[f.name for f in (Fault.WORKLOAD_EXC, Fault.ASYNC_EXC, Fault.SIGNAL_EXC)],
        default=Fault.WORKLOAD_EXC.name,
        help="CPU fault injected on one rank in the first iteration (default WORKLOAD_EXC)",
    )
    p.add_argument(
        "--fault-delay", type=float, default=0.1, help="seconds into the first call (0.1)"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of inject_fault's draw (1)")
    p.add_argument(
        "--max-iterations", type=int, default=3, help="RetryController limit (default 3)"
    )
    p.add_argument(
        "--store-marker",
        default=None,
        help="directory where the custom store writes a marker file per connection",
    )
    p.add_argument("--soft-timeout", type=float, default=30.0, help="seconds (default 30)")
    p.add_argument("--hard-timeout", type=float, default=45.0, help="seconds (default 45)")
    return p.parse_args(argv)


def make_wrapper(args: argparse.Namespace) -> inprocess.Wrapper:
    """The Wrapper as a user of the reference's API configures it."""
    world_size = int(os.environ["WORLD_SIZE"])
    store_kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=60)}
    if args.store_marker is not None:
        store_kwargs["marker_dir"] = args.store_marker
    return inprocess.Wrapper(
        store_factory=MarkedTCPStore,
        store_kwargs=store_kwargs,
        initialize=inprocess.Compose(
            inprocess.nested_restarter.NestedRestarterHandlingCompleted(),
            inprocess.initialize.RetryController(max_iterations=args.max_iterations),
        ),
        abort=inprocess.Compose(
            inprocess.abort.AbortTorchDistributed(),
            inprocess.nested_restarter.NestedRestarterHandlingStarting(),
        ),
        completion=inprocess.nested_restarter.NestedRestarterFinalized(),
        terminate=inprocess.nested_restarter.NestedRestarterAborted(),
        rank_filter=inprocess.rank_filter.MaxActiveWorldSize(world_size),
        health_check=inprocess.health_check.FaultCounter(max_rank_faults=3),
        soft_timeout=datetime.timedelta(seconds=args.soft_timeout),
        hard_timeout=datetime.timedelta(seconds=args.hard_timeout),
        barrier_timeout=datetime.timedelta(seconds=args.hard_timeout + 30),
        completion_timeout=datetime.timedelta(seconds=args.hard_timeout + 30),
        heartbeat_timeout=datetime.timedelta(seconds=10),
        last_call_wait=datetime.timedelta(seconds=0.3),
    )


def train(
    args: argparse.Namespace, call_wrapper: inprocess.CallWrapper | None = None
) -> dict[str, int]:
    """One call of the training function: a fresh process group, then ``args.steps`` steps."""
    iteration = call_wrapper.iteration
    # RANK/WORLD_SIZE/MASTER_* are the Wrapper's for this iteration: init from the environment.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if iteration == 0:
        inprocess.tools.inject_fault.inject_fault(
            faults=(Fault[args.fault],),
            num_faults=1,
            keep_alive=1,  # rank 0 never faults
            delay=args.fault_delay,
            seed=args.seed,
        )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    target = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
    for _ in range(args.steps):
        inprocess.tools.inject_fault.maybe_raise_workload_exception()
        x = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel by hand: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world_size, "iteration": iteration, "steps": args.steps}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Import what the optimizer imports lazily before the Wrapper runs: a restart that
    # interrupts an import leaves the module half imported (docs/inprocess.md, Limits).
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    result = make_wrapper(args)(train)(args)
    print(
        f"reference_api: done rank={result['rank']} world_size={result['world_size']} "
        f"iteration={result['iteration']} steps={result['steps']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
