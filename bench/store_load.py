"""Load on the job's store from N nodes x R ranks, and what a barrier and a read cost under it.

The store is REAL: ``nvrx.store.service.StoreService`` (a torch ``TCPStore`` server, libuv
backend, in a process of its own), started as node 0's supervisor starts it for a
multi-node job, with the same snapshot keeper (``store_setup.snapshot_spec``: every second
the server process lists the store's keys and copies the job-level ones to a file).

The parties are SIMULATED: a few worker processes (``--workers``) speak torch's TCPStore
wire protocol directly over plain sockets (the bytes of each request are the ones torch's
client sends, with the real key names from ``nvrx.store.keys``, ``nvrx.store.rounds`` and
``nvrx.supervisor.node_keys``; a start-up check compares them with a real torch client and
a real ``nvrx.store.barrier`` participant). What each simulated party sends, per
``--interval`` (1 s, the default of every period involved):

``per-rank`` (a Wrapper job under supervisors before issue 14)
    every rank's monitor process (``_Monitor._heartbeat`` as it was): ``add`` of
    ``nvrx/r0/hb/<rank>``, ``add`` of the job's alive counter ``nvrx/alive`` (removed
    since), ``add(nvrx/r0/hb/<peer>, 0)``, one after the other; every rank's monitor thread
    as it was: a ``wait`` on ``nvrx/r0/interrupted`` that times out after the interval, i.e.
    a WAIT and a CANCEL_WAIT request, then the next WAIT; plus every node's liveness tick as
    it was then (``add`` of its ``alive`` counter, ``add(claim(own), 0)``,
    ``add(claim(watched), 0)``, ``add(alive(watched), 0)``: four requests, one after the
    other); barrier arrivals per rank.
``per-node`` (everything aggregated per node)
    only every node's supervisor: its node agent's tick in the ring (``nvrx.store.ring``:
    ``add`` of its ``alive`` counter, ``add(alive(watched), 0)``; the claims are read only when they can
    matter, and its own claim once every ``OWN_CLAIM_EVERY`` beats in place of the watched
    count, each node at a beat of its own): 2 requests per node; barrier arrivals per node.
``product`` (a Wrapper job under supervisors now)
    ``per-node`` (the ranks beat to their supervisor, ``nvrx.node_agent.rank_wire``, which sends
    nothing to the store for a beat), plus every rank's monitor thread holding one wait on
    the round's interrupted key, renewed every ``monitor_thread.WAIT_CHUNK_S`` (a WAIT and
    a CANCEL_WAIT then); barrier arrivals per rank, as the Wrapper's barriers still are.
    The Wrapper alone sends the same now: its ranks beat to their host's node agent
    (``nvrx.node_agent``), which beats for the host in the same ring as a
    supervisor's node agent does.

In every pattern each node also holds the node agent's key watches (one connection each,
a ``wait`` on the stop key and on the next job restart, re-armed once a day).

Realistic where it matters for the server: every waiting party (a monitor thread, a
watch, a barrier participant) has a connection of its own, because the server keeps one
waiter entry per connection (a CANCEL_WAIT walks every waiter of the store). The short
request chains (heartbeats, node ticks) share a pool of connections per worker, each
with at most one request in flight (as a real client: no pipelining), started at each
party's own phase in the interval. The key watches, re-armed once a day, are put 64 to
a connection (the server keeps one entry per wait all the same). The server process can
hold no more connections than the open-files limit (raised to its hard limit; a real job
would need about 3 per rank today): where the parties do not fit, barrier ranks share
connections (the server counts every arrival but writes one release per connection) and,
past that, so do the waits; the row says so. Not simulated: the TCP handshake spread over
hosts, the ranks' own CPU and network, torch's per-op client overhead.

Barriers (``--barrier-every`` s, during the measured window): ``per-rank`` and ``product`` run
nvrx's plain ``nvrx.store.barrier.barrier`` across all N x R ranks (a SET of the arrival key and
torch's native BARRIER request, held by the server; the Wrapper's own barriers send one request
more per rank: an ``add`` of the count, then a ``wait``); ``per-node`` arrives once per node
(an ``add`` of the node's R ranks, the completing node sets the release key) and wait once
per node. Latency: last arrival sent -> last release received (the time the worker's epoll
returned it). A ``get`` probe (a real torch client, ``nvrx.store.client.connect``) reads a
key every 20 ms. Requests are counted when answered (a SET, which has no answer, when
sent); "offered" is what the schedule asked for in the window, so served/offered < 1 means
the server or the driver (see its CPU) fell behind. All of it shares this machine's cores
with the server: treat the figures as a lower bound of what one store host serves.

Run as root (or where ``unshare -rn`` is allowed) it re-executes itself in a private network
namespace (``ip link set lo up``), so that connections do not stall on reverse DNS;
otherwise it sets RES_OPTIONS and says so.

    .venv/bin/python bench/store_load.py [--nodes 64,1024,2048] [--ranks 8] [--interval 1.0]
        [--duration 10] [--patterns per-rank,per-node,product]

``--real-agents`` measures instead the store requests per barrier with real node agents
and real barrier clients (``bench/store_load_agents.py`` says how), for 4, 16 and 64 ranks
on 2 hosts, with the agents and without.

Targets (issue 14): store requests/s <= 2 x nodes at a 1 s interval; a barrier across 8,192
ranks (1,024 nodes x 8) under that load with p99 < 150 ms.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import private_netns  # noqa: E402

TARGET_REQ_PER_NODE = 2.0
TARGET_BARRIER_P99_S = 0.150
TARGET_BARRIER_NODES = 1024
WATCH_SHARE = 64  # key watches per connection: each is re-armed once a day only
RESERVED_FDS = 256  # the server's own descriptors, the probe, the snapshot keeper
PROBE_EVERY_S = 0.02
PATTERNS = ("per-rank", "per-node", "product")

# -- torch TCPStore wire protocol (torch 2.13, little endian) -------------------------------------
# A client opens with VALIDATE(magic) and PING(nonce); every key goes out with torch's "/" prefix.
_VALIDATE, _SET, _ADD, _WAIT, _CANCEL_WAIT, _PING, _BARRIER = 0, 1, 4, 6, 12, 13, 18
_MAGIC = 0x3C85F7CE
_STOP_WAITING, _WAIT_CANCELED = 0, 1


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _key(key: str) -> bytes:
    return _string(("/" + key).encode())


def enc_add(key: str, delta: int) -> bytes:
    """ADD: answered with the new value (int64)."""
    return bytes([_ADD]) + _key(key) + struct.pack("<q", delta)


def enc_set(key: str, value: bytes) -> bytes:
    """SET: not answered."""
    return bytes([_SET]) + _key(key) + _string(value)


def enc_wait(key: str) -> bytes:
    """WAIT on one key: answered (one byte) when the key exists, or after a CANCEL_WAIT."""
    return bytes([_WAIT]) + struct.pack("<Q", 1) + _key(key)


def enc_barrier(key: str, count: int) -> bytes:
    """torch's native ``Store.barrier``: answered (one byte) when ``count`` arrived."""
    return bytes([_BARRIER]) + _key(key) + struct.pack("<q", count)


