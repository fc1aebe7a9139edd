"""AbortTorchDistributed brings ranks blocked in gloo collectives back, and gloo re-initializes.

Four real processes share a gloo process group over a TCPStore on loopback
(hosted by the test, like the nvrx store). Rank 3 stops participating but
stays alive; ranks 0 and 2 block in an all_reduce on the default group and
rank 1 in an all_reduce on a sub-group {1, 3}, all with a 60 s timeout. A
helper thread calls ``AbortTorchDistributed()`` on each blocked rank: every
blocked collective must raise within seconds, the store connection must keep
working, and a new process group on a new store prefix must all_reduce
correctly among all four ranks. The groups are created while
``gloo_abort.tracking()`` is on, as inside a Wrapper call.

A second test checks that the Wrapper tracks group creation only during a
call of the wrapped function: torch's group factory is its own before and
after the call, and the tracking one inside it.

Run as a script (``python test_abort_gloo.py worker`` or ``... wrapper``) it
is one such rank.
"""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

WORLD = 4
VICTIM = 3
SUBGROUP = [1, 3]
PG_TIMEOUT_S = 60.0
ABORT_BOUND_S = 10.0


def _in_the_blocking_call(thread_id: int | None) -> str | None:
    """The source line where the thread's innermost Python frame, torch's ``all_reduce``, calls
    into the backend: blocked there in C (or about to be); None elsewhere."""
    frames = sys._current_frames()
    frame = frames.get(thread_id) if thread_id is not None else None
    if frame is None or frame.f_code.co_name != "all_reduce":
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return line if "allreduce(" in line or ".wait(" in line else None


