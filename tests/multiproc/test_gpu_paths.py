"""The CUDA paths of the in-process layer, on a real GPU: they skip with the reason elsewhere.

Each scenario runs in its own process (a CUDA context broken by a device-side
assert stays broken), started by the test: ``python test_gpu_paths.py
<scenario> <out.json>`` is one such process, which writes what it saw.

- ``CudaHealthCheck`` never initializes CUDA, passes on a working GPU, raises
  after a device-side assert (``Fault.GPU_ERROR``) and times out on a kernel
  that never ends (``Fault.GPU_SLEEP``);
- ``AbortTorchDistributed`` aborts an NCCL communicator, writes the
  flight-recorder dump when asked to, and NCCL initializes again afterwards;
- a Wrapper whose function uses NCCL restarts after an exception, with
  ``CudaHealthCheck`` as its health check, and NCCL works in the second round;
- ``ChainedGPUHealthCheck`` and ``ChainedNVLHealthCheck`` read NVML on a healthy GPU;
- with two GPUs, an NCCL all_reduce blocked because a peer stays away returns
  once ``AbortTorchDistributed`` runs;
- ``KeptState`` commits CUDA state into pinned host buffers without a race with the
  next step's in-place updates, keeps the previous commit whole through a fault during
  a commit, and ``restore_agreed`` over NCCL restores the step on the device;
- ``RankMonitorClient.timed_step(cuda=True)`` records the GPU time of a block without the
  host waiting for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_inprocess import FAST, free_port_pair, rank_env

HERE = Path(__file__).resolve()


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        _cuda_devices() == 0, reason="needs CUDA: torch.cuda.is_available() is False here"
    ),
]


def _run(tmp: Path, scenario: str, *, rank: int = 0, world: int = 1, port: int | None = None,
         env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    full = rank_env(tmp / "logs", rank, world, port)
    full.update(env or {})
    log = open(tmp / f"{scenario}-{rank}.log", "wb")  # noqa: SIM115 - closed by the child's end
    return subprocess.Popen(
        [sys.executable, str(HERE), scenario, str(tmp / f"{scenario}-{rank}.json")],
        env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _finish(tmp: Path, scenario: str, procs: list[subprocess.Popen[bytes]],
            timeout: float = 120) -> list[dict]:  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(tmp.glob(f"{scenario}-*.log")))
    results = []
    for rank, proc in enumerate(procs):
        out = tmp / f"{scenario}-{rank}.json"
        assert proc.returncode == 0 and out.exists(), f"rank {rank} exit {proc.returncode}\n{logs}"
        results.append(json.loads(out.read_text()))
    print(logs)
    return results


def _one(tmp: Path, scenario: str, env: dict[str, str] | None = None) -> dict:
    return _finish(tmp, scenario, [_run(tmp, scenario, env=env)])[0]


def test_cuda_health_check_leaves_cuda_alone_then_passes_on_a_working_gpu(tmp_path):
    out = _one(tmp_path, "health_ok")
    assert out == {"initialized_by_check": False, "passed_after_init": True}


def test_cuda_health_check_raises_after_a_device_side_assert(tmp_path):
    out = _one(tmp_path, "health_after_assert")
    assert out["injected"] == "GPU_ERROR"
    assert out["injector_saw"], out  # the assert surfaced in the injecting thread
    assert out["check_raised"].startswith(("RuntimeError", "AcceleratorError")), out
    assert "device-side assert" in out["check_raised"], out
    assert out["check_is_runtime_error"] is True, out  # what callers of the reference catch


def test_cuda_health_check_times_out_on_a_kernel_that_never_ends(tmp_path):
    out = _one(tmp_path, "health_hung_kernel")
    assert out["injected"] == "GPU_SLEEP"
    assert out["check_raised"].startswith("TimeoutError"), out
    assert out["check_s"] < 10, out  # the 1 s limit, not the kernel, bounds the check


def test_nccl_abort_dumps_the_flight_recorder_and_nccl_starts_again(tmp_path):
    fr = tmp_path / "fr"
    out = _one(tmp_path, "nccl_abort", env={"TORCH_FR_BUFFER_SIZE": "1000", "NVRX_FR_TRACE_PATH": str(fr)})
    assert out["nccl_backends"] >= 1, out  # the NCCL path of the abort, not the gloo one
    assert out["initialized_after_abort"] is False, out
    assert out["second_all_reduce"] == 1.0, out
    assert out["dump"] == str(fr / "iter_0" / "rank_0"), out
    assert out["dump_entries"] >= 1, out  # the all_reduce of the first group is in the trace


def test_wrapper_restarts_an_nccl_function_with_the_cuda_health_check(tmp_path):
    out = _one(tmp_path, "wrapper_nccl")
    assert out["calls"] == [0, 1], out
    assert out["result"] == {"iteration": 1, "sum": 1.0}, out


def test_gpu_and_nvlink_checks_read_nvml_on_a_healthy_gpu(tmp_path):
    out = _one(tmp_path, "device_checks")
    if not out["pynvml"]:
        pytest.skip("pynvml is not installed beside torch here (pip install nvidia-ml-py)")
    assert out["recovery_action"] == 0, out  # NVML asks for nothing on a healthy GPU
    assert out["gpu_check"] == "passed", out
    assert out["nvl_check"] == "passed", out


def test_kept_state_commits_cuda_state_into_pinned_memory_and_restores_it(tmp_path):
    out = _one(tmp_path, "kept_state_cuda")
    assert out["pinned"] is True and out["on_device_after_restore"] is True, out
    assert out["restored_commit"] == 3 and out["same_bits"] is True, out
    # the step's in-place update, queued right after the commit, did not reach the copy
    assert out["raced_update_kept_out"] is True, out
    assert out["after_failed_commit"] == [3, True], out
    assert out["agreed"] == {"step": 3, "same_bits": True}, out


def test_a_step_timed_on_the_gpu_is_recorded_without_the_host_waiting(tmp_path):
    out = _one(tmp_path, "gpu_step_time")
    assert out["host_block_s"] < 0.5 * out["kernel_s"], out  # the host only queued the kernel
    assert len(out["recorded"]) == 3, out
    for seconds in out["recorded"]:
        assert abs(seconds - out["kernel_s"]) < 0.25 * out["kernel_s"], out


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 GPUs, one per NCCL rank")
def test_abort_returns_an_nccl_all_reduce_blocked_on_an_absent_peer(tmp_path):
    port = free_port_pair()
    procs = [_run(tmp_path, "nccl_blocked", rank=r, world=2, port=port) for r in range(2)]
    blocked, peer = _finish(tmp_path, "nccl_blocked", procs)
    assert peer["stayed_away"] is True
    assert blocked["returned_after_abort_s"] < 30, blocked
    assert blocked["second_all_reduce"] == 2.0, blocked


# -- the processes -------------------------------------------------------------------------


def _state():
    from nvrx.inprocess.state import State

    return State.from_env().freeze()


def _raised(call) -> str | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the scenario reports what was raised
        return f"{type(exc).__name__}: {exc}"
    return None


def _health_ok() -> dict:
    import torch

    from nvrx.inprocess.health_check import CudaHealthCheck

    CudaHealthCheck()(_state())
    initialized = torch.cuda.is_initialized()
    torch.ones(4, device="cuda").sum().item()
    CudaHealthCheck()(_state())
    return {"initialized_by_check": initialized, "passed_after_init": True}


def _inject(kind: str) -> tuple[str, list[str]]:
    """Inject ``kind`` on this rank now; returns its name and what the injecting thread raised."""
    import threading

    from nvrx.inprocess.tools.inject_fault import Fault, inject_fault

    seen: list[str] = []
    done = threading.Event()
    original = threading.excepthook

    def hook(args):
        seen.append(f"{args.exc_type.__name__}: {args.exc_value}")
        done.set()

    threading.excepthook = hook
    fault = inject_fault([Fault[kind]], num_faults=1, keep_alive=0, delay=0.0, seed=0)
    if kind == "GPU_ERROR":
        done.wait(30)
    if kind == "GPU_SLEEP":  # its launch returns at once: launched once the injecting thread ended
        for thread in threading.enumerate():
            if thread.name == f"nvrx-inject-{fault.name}":
                thread.join(30)
    threading.excepthook = original
    return fault.name, seen


def _health_after_assert() -> dict:
    import torch

    from nvrx.inprocess.health_check import CudaHealthCheck

    torch.ones(1, device="cuda").sum().item()
    injected, seen = _inject("GPU_ERROR")
    try:
        CudaHealthCheck(timeout=10)(_state())
        raised, runtime_error = None, False
    except Exception as exc:
        raised, runtime_error = f"{type(exc).__name__}: {exc}", isinstance(exc, RuntimeError)
    return {
        "injected": injected, "injector_saw": seen, "check_raised": raised,
        "check_is_runtime_error": runtime_error,
    }  # fmt: skip


def _health_hung_kernel() -> dict:
    import torch

    from nvrx.inprocess.health_check import CudaHealthCheck

    torch.ones(1, device="cuda").sum().item()
    injected, _ = _inject("GPU_SLEEP")
    start = time.monotonic()
    raised = _raised(lambda: CudaHealthCheck(timeout=1)(_state()))
    return {"injected": injected, "check_raised": raised, "check_s": time.monotonic() - start}


def _nccl_group(prefix: str, store, rank: int, world: int):
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip


def _store(rank: int):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=rank == 0,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip


def _nccl_abort() -> dict:
    import pickle

    import torch
    import torch.distributed as dist

    from nvrx.inprocess.abort import AbortTorchDistributed, _all_groups, _nccl_backends

    store = _store(0)
    _nccl_group("first", store, 0, 1)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    backends = len(_nccl_backends(_all_groups()))
    abort = AbortTorchDistributed()
    dump = abort.collect_fr_trace(_state())
    abort(_state())
    entries = len(pickle.loads(dump.read_bytes()).get("entries", [])) if dump else 0
    initialized = dist.is_initialized()
    _nccl_group("second", store, 0, 1)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    second = t.item()
    dist.destroy_process_group()
    return {
        "nccl_backends": backends, "initialized_after_abort": initialized,
        "second_all_reduce": second, "dump": str(dump) if dump else None, "dump_entries": entries,
    }  # fmt: skip


def _wrapper_nccl() -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    import nvrx.inprocess as inprocess
    from nvrx.inprocess.health_check import CudaHealthCheck

    calls: list[int] = []
    timeouts = {
        k: datetime.timedelta(seconds=v) if k.endswith(("_timeout", "_interval", "_wait", "_time")) else v
        for k, v in {**FAST, "soft_timeout": 30, "hard_timeout": 60, "barrier_timeout": 120}.items()
    }  # fmt: skip  (NCCL's first initialization may take seconds)

    @inprocess.Wrapper(health_check=CudaHealthCheck(), **timeouts)
    def train(call_wrapper: inprocess.CallWrapper = None) -> dict:
        calls.append(call_wrapper.iteration)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        if call_wrapper.iteration == 0:
            raise RuntimeError("injected fault after an NCCL all_reduce")
        dist.destroy_process_group()
        return {"iteration": call_wrapper.iteration, "sum": t.item()}

    return {"calls": calls, "result": train()}


def _waits_for_the_gpu(thread_id: int) -> bool:
    """Whether the thread's innermost Python frame is ``torch.cuda.synchronize``: blocked in
    C there on a collective that cannot complete (or about to be)."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and frame.f_code.co_name == "synchronize"