CANCEL = bytes([_CANCEL_WAIT])


def hello(nonce: int) -> bytes:
    """What torch's client sends on connect (it then reads the nonce back)."""
    return bytes([_VALIDATE]) + struct.pack("<I", _MAGIC) + bytes([_PING]) + struct.pack("<I", nonce)


def raw_connect(host: str, port: int, source: str | None = None) -> socket.socket:
    """A blocking, validated connection as torch's client opens it (TCP_NODELAY on)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source is not None:
        sock.bind((source, 0))  # 127.0.0.x sources: one ephemeral port range per source address
    sock.connect((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = random.randrange(1, 1 << 31)
    sock.sendall(hello(nonce))
    got = b""
    while len(got) < 4:
        chunk = sock.recv(4 - len(got))
        if not chunk:
            raise ConnectionError("store closed the connection during the handshake")
        got += chunk
    if struct.unpack("<I", got)[0] != nonce:
        raise ConnectionError("store answered the ping with a wrong nonce")
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("store closed the connection")
        data += chunk
    return data


def _heartbeat(rank: int) -> str:
    """The per-rank heartbeat counter of a round, as monitors wrote it before hosts beat
    for their ranks (the old pattern this bench still sends; no nvrx module writes it)."""
    return f"hb/{rank}"


# -- the keys of each pattern (real names) --------------------------------------------------------
def key_names() -> dict[str, Any]:
    """The store keys the simulated parties use, from nvrx's own key modules."""
    from nvrx.store import keys, rounds
    from nvrx.supervisor import node_keys
    from nvrx.supervisor.config import STOP_KEY
    from nvrx.supervisor.stop_flag import StopFlag

    try:
        from nvrx.supervisor.job_restart import _key as job_key

        restart_watch = job_key(1, "begin")
    except Exception:  # renamed: any second watched key costs the server the same
        restart_watch = STOP_KEY + "/job_restart"
    r0 = rounds.round_prefix(0)
    return {
        "round": r0,
        "alive": keys.ROOT + "alive",  # the job's alive counter of the per-rank pattern (gone)
        "interrupted": r0 + rounds.INTERRUPTED,
        "hb": [r0 + _heartbeat(0), _heartbeat],
        "node_alive": node_keys.alive,
        "node_claim": node_keys.claim,
        "watches": (StopFlag.key(1), restart_watch),
    }


# -- worker: the simulated parties of a range of nodes --------------------------------------------
_POOL, _WAITER, _BAR_RANK, _BAR_NODE = range(4)


