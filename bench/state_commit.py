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

With ``--device cuda`` the state lives on the GPU and each step is the optimizer's step
plus ``--matmuls`` bf16 products of 8192² matrices (a stand-in for the step's compute).
The bench then prints, per size: the step alone, the step followed by a commit (each
waited for on the compute stream only, as training waits), how long ``commit()`` holds
the Python thread right after a step (it waits there for the previous commit's copy
while the GPU runs the step) and with no copy pending, how long the copy to pinned host
memory runs on past that return, and the
device memory the commit's clone takes for a while. The step does not wait for the host
copy when the step with a commit is within noise of the step alone.

    python3 bench/state_commit.py --device cuda [--sizes-mb 100 1000] [--matmuls 30]
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


def _job(size_mb: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Parameters of ``size_mb / 3`` MB, in 16 tensors, with Adam's moments allocated."""
    per_tensor = max(1, size_mb * 2**20 // 3 // _FLOAT // 16)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(per_tensor, device=device)) for _ in range(16)
    )
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


def measure_cuda(size_mb: int, repeats: int, matmuls: int) -> dict[str, float]:
    """The GPU figures of one size (see the module)."""
    model, optimizer = _job(size_mb, "cuda")
    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    compute = torch.cuda.current_stream()

    def step() -> None:
        for _ in range(matmuls):
            torch.mm(a, a)
        optimizer.step()

    steps = iter(range(10**9))
    for _ in range(3):  # warm: kernels, both slots' pinned buffers
        step()
        kept.commit(next(steps))
    torch.cuda.synchronize()
    alone, with_commit, holds, queues, runs_on = [], [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        compute.synchronize()
        alone.append(time.perf_counter() - start)
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        before_commit = time.perf_counter()
        kept.commit(next(steps))
        returned = time.perf_counter()
        compute.synchronize()
        with_commit.append(time.perf_counter() - start)
        holds.append(returned - before_commit)
    kept.steps()  # waits for the last copy
    for _ in range(repeats):  # the copy alone, past the commit's return, nothing else queued
        compute.synchronize()
        called = time.perf_counter()
        kept.commit(next(steps))
        returned = time.perf_counter()
        kept.steps()
        queues.append(returned - called)
        runs_on.append(time.perf_counter() - returned)
    return {
        "state_mb": sum(t.numel() * t.element_size() for t in _tensors(model, optimizer)) / 2**20,
        "step_ms": statistics.median(alone) * 1e3,
        "step_with_commit_ms": statistics.median(with_commit) * 1e3,
        "commit_holds_ms": statistics.median(holds) * 1e3,
        "commit_queues_ms": statistics.median(queues) * 1e3,
        "copy_runs_on_ms": statistics.median(runs_on) * 1e3,
        "held_mb": kept.memory_bytes() / 2**20,
        "clone_peak_mb": (torch.cuda.max_memory_allocated() - base) / 2**20,
    }


def _print_cuda(r: dict[str, float]) -> None:
    print(
        f"state {r['state_mb']:7.0f} MB on {torch.cuda.get_device_name()}: step {r['step_ms']:.1f} ms, "
        f"step + commit {r['step_with_commit_ms']:.1f} ms "
        f"({100 * (r['step_with_commit_ms'] / r['step_ms'] - 1):+.1f} %); commit() holds the thread "
        f"{r['commit_holds_ms']:.1f} ms after a step (the previous copy's end included), "
        f"{r['commit_queues_ms']:.1f} ms with no copy pending, and the host copy runs on "
        f"{r['copy_runs_on_ms']:.1f} ms past it; "
        f"pinned host memory held {r['held_mb']:.0f} MB, device memory for the clone {r['clone_peak_mb']:.0f} MB"
    )


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000],
                        help="state sizes in MB (default 100 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="commits and steps timed per size (default 5)")
    parser.add_argument("--hand-over-mb", type=int, default=1000,
                        help="state handed from a peer, in MB (default 1000; 0: skip)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the state lives (default cpu; cuda: the GPU figures, no hand-over)")
    parser.add_argument("--matmuls", type=int, default=30,
                        help="with --device cuda: bf16 8192² products per step (default 30)")
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
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False here")
        for size in args.sizes_mb:
            _print_cuda(measure_cuda(size, args.repeats, args.matmuls))
        return
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