def _nccl_blocked() -> dict:
    import threading

    import torch
    import torch.distributed as dist

    from nvrx.inprocess.abort import AbortTorchDistributed

    rank = int(os.environ["RANK"])
    store = _store(rank)
    _nccl_group("first", store, rank, 2)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)  # both ranks: the communicator exists
    torch.cuda.synchronize()
    if rank == 1:  # stays away from the next collective until rank 0 has aborted
        store.wait(["aborted"])
        abort_result: dict = {"stayed_away": True}
    else:
        abort = AbortTorchDistributed()
        aborted_at: list[float] = []
        main = threading.get_ident()

        def abort_later() -> None:  # once the main thread waits for the GPU, not before
            deadline = time.monotonic() + 30
            while not _waits_for_the_gpu(main) and time.monotonic() < deadline:
                time.sleep(0.01)
            aborted_at.append(time.monotonic())
            abort(_state())

        threading.Thread(target=abort_later, daemon=True).start()
        raised = _raised(lambda: (dist.all_reduce(t), torch.cuda.synchronize()))
        returned = time.monotonic() - aborted_at[0] if aborted_at else None
        store.set("aborted", "1")
        abort_result = {"raised": raised, "returned_after_abort_s": returned}
    _nccl_group("second", store, rank, 2)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    abort_result["second_all_reduce"] = t.item()
    dist.destroy_process_group()
    return abort_result