class _Conn:
    """One socket and what it is doing; at most one request in flight."""

    __slots__ = ("sock", "fd", "kind", "buf", "need", "steps", "idx", "t0", "node_job", "state",
                 "wait", "period", "bar", "party")  # fmt: skip

    def __init__(self, sock: socket.socket, kind: int) -> None:
        self.sock, self.fd, self.kind = sock, sock.fileno(), kind
        self.buf = b""
        self.need = 0
        self.steps: tuple[bytes, ...] = ()
        self.idx = 0
        self.t0 = 0.0
        self.node_job = False
        self.state = 0
        self.wait = b""
        self.period = 0.0
        self.bar = -1
        self.party = 0


def _pctl(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Connect this worker's parties, wait for GO, drive the schedule; return its counts."""
    names = key_names()
    host, port = cfg["host"], cfg["port"]
    interval, pattern, ranks = cfg["interval"], cfg["pattern"], cfg["ranks"]
    nodes_total = cfg["nodes"]
    world = nodes_total * ranks
    first, last = cfg["node_range"]
    rng = random.Random(first)
    per_rank = pattern == "per-rank"
    rank_waits = pattern in ("per-rank", "product")
    rank_barrier = pattern in ("per-rank", "product")
    wait_period = interval if per_rank else cfg["wait_chunk"]

    # Jobs: request chains started once per interval at the party's phase.
    # (phase, steps, a node's tick?, the steps instead at a beat that reads the own claim, node)
    jobs: list[tuple[float, tuple[bytes, ...], bool, tuple[bytes, ...] | None, int]] = []
    every = cfg["own_claim_every"]
    for node in range(first, last):
        watched = (node + 1) % nodes_total
        if per_rank:  # the node watch before issue 14 read both claims at every beat
            tick = (
                enc_add(names["node_alive"](node), 1),
                enc_add(names["node_claim"](node), 0),
                enc_add(names["node_claim"](watched), 0),
                enc_add(names["node_alive"](watched), 0),
            )
        else:
            tick = (enc_add(names["node_alive"](node), 1), enc_add(names["node_alive"](watched), 0))
        # its own claim at one beat in OWN_CLAIM_EVERY (each node at its own beat), in place of
        # the watched count: one request (a compare-and-set that reads the sealed claim list;
        # modelled by the add of the same key, the load is the same)
        claim_tick = None if per_rank else (tick[0], enc_add(names["node_claim"](node), 0))
        jobs.append((rng.random() * interval, tick, True, claim_tick, node))
        if per_rank:
            hb = names["hb"][1]
            for rank in range(node * ranks, (node + 1) * ranks):
                peer = (rank + 1) % world
                chain = (
                    enc_add(names["round"] + hb(rank), 1),
                    enc_add(names["alive"], 1),
                    enc_add(names["round"] + hb(peer), 0),
                )
                jobs.append((rng.random() * interval, chain, False, None, rank))
    jobs.sort(key=lambda j: j[0])
    steps_per_interval = sum(len(j[1]) for j in jobs)

    sources = [f"127.0.0.{2 + i}" for i in range(200)]
    n_conn = [0]

    def connect(kind: int) -> _Conn:
        sock = raw_connect(host, port, sources[n_conn[0] % len(sources)])
        n_conn[0] += 1
        sock.setblocking(False)
        return _Conn(sock, kind)

    ep = select.epoll()
    by_fd: dict[int, _Conn] = {}

    def register(conn: _Conn) -> _Conn:
        by_fd[conn.fd] = conn
        ep.register(conn.fd, select.EPOLLIN)
        return conn

    pool = [register(connect(_POOL)) for _ in range(min(len(jobs), cfg["pool"]))]
    waiters: list[tuple[_Conn, float]] = []

    def add_waiters(wait: bytes, count: int, share: int, period: float) -> None:
        """``count`` waits on one key, ``share`` of them per connection (1: realistic)."""
        for i in range(0, count, share):
            n = min(share, count - i)
            conn = register(connect(_WAITER))
            conn.wait, conn.period, conn.party = wait * n, period, n
            waiters.append((conn, rng.random() * period))

    for key in names["watches"]:  # re-armed once a day: no traffic, but server entries
        add_waiters(enc_wait(key), last - first, WATCH_SHARE, cfg["watch_chunk"])
    if rank_waits:
        add_waiters(
            enc_wait(names["interrupted"]), (last - first) * ranks, cfg["wait_share"], wait_period
        )
    bar_conns: list[_Conn] = []
    share = cfg["bar_share"]
    if cfg["barriers"]:
        parties = list(range(first * ranks, last * ranks)) if rank_barrier else list(range(first, last))
        for i in range(0, len(parties), share):
            conn = register(connect(_BAR_RANK if rank_barrier else _BAR_NODE))
            conn.party = parties[i]
            conn.steps = tuple(str(p).encode() for p in parties[i : i + share])
            bar_conns.append(conn)
    print(f"READY {n_conn[0]}", flush=True)
    line = sys.stdin.readline().split()
    t0, t_ms, t_end = (float(x) for x in line[1:4])
    barrier_times = [t_ms + float(x) for x in cfg["barrier_offsets"]]

    # state and counters
    free = collections.deque(pool)
    ready: collections.deque[tuple[tuple[bytes, ...], float, bool]] = collections.deque()
    cancel_q: dict[float, collections.deque[tuple[float, _Conn]]] = {}
    offered = served = served_bar = 0
    lags: list[float] = []
    ticks: list[float] = []
    bar_arrive = [0.0] * len(barrier_times)
    bar_release = [0.0] * len(barrier_times)
    bar_done = [0] * len(barrier_times)
    bar_started = [False] * len(barrier_times)
    bar_pending = 0
    next_bar = 0
    cpu0 = time.process_time()
    write, read, now_f = os.write, os.read, time.monotonic

    # arm the waits: each party's first wait times out at its own phase
    for conn, phase in sorted(waiters, key=lambda w: w[1]):
        write(conn.fd, conn.wait)
        conn.state, conn.need = 1, 1
        cancel_q.setdefault(conn.period, collections.deque()).append((t0 + phase, conn))
    njobs = len(jobs)
    ji, cycle = 0, 0
    next_due = t0 + jobs[0][0] if njobs else float("inf")

    def start_barrier(k: int, now: float) -> int:
        names_k = f"{names['round']}bench_barrier/{cfg['pattern']}/{k}"
        last_sent = now
        for conn in bar_conns:
            conn.bar = k
            if rank_barrier:  # nvrx.store.barrier.barrier, plain: arrival key, then torch's BARRIER
                for party in conn.steps:  # more than one only where connections ran short
                    write(conn.fd, enc_set(f"{names_k}/a/{party.decode()}", b"1"))
                    write(conn.fd, enc_barrier(f"{names_k}/native", world))
                conn.state, conn.need = 2, 1
            else:  # one arrival of the node's ranks, then one wait for the release
                write(conn.fd, enc_add(f"{names_k}/n", ranks))
                conn.state, conn.need = 1, 8
            last_sent = now_f()
        bar_arrive[k] = last_sent
        bar_started[k] = True
        return len(bar_conns)

    while True:
        now = now_f()
        if now >= t_end and (bar_pending == 0 or now >= t_end + cfg["grace"]):
            break
        # due request chains
        while next_due <= now:
            _, steps, is_node, claim_tick, party = jobs[ji]
            if claim_tick is not None and (cycle + party) % every == 0:
                steps = claim_tick
            ready.append((steps, next_due, is_node))
            if t_ms <= next_due < t_end:
                offered += len(steps)
            ji += 1
            if ji == njobs:
                ji, cycle = 0, cycle + 1
            next_due = t0 + cycle * interval + jobs[ji][0]
        while ready and free:
            steps, due, is_node = ready.popleft()
            conn = free.popleft()
            conn.steps, conn.idx, conn.t0, conn.node_job, conn.need = steps, 0, now, is_node, 8
            if t_ms <= due < t_end:
                lags.append(now - due)
            write(conn.fd, steps[0])
        # due cancels of the waits
        for queue in cancel_q.values():
            while queue and queue[0][0] <= now:
                deadline, conn = queue.popleft()
                write(conn.fd, CANCEL)
                conn.state = 2
                if t_ms <= deadline < t_end:
                    offered += conn.party + 1
        # barriers (one at a time: a barrier still running when the next is due skips it)
        if next_bar < len(barrier_times) and barrier_times[next_bar] <= now:
            if bar_pending == 0 and now < t_end:
                bar_pending = start_barrier(next_bar, now)
            next_bar += 1
        # sleep until the next thing is due or an answer arrives
        nxt = min(next_due, t_end)
        for queue in cancel_q.values():
            if queue:
                nxt = min(nxt, queue[0][0])
        if next_bar < len(barrier_times):
            nxt = min(nxt, barrier_times[next_bar])
        events = ep.poll(max(0.0, nxt - now_f()) if not (ready and free) else 0)
        tev = now_f()
        in_window = t_ms <= tev < t_end
        for fd, _ in events:
            conn = by_fd[fd]
            data = read(fd, 65536)
            if not data:
                raise ConnectionError("the store closed a connection")
            if conn.buf:
                data = conn.buf + data
            if len(data) < conn.need:
                conn.buf = data
                continue
            conn.buf = b""
            kind = conn.kind
            if kind == _POOL:
                if in_window:
                    served += 1
                conn.idx += 1
                if conn.idx < len(conn.steps):
                    write(fd, conn.steps[conn.idx])
                    continue
                if conn.node_job and in_window:
                    ticks.append(tev - conn.t0)
                if ready:
                    steps, due, is_node = ready.popleft()
                    conn.steps, conn.idx, conn.t0, conn.node_job = steps, 0, tev, is_node
                    if t_ms <= due < t_end:
                        lags.append(tev - due)
                    write(fd, steps[0])
                else:
                    free.append(conn)
            elif kind == _WAITER:
                if conn.state == 2 and data[-1] == _WAIT_CANCELED:
                    if in_window:
                        served += conn.party + 1
                    write(fd, conn.wait)
                    conn.state = 1
                    cancel_q[conn.period].append((tev + conn.period, conn))
                # a STOP_WAITING (the key was set) would end the wait: not in this bench
            else:
                k = conn.bar
                if conn.state == 0:
                    continue  # a second release byte of a shared connection
                if kind == _BAR_NODE and conn.state == 1:  # the node's arrival was counted
                    names_k = f"{names['round']}bench_barrier/{cfg['pattern']}/{k}"
                    served_bar += 1
                    if struct.unpack("<q", data[:8])[0] == world:
                        write(fd, enc_set(f"{names_k}/go", b"1"))
                        served_bar += 1
                    write(fd, enc_wait(f"{names_k}/go"))
                    conn.state, conn.need = 2, 1
                    continue
                # per rank: SET + BARRIER per party; per node: the WAIT (+ ADD above)
                served_bar += 2 * len(conn.steps) if kind == _BAR_RANK else 1
                conn.state = 0
                bar_release[k] = max(bar_release[k], tev)
                bar_done[k] += 1
                bar_pending -= 1
    cpu = time.process_time() - cpu0
    lags += [t_end - due for _, due, _ in ready if t_ms <= due < t_end]  # never started
    return {
        "conns": n_conn[0],
        "offered": offered,
        "served": served,
        "served_barrier": served_bar,
        "steps_per_interval": steps_per_interval,
        "backlog": len(ready),
        "lag_p50": _pctl(lags, 0.5),
        "lag_p99": _pctl(lags, 0.99),
        "tick_p50": _pctl(ticks, 0.5),
        "tick_p99": _pctl(ticks, 0.99),
        "barriers": [
            [bar_arrive[k], bar_release[k], bar_done[k], len(bar_conns) if bar_started[k] else -1]
            for k in range(len(barrier_times))
        ],
        "cpu_s": cpu,
    }


def _worker_main() -> int:
    cfg = json.loads(sys.stdin.readline())
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit[1], limit[1]))
    result = run_worker(cfg)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- the parent: store, probe, workers ------------------------------------------------------------
