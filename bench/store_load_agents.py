"""Store requests per barrier with REAL node agents: ``bench/store_load.py --real-agents``.

What runs, all of it real nvrx code: a job store (``nvrx.store.service.StoreService``, a torch
``TCPStore`` server in a process of its own) behind a counting proxy; per simulated host a
driver process whose threads are that host's ranks (``NVRX_HOST_ID`` tells the hosts apart). Each
rank beats to its host's node agent as a rank's monitor does (``agent_link.AgentLink``, which
starts the agent, ``python -m nvrx.node_agent host``, in a session of its own) and
meets the barriers as the Wrapper's ranks do (``rank_wire.HostBarrierClient.meet``), at
a generation's termination barrier, where every rank waits for all. ``direct`` is the same
without agents: each rank meets the barrier at the store itself.

The proxy reads every request the store is sent (torch's wire protocol,
``nvrx.store.wire``) and counts those whose keys belong to a measured barrier
(``nvrx/g<at>/termination...``): its arrivals, count, closing, release and the waits on it.
The agents' ring ticks and the ranks' host lists are other keys, not counted. One warm-up
barrier (its agents start, hear their ranks) comes before the measured ones.

    .venv/bin/python bench/store_load.py --real-agents [--agent-ranks 4,16,64] [--hosts 2]
        [--barriers 5] [--sealed]

``--sealed`` gives the job a secret (``NVRX_JOB_SECRET_FILE``), as a supervisor does: every
barrier is sealed.

Target (issue 37): requests per barrier for 4, 16 and 64 ranks on 2 hosts within 10 % of
each other with agents.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from nvrx import jobenv  # noqa: E402
from nvrx.store import rounds, wire  # noqa: E402

_U8, _U32, _U64, _I64 = (struct.Struct(f"={c}") for c in "BIQq")
MODES = ("agents", "direct")


# -- the counting proxy ---------------------------------------------------------------------
class _Reader:
    """Pulls whole requests out of one client's byte stream."""

    def __init__(self) -> None:
        self.buf = b""
        self.pos = 0

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise EOFError
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def _string(self) -> str:
        return self._take(_U64.unpack(self._take(8))[0]).decode(errors="replace")

    def _keys(self) -> list[str]:
        return [self._string() for _ in range(_U64.unpack(self._take(8))[0])]

    def requests(self, data: bytes) -> list[tuple[int, list[str]]]:
        """The requests that ``data`` completes: (query type, keys)."""
        self.buf = self.buf[self.pos :] + data
        self.pos, done = 0, []
        while True:
            start = self.pos
            try:
                done.append(self._one())
            except EOFError:
                self.pos = start
                return done

    def _one(self) -> tuple[int, list[str]]:
        kind = self._take(1)[0]
        if kind in (wire.VALIDATE, wire.PING):
            self._take(4)
            return kind, []
        if kind in (wire.SET, wire.APPEND):
            key = self._string()
            self._string()
            return kind, [key]
        if kind == wire.COMPARE_SET:
            key = self._string()
            self._string(), self._string()
            return kind, [key]
        if kind == wire.ADD:
            key = self._string()
            self._take(8)
            return kind, [key]
        if kind in (wire.GET, wire.DELETE_KEY):
            return kind, [self._string()]
        if kind in (wire.CHECK, wire.WAIT, wire.MULTI_GET):
            return kind, self._keys()
        if kind == wire.MULTI_SET:
            pairs = [(self._string(), self._string()) for _ in range(_U64.unpack(self._take(8))[0])]
            return kind, [k for k, _ in pairs]
        if kind in (wire.CANCEL_WAIT, wire.GETNUMKEYS, wire.LIST_KEYS):
            return kind, []
        raise ValueError(f"query type {kind} not known to this proxy")


