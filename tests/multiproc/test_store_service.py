"""The store service: a TCPStore server in its own process that outlives its clients."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from nvrx.events import read_dir
from nvrx.store.service import StorePortInUse, StoreService, StoreUnavailable, wait_for_store
from tests.support.waiting import wait_until


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


@pytest.mark.timeout(120)
def test_keys_survive_a_killed_client_and_service_logs_events(tmp_path: Path) -> None:
    with StoreService("127.0.0.1", 0, job_id="svc", log_dir=tmp_path) as svc:
        assert svc.alive and svc.port > 0
        writer = textwrap.dedent(
            f"""
            import os, datetime, torch.distributed as dist
            s = dist.TCPStore("127.0.0.1", {svc.port}, is_master=False,
                              timeout=datetime.timedelta(seconds=10))
            s.set("written", "by-dead-client"); s.add("counter", 5)
            s.get("written")  # round trip: everything above reached the server
            os.kill(os.getpid(), 9)
            """
        )
        proc = subprocess.run([sys.executable, "-c", writer], timeout=60)
        assert proc.returncode == -signal.SIGKILL
        client = _client(svc.port)
        assert client.get("written") == b"by-dead-client"
        assert client.add("counter", 0) == 5
        pid = svc.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    got, _ = read_dir(tmp_path / "svc")
    kinds = [e["kind"] for e in got]
    assert kinds == ["store_start", "store_end"]
    assert got[0]["port"] == svc.port and got[0]["component"] == "store"


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error() -> None:
    with StoreService("127.0.0.1", 0) as svc:
        with pytest.raises(StorePortInUse, match=f"127.0.0.1:{svc.port} is already in use"):
            StoreService("127.0.0.1", svc.port).start()


_TGKILL = {"x86_64": 234, "aarch64": 131}  # the syscall's number


def _signal_thread(pid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to thread ``tid`` of process ``pid`` (``tgkill``), not to the process."""
    number = _TGKILL.get(os.uname().machine)
    if number is None:
        pytest.skip(f"tgkill's syscall number is not known here ({os.uname().machine})")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, tid, int(signum)) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {signum})")