@dataclass
class Outcome:
    """What one pattern at one size measured."""

    pattern: str
    nodes: int
    ranks: int
    conns: int = 0
    offered_s: float = 0.0
    served_s: float = 0.0
    barrier_req: int = 0
    server_cpu: float = 0.0
    driver_cpu: float = 0.0
    box_cpu: float = 0.0
    lag_p99_ms: float = 0.0
    tick_p99_ms: float = 0.0
    backlog: int = 0
    get_ms: list[float] = field(default_factory=list)
    barrier_ms: list[float] = field(default_factory=list)
    barriers_failed: int = 0
    wait_share: int = 1
    bar_share: int = 1


def _wire_check(host: str, port: int) -> None:
    """The raw requests mean to the server what torch's and nvrx's clients mean (fails loudly)."""
    from nvrx.inprocess import store as rstore
    from nvrx.store import barrier as nvrx_barrier
    from nvrx.store import client

    names = key_names()
    real = client.connect(host, port, timeout=30)
    raw = raw_connect(host, port)
    raw.sendall(enc_add(names["round"] + _heartbeat(3), 5))
    assert struct.unpack("<q", _recv_exact(raw, 8))[0] == 5
    round_store = rstore.round_store(real, 0)
    assert int(round_store.add(_heartbeat(3), 0)) == 5, "round prefix differs on the wire"
    raw.sendall(enc_wait(names["interrupted"]))
    time.sleep(0.05)
    raw.sendall(CANCEL)
    assert _recv_exact(raw, 1)[0] == _WAIT_CANCELED
    name = "nvrx/bench_check/barrier"
    raw.sendall(enc_set(f"{name}/a/0", b"1") + enc_barrier(f"{name}/native", 2))
    thread = threading.Thread(target=nvrx_barrier.barrier, args=(real, name, 1, 2, 10.0))
    thread.start()
    assert _recv_exact(raw, 1)[0] == _STOP_WAITING
    thread.join(10)
    assert not thread.is_alive(), "a real nvrx barrier participant was not released"
    assert nvrx_barrier.has_arrived(real, name, 0), "the raw arrival key is not nvrx's"
    raw.close()


