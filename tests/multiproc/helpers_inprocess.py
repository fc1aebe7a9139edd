"""Harness for Wrapper tests: N ranks as real processes on loopback, gloo, a real store.

``launch(tmp_path, world_size, scenario=..., **params)`` starts one process per
rank running this file; each rank wraps ``train`` with a ``Wrapper`` built from
``params["wrapper"]`` and appends one JSON line per call of the function to
``calls-<rank>.jsonl``. Faults are injected on round 0 by the ranks named in
``params["fault_ranks"]``; ``params["train_s"]``: after a restart the ranks all-reduce
for that long before they return. ``Ranks.wait()`` reaps every rank and returns their
exit codes; ``Ranks.calls()`` and ``Ranks.events()`` read what happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()

#: Wrapper timeouts short enough for tests of its restart paths on this machine.
FAST = dict(
    soft_timeout=3,
    hard_timeout=5,
    heartbeat_timeout=3,
    heartbeat_interval=0.5,
    monitor_process_interval=0.25,
    monitor_thread_interval=0.5,
    progress_watchdog_interval=0.2,
    barrier_timeout=30,
    last_call_wait=0.2,
    termination_grace_time=0.5,
)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc``'s stdout and stderr once it ended; its process group is killed when it did
    not end within ``timeout`` seconds (``communicate`` then raises)."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_rank_scripts(script: str, world: int, args: list[str], env: dict[str, str]) -> list[dict]:
    """Run ``script RANK *args`` once per rank, together; each rank's last stdout line as
    JSON, in rank order. A rank that fails fails the caller, and the others (left waiting
    in a collective, maybe) are killed with their process groups."""
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env),
        )  # fmt: skip
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = finish(proc, 120)
            assert proc.returncode == 0, err[-2000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outputs


def free_port_pair() -> int:
    """A port p with p and p+1 free (MASTER_PORT and the store's MASTER_PORT + 1)."""
    from tests.support.ports import free_port_run  # the test process's, not a rank's, import

    return free_port_run(2)


@dataclass
class Ranks:
    tmp: Path
    port: int = 0
    world_size: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def wait(self, timeout: float = 60.0) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        try:
            for proc in self.procs:
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    codes.append(proc.wait(remaining))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        finally:
            self.kill()
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def calls(self, rank: int) -> list[dict[str, Any]]:
        path = self.tmp / f"calls-{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def result(self, rank: int) -> Any:
        path = self.tmp / f"result-{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def events(self) -> list[dict[str, Any]]:
        from nvrx.events import read_dir

        evs, _ = read_dir(self.tmp / "logs")
        return evs

    def log(self, rank: int) -> str:
        path = self.tmp / f"rank-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """Each rank's output, then the tail of each monitor process's log (when the test asked
        for one: who ended a rank shows there)."""
        logged = sorted(int(p.stem.removeprefix("rank-")) for p in self.tmp.glob("rank-*.log"))
        text = "\n".join(f"--- rank {r} ---\n{self.log(r)}" for r in logged)
        for path in sorted(self.tmp.glob("monitor-*.log")):
            text += f"\n--- {path.name} ---\n" + path.read_text(errors="replace")[-3000:]
        if (self.tmp / "logs").is_dir():
            faults = [e for e in self.events() if e["kind"] in ("fault", "terminate", "round_end")]
            text += "\n--- fault/terminate/round_end events ---\n" + "\n".join(
                f"rank {e.get('rank')} {e['kind']} {e.get('fault_kind') or e.get('outcome')} "
                f"{e.get('message') or ''}"[:200]
                for e in faults
            )
        return text


def rank_env(
    log_dir: Path, rank: int = 0, world_size: int = 1, port: int | None = None, job_id: str = "test"
) -> dict[str, str]:
    """The environment of one unsupervised Wrapper rank on loopback (no nvrx store outside it)."""
    env = dict(os.environ)
    for name in ("NVRX_STORE_HOST", "NVRX_STORE_PORT", "NVRX_SUPERVISED", "NVRX_RESTART_COUNT"):
        env.pop(name, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or free_port_pair()),
        NVRX_LOG_DIR=str(log_dir),
        NVRX_JOB_ID=job_id,
        TORCH_CPP_LOG_LEVEL="ERROR",
        PYTHONUNBUFFERED="1",
    )
    return env


#: Every ``Ranks`` launched in this process: the multiproc conftest kills what is left of
#: them after each test, also after a failed assertion skipped the test's own ``wait``.
LAUNCHED: list[Ranks] = []


def launch(tmp: Path, world_size: int, **params: Any) -> Ranks:
    """Start ``world_size`` ranks running ``train`` under a Wrapper configured by ``params``."""
    tmp.mkdir(parents=True, exist_ok=True)
    ranks = Ranks(tmp, port=free_port_pair(), world_size=world_size)
    LAUNCHED.append(ranks)
    (tmp / "params.json").write_text(json.dumps(params))
    for rank in range(world_size):
        ranks.procs.append(spawn(ranks, rank, params))
    return ranks


def spawn(
    ranks: Ranks, rank: int, params: dict[str, Any], extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start the process of one rank (also a replacement of a dead one, as a supervisor would)."""
    env = rank_env(ranks.tmp / "logs", rank, ranks.world_size, ranks.port)
    if params.get("hosts"):  # the host each rank stands for: a node agent per host
        env["NVRX_HOST_ID"] = params["hosts"][rank]
    env.update(params.get("env", {}))
    env.update(extra_env or {})
    with open(ranks.tmp / f"rank-{rank}.log", "ab") as out:
        return subprocess.Popen(
            [sys.executable, str(HERE), str(ranks.tmp)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


# -- the rank process -------------------------------------------------------------------


def _catastrophic_regex() -> None:
    import re

    re.match(r"(a+)+$", "a" * 64 + "b")  # holds the GIL for a very long time


def _ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores ``signum`` (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _dying_at_the_first_restart(assignment: Any, raises: bool = False) -> Any:
    """``assignment``, but the process is SIGKILLed (``raises``: the assignment raises) when it
    assigns ranks for the first restart: after the iteration barrier released it into the
    next round, before it starts that round."""
    from nvrx.inprocess.rank_assignment import RankAssignment

    class DyingAssignment(RankAssignment):
        calls = 0

        def __call__(self, ctx: Any) -> Any:
            DyingAssignment.calls += 1
            if DyingAssignment.calls == 2 and raises:  # the first call assigns the first round
                raise RuntimeError("rank assignment failed")
            if DyingAssignment.calls == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return assignment(ctx)

    return DyingAssignment()


def _wait_for_files(tmp: Path, pattern: str, count: int, what: str) -> None:
    """Until ``count`` files match ``pattern`` in ``tmp``: what other ranks signal they reached."""
    deadline = time.monotonic() + 30
    while len(list(tmp.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"{what} never came ({pattern})"
        time.sleep(0.01)


def _aborting_once_creating(tmp: Path, rank: int) -> Any:
    """The Wrapper's abort, run only once this rank's main thread is inside a process group's
    creation (waited for 30 s at most; ``abort-saw-creation-<rank>`` says it was): the
    fault then reaches the rank while it creates. A creation that no peer holds up (the last
    member's: the others already wait inside theirs) may be over between two looks: then
    ``subgroup-<rank>`` says it returned, and the abort comes after it."""
    from nvrx.inprocess import gloo_abort
    from nvrx.inprocess.abort import AbortTorchDistributed

    class AbortOnceCreating(AbortTorchDistributed):
        def __call__(self, state: Any) -> Any:
            deadline = time.monotonic() + 30
            created = tmp / f"subgroup-{rank}"
            while not gloo_abort.creating() and not created.exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            if gloo_abort.creating():
                (tmp / f"abort-saw-creation-{rank}").touch()
            return super().__call__(state)

    return AbortOnceCreating()


def _fault_while_peers_create(tmp: Path, rank: int, faulty: set[int], world: int) -> None:
    """A faulty rank raises; the others then create a group of their own, the lowest first
    and each next one only once the abort of the one before found it inside its creation
    (so that creation is sure to wait for its peers when the abort comes). They note that
    their creation returned, then wait there for the restart."""
    import torch.distributed as dist

    if rank in faulty:
        (tmp / "faulted").touch()
        raise RuntimeError(f"injected fault on rank {rank}")
    _wait_for_files(tmp, "faulted", 1, "the faulty rank")
    members = [r for r in range(world) if r not in faulty]
    before = members[: members.index(rank)]
    if before:
        _wait_for_files(tmp, f"abort-saw-creation-{before[-1]}", 1, "the abort of the rank before")
    dist.new_group(members, use_local_synchronization=True)
    (tmp / f"subgroup-{rank}").touch()
    while True:
        time.sleep(0.01)  # until the restart comes


def _closed_store_client() -> Any:
    """A client of the round's store whose connection is closed for reading, as one the
    store or the network dropped: its next answer never comes (``DistNetworkError``)."""
    import socket

    import torch.distributed as dist

    def sockets() -> set[str]:
        found = set()
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    found.add(name)
        return found

    before = sockets()
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        wait_for_workers=False,
    )  # fmt: skip
    for name in sockets() - before:
        with socket.socket(fileno=os.dup(int(name))) as sock:
            sock.shutdown(socket.SHUT_RD)
    return client


def _add_recording_plugins(wkw: dict[str, Any], tmp: Path, rank: int) -> None:
    """``initialize`` and ``finalize`` plug-ins that append the state they are given to
    ``plugins-<rank>.jsonl`` (the initialize before a ``RetryController`` of ``max_iterations``)."""
    import nvrx.inprocess as inprocess

    def note(kind: str, state: Any) -> None:
        fields = ("rank", "world_size", "active_rank", "iteration")
        record = {"plugin": kind, **{f: getattr(state, f) for f in fields}}
        with open(tmp / f"plugins-{rank}.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")

    class Init(inprocess.initialize.Initialize):
        def __call__(self, state):
            note("initialize", state)
            return state

    class Fin(inprocess.finalize.Finalize):
        def __call__(self, state):
            note("finalize", state)
            return state

    first = wkw.get("initialize")
    wkw["initialize"] = Init() if first is None else inprocess.Compose(first, Init())
    wkw["finalize"] = Fin()


def _rank_main(tmp: Path) -> int:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import nvrx.inprocess as inprocess
    from nvrx.inprocess import CallWrapper
    from nvrx.inprocess.rank_assignment import ActivateAllRanks, MaxActiveWorldSize, ShiftRanks

    group_factory = c10d._new_process_group_helper  # the Wrapper tracks groups only inside a call
    params = json.loads((tmp / "params.json").read_text())
    initial_rank = int(os.environ["RANK"])
    wkw = dict(params.get("wrapper", {}))
    for name in list(wkw):
        if name.endswith(("_timeout", "_interval", "_wait", "_time")):
            wkw[name] = datetime.timedelta(seconds=wkw[name])
    if params.get("max_iterations") is not None:
        wkw["initialize"] = inprocess.initialize.RetryController(
            max_iterations=params["max_iterations"]
        )
    if params.get("max_active") is not None:
        wkw["rank_assignment"] = inprocess.Compose(
            MaxActiveWorldSize(params["max_active"]), ShiftRanks()
        )
    elif params.get("tree"):
        from nvrx.inprocess.rank_assignment.tree import Layer, LayerFlag, Tree

        wkw["rank_assignment"] = Tree([Layer(key_or_fn="job", flag=LayerFlag.RESERVE)])
    elif params.get("grouped"):
        from nvrx.inprocess.rank_assignment import FilterCountGroupedByKey

        grouped = FilterCountGroupedByKey("job", lambda count: count >= 1, timeout=20)
        wkw["rank_assignment"] = inprocess.Compose(ActivateAllRanks(), ShiftRanks(), grouped)
    else:
        wkw["rank_assignment"] = inprocess.Compose(ActivateAllRanks(), ShiftRanks())
    if params.get("die_in_assignment") == initial_rank and not os.environ.get("NVRX_RESTART_COUNT"):
        wkw["rank_assignment"] = _dying_at_the_first_restart(wkw["rank_assignment"])
    if params.get("raise_in_assignment") == initial_rank and not os.environ.get("NVRX_RESTART_COUNT"):
        wkw["rank_assignment"] = _dying_at_the_first_restart(wkw["rank_assignment"], raises=True)
    if params.get("callbacks"):

        class Done(inprocess.completion.Completion):
            def __call__(self, state):
                (tmp / f"completion-{initial_rank}").write_text(str(state.rank))
                return state

        class Gone(inprocess.terminate.Terminate):
            def __call__(self, state):
                (tmp / f"terminate-{initial_rank}").write_text(state.mode.name)
                return state

        wkw["completion"], wkw["terminate"] = Done(), Gone()
    if params.get("record_plugins"):
        _add_recording_plugins(wkw, tmp, initial_rank)
    fault = params.get("fault")
    fault_ranks = set(params.get("fault_ranks", []))
    if params.get("abort_once_creating") and initial_rank not in fault_ranks:
        wkw["abort"] = _aborting_once_creating(tmp, initial_rank)
    fault_rounds = params.get("fault_rounds", 1)

    @inprocess.Wrapper(**wkw)
    def train(call_wrapper: CallWrapper = None, tag: str = "x") -> dict[str, Any]:
        it = call_wrapper.iteration
        record = {
            "initial_rank": initial_rank,
            "iteration": it,
            "rank": os.environ.get("RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
            "tag": tag,
            "t": time.time(),
            "monitor_ignores_usr2": _ignores(call_wrapper.monitor_process.pid, signal.SIGUSR2),
        }
        with open(tmp / f"calls-{initial_rank}.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        world = None
        if fault == "sigkill_before_pg" and it < fault_rounds and initial_rank in fault_ranks:
            os.kill(os.getpid(), signal.SIGKILL)  # the others wait in init_process_group for it
        if it == 0 and initial_rank in params.get("late_to_pg", []):
            time.sleep(300)  # ended by the restart, before its init_process_group
        if params.get("init_pg", True):
            dist.init_process_group(
                "gloo", timeout=datetime.timedelta(seconds=params.get("pg_timeout", 30))
            )
            t = torch.tensor([1.0])
            dist.all_reduce(t)
            world = int(t.item())
            train_until = time.monotonic() + (params.get("train_s", 0) if it > 0 else 0)
            while time.monotonic() < train_until:  # the restarted ranks train on a while
                dist.all_reduce(torch.tensor([1.0]))
                time.sleep(0.05)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, initial_rank)
            record["peers"] = gathered
        if fault == "fault_while_peers_create" and it == 0:
            _fault_while_peers_create(tmp, initial_rank, fault_ranks, dist.get_world_size())
        if it < fault_rounds and initial_rank in fault_ranks:
            if fault == "exception":
                raise RuntimeError(f"injected fault on rank {initial_rank}")
            if fault == "exception_together":
                # Every faulty rank raises, none is restarted first by another's fault:
                # they wait for each other where a restart cannot interrupt them.
                with call_wrapper.atomic():
                    (tmp / f"together-{initial_rank}").touch()
                    _wait_for_files(tmp, "together-*", len(fault_ranks), "the other faulty ranks")
                    raise RuntimeError(f"injected fault on rank {initial_rank}")
            if fault == "sleep":
                time.sleep(300)
            if fault == "gil":
                _catastrophic_regex()
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "ping_stall":
                call_wrapper.ping()
                while True:
                    sum(range(1000))
            if fault == "atomic":
                with call_wrapper.atomic():
                    (tmp / f"atomic-{initial_rank}.entered").touch()
                    time.sleep(params.get("atomic_s", 2.0))
                    with open(tmp / f"atomic-{initial_rank}.done", "w") as fh:
                        fh.write("1")
                time.sleep(300)
            if fault == "base_exception":
                raise KeyboardInterrupt("injected")
            if fault == "monitor_connection_lost":
                # the next round's monitor thread waits on a connection that is gone
                call_wrapper.services.mt_store = _closed_store_client()
                raise RuntimeError(f"injected fault on rank {initial_rank}")
        if [initial_rank, it] in params.get("raise_at", []):
            raise RuntimeError(f"injected fault on rank {initial_rank} in iteration {it}")
        if fault == "atomic" and it < fault_rounds and initial_rank not in fault_ranks:
            _wait_for_files(tmp, "atomic-*.entered", len(fault_ranks), "the faulty ranks' atomic()")
            raise RuntimeError("peer fault while rank is in atomic()")
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return {
            "iteration": it,
            "world": world,
            "rank": os.environ.get("RANK"),
            "peers": record.get("peers"),
        }

    try:
        result = train(tag="ok")
    except BaseException as exc:
        restored = c10d._new_process_group_helper is group_factory
        (tmp / f"result-{initial_rank}.json").write_text(
            json.dumps(
                {"error": type(exc).__name__, "message": str(exc), "gloo_restored": restored}
            )
        )
        raise
    (tmp / f"result-{initial_rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1])))
