"""What sealing control values costs: the MAC itself, the stop flag and sealed lists
against a real store.

* ``seal`` and ``unseal`` of a stop request (HMAC-SHA256 over key, run and payload): what a
  supervisor spends per sealed write and per read.
* ``StopFlag.write`` and ``StopFlag.read`` against a real torch ``TCPStore`` on loopback
  (with ``--forged`` forged generations ahead, as a forger could leave them), next to one
  plain ``set`` and ``get`` of the same request unsealed: what a stop costs now.

* ``count_up`` of a sealed list (the restart budget, nodes ready: append, read, check
  every entry) with ``--entries`` entries in it already, next to the plain ``add`` it
  replaces: what a restart's budget and ready counts cost now.

No training step seals anything: the stop flag is written once per stop, read once per
failed child (``_stopped_by_another_node``), so the per-step cost is zero and the cost per
restart is at most one read. Times are medians of ``--repeats``.

    .venv/bin/python bench/seal_cost.py [--repeats 200] [--forged 0 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_ports import free_ports  # noqa: E402

from nvrx.store import sealed_keys  # noqa: E402
from nvrx.store.seal import Sealer, new_secret, seal, unseal  # noqa: E402
from nvrx.supervisor.config import StopRequest  # noqa: E402
from nvrx.supervisor.stop_flag import StopFlag  # noqa: E402


class _Link:
    """What the stop flag uses of a store link, over a real ``TCPStore`` client."""

    def __init__(self, store) -> None:
        self.store = store

    def get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        return self.store.compare_set(key, expected, desired).decode()

    def append(self, key: str, value: str) -> None:
        self.store.append(key, value)


def _median_us(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        action()
        times.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(times)


def mac_us(repeats: int) -> tuple[float, float]:
    secret, payload = bytes.fromhex(new_secret()), StopRequest("received SIGTERM", 143, 1).encode()
    value = seal(secret, StopFlag.key(1), payload, 0)
    return (
        _median_us(lambda: seal(secret, StopFlag.key(1), payload, 0), repeats),
        _median_us(lambda: unseal(secret, StopFlag.key(1), value, 0), repeats),
    )


def store_us(repeats: int, forged: int) -> dict[str, float]:
    """Median µs of a stop's write and read through the chain, and of a plain set/get."""
    import torch.distributed as dist

    port = free_ports(1)[0]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))  # fmt: skip
    secret, request = bytes.fromhex(new_secret()), StopRequest("received SIGTERM", 143, 1)
    writes, reads, plain = [], [], []
    for i in range(repeats):
        prefix = f"bench{i}/"
        store = dist.PrefixStore(prefix, server)
        link = _Link(store)
        for g in range(1, forged + 1):
            store.set(StopFlag.key(g), "forged")
        flag = StopFlag(secret, 0)
        start = time.perf_counter_ns()
        flag.write(link, request)
        writes.append((time.perf_counter_ns() - start) / 1000)
        start = time.perf_counter_ns()
        assert StopFlag(secret, 0).read(link, 1) == request
        reads.append((time.perf_counter_ns() - start) / 1000)
        start = time.perf_counter_ns()
        store.set("plain", request.encode())
        store.get("plain")
        plain.append((time.perf_counter_ns() - start) / 1000)
    return {
        "write": statistics.median(writes),
        "read": statistics.median(reads),
        "plain": statistics.median(plain),
    }


def list_us(repeats: int, entries: int) -> tuple[float, float]:
    """Median µs of one ``count_up`` on a sealed list holding ``entries``, and of a plain add."""
    import torch.distributed as dist

    port = free_ports(1)[0]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))  # fmt: skip
    sealer = Sealer(bytes.fromhex(new_secret()), 0)
    sealed, plain = [], []
    for i in range(repeats):
        link = _Link(dist.PrefixStore(f"list{i}/", server))
        for _ in range(entries):
            sealed_keys.count_up(link, sealer, "count", 0)
        start = time.perf_counter_ns()
        assert sealed_keys.count_up(link, sealer, "count", 0) == entries + 1
        sealed.append((time.perf_counter_ns() - start) / 1000)
        start = time.perf_counter_ns()
        link.store.add("plain", 1)
        plain.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(sealed), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=200, help="timed repeats (default 200)")
    parser.add_argument("--forged", type=int, nargs="+", default=[0, 10],
                        help="forged generations ahead of the stop (default 0 10)")  # fmt: skip
    parser.add_argument("--entries", type=int, nargs="+", default=[0, 10, 100],
                        help="entries already in a sealed list (default 0 10 100)")  # fmt: skip
    args = parser.parse_args()
    if args.repeats < 1 or min(args.forged) < 0:
        parser.error(f"--repeats must be >= 1 and --forged >= 0, got {args.repeats}, {args.forged}")
    sealing, unsealing = mac_us(args.repeats * 50)
    print(f"seal {sealing:.1f} µs, unseal {unsealing:.1f} µs per stop request")
    for forged in args.forged:
        r = store_us(args.repeats, forged)
        print(f"{forged:3d} forged ahead: stop write {r['write']:.0f} µs, read {r['read']:.0f} µs "
              f"(a plain set + get of the same request: {r['plain']:.0f} µs)")  # fmt: skip
    for entries in args.entries:
        sealed, plain = list_us(max(args.repeats // 4, 1), entries)
        print(f"{entries:3d} entries: sealed count_up {sealed:.0f} µs (a plain add: {plain:.0f} µs)")


if __name__ == "__main__":
    main()
