"""Event logs of small jobs, written with the real ``EventWriter``, for the report tests.

Hosts are simulated: each has its own name, boot id, monotonic origin and
wall-clock skew, stamped on the events it writes (the writer lets fields
given to ``emit`` override its own). Times are "true" seconds after ``T0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nvrx.events import EventWriter, context_from_env

T0 = 1_700_000_000.0
JOB = "777"

USER_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/venv/lib/python3.11/site-packages/nvrx/inprocess/wrap.py", line 120, in run\n'
    "    return fn()\n"
    '  File "/home/u/train.py", line 30, in train\n'
    "    step(batch)\n"
    '  File "/home/u/train.py", line 12, in step\n'
    "    raise ValueError('bad batch 17')\n"
    "ValueError: bad batch 17\n"
)
HANG_STACK = (
    "Thread 0x7f00 (most recent call first):\n"
    '  File "/home/u/train.py", line 55 in all_reduce_grads\n'
    '  File "/home/u/train.py", line 30 in train\n'
)


class Host:
    def __init__(self, name: str, node: int, skew: float = 0.0, mono0: float = 1000.0) -> None:
        self.name, self.node, self.skew, self.mono0 = name, node, skew, mono0
        self.boot = f"boot-{name}"
        self.wall_step = 0.0  # a later NTP step of this host's wall clock


class Proc:
    """One process's event file on a simulated host."""

    def __init__(
        self,
        log_dir: Path,
        host: Host,
        component: str,
        rank: int | None = None,
        job: str = JOB,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        context: dict[str, Any] = {"job": job, "node": host.node, "rank": rank, "round": None}
        if env is not None:  # what else the writers read from their environment (the SLURM run)
            context = {**context_from_env(env), **context}
        self.writer = EventWriter(log_dir, component, context)

    def round(self, rnd: int | None) -> Proc:
        self.writer.update(round=rnd)
        return self

    def at(self, t: float, kind: str, **fields: Any) -> dict[str, Any]:
        h = self.host
        stamped: dict[str, Any] = {
            "wall": T0 + t + h.skew + h.wall_step,
            "mono": h.mono0 + t,
            "host": h.name,
            "boot": h.boot,
        }
        stamped.update(fields)  # as in the writer, a kind's own field wins
        return self.writer.emit(kind, **stamped)

    def close(self) -> None:
        self.writer.close()


def write_standard_job(log_dir: Path) -> dict[str, Any]:
    """2 nodes x 2 ranks, 4 rounds; returns the facts the report must find.

    round 0: ValueError on rank 2 (node 1); rank 0 (node 0) then fails with its
             own TimeoutError; node 0's wall clock is 3 s behind, so by wall
             clock rank 0 looks first; ``peer`` faults name rank 2 as origin.
    round 1: the process of rank 1 (node 0, local rank 1) is SIGKILLed; its
             supervisor restarts it; no fault event of its own.
    round 2: rank 3 hangs; the monitor writes the stack.
    round 3: completes.
    """
    a = Host("node-a", 0, skew=-3.0, mono0=5000.0)
    b = Host("node-b", 1, skew=0.0, mono0=200.0)
    hosts = {0: a, 1: b}
    sup = {n: Proc(log_dir, h, "supervisor") for n, h in hosts.items()}
    for s in sup.values():
        s.at(
            0.0,
            "supervisor_start",
            nnodes=2,
            nproc_per_node=2,
            command="python train.py",
            store="node-a:29500",
        )
    store = Proc(log_dir, a, "store")
    store.at(0.1, "store_start", addr="node-a", listen="all", port=29500)
    ranks = {r: Proc(log_dir, hosts[r // 2], "wrapper", rank=r) for r in range(4)}
    for r, p in ranks.items():
        sup[r // 2].at(0.5, "child_start", local_rank=r % 2, child_pid=100 + r, attempt=0)
        p.at(1.0, "process_start", argv=["train.py"], local_rank=r % 2)

    def start_round(rnd: int, t: float, procs: dict[int, Proc]) -> None:
        for r, p in procs.items():
            p.round(rnd).at(
                t, "round_start", world_size=4, active_world_size=4, active_rank=r, initial_rank=r
            )
            p.at(t + 0.1, "call_start", note="enter")

    def restart_tail(rnd: int, t: float, procs: dict[int, Proc], slow: dict[int, float]) -> None:
        for r, p in procs.items():
            p.at(t + 0.1, "restart_phase", phase="abort", duration_s=0.1, ok=True)
            p.at(
                t + 0.2,
                "restart_phase",
                phase="iteration_barrier",
                duration_s=slow.get(r, 0.4),
                ok=True,
            )
            p.at(t + 0.9, "round_end", outcome="restart", duration_s=9.0, restart_latency_s=1.5)

    # -- round 0 -------------------------------------------------------------
    start_round(0, 2.0, ranks)
    ranks[2].at(10.0, "call_end", duration_s=7.9, outcome="fault")
    ranks[2].at(
        10.0,
        "fault",
        fault_kind="exception",
        origin_rank=2,
        exc_type="ValueError",
        message="bad batch 17",
        traceback=USER_TRACEBACK,
        detection_s=0.0,
    )
    ranks[3].at(10.1, "call_end", duration_s=8.0, outcome="fault")
    ranks[3].at(10.1, "fault", fault_kind="peer", origin_rank=2, message="rank 2 faulted")
    ranks[1].at(10.2, "call_end", duration_s=8.1, outcome="fault")
    ranks[1].at(10.2, "fault", fault_kind="peer", origin_rank=2, message="rank 2 faulted")
    ranks[0].at(10.3, "call_end", duration_s=8.2, outcome="fault")
    ranks[0].at(
        10.3,
        "fault",
        fault_kind="exception",
        origin_rank=0,
        exc_type="TimeoutError",
        message="barrier",
    )
    restart_tail(0, 10.5, ranks, {1: 0.6})

    # -- round 1: rank 1's process is killed ------------------------------------
    start_round(1, 12.0, ranks)
    ranks[1].at(19.9, "progress", step=40)
    ranks[1].close()
    sup[0].at(
        20.1,
        "child_exit",
        local_rank=1,
        child_pid=101,
        exit_code=None,
        signal="SIGKILL",
        runtime_s=19.6,
    )
    sup[0].at(
        20.2,
        "restart_decision",
        local_rank=1,
        decision="restart",
        reason="killed by SIGKILL",
        budget_left=9,
    )
    sup[0].at(20.6, "child_start", local_rank=1, child_pid=201, attempt=1)
    for r in (0, 2, 3):
        ranks[r].at(20.4, "call_end", duration_s=8.3, outcome="fault")
        ranks[r].at(20.4, "fault", fault_kind="peer", origin_rank=1, message="rank 1 died")
    restart_tail(1, 20.5, {r: ranks[r] for r in (0, 2, 3)}, {})
    for r in (0, 2, 3):  # the survivors waited for rank 1's replacement
        ranks[r].at(21.9, "restart_phase", phase="rejoin_wait", duration_s=1.2 + r / 10, ok=True)
    ranks[1] = Proc(log_dir, a, "wrapper", rank=1)
    ranks[1].at(21.0, "process_start", argv=["train.py"], local_rank=1)
    sup[0].at(22.0, "rejoin", local_rank=1, wait_s=1.4)

    # -- round 2: rank 3 hangs ---------------------------------------------------
    start_round(2, 22.0, ranks)
    monitor = Proc(log_dir, b, "monitor", rank=3)
    monitor.round(2).at(45.0, "hang", timeout="soft", stack=HANG_STACK)
    for r in (0, 1, 2):
        ranks[r].at(45.3, "call_end", duration_s=23.2, outcome="fault")
        ranks[r].at(45.3, "fault", fault_kind="peer", origin_rank=3, message="rank 3 hung")
    ranks[3].at(45.4, "call_end", duration_s=23.3, outcome="fault")
    restart_tail(2, 45.5, ranks, {})

    # -- round 3: completes ------------------------------------------------------
    start_round(3, 47.0, ranks)
    for p in ranks.values():
        p.at(60.0, "call_end", duration_s=12.9, outcome="completed")
        p.at(60.1, "round_end", outcome="completed", duration_s=13.1)
        p.at(60.2, "wrapper_end", outcome="completed", rounds=4)
    for n, s in sup.items():
        for local in (0, 1):
            s.at(
                60.5,
                "child_exit",
                local_rank=local,
                child_pid=0,
                exit_code=0,
                signal=None,
                runtime_s=60.0,
            )
        if n == 0:
            s.at(60.6, "job_stop", reason="training completed", exit_code=0)
        s.at(60.7, "supervisor_end", exit_code=0, reason="all children exited 0")
    store.at(60.8, "store_end", reason="supervisor exiting")
    for p in [*ranks.values(), *sup.values(), store, monitor]:
        p.close()
    call_s = (7.9 + 8.0 + 8.1 + 8.2) + (19.9 - 12.1) + 3 * 8.3 + 3 * 23.2 + 23.3 + 4 * 12.9
    return {
        "call_s": call_s,
        # first event: node-a at t=0 (wall skew -3 s); last: node-b supervisor_end at t=60.7
        "wall_s": 60.7 + 3.0,
    }