def _device_checks() -> dict:
    from nvrx.inprocess.health_check import ChainedGPUHealthCheck, ChainedNVLHealthCheck

    try:
        import pynvml
    except ImportError:
        return {"pynvml": False}
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    field = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
    action = int(field.value.uiVal) if field.nvmlReturn == pynvml.NVML_SUCCESS else None
    pynvml.nvmlShutdown()
    nvl = ChainedNVLHealthCheck(0)
    result = {
        "pynvml": True,
        "recovery_action": action,
        "gpu_check": _raised(lambda: ChainedGPUHealthCheck(0)(_state())) or "passed",
        "nvl_check": _raised(lambda: (nvl(_state()), nvl(_state()))) or "passed",
    }
    result["nvlinks_up"] = len(nvl.links_up or ())
    return result


def _kept_state_cuda() -> dict:
    import torch
    import torch.distributed as dist

    from nvrx.inprocess.kept_state import KeptState

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4))).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kept = KeptState()
    kept.register("model", model)
    kept.register("optimizer", optimizer)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
        optimizer.step()

    def snapshot() -> list:
        moments = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()] + moments

    def same(before: list) -> bool:
        return all(torch.equal(a, b) for a, b in zip(snapshot(), before, strict=True))

    for _ in range(3):
        step()
    before = snapshot()
    kept.commit(3)
    with torch.no_grad():  # queued at once, no sync: it must not reach the copy in flight
        for p in model.parameters():
            p.mul_(-1.0).add_(7.0)
    raced = not same(before)
    restored = kept.restore()
    slot = kept._slots[kept._last]
    pinned = all(t.is_pinned() for t in slot.states["model"].values())
    result = {
        "pinned": pinned, "restored_commit": restored, "same_bits": same(before),
        "raced_update_kept_out": raced and same(before),
        "on_device_after_restore": all(t.is_cuda for t in snapshot()),
    }  # fmt: skip

    class Breaks:
        def state_dict(self):
            raise RuntimeError("injected fault during a commit")

        def load_state_dict(self, state):
            pass

    step()
    kept.register("breaks", Breaks(), per_rank=True)  # per rank: not in commit 3, not wanted back
    failed = _raised(lambda: kept.commit(4))
    result["after_failed_commit"] = (kept.restore(), same(before) and failed is not None)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    step()
    result["agreed"] = {"step": kept.restore_agreed(), "same_bits": same(before)}
    dist.destroy_process_group()
    return result


