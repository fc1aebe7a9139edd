"""What keeping the training state in memory costs per step, on CPU: ``KeptState.commit``.

For each size, a model whose parameters and Adam moments together hold that many bytes
(a third each) is registered with a ``KeptState`` and committed ``--repeats`` times; the
bench prints the median time of a commit (the first, which allocates the slots' buffers,
apart), the memory the two slots hold, the median time of the optimizer's own ``step()``
over the same parameters (a lower bound on any training step with that state), and the
commit as a share of that step (an upper bound on the share of a real step).

    .venv/bin/python bench/state_commit.py [--sizes-mb 100 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000],
                        help="state sizes in MB (default 100 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="commits and steps timed per size (default 5)")
    args = parser.parse_args()
    if args.repeats < 1 or min(args.sizes_mb) < 1:
        parser.error(f"--repeats and every --sizes-mb must be ≥ 1, got {args.repeats} and {args.sizes_mb}")
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


if __name__ == "__main__":
    main()
