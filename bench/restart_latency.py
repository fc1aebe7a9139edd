"""Restart latency of the in-process Wrapper, and its per-step overhead.

N ranks (default 4) train a loop of small gloo all-reduces. A fault is
injected on one rank at a given step: an exception, a GIL-released hang
(``time.sleep``) or a SIGKILL. The latency is "fault -> every surviving rank
back in the function" (wall clock, one host). The overhead is the median step
time of the wrapped loop against the same loop unwrapped.

    .venv/bin/python bench/restart_latency.py [--ranks 4] [--step 20] [--faults exception,hang,sigkill]
    .venv/bin/python bench/restart_latency.py --sealed-pairs 5 [--ranks 4]
    .venv/bin/python bench/restart_latency.py --against-reference 3 --faults exception

``--against-reference N`` runs each fault N times under nvrx and N times under NVRx 0.4.1
(``nvidia_resiliency_ext.inprocess`` in ``.venv-nvrx``, made by
``scripts/setup_nvrx_reference.sh``), interleaved, with the same function and store port
and each Wrapper's default settings (under the shorter timeouts this bench
sets otherwise, NVRx's restart outlasts its 4 s hard timeout and its monitor kills the rank), and prints both medians and their ratio. With
``--step-kind allreduce`` (the default) the other ranks wait in a gloo all-reduce when rank 1
faults: a restart includes ending that collective (the process group's timeout is 30 s).
With ``--step-kind sleep`` a step sleeps 1 ms instead and the others are in Python: the
restart machinery alone.

``--sealed-pairs N`` measures instead what sealing the fault records and the round's
interruption costs a restart:
N exception restarts with the records plain (as without a supervisor) interleaved with N
whose processes hold a job secret (``$NVRX_JOB_SECRET_FILE``, as a supervisor's ranks
do, so every record is sealed and every read checks the seals); both medians.

Targets on a 2-core machine: exception <= 0.5 s with every rank retained
(the Wrapper does not sleep ``last_call_wait``); hang <= soft_timeout + 1 s; overhead <= 2 % of a step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_ports import free_port_run  # noqa: E402

#: The package each implementation's ranks import the Wrapper from, and their python.
PACKAGES = {"nvrx": "nvrx.inprocess", "reference": "nvidia_resiliency_ext.inprocess"}
REFERENCE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-nvrx" / "bin" / "python"
#: ``sleep``: the training steps sleep 1 ms instead of an all-reduce (``--step-kind``).
STEP_KIND_ENV = "BENCH_STEP_KIND"

SETTINGS = dict(
    soft_timeout=2.0,
    hard_timeout=4.0,
    heartbeat_timeout=3.0,
    heartbeat_interval=0.5,
    monitor_process_interval=0.25,
    monitor_thread_interval=1.0,
    progress_watchdog_interval=0.25,
    barrier_timeout=30.0,
    last_call_wait=0.2,
    termination_grace_time=0.5,
)


def _rank(out: Path, impl: str, mode: str, fault: str, fault_step: int, steps: int) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    inprocess = importlib.import_module(PACKAGES[impl])
    rank = int(os.environ["RANK"])

    def loop(call_wrapper=None) -> None:  # noqa: ANN001 - annotated below, with the class itself
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        with open(out / f"enter-{rank}.jsonl", "a") as fh:
            fh.write(json.dumps({"iteration": iteration, "t": time.time()}) + "\n")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        x = torch.ones(256)
        times = []
        n = steps if iteration == 0 else max(3, steps // 10)
        sleep_steps = os.environ.get(STEP_KIND_ENV) == "sleep"
        if sleep_steps and iteration == 0 and rank != 1 and fault != "none":
            n = 10**9  # in Python until the restart reaches it, never in a collective
        for step in range(n):
            if iteration == 0 and step == fault_step and rank == 1 and fault != "none":
                (out / "fault.json").write_text(json.dumps({"t": time.time()}))
                if fault == "exception":
                    raise RuntimeError("injected")
                if fault == "hang":
                    time.sleep(3600)
                if fault == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            if sleep_steps:
                time.sleep(0.001)
            else:
                dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        dist.barrier()
        dist.destroy_process_group()
        if iteration == 0 or fault == "none":
            (out / f"steps-{rank}.json").write_text(json.dumps(times))

    if mode in ("wrapped", "defaults"):
        # the class, not a string: NVRx finds the parameter by comparing the annotation with it
        loop.__annotations__["call_wrapper"] = inprocess.CallWrapper
        kw = {k: datetime.timedelta(seconds=v) for k, v in SETTINGS.items()} if mode == "wrapped" else {}
        store_port = int(os.environ["MASTER_PORT"]) + 1  # NVRx's own store takes the port given
        inprocess.Wrapper(**kw, store_kwargs={"port": store_port})(loop)()
    else:
        loop()
    return 0


def _run(n: int, mode: str, fault: str, fault_step: int, steps: int, impl: str = "nvrx") -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"nvrx-bench-{fault}-"))
    port = free_port_run(2)
    service = None
    extra: dict[str, str] = {}
    if (
        mode == "plain"
    ):  # the same rendezvous as under the Wrapper: a store process, all ranks clients
        from nvrx.store.service import StoreService

        service = StoreService("127.0.0.1", 0, node=None).start()
        extra = {"MASTER_PORT": str(service.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    try:
        return _launch(out, port, n, (impl, mode), fault, fault_step, steps, extra)
    finally:
        if service is not None:
            service.stop()


def _launch(
    out: Path,
    port: int,
    n: int,
    impl_mode: tuple[str, str],
    fault: str,
    fault_step: int,
    steps: int,
    extra: dict[str, str],
) -> Path:
    impl, mode = impl_mode
    python = sys.executable if impl == "nvrx" else str(REFERENCE_PYTHON)
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(port)
        env.update(extra)
        env.update(NVRX_LOG_DIR=str(out / "logs"), TORCH_CPP_LOG_LEVEL="ERROR")
        for name in ("NVRX_STORE_HOST", "NVRX_STORE_PORT", "NVRX_SUPERVISED", "NVRX_RESTART_COUNT"):
            env.pop(name, None)
        log = open(out / f"rank-{rank}.log", "wb")
        cmd = [
            python,
            __file__,
            "--rank",
            str(out),
            impl,
            mode,
            fault,
            str(fault_step),
            str(steps),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()
    deadline = time.monotonic() + 180
    for proc in procs:
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    codes = [p.returncode for p in procs]
    expected_dead = {1} if fault == "sigkill" else set()
    bad = [r for r, c in enumerate(codes) if (c != 0) != (r in expected_dead)]
    if bad:
        raise RuntimeError(
            f"{impl} {mode}/{fault}: ranks {bad} exited {[codes[r] for r in bad]}; logs in {out}"
        )
    return out


def _latency(out: Path, n: int, survivors: list[int]) -> float:
    t_fault = json.loads((out / "fault.json").read_text())["t"]
    back = []
    for rank in survivors:
        entries = [
            json.loads(line) for line in (out / f"enter-{rank}.jsonl").read_text().splitlines()
        ]
        again = [e["t"] for e in entries if e["iteration"] > 0]
        if not again:  # it ended without a restart: there is no latency to report
            raise RuntimeError(f"rank {rank} never entered the function again; logs in {out}")
        back.append(min(again))
    return max(back) - t_fault


def _median_step(out: Path, n: int) -> float:
    per_rank = [
        statistics.median(json.loads((out / f"steps-{r}.json").read_text())[5:]) for r in range(n)
    ]
    return statistics.median(per_rank)


def _sealed_pairs(n: int, step: int, pairs: int, keep: bool) -> int:
    """Exception restarts with plain and with sealed fault records, interleaved."""
    from nvrx import jobenv
    from nvrx.store.seal import new_secret

    secret_dir = Path(tempfile.mkdtemp(prefix="nvrx-bench-secret-"))
    secret_file = secret_dir / "secret"
    secret_file.write_text(new_secret())
    secret_file.chmod(0o600)
    latencies: dict[str, list[float]] = {"plain": [], "sealed": []}
    dirs = [secret_dir]
    for pair in range(pairs):  # each goes first in every other pair: no order effect
        for kind in ("plain", "sealed") if pair % 2 == 0 else ("sealed", "plain"):
            os.environ.pop(jobenv.JOB_SECRET_FILE, None)
            if kind == "sealed":
                os.environ[jobenv.JOB_SECRET_FILE] = str(secret_file)
            out = _run(n, "wrapped", "exception", step, step + 20)
            dirs.append(out)
            latencies[kind].append(_latency(out, n, list(range(n))))
    os.environ.pop(jobenv.JOB_SECRET_FILE, None)
    plain, sealed = (statistics.median(latencies[k]) for k in ("plain", "sealed"))
    print(f"exception restart, {n} ranks, median of {pairs}: plain records {plain:.3f} s, "
          f"sealed records {sealed:.3f} s ({sealed - plain:+.3f} s)")  # fmt: skip
    print("  plain:  " + " ".join(f"{x:.3f}" for x in latencies["plain"]))
    print("  sealed: " + " ".join(f"{x:.3f}" for x in latencies["sealed"]))
    if not keep:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def _survivors(n: int, fault: str) -> list[int]:
    return [r for r in range(n) if not (fault == "sigkill" and r == 1)]


def _against_reference(n: int, step: int, faults: str, runs: int, keep: bool) -> int:
    """Each fault ``runs`` times under nvrx and under the reference, interleaved: medians."""
    if not REFERENCE_PYTHON.exists():
        print(f"{REFERENCE_PYTHON} not found: make it with scripts/setup_nvrx_reference.sh",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"ranks={n}, steps: {os.environ[STEP_KIND_ENV]}, each Wrapper's default settings")
    dirs = []
    for fault in [f for f in faults.split(",") if f]:
        latencies: dict[str, list[float]] = {"nvrx": [], "reference": []}
        for run in range(runs):  # each goes first in every other run: no order effect
            for impl in ("nvrx", "reference") if run % 2 == 0 else ("reference", "nvrx"):
                out = _run(n, "defaults", fault, step, step + 20, impl)
                dirs.append(out)
                latencies[impl].append(_latency(out, n, _survivors(n, fault)))
        ours, theirs = (statistics.median(latencies[k]) for k in ("nvrx", "reference"))
        print(f"{fault:>9}: restart latency, median of {runs}: nvrx {ours:.3f} s, NVRx 0.4.1 "
              f"{theirs:.3f} s: NVRx takes {theirs / ours:.1f} x as long")  # fmt: skip
        for impl, values in latencies.items():
            print(f"           {impl:>9}: " + " ".join(f"{x:.3f}" for x in values))
    if not keep:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the fault runs (default 4)")
    parser.add_argument("--step", type=int, default=20, help="step at which rank 1 faults")
    parser.add_argument("--faults", default="exception,hang,sigkill", help="comma separated; empty: only the overhead")
    parser.add_argument("--overhead-steps", type=int, default=2000, help="steps per overhead run (default 2000)")
    parser.add_argument(
        "--overhead-ranks", type=int, default=2, help="ranks of the overhead runs (default 2)"
    )
    parser.add_argument(
        "--overhead-repeats", type=int, default=2, help="plain/wrapped pairs, interleaved"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--sealed-pairs", type=int, default=0, metavar="N",
                        help="only compare exception restarts with plain and sealed fault records, N of each")  # fmt: skip
    parser.add_argument("--against-reference", type=int, default=0, metavar="N",
                        help="only compare restarts with NVRx 0.4.1's (.venv-nvrx), N runs of each per fault")  # fmt: skip
    parser.add_argument("--step-kind", choices=("allreduce", "sleep"), default="allreduce",
                        help="what a training step does: a gloo all-reduce (the other ranks wait in "
                             "it when one faults), or a 1 ms sleep (they are in Python)")  # fmt: skip
    return parser


def _fault_runs(n: int, faults: list[str], step: int) -> list[Path]:
    """One wrapped run of ``n`` ranks per fault, rank 1 faulting at ``step``: prints each
    restart latency against its target; the runs' directories."""
    dirs = []
    for fault in faults:
        out = _run(n, "wrapped", fault, step, step + 20)
        dirs.append(out)
        survivors = _survivors(n, fault)
        lat = _latency(out, n, survivors)
        if fault == "exception":
            target, what = 0.5, "0.5 s"
        elif fault == "hang":
            target, what = SETTINGS["soft_timeout"] + 1.0, "soft_timeout + 1 s"
        else:
            target, what = SETTINGS["heartbeat_timeout"], "heartbeat_timeout"
        print(
            f"{fault:>9}: restart latency {lat:6.3f} s, {len(survivors)}/{n} ranks back; target {what} = {target:g} s, ratio {lat / target:.2f}"
        )
    return dirs


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        out, impl, mode, fault, fault_step, steps = sys.argv[2:8]
        return _rank(Path(out), impl, mode, fault, int(fault_step), int(steps))
    parser = _parser()
    args = parser.parse_args()
    if args.overhead_repeats < 1 or args.overhead_steps <= 5:
        parser.error("--overhead-repeats must be >= 1 and --overhead-steps > 5 (the first 5 are dropped)")
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    os.environ[STEP_KIND_ENV] = args.step_kind
    n = args.ranks
    if args.sealed_pairs > 0:
        return _sealed_pairs(n, args.step, args.sealed_pairs, args.keep)
    if args.against_reference > 0:
        return _against_reference(n, args.step, args.faults, args.against_reference, args.keep)
    print(f"ranks={n} settings: " + ", ".join(f"{k}={v:g}" for k, v in SETTINGS.items()))
    dirs = _fault_runs(n, [f for f in args.faults.split(",") if f], args.step)
    m = args.overhead_ranks
    plain_t, wrapped_t = [], []
    for _ in range(args.overhead_repeats):  # interleaved, so a load change hits both alike
        for mode, sink in (("plain", plain_t), ("wrapped", wrapped_t)):
            out = _run(m, mode, "none", 0, args.overhead_steps)
            dirs.append(out)
            sink.append(_median_step(out, m))
    t_plain, t_wrapped = statistics.median(plain_t), statistics.median(wrapped_t)
    overhead = (t_wrapped - t_plain) / t_plain
    print(
        f" overhead ({m} ranks): median {os.environ[STEP_KIND_ENV]} step {t_plain * 1e3:.3f} ms plain, {t_wrapped * 1e3:.3f} ms "
        f"wrapped: {overhead * 100:+.2f} % (target <= 2 %, ratio {max(overhead, 0) / 0.02:.2f})"
    )
    if not args.keep:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