class CountingProxy:
    """Relays clients to the store and counts their requests by the barrier they touch."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        reader = _Reader()
        with client, server:
            while True:
                readable, _, _ = select.select([client, server], [], [])
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        return
                    (server if src is client else client).sendall(data)
                    if src is client:
                        self._count(reader.requests(data))

    def _count(self, requests: list[tuple[int, list[str]]]) -> None:
        with self._lock:
            for _, keys in requests:
                for barrier in {_barrier_of(k) for k in keys} - {None}:
                    self.counts[barrier] += 1  # type: ignore[index]

    def close(self) -> None:
        self.listener.close()


def _barrier_of(key: str) -> str | None:
    """``g<at>`` for a key of a termination barrier, None for any other key."""
    parts = key.lstrip("/").split("/")
    if len(parts) >= 3 and parts[0] + "/" == rounds.ROOT and parts[2] == "termination":
        return parts[1]
    return None


# -- a host: its ranks, as threads of one driver process ------------------------------------
def _config(rank: int, world: int, port: int, logfile: str) -> Any:
    from nvrx.inprocess.monitor_process import MonitorConfig

    return MonitorConfig(
        target_pid=os.getpid(), board_path="", initial_rank=rank, monitor_process_interval=0.5,
        heartbeat_interval=0.5, heartbeat_timeout=30.0, soft_timeout=60.0, hard_timeout=90.0,
        termination_grace_time=1.0, logfile=logfile, store_host="127.0.0.1", store_port=port,
        initial_world_size=world,
    )  # fmt: skip


def drive(spec: dict[str, Any]) -> int:
    """One host's ranks meet ``barriers`` termination barriers (generations 1..): beats to
    the host's agent (``agents``) or none (``direct``). Ends its agent and waits for it."""
    from nvrx.inprocess.agent_link import AgentLink
    from nvrx.node_agent.host import HostConfig, agent_address
    from nvrx.node_agent.rank_wire import Beat, HostBarrierClient, Meeting, relay_address
    from nvrx.store.wire import WireStore

    port, world, ranks = spec["port"], spec["world"], spec["ranks"]
    store = lambda: WireStore("127.0.0.1", port, timeout=60)  # noqa: E731
    configs = [_config(r, world, port, spec["log"]) for r in ranks]
    links = [AgentLink(c, store) for c in configs] if spec["mode"] == "agents" else []
    address = None
    if links:
        address = relay_address(agent_address(HostConfig.of(configs[0]), os.environ[jobenv.HOST_ID]))
    stop, passes = threading.Event(), [0]
    heard = threading.Condition()

    def beat() -> None:
        """Each rank's monitor beats at a phase of its own in the interval, as real ones do
        (a burst of beats overflows the agent's queue: the kernel's ``max_dgram_qlen``)."""
        while not stop.is_set():
            for link, rank in zip(links, ranks, strict=True):
                link.beat(Beat(initial_rank=rank, pid=os.getpid(), interval=0.5, timeout=30.0))
                stop.wait(0.5 / len(links))
            with heard:
                passes[0] += 1
                heard.notify_all()

    beater = threading.Thread(target=beat, daemon=True)
    if links:
        beater.start()
    if address is not None:
        _await_bound(address)
        with heard:  # two passes of beats since: the agent heard every rank of its host
            seen = passes[0]
            heard.wait_for(lambda: passes[0] >= seen + 2, timeout=60)
    failures: list[BaseException] = []
    took: list[float] = []

    def rank_main(rank: int) -> None:
        client, base = HostBarrierClient(address), store()
        try:
            client.meet(base, Meeting("termination", 0, world), rank, 120.0)  # warm-up
            start = time.monotonic()
            for at in range(1, spec["barriers"] + 1):
                client.meet(base, Meeting("termination", at, world), rank, 120.0)
            took.append((time.monotonic() - start) / spec["barriers"])
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if links:
        beater.join()
    started = [link._started for link in links if link._started is not None]
    for link in links:
        link.end()
    for proc in started:  # the agent ends once every rank said bye
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failures.append(RuntimeError(f"node agent {proc.pid} did not end"))
    print(json.dumps({"failures": [repr(f) for f in failures], "seconds": max(took, default=0)}))
    return 1 if failures else 0


