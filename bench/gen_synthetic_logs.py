"""Write synthetic nvrx event logs of a large job, for timing ``nvrx-report``.

The job: ``--ranks`` ranks on nodes of ``--ranks-per-node``, ``--rounds``
Wrapper rounds. Every round but the last ends in a restart caused by one rank
(an exception; in a few rounds a SIGKILLed process that its supervisor
restarts; in one round a hang with a stack dump); the other ranks see ``peer``
faults later by their own monotonic clock. Each node has its own boot id,
monotonic origin and a wall-clock skew of up to +-50 ms, as real hosts do.

Files follow the event writer's layout: one file per process, named
``<component>-n<node>-p<pid>-<token>.jsonl``. Lines are formatted directly
(not through ``EventWriter``) so that millions of events are written fast;
the field set is the writer's. ``generate`` returns the ground truth.

    python bench/gen_synthetic_logs.py OUT_DIR [--ranks 4096] [--rounds 50]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("abort", "finalize", "health_check", "iteration_barrier", "rank_assignment", "initialize")
ROUND_S = 60.0
_dump = json.dumps


@dataclass
class Truth:
    """What the generated job did, for checking a report against."""

    job: str
    ranks: int
    nodes: int
    rounds: int
    roots: dict[int, int] = field(default_factory=dict)  # round -> first failing rank
    killed: dict[int, int] = field(
        default_factory=dict
    )  # round -> rank whose process was SIGKILLed
    hang: tuple[int, int] | None = None  # (round, rank)
    call_s: float = 0.0  # total seconds inside the function, over all ranks
    events: int = 0
    files: int = 0


class _Host:
    def __init__(self, node: int, rng: random.Random) -> None:
        self.node = node
        self.host = f"node{node:04d}"
        self.boot = f"{rng.getrandbits(64):016x}-boot"
        self.mono0 = rng.uniform(1_000.0, 900_000.0)  # monotonic clock at job start
        self.skew = rng.uniform(-0.05, 0.05)  # wall-clock error of this host

    def stamp(self, t: float) -> str:
        """Wall and mono fields of an event at true job time ``t`` (seconds since the epoch)."""
        return f'"wall":{t + self.skew:.6f},"mono":{self.mono0 + (t - T0):.6f}'


T0 = 1_700_000_000.0


class _File:
    """Lines of one process's event file."""

    def __init__(
        self, directory: Path, component: str, host: _Host, pid: int, job: str, rank: int | None
    ) -> None:
        self.path = directory / f"{component}-n{host.node}-p{pid}-{pid:08x}.jsonl"
        self.host = host
        self.lines: list[str] = []
        rank_text = "null" if rank is None else str(rank)
        self.common = (
            f'"boot":"{host.boot}","host":"{host.host}","pid":{pid},"component":"{component}",'
            f'"job":"{job}","node":{host.node},"rank":{rank_text}'
        )

    def emit(self, kind: str, t: float, rnd: int | None, extra: str = "") -> None:
        rnd_text = "null" if rnd is None else str(rnd)
        tail = "," + extra if extra else ""
        self.lines.append(
            f'{{"kind":"{kind}","v":1,{self.host.stamp(t)},{self.common},"round":{rnd_text}{tail}}}\n'
        )

    def write(self) -> int:
        self.path.write_text("".join(self.lines))
        return len(self.lines)


def _traceback(rnd: int, rank: int) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "/opt/venv/lib/python3.11/site-packages/nvrx/inprocess/wrap.py", line 210, in _run\n'
        "    return fn(*args, **kwargs)\n"
        '  File "/home/user/train.py", line 88, in train\n'
        "    loss = step(model, batch)\n"
        '  File "/home/user/train.py", line 41, in step\n'
        "    raise RuntimeError(f'loss is NaN at step {n}')\n"
        f"RuntimeError: loss is NaN at step {1000 * rnd + rank % 97}\n"
    )