@pytest.mark.timeout(120)
def test_stop_signals_that_come_in_a_burst_or_to_another_thread_stop_it(tmp_path: Path) -> None:
    """The kernel hands a signal sent to the service to any of its threads (the TCPStore
    server's own, torch's), and a stop may come more than once (the parent's death sends
    SIGTERM too, a stop sends its own): the service ends all the same, with one
    ``store_end`` event. (Its handler used to set a ``threading.Event``: a signal that
    came while an earlier one's handler held the event's lock deadlocked the service,
    about one burst in six.)"""
    for attempt in range(3):
        svc = StoreService("127.0.0.1", 0, job_id=f"svc{attempt}", log_dir=tmp_path).start()
        try:
            pid = svc.pid
            assert pid is not None
            others = [t.id for t in psutil.Process(pid).threads() if t.id != pid]
            assert others, "the server runs threads of its own"
            _signal_thread(pid, others[0], signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                for signum in [signal.SIGTERM, signal.SIGINT] * 100:
                    os.kill(pid, signum)
            wait_until("the service to end", lambda: not svc.alive, 20)  # noqa: B023
        finally:
            code = svc.stop()
        assert code == 0
        events, _ = read_dir(tmp_path / f"svc{attempt}")
        assert [e["reason"] for e in events if e["kind"] == "store_end"] == ["stopped by signal"]


@pytest.mark.timeout(60)
def test_service_exits_when_its_parent_dies(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys
        from nvrx.store.service import StoreService
        svc = StoreService("127.0.0.1", 0).start()
        print(svc.pid, flush=True)
        os._exit(0)  # no stop(): the service must notice by itself
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    try:
        psutil.Process(pid).wait(timeout=20)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        os.killpg(pid, signal.SIGKILL)
        pytest.fail("store service outlived the process that started it")


@pytest.mark.timeout(120)
def test_wait_for_store_names_host_and_port() -> None:
    with StoreService("127.0.0.1", 0) as svc:
        port = svc.port
        wait_for_store("127.0.0.1", port, timeout=5)
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        wait_for_store("127.0.0.1", port, timeout=0.5)


def test_bad_port_is_rejected() -> None:
    with pytest.raises(ValueError, match="store port must be in 0..65535, got 70000"):
        StoreService("127.0.0.1", 70000)


@pytest.mark.timeout(120)
def test_agent_and_service_started_before_the_address_is_known() -> None:
    """How a store failover saves seconds: the supervisor's node agent starts (importing
    torch) before any address exists, the service launches while other work goes on."""
    from nvrx.supervisor.store_link import StoreLink

    link = StoreLink(None, None, timeout=30).launch()
    service = StoreService("127.0.0.1", 0, node=None).launch()
    try:
        service.wait_started(60)
        link.aim("127.0.0.1", service.port).wait_ready()
        link.set("k", "v")
        assert link.get("k") == "v" and (link.host, link.port) == ("127.0.0.1", service.port)
    finally:
        link.close()
        service.stop()
    unused = StoreLink(None, None, timeout=30).launch()
    pid = unused.pid
    unused.close()  # never aimed: it ends at the end of its stdin
    assert pid is not None and (
        not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    )
    never_waited = StoreService("127.0.0.1", 0, node=None).launch()
    pid = never_waited.pid
    never_waited.stop()
    assert pid is not None and (
        not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    )


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.timeout(120)
def test_a_held_store_serves_only_once_released_and_ends_unreleased() -> None:
    """The store a failover's successor keeps ready: torch imported, no port bound until it
    is let go; one that is never let go ends cleanly with its stdin."""
    held = StoreService("127.0.0.1", 0, node=None, held=True).launch()
    try:
        pid = held.pid
        assert pid is not None
        wait_until("the held service to load torch", lambda: _torch_loaded(pid), 60)
        assert not psutil.Process(pid).net_connections(kind="tcp")  # nothing bound yet
        held.release().wait_started(60)
        client = dist.TCPStore(
            "127.0.0.1", held.port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        held.stop()
    unused = StoreService("127.0.0.1", 0, node=None, held=True).launch()
    pid = unused.pid
    assert pid is not None
    wait_until("the unused service to load torch", lambda: _torch_loaded(pid), 60)
    # It reads its stdin and signals once torch is imported, which libtorch mapped does not
    # mean yet: on a loaded machine the rest of the import may outlast the default grace.
    assert unused.stop(timeout=60) == 0  # it ended at the end of its stdin (or its SIGTERM), not killed
    assert not psutil.pid_exists(pid)


def _connects(address: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


@pytest.mark.timeout(120)
def test_the_store_listens_only_on_the_address_clients_reach_it_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 127.0.0.2 is another address of this machine (all of 127/8 is loopback): a client
    # there is refused, as one on another interface of a node would be.
    monkeypatch.delenv("NVRX_STORE_BIND", raising=False)
    with StoreService("127.0.0.1", 0, job_id="bound", log_dir=tmp_path) as svc:
        assert _client(svc.port).add("reached", 1) == 1
        assert not _connects("127.0.0.2", svc.port)
    monkeypatch.setenv("NVRX_STORE_BIND", "all")  # the override: every interface, as torch does
    with StoreService("127.0.0.1", 0, job_id="all", log_dir=tmp_path) as svc:
        assert _connects("127.0.0.2", svc.port)
        assert _client(svc.port).add("reached", 1) == 1
    starts = {job: read_dir(tmp_path / job)[0][0] for job in ("bound", "all")}
    assert {job: (e["kind"], e["addr"], e["listen"]) for job, e in starts.items()} == {
        "bound": ("store_start", "127.0.0.1", "127.0.0.1"),
        "all": ("store_start", "127.0.0.1", "all"),
    }