def _gpu_step_time() -> dict:
    import torch

    from nvrx import jobenv
    from nvrx.fault_tolerance import RankMonitorClient
    from nvrx.supervisor.rank_watch import RankWatch

    watch = RankWatch()
    os.environ[jobenv.FT_SOCKET] = watch.path
    client = RankMonitorClient()
    client.init_workload_monitoring()
    fd = watch.accept()
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # warm
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    kernel_s = begin.elapsed_time(end) / 1000
    host = []
    for _ in range(3):
        start = time.perf_counter()
        with client.timed_step(cuda=True):
            torch.cuda._sleep(cycles)
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    with client.timed_step(cuda=True):  # a later step reads what the GPU finished
        pass
    torch.cuda.synchronize()
    client.shutdown_workload_monitoring()
    recorded = [s for what, _, values in watch.read(fd) if what == "steps" for s in values]
    watch.close()
    return {"kernel_s": kernel_s, "host_block_s": max(host), "recorded": recorded[:3]}


SCENARIOS = {
    "gpu_step_time": _gpu_step_time,
    "kept_state_cuda": _kept_state_cuda,
    "device_checks": _device_checks,
    "health_ok": _health_ok,
    "health_after_assert": _health_after_assert,
    "health_hung_kernel": _health_hung_kernel,
    "nccl_abort": _nccl_abort,
    "wrapper_nccl": _wrapper_nccl,
    "nccl_blocked": _nccl_blocked,
}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    Path(sys.argv[2]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # a hung kernel or a broken context must not hold the exit
