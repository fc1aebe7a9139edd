"""What keeping the training state in memory costs per step, on CPU: ``KeptState.commit``.

For each size, a model whose parameters and Adam moments together hold that many bytes
(a third each) is registered with a ``KeptState`` and committed ``--repeats`` times; the
bench prints the median time of a commit (the first, which allocates the slots' buffers,
apart), the memory the two slots hold, the median time of the optimizer's own ``step()``
over the same parameters (a lower bound on any training step with that state), and the
commit as a share of that step (an upper bound on the share of a real step). Then, for
``--hand-over-mb``, the time two gloo ranks on loopback take in ``restore_agreed`` when
rank 0 holds that state and rank 1 (a replacement process) holds none: the hand-over.

    .venv/bin/python bench/state_commit.py [--sizes-mb 100 1000] [--repeats 5] [--hand-over-mb 1000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nvrx.inprocess.kept_state import KeptState  # noqa: E402

_FLOAT = 4  # bytes of a float32


def _job(size_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Parameters of ``size_mb / 3`` MB, in 16 tensors, with Adam's moments allocated."""
    per_tensor = max(1, size_mb * 2**20 // 3 // _FLOAT // 16)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(per_tensor)) for _ in range(16))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # allocates exp_avg and exp_avg_sq
    return model, optimizer


def _median_s(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size_mb: int, repeats: int) -> dict[str, float]:
    model, optimizer = _job(size_mb)
    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    steps = iter(range(10**9))
    start = time.perf_counter()
    kept.commit(next(steps))
    first = time.perf_counter() - start
    kept.commit(next(steps))  # both slots allocated from here on
    commit = _median_s(lambda: kept.commit(next(steps)), repeats)
    step = _median_s(optimizer.step, repeats)
    return {
        "state_mb": sum(t.numel() * t.element_size() for t in _tensors(model, optimizer)) / 2**20,
        "first_commit_ms": first * 1e3,
        "commit_ms": commit * 1e3,
        "held_mb": kept.memory_bytes() / 2**20,
        "optimizer_step_ms": step * 1e3,
    }


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = list(model.parameters())
    for state in optimizer.state.values():
        found += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
    return found


def _hand_over_rank(rank: int, port: int, size_mb: int) -> None:
    """One rank of the hand-over: rank 0 commits, rank 1 starts empty; both time the call."""
    import torch.distributed as dist

    model, optimizer = _job(size_mb)
    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    if rank == 0:
        kept.commit(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    start = time.perf_counter()
    step = kept.restore_agreed()
    print(json.dumps({"rank": rank, "step": step, "s": time.perf_counter() - start}), flush=True)
    dist.destroy_process_group()


def hand_over(size_mb: int) -> float:
    """Seconds rank 1 spent receiving ``size_mb`` of state from rank 0."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from free_ports import free_ports

    port = free_ports(1)[0]
    ranks = [
        subprocess.Popen([sys.executable, __file__, "--hand-over-rank", str(r), str(port), str(size_mb)],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=1200)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [r for r, p in enumerate(ranks) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"hand-over rank(s) {failed} failed (exit {[ranks[r].returncode for r in failed]})")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    if any(r["step"] != 1 for r in results):
        raise RuntimeError(f"the hand-over restored {results}, not step 1 on both ranks")
    return results[1]["s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000],
                        help="state sizes in MB (default 100 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="commits and steps timed per size (default 5)")
    parser.add_argument("--hand-over-mb", type=int, default=1000,
                        help="state handed from a peer, in MB (default 1000; 0: skip)")
    parser.add_argument("--hand-over-rank", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand_over_rank:
        _hand_over_rank(*args.hand_over_rank)
        return
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.sizes_mb) < 1 or args.hand_over_mb < 0:
        parser.error(f"--sizes-mb must be >= 1 and --hand-over-mb >= 0, got {args.sizes_mb}, {args.hand_over_mb}")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for size in args.sizes_mb:
        r = measure(size, args.repeats)
        print(
            f"state {r['state_mb']:7.0f} MB: commit {r['commit_ms']:8.1f} ms "
            f"(first, allocating: {r['first_commit_ms']:.1f} ms), held {r['held_mb']:.0f} MB; "
            f"Adam step alone {r['optimizer_step_ms']:.1f} ms, commit = "
            f"{100 * r['commit_ms'] / r['optimizer_step_ms']:.0f} % of it"
        )
    if args.hand_over_mb:
        seconds = hand_over(args.hand_over_mb)
        print(f"hand-over of {args.hand_over_mb} MB from a peer over gloo on loopback: {seconds:.2f} s "
              f"({args.hand_over_mb / seconds:.0f} MB/s)")


if __name__ == "__main__":
    main()
