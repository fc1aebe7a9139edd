"""Where the start of a job goes: a supervisor's phases, and a 4-rank job with and without nvrx.

Variants, each a 4-rank job on this machine running the same tiny gloo function
(``init_process_group("gloo")``, one ``all_reduce``, ``barrier``, ``destroy_process_group``):

``plain``                4 processes started as torchrun would (RANK, WORLD_SIZE, MASTER_*),
                         plain torch.distributed;
``wrapper``              the same processes, the function wrapped in ``nvrx.inprocess.Wrapper()``
                         with its default settings (rank 0 starts the store service);
``supervised``           ``python -m nvrx.supervisor.cli --nnodes 1 --nproc-per-node 4`` running
                         the plain script;
``supervised-wrapper``   the same supervisor running the Wrapper script (the Wrapper uses the
                         supervisor's store).
``supervised-cold``      (not run by default) ``supervised`` with ``--no-warm-standby``.

Every time is in seconds from the launch (the bench's ``Popen``) and comes from the events
the processes write (``supervisor_start``, ``store_start``, ``child_start``, the Wrapper's
``call_start``/``call_end``...; ``nvrx.events``), from lines the child script prints at its
first line of code, after ``import torch``, on entering the function and so on, and, for the
store service, the node agent (the supervisor's, or the host's without a
supervisor) and the warm standby, from their process start (psutil)
and the agent's connection to the store (psutil polls it every 20 ms). A phase "of the
ranks" is its last rank's. Each variant runs ``--repeats`` times (interleaved) and the
medians are printed. Then the supervisor runs once more under ``python -X importtime`` and
the imports of its own process are summed by package.

Targets: a supervisor's children run within 2 s of its start (issue 14); the last rank of a
Wrapper job enters its function at most 0.5 s after a plain script's, under the same
supervisor (issue 37; paired runs, printed for the unsupervised pair too).

Run as root (or where ``unshare -rn`` is allowed) it re-executes itself in a private network
namespace, so that loopback connections do not stall on reverse DNS (torch's store does a
lookup per connection); otherwise it sets RES_OPTIONS and says so. It first caches nvrx's
bytecode (``compileall``), as an installed package has it: where ``PYTHONDONTWRITEBYTECODE`` is
set, each process would otherwise compile every nvrx module it imports (``--no-compile``).

    .venv/bin/python bench/startup.py [--repeats 3] [--nproc 4]
        [--variants plain,wrapper,supervised,supervised-wrapper] [--no-compile]
"""

from __future__ import annotations

import argparse
import collections
import compileall
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import private_netns  # noqa: E402
from free_ports import free_port_run  # noqa: E402

TARGET_CHILDREN_S = 2.0
TARGET_WRAPPER_LAG_S = 0.5
VARIANTS = ("plain", "wrapper", "supervised", "supervised-wrapper", "supervised-cold")
DEFAULT_VARIANTS = VARIANTS[:4]
MARK = "NVRX_STARTUP"

#: The job: marks go to stdout as "NVRX_STARTUP <what> <monotonic> <rank>".
CHILD = textwrap.dedent(
    f'''
    import time
    _t = time.monotonic()
    import os
    import sys
    def mark(what, t=None):
        print(f"{MARK} {{what}} {{time.monotonic() if t is None else t:.6f}} {{os.environ.get('RANK', '?')}}", flush=True)
    mark("first_line", _t)
    import datetime
    import torch
    import torch.distributed as dist
    mark("torch_imported")
    def work():
        mark("fn_entered")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        mark("pg_ready")
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.barrier()
        dist.destroy_process_group()
        mark("fn_done")
    if sys.argv[1] == "wrapper":
        from nvrx.inprocess import Wrapper
        mark("nvrx_imported")
        Wrapper()(work)()
    else:
        work()
    mark("exit")
    '''
)


@dataclass
class Run:
    """One job: named times in seconds from its launch (lists where there is one per rank)."""

    variant: str
    t: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    problems: list[str] = field(default_factory=list)

    def add(self, what: str, value: float | None) -> None:
        if value is not None:
            self.t[what].append(value)