def _await_bound(address: str, timeout: float = 60.0) -> None:
    """Until a socket is bound at ``address`` (the agent's relay started)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        while True:
            try:
                probe.connect(address)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no node agent relay came up at {address!r}") from None
            time.sleep(0.05)  # the agent binds it as it starts: nothing to wait on


# -- the runs -------------------------------------------------------------------------------
def run(
    mode: str, world: int, hosts: int, barriers: int, logdir: str, secret: str | None = None
) -> dict[str, Any]:
    """One job of ``world`` ranks on ``hosts`` hosts; requests per measured barrier.
    ``secret``: the job secret's file (sealed barriers)."""
    from nvrx.store.service import StoreService

    per_host = world // hosts
    sealed = {jobenv.JOB_SECRET_FILE: secret} if secret else {}
    with StoreService("127.0.0.1", 0) as service:
        proxy = CountingProxy(service.port)
        drivers: list[subprocess.Popen] = []
        try:
            for h in range(hosts):
                spec = {"mode": mode, "port": proxy.port, "world": world, "barriers": barriers,
                        "ranks": list(range(h * per_host, (h + 1) * per_host)),
                        "log": os.path.join(logdir, f"{mode}-{world}-host{h}.log")}  # fmt: skip
                env = dict(os.environ, PYTHONPATH=ROOT, **{jobenv.HOST_ID: f"bench-host-{h}"}, **sealed)
                drivers.append(subprocess.Popen(
                    [sys.executable, __file__, "--drive", json.dumps(spec)], env=env,
                    stdout=subprocess.PIPE, start_new_session=True,
                ))  # fmt: skip
            outs = [_outcome(h, d) for h, d in enumerate(drivers)]
        finally:
            _end_drivers(drivers)
            proxy.close()
    measured = [proxy.counts.get(f"g{at}", 0) for at in range(1, barriers + 1)]
    return {
        "mode": mode, "ranks": world, "hosts": hosts, "per_barrier": measured,
        "mean": sum(measured) / len(measured), "failures": [f for o in outs for f in o["failures"]],
        "seconds": max(o["seconds"] for o in outs),
    }  # fmt: skip


def _end_drivers(drivers: list[subprocess.Popen]) -> None:
    """Kills the session of every driver still running (its ranks, threads of it, with it) and
    reaps it, so a driver that failed leaves no other running; each node agent, in a session
    of its own, ends by itself once its ranks and the store are gone."""
    for driver in drivers:
        if driver.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signal.SIGKILL)
            driver.communicate()


def _outcome(host: int, driver: subprocess.Popen) -> dict[str, Any]:
    """What a host's driver printed last; a driver that ended without it fails the run."""
    lines = driver.communicate()[0].decode().strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"host {host}'s driver exited {driver.returncode} without its outcome "
                           "(its traceback is above)")  # fmt: skip
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent-ranks", default="4,16,64", help="ranks of the job, comma separated")
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts")
    parser.add_argument("--barriers", type=int, default=5, help="measured barriers per job")
    parser.add_argument("--modes", default=",".join(MODES), help="agents, direct")
    parser.add_argument("--sealed", action="store_true", help="with a job secret, as under a supervisor")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.drive:
        return drive(json.loads(args.drive))
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="nvrx-store-load-agents-") as logdir:
        secret = None
        if args.sealed:
            from nvrx.store.seal import new_secret

            secret = os.path.join(logdir, "secret")
            with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(new_secret())
        for mode in args.modes.split(","):
            for world in (int(n) for n in args.agent_ranks.split(",")):
                rows.append(run(mode, world, args.hosts, args.barriers, logdir, secret))
                r = rows[-1]
                print(f"{r['mode']:>7}{' sealed' if secret else ''} {r['ranks']:>4} ranks on {r['hosts']} hosts: "
                      f"{r['mean']:.1f} store requests per barrier {r['per_barrier']}, "
                      f"{r['seconds'] * 1000:.1f} ms per barrier (slowest rank)"
                      + (f"  FAILURES {r['failures']}" if r["failures"] else ""), flush=True)  # fmt: skip
    agents = [r["mean"] for r in rows if r["mode"] == "agents"]
    failed = any(r["failures"] for r in rows)
    if agents:
        spread = (max(agents) - min(agents)) / min(agents)
        verdict = "within" if spread <= 0.10 else "NOT within"
        print(f"with agents: requests per barrier {min(agents):.1f}..{max(agents):.1f}, "
              f"spread {spread:.1%}: {verdict} 10 %")  # fmt: skip
        failed = failed or spread > 0.10
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