def _worker() -> None:
    """One rank; prints one JSON line with what it observed."""
    import torch
    import torch.distributed as dist

    from nvrx.inprocess import gloo_abort
    from nvrx.inprocess.abort import AbortTorchDistributed
    from nvrx.inprocess.gloo_abort import tracked_groups
    from nvrx.inprocess.state import State

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["NVRX_STORE_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    state = State.from_env().freeze()
    abort = AbortTorchDistributed()
    out: dict = {"rank": rank}

    # No group yet: a no-op that must not fail.
    abort(state)
    out["noop_ok"] = not dist.is_initialized()
    out["tracking"] = gloo_abort.install()  # what a Wrapper call does on entry

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("round0", store),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    sub = dist.new_group(SUBGROUP)
    x = torch.ones(4)
    dist.all_reduce(x)
    out["warmup_world"] = x[0].item()
    if rank in SUBGROUP:
        y = torch.ones(4)
        dist.all_reduce(y, group=sub)
        out["warmup_sub"] = y[0].item()
    out["tracked_groups"] = len(tracked_groups())

    if rank == VICTIM:
        # Alive but absent from the collectives; joins the next round once every
        # blocked rank came back.
        store.wait([f"back_{r}" for r in range(WORLD) if r != VICTIM], timedelta(seconds=60))
        abort(state)
    else:
        times: dict[str, float] = {}
        main = threading.main_thread().ident

        def abort_soon() -> None:
            # Not a store wait: a blocking wait holds the store client and would stall the main thread.
            deadline = time.monotonic() + 60
            while not _in_the_blocking_call(main) and time.monotonic() < deadline:
                time.sleep(0.01)
            out["blocked_at"] = _in_the_blocking_call(main)
            times["abort"] = time.monotonic()
            abort(state)
            times["abort_done"] = time.monotonic()

        helper = threading.Thread(target=abort_soon, daemon=True)
        helper.start()
        group = sub if rank in SUBGROUP else None
        t = torch.ones(4)
        times["enter"] = time.monotonic()
        try:
            dist.all_reduce(t, group=group)
            out["blocked_raised"] = False
        except Exception as exc:  # gloo's error, or torch's once the group is gone
            out["blocked_raised"] = True
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        times["raised"] = time.monotonic()
        helper.join(timeout=30)
        out["helper_done"] = not helper.is_alive()
        out["raised_after_abort"] = times["raised"] >= times.get("abort", float("inf"))
        out["raise_latency_s"] = times["raised"] - times.get("abort", times["enter"])
        out["blocked_s"] = times["raised"] - times["enter"]
        out["abort_call_s"] = times.get("abort_done", 0.0) - times.get("abort", 0.0)
        store.set(f"back_{rank}", "1")

    out["destroyed"] = not dist.is_initialized()
    # The store connection survived the abort.
    store.set(f"after_abort_{rank}", str(rank))
    out["store_ok"] = store.get(f"after_abort_{rank}") == str(rank).encode()

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("round1", store),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    z = torch.full((4,), float(rank + 1))
    dist.all_reduce(z)
    out["round1_sum"] = z[0].item()
    sub2 = dist.new_group(SUBGROUP)
    if rank in SUBGROUP:
        w = torch.ones(2)
        dist.all_reduce(w, group=sub2)
        out["round1_sub"] = w[0].item()
    dist.destroy_process_group()
    gloo_abort.uninstall()
    print(json.dumps(out), flush=True)


def _wrapper_worker() -> None:
    """One rank of a one-rank job: is torch's group factory tracked only inside the Wrapper call?"""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from nvrx.inprocess import Wrapper, gloo_abort

    original = c10d._new_process_group_helper
    out: dict = {"before": c10d._new_process_group_helper is original}

    @Wrapper(soft_timeout=20, hard_timeout=30, barrier_timeout=60, completion_timeout=60)
    def train() -> None:
        helper = c10d._new_process_group_helper
        out["inside_patched"] = helper is not original and helper.__wrapped__ is original
        dist.init_process_group("gloo")  # through the tracking factory
        t = torch.ones(1)
        dist.all_reduce(t)
        out["inside_sum"] = t.item()
        dist.destroy_process_group()

    train()
    out["after"] = c10d._new_process_group_helper is original
    out["after_installed"] = gloo_abort.installed()
    print(json.dumps(out), flush=True)


def _run_ranks(tmp_path) -> list[dict]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(WORLD):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                NVRX_STORE_HOST="127.0.0.1",
                NVRX_STORE_PORT=str(server.port),
                NVRX_LOG_DIR=str(tmp_path),
                TORCH_CPP_LOG_LEVEL="ERROR",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "worker"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        results = []
        deadline = time.monotonic() + 150
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{stderr[-3000:]}"
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            assert lines, f"rank {rank} printed no result:\n{stdout}\n{stderr[-3000:]}"
            results.append(json.loads(lines[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


@pytest.mark.timeout(200)
def test_abort_unblocks_gloo_collectives_and_gloo_reinitializes(tmp_path):
    results = _run_ranks(tmp_path)
    for out in results:
        rank = out["rank"]
        assert out["noop_ok"], out
        assert out["tracking"], out
        assert out["warmup_world"] == WORLD, out
        expected_groups = 2 if rank in SUBGROUP else 1
        assert out["tracked_groups"] == expected_groups, (
            f"rank {rank}: group sockets not recorded: {out}"
        )
        if rank != VICTIM:
            assert out["blocked_at"], out  # the abort came once it was blocked in the collective
            assert out["blocked_raised"], out
            assert out["helper_done"], out
            # It stayed blocked until the abort, then came back well before the 60 s timeout.
            assert out["raised_after_abort"], out
            assert out["raise_latency_s"] < ABORT_BOUND_S, out
        assert out["destroyed"], out
        assert out["store_ok"], out
        assert out["round1_sum"] == sum(range(1, WORLD + 1)), out
        if rank in SUBGROUP:
            assert out["warmup_sub"] == len(SUBGROUP), out
            assert out["round1_sub"] == len(SUBGROUP), out
    latencies = {o["rank"]: round(o["raise_latency_s"], 3) for o in results if o["rank"] != VICTIM}
    calls = {o["rank"]: round(o["abort_call_s"], 4) for o in results if o["rank"] != VICTIM}
    print(f"abort -> raise latency per blocked rank (s): {latencies}")
    print(f"AbortTorchDistributed() call per blocked rank (s): {calls}")


@pytest.mark.timeout(120)
def test_wrapper_tracks_group_creation_only_during_the_call(tmp_path):
    from helpers_inprocess import rank_env

    env = rank_env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, __file__, "wrapper"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    from helpers_inprocess import finish

    stdout, stderr = finish(proc, 100)
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])
    assert out == {
        "before": True,
        "inside_patched": True,
        "inside_sum": 1.0,
        "after": True,
        "after_installed": False,
    }, out


@pytest.mark.timeout(60)
def test_abort_without_process_group_is_noop():
    import torch.distributed as dist

    from nvrx.inprocess.abort import AbortTorchDistributed
    from nvrx.inprocess.state import State

    assert not dist.is_initialized()
    state = State(rank=0, world_size=1).freeze()
    assert AbortTorchDistributed()(state) is state
    assert not dist.is_initialized()


class _CutShort(Exception):
    """Stands for the Wrapper's restart exception landing inside ``init_process_group``."""


def _cut_short(*args: object, **kwargs: object) -> None:
    raise _CutShort


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["_new_process_group_helper", "_update_default_pg"])
def test_abort_clears_an_init_process_group_cut_short(monkeypatch, where: str) -> None:
    """A peer's fault can interrupt ``init_process_group`` before its group exists (its name
    already counted) or after the group is registered but before it is the default group.
    The abort leaves torch as a fresh process has it: the next round's group is named "0"
    on every rank, and ``init_process_group`` works again."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from nvrx.inprocess.abort import AbortTorchDistributed
    from nvrx.inprocess.state import State

    with monkeypatch.context() as patch:
        patch.setattr(c10d, where, _cut_short)
        with pytest.raises(_CutShort):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized() and c10d._world.group_count == 1
    assert bool(c10d._world.pg_map) == (where == "_update_default_pg")
    AbortTorchDistributed()(State(rank=0, world_size=1).freeze())
    assert (c10d._world.pg_map, c10d._world.group_count) == ({}, 0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "gloo" and c10d._world.pg_names[dist.group.WORLD] == "0"
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
if __name__ == "__main__" and sys.argv[1:] == ["wrapper"]:
    _wrapper_worker()
