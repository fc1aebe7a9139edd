"""Demo job: a small CPU model trained with gloo all_reduce, checkpointed, with injected faults.

Run under ``nvrx-supervise`` (see ``scripts/demo.sh``), which sets RANK,
WORLD_SIZE and the NVRX_* variables. Faults (``--fault KIND:STEP:RANK``, see
``fault_injection.py``) make ranks raise, hang, die or ask for a clean stop;
the job resumes from its last checkpoint and finishes at full size.

Without the in-process Wrapper every fault costs a process restart of all
ranks: a peer of a failed rank sees gloo's "connection closed" and exits too,
and a rank that stops making progress is ended by a watchdog
(``faulthandler``, which also writes its stack). Ranks agree on a fresh
process-group generation through a counter in the job's store.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_injection import FaultInjector, parse_faults  # noqa: E402

from nvrx import events  # noqa: E402


class PeerLost(RuntimeError):
    """A collective failed because another rank failed: a collateral fault, not this rank's own."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)"
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=0.05,
        help="extra seconds per step, so faults land mid-job",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="checkpoints and fault markers (default: $NVRX_LOG_DIR/$NVRX_JOB_ID/run)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:STEP:RANK",
        help="inject a fault (repeatable)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=15.0,
        help="seconds without a step before a rank ends itself",
    )
    p.add_argument(
        "--pg-timeout", type=float, default=20.0, help="gloo collective timeout in seconds"
    )
    return p.parse_args(argv)


def build_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )


def batch(torch, step: int, rank: int, size: int = 64):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=gen)
    w = torch.linspace(-1.0, 1.0, 32).unsqueeze(1)
    return x, x @ w + 0.01 * torch.randn(size, 1, generator=gen)


def save_checkpoint(torch, path: Path, step: int, model, opt) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)


def join_generation(store, world_size: int) -> int:
    """Process-group generation this process belongs to: every start of every rank counts once."""
    return (int(store.add("demo/joins", 1)) - 1) // world_size


def main(argv: list[str] | None = None) -> int:
    try:
        return train(parse_args(argv))
    except Exception as exc:
        here = Path(__file__).resolve().parent
        frames = [
            f
            for f in traceback.extract_tb(exc.__traceback__)
            if Path(f.filename).resolve().parent == here
        ]
        frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
        events.emit(
            "fault",
            fault_kind="peer" if isinstance(exc, PeerLost) else "exception",
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc)[:2000],
            traceback=traceback.format_exc()[-8000:],
            signature=f"{type(exc).__qualname__}@{Path(frame.filename).name}:{frame.lineno}",
        )
        raise


def train(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(args.run_dir) if args.run_dir else events.job_log_dir() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = events.configure("app")
    injector = FaultInjector(
        parse_faults(args.fault, os.environ.get("NVRX_DEMO_FAULTS")), rank, run_dir
    )

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        os.environ["NVRX_STORE_HOST"],
        int(os.environ["NVRX_STORE_PORT"]),
        world_size=None,
        is_master=False,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    generation = join_generation(store, world)
    writer.update(round=generation)
    writer.emit("process_start", argv=sys.argv, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"demo/gen{generation}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    model = build_model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = run_dir / "checkpoint.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        writer.emit("checkpoint", path=str(ckpt), step=start, action="load")
    print(
        f"[demo] rank {rank}/{world} generation {generation} starts at step {start} "
        f"(restart {os.environ.get('NVRX_RESTART_COUNT', '0')})",
        flush=True,
    )
    loss = torch.tensor(0.0)
    for step in range(start + 1, args.steps + 1):
        faulthandler.dump_traceback_later(args.hang_timeout, exit=True)  # watchdog for a hung rank
        injector.at_step(step)
        x, y = batch(torch, step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        try:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        except RuntimeError as exc:  # gloo: a peer died, hung or was restarted
            raise PeerLost(f"all_reduce at step {step} failed: {exc}") from exc
        opt.step()
        time.sleep(args.step_time)
        if step % args.checkpoint_every == 0:
            if rank == 0:
                save_checkpoint(torch, ckpt, step, model, opt)
                writer.emit("checkpoint", path=str(ckpt), step=step, action="save")
            writer.emit("progress", step=step, loss=float(loss.detach()))
    faulthandler.cancel_dump_traceback_later()
    final = torch.tensor([float(dist.get_world_size())])
    dist.all_reduce(final)
    if rank == 0:
        print(
            f"[demo] finished {args.steps} steps at world size {dist.get_world_size()}, "
            f"loss {float(loss.detach()):.4f}; events in {events.job_log_dir()}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