def _start_store(nodes: int, snapshot_on: bool, tmp: str) -> Any:
    from nvrx.store.service import StoreService

    spec = None
    if snapshot_on:
        from nvrx.jobenv import JobEnv
        from nvrx.supervisor import store_setup
        from nvrx.supervisor.config import SupervisorConfig

        job = JobEnv.local(nnodes=max(nodes, 2), log_dir=tmp, job_id="bench")
        cfg = SupervisorConfig(command=["true"], job=job)
        spec = store_setup.snapshot_spec(cfg)
    return StoreService("127.0.0.1", 0, job_id="bench", log_dir=tmp, node=0, snapshot=spec).start()


def _probe(host: str, port: int, key: str, t_ms: float, t_end: float, out: list[float]) -> None:
    from nvrx.store import client

    store = client.connect(host, port, timeout=60)
    while time.monotonic() < t_ms:
        time.sleep(0.01)
    while time.monotonic() < t_end:
        t = time.perf_counter()
        store.get(key)
        out.append(time.perf_counter() - t)
        time.sleep(PROBE_EVERY_S)


def shares(pattern: str, nodes: int, ranks: int, nworkers: int, pool: int, limit: int) -> tuple[int, int]:
    """Waits and barrier participants per connection so that the server stays under ``limit``
    open files: 1 (a connection each, as in a job) unless there are not enough."""
    budget = limit - RESERVED_FDS - nworkers * pool - 2 * (nodes // WATCH_SHARE + nworkers)
    waits = nodes * ranks if pattern != "per-node" else 0
    parties = nodes * ranks if pattern != "per-node" else nodes
    bar_min = -(-parties // 16)
    wait_share = 1 if waits + bar_min <= budget else -(-waits // max(1, budget - bar_min))
    left = budget - -(-waits // wait_share) - nworkers
    return wait_share, max(1, -(-parties // max(1, left)))


def run_one(pattern: str, nodes: int, args: argparse.Namespace, tmp: str) -> Outcome:
    """Start a fresh store, drive ``pattern`` for ``nodes`` x ``args.ranks``, measure."""
    import psutil

    out = Outcome(pattern, nodes, args.ranks)
    service = _start_store(nodes, not args.no_snapshot, tmp)
    workers: list[subprocess.Popen[str]] = []
    try:
        host, port = service.host, service.port
        from nvrx.inprocess.monitor_thread import WAIT_CHUNK_S
        from nvrx.node_agent.supervised import _WATCH_CHUNK
        from nvrx.store import client
        from nvrx.store.ring import OWN_CLAIM_EVERY

        probe_key = "nvrx/bench/probe"
        client.connect(host, port, timeout=30).set(probe_key, "x" * 64)
        nworkers = max(1, min(args.workers, nodes))
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        out.wait_share, out.bar_share = shares(
            pattern, nodes, args.ranks, nworkers, args.pool, limit
        )
        bounds = [nodes * i // nworkers for i in range(nworkers + 1)]
        offsets = []
        t = 0.5
        while t < args.duration - 0.2:
            offsets.append(t)
            t += args.barrier_every
        for i in range(nworkers):
            cfg = {
                "host": host, "port": port, "pattern": pattern, "nodes": nodes,
                "ranks": args.ranks, "interval": args.interval,
                "node_range": [bounds[i], bounds[i + 1]], "pool": args.pool,
                "barriers": bool(offsets), "barrier_offsets": offsets, "grace": 10.0,
                "wait_share": out.wait_share, "bar_share": out.bar_share,
                "wait_chunk": WAIT_CHUNK_S, "own_claim_every": OWN_CLAIM_EVERY,
                "watch_chunk": _WATCH_CHUNK.total_seconds(),
            }  # fmt: skip
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
            proc.stdin.write(json.dumps(cfg) + "\n")
            proc.stdin.flush()
            workers.append(proc)
        for proc in workers:
            line = proc.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"a load worker failed to connect: {line!r}")
            out.conns += int(line.split()[1])
        t0 = time.monotonic() + 0.2
        t_ms = t0 + args.warmup
        t_end = t_ms + args.duration
        for proc in workers:
            proc.stdin.write(f"GO {t0} {t_ms} {t_end}\n")
            proc.stdin.flush()
        gets: list[float] = []
        prober = threading.Thread(
            target=_probe, args=(host, port, probe_key, t_ms, t_end, gets), daemon=True
        )
        prober.start()
        server = psutil.Process(service.pid)
        while time.monotonic() < t_ms:
            time.sleep(0.01)
        c0, b0 = sum(server.cpu_times()[:2]), psutil.cpu_times()
        time.sleep(max(0.0, t_end - time.monotonic()))
        c1, b1 = sum(server.cpu_times()[:2]), psutil.cpu_times()
        busy = (b1.user + b1.system + b1.nice - b0.user - b0.system - b0.nice) + (
            b1.softirq + b1.irq - b0.softirq - b0.irq
        )
        total = sum(b1) - sum(b0)
        out.box_cpu = busy / total if total > 0 else float("nan")
        out.server_cpu = (c1 - c0) / args.duration
        prober.join(30)
        results = []
        for proc in workers:
            line = proc.stdout.readline()
            if not line.startswith("RESULT"):
                raise RuntimeError(f"a load worker failed: {line!r}")
            results.append(json.loads(line[len("RESULT ") :]))
        out.offered_s = sum(r["offered"] for r in results) / args.duration
        out.served_s = sum(r["served"] for r in results) / args.duration
        out.barrier_req = sum(r["served_barrier"] for r in results)
        out.driver_cpu = sum(r["cpu_s"] for r in results) / (args.duration + args.warmup + 0.2)
        out.lag_p99_ms = max(r["lag_p99"] for r in results) * 1e3
        out.tick_p99_ms = max(r["tick_p99"] for r in results) * 1e3
        out.backlog = sum(r["backlog"] for r in results)
        out.get_ms = [g * 1e3 for g in gets]
        for k in range(len(offsets)):
            rows = [r["barriers"][k] for r in results]
            if any(row[3] < 0 for row in rows):
                continue  # skipped: the previous barrier was still running
            if any(row[2] != row[3] for row in rows):
                out.barriers_failed += 1
                continue
            out.barrier_ms.append((max(r[1] for r in rows) - max(r[0] for r in rows)) * 1e3)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        service.stop()
    return out


def _fmt(v: float, width: int, digits: int = 1) -> str:
    return f"{v:>{width}.{digits}f}" if v == v else f"{'-':>{width}}"


def _notes(o: Outcome) -> str:
    notes = []
    if o.barriers_failed:
        notes.append(f"{o.barriers_failed} barriers incomplete")
    if o.wait_share > 1:
        notes.append(f"{o.wait_share} waits per connection")
    if o.bar_share > 1:
        notes.append(f"{o.bar_share} barrier ranks per connection")
    return f" ({'; '.join(notes)})" if notes else ""


def _report(rows: list[Outcome], args: argparse.Namespace) -> None:
    print()
    print("target: store requests/s <= 2 x nodes at a 1 s interval (steady load, barriers excluded)")
    for o in rows:
        target = TARGET_REQ_PER_NODE * o.nodes * (1.0 / args.interval)
        note = "" if o.served_s >= 0.95 * o.offered_s else "  (served < offered: see above)"
        print(
            f"  {o.pattern:<15} {o.nodes:>5} nodes x {o.ranks}: offered {o.offered_s:>9.0f}/s "
            f"served {o.served_s:>9.0f}/s  target {target:>6.0f}/s  ratio {o.offered_s / target:6.2f}"
            f" (<= 1 meets){note}"
        )
    print(
        f"target: barrier across {TARGET_BARRIER_NODES * args.ranks} ranks "
        f"({TARGET_BARRIER_NODES} nodes x {args.ranks}) under that load, p99 < "
        f"{TARGET_BARRIER_P99_S * 1e3:.0f} ms"
    )
    for o in rows:
        if o.nodes != TARGET_BARRIER_NODES:
            continue
        if not o.barrier_ms:
            print(f"  {o.pattern:<15} no completed barrier ({o.barriers_failed} failed)")
            continue
        p99 = _pctl(o.barrier_ms, 0.99)
        failed = f", {o.barriers_failed} more incomplete (not in it)" if o.barriers_failed else ""
        print(
            f"  {o.pattern:<15} p99 {p99:8.1f} ms over {len(o.barrier_ms)} barriers{failed}  "
            f"ratio {p99 / (TARGET_BARRIER_P99_S * 1e3):6.2f} (< 1 meets)"
        )



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="64,1024,2048", help="node counts, comma separated")
    parser.add_argument("--ranks", type=int, default=8, help="ranks per node")
    parser.add_argument("--interval", type=float, default=1.0, help="every period involved (s)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--barrier-every", type=float, default=2.0, help="s between barriers")
    parser.add_argument("--patterns", default=",".join(PATTERNS), help="comma separated")
    parser.add_argument("--workers", type=int, default=2, help="load processes")
    parser.add_argument("--pool", type=int, default=256, help="chain connections per worker")
    parser.add_argument("--no-snapshot", action="store_true", help="store without its keeper")
    parser.add_argument("--no-netns", action="store_true", help="stay in this network namespace")
    return parser


def _print_setup(sizes: list[int], args: argparse.Namespace) -> None:
    """Raises the open files limit to its hard limit and prints the run's conditions."""
    need = max(sizes) * args.ranks * 2 + args.workers * args.pool + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(
        f"network namespace: {os.environ.get('NVRX_BENCH_NETNS', 'none (--no-netns)')}; "
        f"open files limit {hard} (largest run needs about {need})"
    )
    if hard < need:
        print(
            "  too few for a connection per waiting party at the largest size: where they do not "
            "fit, barrier ranks (then waits) share connections, as the rows say"
        )
    print(
        f"interval {args.interval:g} s, {args.duration:g} s measured after {args.warmup:g} s, "
        f"barrier every {args.barrier_every:g} s, {args.workers} load workers, "
        f"snapshot keeper {'off' if args.no_snapshot else 'on'}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )


def _print_header() -> None:
    print(
        f"{'pattern':<15} {'nodes':>5} {'ranks':>5} {'conns':>6} {'offered/s':>9} "
        f"{'served/s':>9} {'srv/off':>7} {'srv_cpu':>7} {'drv_cpu':>7} {'box':>4} "
        f"{'lag99':>6} {'tick99':>6} {'get50':>6} {'get99':>6} {'bar50':>7} {'bar99':>7} "
        f"{'n':>2}"
    )
    print(
        f"{'':<15} {'':>5} {'':>5} {'':>6} {'':>9} {'':>9} {'':>7} {'%core':>7} {'%core':>7} "
        f"{'%':>4} {'ms':>6} {'ms':>6} {'ms':>6} {'ms':>6} {'ms':>7} {'ms':>7}"
    )


def _print_row(o: Outcome, pattern: str, nodes: int, ranks: int) -> None:
    bar50 = statistics.median(o.barrier_ms) if o.barrier_ms else float("nan")
    bar99 = _pctl(o.barrier_ms, 0.99)
    print(
        f"{pattern:<15} {nodes:>5} {ranks:>5} {o.conns:>6} {o.offered_s:>9.0f} "
        f"{o.served_s:>9.0f} {o.served_s / o.offered_s if o.offered_s else 0:>7.2f} "
        f"{o.server_cpu * 100:>7.0f} {o.driver_cpu * 100:>7.0f} {o.box_cpu * 100:>4.0f} "
        f"{_fmt(o.lag_p99_ms, 6)} {_fmt(o.tick_p99_ms, 6)} "
        f"{_fmt(statistics.median(o.get_ms) if o.get_ms else float('nan'), 6, 2)} "
        f"{_fmt(_pctl(o.get_ms, 0.99), 6, 2)} {_fmt(bar50, 7)} {_fmt(bar99, 7)} "
        f"{len(o.barrier_ms):>2}" + _notes(o),
        flush=True,
    )  # fmt: skip


def _print_legend() -> None:
    # _pctl's index round(0.99 * (n - 1)) is the last one up to n = 51 (round() ties to even)
    print(
        "columns: conns = sockets the simulated parties hold; offered/served = steady requests/s "
        "(barrier requests excluded); srv_cpu = store server process, drv_cpu = all load "
        "workers, box = whole machine busy; lag99 = p99 delay of a chain's start behind its "
        "schedule (driver or pool behind); tick99 = p99 of a node's liveness tick (4 requests per-rank, 2 per-node); "
        "get = a real client's get (2 round trips); bar = barrier last arrival -> last release, "
        "n barriers (p99 = max for n <= 51)"
    )


def exit_code(rows: list[Outcome]) -> int:
    """1 when any run had a barrier that did not complete for every rank (the barrier figures
    leave it out, so they would read better than the run was), else 0."""
    incomplete = sum(o.barriers_failed for o in rows)
    if incomplete:
        print(f"{incomplete} barriers did not complete for every rank: see the rows' notes")
    return 1 if incomplete else 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return _worker_main()
    if "--real-agents" in sys.argv[1:]:  # real node agents, real ranks' barrier clients
        import store_load_agents

        return store_load_agents.main([a for a in sys.argv[1:] if a != "--real-agents"])
    parser = _parser()
    args = parser.parse_args()
    patterns = [p for p in args.patterns.split(",") if p]
    for p in patterns:
        if p not in PATTERNS:
            parser.error(f"unknown pattern {p!r}: choose from {', '.join(PATTERNS)}")
    sizes = [int(n) for n in args.nodes.split(",") if n]
    code = private_netns.rerun_inside(__file__, args.no_netns)
    if code is not None:
        return code
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    _print_setup(sizes, args)
    with tempfile.TemporaryDirectory(prefix="nvrx-store-load-") as tmp:
        service = _start_store(2, False, tmp)
        try:
            _wire_check(service.host, service.port)
        finally:
            service.stop()
        print("wire check: raw requests match torch's client and nvrx.store.barrier: ok")
        _print_header()
        rows: list[Outcome] = []
        for nodes in sizes:
            for pattern in patterns:
                rows.append(run_one(pattern, nodes, args, tmp))
                _print_row(rows[-1], pattern, nodes, args.ranks)
    _print_legend()
    _report(rows, args)
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