#: Helper processes told apart by their command lines: (name, what the command line holds).
HELPERS = (
    ("store_process", "nvrx.store.service"),
    ("agent_process", "nvrx.node_agent"),
    ("standby_process", "nvrx.supervisor.standby_process"),
    ("monitor_process", "nvrx.monitor_boot"),
)


class ProcessWatch(threading.Thread):
    """Polls the launched processes' descendants every 20 ms: when each helper process
    (``HELPERS``) started, and when the node agent's connection to the store was up."""

    def __init__(self, pids: list[int], store_port: int | None, mono0: float) -> None:
        super().__init__(name="process-watch", daemon=True)
        self.pids, self.store_port, self.mono0 = pids, store_port, mono0
        # process start times are in clock ticks since boot: compare them on CLOCK_BOOTTIME
        self.boot0 = time.clock_gettime(time.CLOCK_BOOTTIME) - (time.monotonic() - mono0)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.stop = threading.Event()
        self.found: dict[str, list[float]] = collections.defaultdict(list)
        self._seen: set[int] = set()
        self._agent: Any = None

    def run(self) -> None:
        import psutil

        roots = []
        for pid in self.pids:
            try:
                roots.append(psutil.Process(pid))
            except psutil.Error:
                pass
        while not self.stop.wait(0.02):
            for root in roots:
                try:
                    children = root.children(recursive=True)
                except psutil.Error:
                    continue
                for child in children:
                    if child.pid in self._seen:
                        continue
                    self._seen.add(child.pid)
                    try:
                        cmd = " ".join(child.cmdline())
                        created = self._start_time(child.pid)
                    except (psutil.Error, OSError):
                        continue
                    for name, needle in HELPERS:
                        if needle in cmd:
                            self.found[name].append(created)
                            if name == "agent_process":
                                self._agent = child
            if self._agent is not None and not self.found.get("agent_connected"):
                try:
                    conns = self._agent.net_connections(kind="tcp")
                except psutil.Error:
                    conns = []
                if any(
                    c.raddr and c.raddr.port == self.store_port and c.status == "ESTABLISHED"
                    for c in conns
                ):
                    self.found["agent_connected"].append(time.monotonic() - self.mono0)

    def _start_time(self, pid: int) -> float:
        """When ``pid`` started, in seconds from the launch (10 ms resolution)."""
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / self.tick - self.boot0


def _marks(text: str, mono0: float, run: Run) -> None:
    for what, mono in re.findall(MARK + r" (\w+) (\d+\.\d{6}) ", text):
        run.add(what, float(mono) - mono0)


def _events(job_dir: Path, mono0: float, run: Run) -> None:
    from nvrx.events import read_dir

    if not job_dir.is_dir():
        return
    evs, _ = read_dir(job_dir)
    for e in evs:
        kind, component = e.get("kind"), e.get("component")
        t = float(e["mono"]) - mono0
        if kind in ("supervisor_start", "child_start", "standby_start", "supervisor_end"):
            run.add(kind, t)
        elif kind == "store_start":
            run.add("store_start", t)
        elif component == "wrapper" and kind in ("round_start", "call_start", "call_end", "wrapper_end"):
            run.add(kind, t)
        elif component == "wrapper" and kind == "restart_phase":
            run.add("phase:" + str(e.get("phase")), float(e.get("duration_s") or 0.0))