def generate(
    out: Path,
    ranks: int = 4096,
    rounds: int = 50,
    ranks_per_node: int = 8,
    job: str = "4242",
    seed: int = 1,
) -> Truth:
    """Write the logs of one synthetic job under ``out`` and return what happened."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    nodes = (ranks + ranks_per_node - 1) // ranks_per_node
    hosts = [_Host(n, rng) for n in range(nodes)]
    truth = Truth(job=job, ranks=ranks, nodes=nodes, rounds=rounds)
    restart_rounds = list(range(rounds - 1))
    killed_rounds = set(rng.sample(restart_rounds, min(3, len(restart_rounds))))
    hang_round = next((r for r in restart_rounds if r not in killed_rounds and r > 0), None)
    for rnd in restart_rounds:
        truth.roots[rnd] = rng.randrange(ranks)
        if rnd in killed_rounds:
            truth.killed[rnd] = truth.roots[rnd]
    if hang_round is not None:
        truth.hang = (hang_round, truth.roots[hang_round])
    # Round r runs from start[r]; a fault at fault_t[r] restarts everybody.
    start = [T0 + 5.0 + r * (ROUND_S + 3.0) for r in range(rounds)]
    fault_t = {r: start[r] + rng.uniform(10.0, ROUND_S) for r in restart_rounds}
    end_t = start[-1] + ROUND_S

    pid = 10_000
    sup_files = []
    for h in hosts:
        pid += 1
        f = _File(out, "supervisor", h, pid, job, None)
        f.emit(
            "supervisor_start",
            T0 + 0.5,
            None,
            f'"nnodes":{nodes},"nproc_per_node":{ranks_per_node},"command":"python train.py","store":"node0000:29500"',
        )
        sup_files.append(f)
    store = _File(out, "store", hosts[0], 9_999, job, None)
    store.emit("store_start", T0 + 0.2, None, '"host":"0.0.0.0","port":29500')

    for rank in range(ranks):
        h = hosts[rank // ranks_per_node]
        local = rank % ranks_per_node
        sup = sup_files[h.node]
        attempt = 0
        pid += 1
        sup.emit(
            "child_start", T0 + 1.0, None, f'"local_rank":{local},"child_pid":{pid},"attempt":0'
        )
        f = _File(out, "wrapper", h, pid, job, rank)
        f.emit("process_start", T0 + 1.5, None, f'"argv":["train.py"],"local_rank":{local}')
        for rnd in range(rounds):
            t0 = start[rnd] + rng.uniform(0.0, 0.05)
            f.emit(
                "round_start",
                t0,
                rnd,
                f'"world_size":{ranks},"active_world_size":{ranks},"active_rank":{rank},"initial_rank":{rank}',
            )
            f.emit("call_start", t0 + 0.01, rnd, '"note":"enter"')
            if rnd not in fault_t:
                duration = end_t - (t0 + 0.01)
                truth.call_s += duration
                f.emit("call_end", end_t, rnd, f'"duration_s":{duration:.6f},"outcome":"completed"')
                f.emit(
                    "round_end",
                    end_t + 0.01,
                    rnd,
                    f'"outcome":"completed","duration_s":{end_t - t0:.6f}',
                )
                f.emit("wrapper_end", end_t + 0.02, rnd, f'"outcome":"completed","rounds":{rounds}')
                f.emit("process_end", end_t + 0.03, rnd, '"exit_code":0,"reason":"completed"')
                break
            root = truth.roots[rnd]
            ft = fault_t[rnd]
            if rank == root and rnd in truth.killed:
                # The process dies in the function: its file stops after a last progress
                # event; its supervisor restarts it.
                f.emit("progress", ft - 0.01, rnd, f'"step":{1000 * rnd + 7}')
                truth.call_s += (ft + 0.02) - (t0 + 0.01)  # until its supervisor saw it end
                f.write()
                truth.events += len(f.lines)
                truth.files += 1
                sup.emit(
                    "child_exit",
                    ft + 0.02,
                    None,
                    f'"local_rank":{local},"child_pid":{pid},"exit_code":null,"signal":"SIGKILL","runtime_s":{ft - T0:.3f}',
                )
                sup.emit(
                    "restart_decision",
                    ft + 0.03,
                    None,
                    f'"local_rank":{local},"decision":"restart","reason":"child killed by SIGKILL",'
                    f'"budget_left":{10 - len(truth.killed)},"signature":"signal SIGKILL"',
                )
                attempt += 1
                pid += 1
                sup.emit(
                    "child_start",
                    ft + 0.5,
                    None,
                    f'"local_rank":{local},"child_pid":{pid},"attempt":{attempt}',
                )
                sup.emit(
                    "rejoin",
                    start[rnd + 1],
                    None,
                    f'"local_rank":{local},"wait_s":{start[rnd + 1] - ft - 0.5:.3f}',
                )
                f = _File(out, "wrapper", h, pid, job, rank)
                f.emit("process_start", ft + 1.0, None, f'"argv":["train.py"],"local_rank":{local}')
                monitor = _File(out, "monitor", h, pid + 500_000, job, rank)
                monitor.emit(
                    "fault",
                    ft + 0.05,
                    rnd,
                    f'"fault_kind":"dead","origin_rank":{rank},"message":"process exited (SIGKILL)",'
                    f'"signature":"signal SIGKILL","detected_mono":{h.mono0 + (ft + 0.05 - T0):.6f},"detection_s":0.05',
                )
                truth.events += monitor.write()
                truth.files += 1
                continue
            truth.call_s += ft - (t0 + 0.01)
            f.emit(
                "call_end",
                ft + 0.001,
                rnd,
                f'"duration_s":{ft - (t0 + 0.01):.6f},"outcome":"fault"',
            )
            if rank == root:
                if truth.hang is not None and truth.hang[0] == rnd:
                    monitor = _File(out, "monitor", h, pid + 600_000, job, rank)
                    stack = (
                        'Thread 0x7f (most recent call first):\n  File "/home/user/train.py", line 55 in all_reduce_grads\n'
                        '  File "/home/user/train.py", line 88 in train'
                    )
                    monitor.emit("hang", ft, rnd, f'"timeout":"soft","stack":{_dump(stack)}')
                    truth.events += monitor.write()
                    truth.files += 1
                    f.emit(
                        "fault",
                        ft + 0.002,
                        rnd,
                        f'"fault_kind":"hang_soft","origin_rank":{rank},"message":"no progress for 30 s",'
                        f'"detected_mono":{h.mono0 + (ft - T0):.6f},"detection_s":30.0',
                    )
                else:
                    f.emit(
                        "fault",
                        ft + 0.002,
                        rnd,
                        f'"fault_kind":"exception","origin_rank":{rank},"exc_type":"RuntimeError",'
                        f'"message":"loss is NaN","traceback":{_dump(_traceback(rnd, rank))},'
                        f'"detected_mono":{h.mono0 + (ft + 0.002 - T0):.6f},"detection_s":0.0',
                    )
            else:
                seen = ft + rng.uniform(0.05, 0.4)  # peers learn of it later, by their own clock
                f.emit(
                    "fault",
                    seen,
                    rnd,
                    f'"fault_kind":"peer","origin_rank":{root},"message":"rank {root} faulted",'
                    f'"detected_mono":{h.mono0 + (seen - T0):.6f}',
                )
            t = ft + 0.5
            for phase in PHASES:
                d = rng.uniform(0.005, 0.3)
                t += d
                f.emit("restart_phase", t, rnd, f'"phase":"{phase}","duration_s":{d:.6f},"ok":true')
            f.emit(
                "round_end",
                t + 0.01,
                rnd,
                f'"outcome":"restart","duration_s":{t - t0:.6f},"restart_latency_s":{start[rnd + 1] - ft:.6f}',
            )
        truth.events += f.write()
        truth.files += 1

    for h, sup in zip(hosts, sup_files, strict=True):
        for local in range(min(ranks_per_node, ranks - h.node * ranks_per_node)):
            sup.emit(
                "child_exit",
                end_t + 0.05,
                None,
                f'"local_rank":{local},"child_pid":0,"exit_code":0,"signal":null,"runtime_s":1.0',
            )
        if h.node == 0:
            sup.emit("job_stop", end_t + 0.1, None, '"reason":"all ranks completed","exit_code":0')
        sup.emit(
            "supervisor_end", end_t + 0.2, None, '"exit_code":0,"reason":"all children exited 0"'
        )
        truth.events += sup.write()
        truth.files += 1
    store.emit("store_end", end_t + 0.3, None, '"reason":"supervisor exiting"')
    truth.events += store.write()
    truth.files += 1
    return truth


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path)
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--job", default="4242")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    t = time.perf_counter()
    truth = generate(args.out, args.ranks, args.rounds, args.ranks_per_node, args.job, args.seed)
    dt = time.perf_counter() - t
    print(f"wrote {truth.events} events in {truth.files} files to {args.out} in {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