def run_job(variant: str, args: argparse.Namespace, tmp: Path, index: int) -> Run:
    """Launch one job of ``variant``, wait for its end, collect its times."""
    run = Run(variant)
    script = tmp / "job.py"
    mode = "wrapper" if variant.endswith("wrapper") else "plain"
    job_id = f"startup-{variant}-{index}"
    log_dir = tmp / "logs"
    port = free_port_run(2)
    env = dict(os.environ, OMP_NUM_THREADS="1", NVRX_LOG_DIR=str(log_dir), NVRX_JOB_ID=job_id)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    py = [sys.executable, str(script), mode]
    out_path = tmp / f"{job_id}.out"
    with out_path.open("w") as sink:
        if variant.startswith("supervised"):
            cmd = [
                sys.executable, "-m", "nvrx.supervisor.cli", "--nnodes", "1",
                "--nproc-per-node", str(args.nproc), "--master-port", str(port),
                "--store-port", str(port + 1), "--job-id", job_id, "--log-dir", str(log_dir),
                *(["--no-warm-standby"] if variant == "supervised-cold" else []), "--", *py,
            ]  # fmt: skip
            mono0 = time.monotonic()
            procs = [subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)]
        else:
            mono0 = time.monotonic()
            procs = []
            for rank in range(args.nproc):
                renv = dict(
                    env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                    LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                )  # fmt: skip
                procs.append(subprocess.Popen(py, env=renv, stdout=sink, stderr=subprocess.STDOUT))
        watch = ProcessWatch([p.pid for p in procs], port + 1, mono0)
        watch.start()
        ended = []
        for proc in procs:
            try:
                code = proc.wait(max(1.0, mono0 + args.timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = _end(proc)
                run.problems.append(f"timed out after {args.timeout:g} s")
            ended.append(time.monotonic() - mono0)
            if code != 0:
                run.problems.append(f"exit code {code}")
    run.add("job_end", max(ended))
    watch.stop.set()
    watch.join(5)
    for name, values in watch.found.items():
        for value in values:
            run.add(name, value)
    _marks(out_path.read_text(errors="replace"), mono0, run)
    _events(log_dir / job_id, mono0, run)
    if run.problems:
        tail = out_path.read_text(errors="replace")[-1500:]
        run.problems.append("output tail:\n" + textwrap.indent(tail, "    "))
    return run


def _end(proc: subprocess.Popen) -> int:
    """End a launched process that ran past the timeout: SIGTERM first, so that a supervisor
    or a Wrapper ends the processes it started (each in a session of its own), then SIGKILL."""
    proc.terminate()
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


#: Rows of the table: (label, key, which value of the ranks: "first" | "last").
ROWS: list[tuple[str, str, str]] = [
    ("supervisor: supervisor_start event", "supervisor_start", "first"),
    ("node agent process started", "agent_process", "first"),
    ("store service process started", "store_process", "first"),
    ("store reachable (store_start event)", "store_start", "first"),
    ("node agent connected to the store", "agent_connected", "first"),
    ("first child started (child_start)", "child_start", "first"),
    ("last child started (child_start)", "child_start", "last"),
    ("warm standby started", "standby_process", "first"),
    ("first Wrapper monitor process started", "monitor_process", "first"),
    ("last Wrapper monitor process started", "monitor_process", "last"),
    ("first rank at its first line", "first_line", "first"),
    ("last rank at its first line", "first_line", "last"),
    ("last rank: import torch done", "torch_imported", "last"),
    ("last rank: import nvrx.inprocess done", "nvrx_imported", "last"),
    ("last rank: Wrapper round_start", "round_start", "last"),
    ("last rank in the function", "fn_entered", "last"),
    ("last rank: process group ready", "pg_ready", "last"),
    ("last rank: function done", "fn_done", "last"),
    ("last rank: Wrapper wrapper_end", "wrapper_end", "last"),
    ("last rank: last line", "exit", "last"),
    ("job finished (every launched process exited)", "job_end", "last"),
]


def _pick(run: Run, key: str, which: str) -> float | None:
    values = run.t.get(key)
    if not values:
        return None
    return min(values) if which == "first" else max(values)


def _median(runs: list[Run], key: str, which: str) -> float | None:
    """The median over the runs that went through (a failed run's times are left out)."""
    values = [v for v in (_pick(r, key, which) for r in runs if not r.problems) if v is not None]
    return statistics.median(values) if values else None


def importtime(args: argparse.Namespace, tmp: Path) -> None:
    """Run the supervisor once under ``-X importtime`` and sum its own imports by package."""
    port = free_port_run(2)
    job_id = "startup-importtime"
    cmd = [
        sys.executable, "-X", "importtime", "-m", "nvrx.supervisor.cli", "--nnodes", "1",
        "--nproc-per-node", str(args.nproc), "--master-port", str(port),
        "--store-port", str(port + 1), "--job-id", job_id, "--log-dir", str(tmp / "logs"),
        "--", sys.executable, str(tmp / "job.py"), "plain",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPROFILEIMPORTTIME", None)  # the children must not print theirs
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    rows = []  # (depth, name, self_us, cumulative_us)
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, self_us, cum_us, name = (part for part in line.replace("import time:", "|", 1).split("|"))
        depth = (len(name) - len(name.lstrip(" "))) // 2
        rows.append((depth, name.strip(), int(self_us), int(cum_us)))
    total = sum(cum for depth, _, _, cum in rows if depth == 0)
    torch_in = any(name == "torch" for _, name, _, _ in rows)
    print()
    print(
        f"supervisor process imports (python -X importtime, one run): {len(rows)} modules, "
        f"{total / 1e6:.3f} s in total; torch imported in the supervisor: {'YES' if torch_in else 'no'}"
    )
    groups: dict[str, int] = collections.Counter()
    for _, name, self_us, _ in rows:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "nvrx" else parts[0]
        groups[key] += self_us
    print("  self time by package (largest first):")
    for key, us in sorted(groups.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {key:<32} {us / 1e3:8.1f} ms")
    print("  largest imports with what they pulled in (cumulative, depth <= 2):")
    shown = sorted((r for r in rows if r[0] <= 2), key=lambda r: -r[3])[:12]
    for depth, name, _, cum in shown:
        print(f"    {'  ' * depth}{name:<{44 - 2 * depth}} {cum / 1e3:8.1f} ms")
    chains = _import_parents(rows, "nvrx.report")
    if chains:
        print(f"  nvrx.report is first imported by: {' <- '.join(chains)}")
    if proc.returncode != 0:
        print(f"  (that supervisor exited {proc.returncode})")


def _import_parents(rows: list[tuple[int, str, int, int]], target: str) -> list[str]:
    """The chain of importers of the first import of ``target`` (importtime prints a module
    after the modules it imported, one level deeper)."""
    for i, (depth, name, _, _) in enumerate(rows):
        if name == target:
            chain, want = [name], depth - 1
            for d, n, _, _ in rows[i + 1 :]:
                if d == want:
                    chain.append(n)
                    want -= 1
                if want < 0:
                    break
            return chain
    return []


def _fmt(v: float | None) -> str:
    return f"{v:8.2f}" if v is not None else f"{'-':>8}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--nproc", type=int, default=4, help="ranks of the job")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma separated")
    parser.add_argument("--timeout", type=float, default=180.0, help="s before a job is killed")
    parser.add_argument("--no-importtime", action="store_true", help="skip the import analysis")
    parser.add_argument("--no-netns", action="store_true", help="stay in this network namespace")
    parser.add_argument(
        "--no-compile", action="store_true",
        help="leave nvrx's modules as they are: where no bytecode is cached, every process "
        "compiles the ones it imports",
    )  # fmt: skip
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
    code = private_netns.rerun_inside(__file__, args.no_netns)
    if code is not None:
        return code
    print(
        f"network namespace: {os.environ.get('NVRX_BENCH_NETNS', 'none (--no-netns)')}; "
        f"{args.nproc} ranks, {args.repeats} runs per variant, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    if not args.no_compile:
        _compile_nvrx()
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
    print(f"one `python -c 'import torch'` alone: {time.monotonic() - t:.2f} s (how loaded this box is)")
    runs: dict[str, list[Run]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="nvrx-startup-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "job.py").write_text(CHILD)
        for i in range(args.repeats):
            for variant in variants:
                run = run_job(variant, args, tmp, i)
                runs[variant].append(run)
                done = _pick(run, "job_end", "last")
                print(f"  run {i + 1} {variant:<20} finished after {done:6.2f} s", flush=True)
                for problem in run.problems:
                    print(f"    problem: {problem}")
        print()
        print(
            f"median seconds from launch ({args.repeats} runs; a phase of the ranks is its last "
            "rank's; each row's median is taken on its own, so rows of different runs may cross)"
        )
        failed = {v: sum(1 for r in rs if r.problems) for v, rs in runs.items()}
        if any(failed.values()):
            print(
                "  failed runs, left out: "
                + ", ".join(f"{v} {n} of {args.repeats}" for v, n in failed.items() if n)
            )
        print(f"{'phase':<46}" + "".join(f"{v[:18]:>19}" for v in variants))
        for label, key, which in ROWS:
            values = [_median(runs[v], key, which) for v in variants]
            if all(v is None for v in values):
                continue
            print(f"{label:<46}" + "".join(f"{_fmt(v):>19}" for v in values))
        phases = sorted({k for rs in runs.values() for r in rs for k in r.t if k.startswith("phase:")})
        if phases:
            print("Wrapper phases (restart_phase events: median of the slowest rank's duration, s)")
            for key in phases:
                values = [_median(runs[v], key, "last") for v in variants]
                print(f"  {key[6:]:<44}" + "".join(f"{_fmt(v):>19}" for v in values))
        print()
        print(f"target: a supervisor's children run within {TARGET_CHILDREN_S:g} s of its start")
        for v in variants:
            if not v.startswith("supervised"):
                continue
            started = _median(runs[v], "child_start", "last")
            first_line = _median(runs[v], "first_line", "last")
            for label, value in (("last child started", started), ("last child at its first line", first_line)):
                if value is not None:
                    print(
                        f"  {v:<20} {label:<30} {value:6.2f} s  ratio "
                        f"{value / TARGET_CHILDREN_S:5.2f} (<= 1 meets)"
                    )
        if "plain" in variants:
            base = _median(runs["plain"], "job_end", "last")
            for v in variants:
                end = _median(runs[v], "job_end", "last")
                if v != "plain" and base and end:
                    print(f"  {v:<20} job finished {end - base:+6.2f} s after plain's ({end / base:4.2f} x)")
        _wrapper_lag(runs, variants)
        if not args.no_importtime:
            importtime(args, tmp)
    return 1 if any(failed.values()) else 0  # the medians above left those runs out


def _compile_nvrx() -> None:
    """Cache nvrx's bytecode, as an installed package has it (pip compiles what it
    installs). Where ``PYTHONDONTWRITEBYTECODE`` is set, as on some shared machines, an
    editable checkout is compiled anew by every process at every import: for a Wrapper
    rank that is a tenth of a second or more of compiling at its start."""
    spec = importlib.util.find_spec("nvrx")
    assert spec is not None and spec.submodule_search_locations
    for directory in spec.submodule_search_locations:
        compileall.compile_dir(directory, quiet=1)
    told = " (PYTHONDONTWRITEBYTECODE is set here)" if sys.dont_write_bytecode else ""
    print(f"nvrx's bytecode cached, as an installed package's is{told}; --no-compile leaves it")


def _wrapper_lag(runs: dict[str, list[Run]], variants: list[str]) -> None:
    """Target (issue 37): the last rank of a Wrapper job enters its function at most
    ``TARGET_WRAPPER_LAG_S`` after a plain script's, under the same launcher; the runs are
    interleaved, so run i of one is paired with run i of the other."""
    for plain, wrapped in (("plain", "wrapper"), ("supervised", "supervised-wrapper")):
        if plain not in variants or wrapped not in variants:
            continue
        lags = []
        for a, b in zip(runs[plain], runs[wrapped], strict=True):
            entered = (_pick(a, "fn_entered", "last"), _pick(b, "fn_entered", "last"))
            if not a.problems and not b.problems and None not in entered:
                lags.append(entered[1] - entered[0])
        if lags:
            lag = statistics.median(lags)
            print(
                f"  {wrapped:<20} last rank in the function {lag:+6.2f} s after {plain}'s "
                f"(median of {len(lags)} paired runs; target <= {TARGET_WRAPPER_LAG_S:g} s: "
                f"ratio {lag / TARGET_WRAPPER_LAG_S:5.2f}, <= 1 meets)"
            )


if __name__ == "__main__":
    sys.exit(main())
