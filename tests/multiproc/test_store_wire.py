"""nvrx's own store client against torch's real TCPStore server, on both of its backends.

What one client writes the other reads, key for key (torch's client puts ``/`` before
every key, and a ``PrefixStore`` joins with ``/``): a wire client that spoke the protocol
slightly wrong would show here as a value the other side cannot find.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from nvrx.store import barrier, errors, rounds
from nvrx.store.wire import StoreGone, StoreTimeout, WireStore
from tests.support.waiting import wait_until


@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def server(request: pytest.FixtureRequest):  # noqa: ANN201
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
        wait_for_workers=False, use_libuv=request.param,
    )  # fmt: skip
    yield store
    del store


@pytest.fixture
def wire(server: dist.TCPStore):  # noqa: ANN201
    client = WireStore("127.0.0.1", server.port, timeout=10)
    yield client
    client.close()


def test_values_written_by_one_client_are_read_by_the_other(server, wire) -> None:  # noqa: ANN001
    wire.set("a", "1")
    server.set("b", b"\x00\xffbytes")
    assert server.get("a") == b"1"
    assert wire.get("b") == b"\x00\xffbytes"
    wire.multi_set(["m1", "m2"], ["p", b"q"])
    assert server.multi_get(["m1", "m2"]) == [b"p", b"q"]
    assert wire.multi_get(["a", "m2"]) == [b"1", b"q"]
    assert sorted(wire.list_keys()) == ["a", "b", "m1", "m2"]
    assert wire.num_keys() == server.num_keys()


def test_counters_appends_and_compare_set_are_the_servers(server, wire) -> None:  # noqa: ANN001
    assert wire.add("n", 3) == 3
    assert server.add("n", 2) == 5
    assert wire.add("n", -1) == 4
    wire.append("list", "1,")
    assert wire.check(["list"])  # answered, so the append before it was applied
    server.append("list", "2,")
    assert server.check(["list"])  # torch's APPEND is not answered either: order it the same way
    wire.append("list", "3,")
    assert wire.get("list") == b"1,2,3,"
    assert wire.compare_set("flag", "", "first") == b"first"
    assert wire.compare_set("flag", "other", "second") == b"first"
    assert server.compare_set("flag", "first", "third") == b"third"
    assert wire.check(["flag", "n"]) and not wire.check(["flag", "absent"])
    assert wire.delete_key("flag") and not wire.delete_key("flag")
    assert not server.check(["flag"])


def _innermost(thread: threading.Thread) -> str | None:
    """The name of the function the thread runs innermost now (None once it ended)."""
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    return None if frame is None else frame.f_code.co_name


def test_a_wait_returns_when_the_key_comes_and_times_out_otherwise(server, wire) -> None:  # noqa: ANN001
    errors_seen: list[BaseException] = []

    def wait_for_late() -> None:
        try:
            wire.wait(["late"], datetime.timedelta(seconds=10))
        except BaseException as exc:
            errors_seen.append(exc)

    waiter = threading.Thread(target=wait_for_late)
    waiter.start()
    # the key comes once the WAIT is sent and its answer awaited, not before
    wait_until("the WAIT in flight", lambda: _innermost(waiter) == "_answered_within", 10, 0.01)
    server.set("late", "1")
    waiter.join(10)
    assert not waiter.is_alive() and errors_seen == []
    with pytest.raises(StoreTimeout):
        wire.wait(["never"], 0.2)
    wire.set_timeout(0.2)
    with pytest.raises(errors.timeouts()):
        wire.get("never")
    wire.set_timeout(10)
    assert wire.add("after", 1) == 1  # the stream is in step after each timeout
    assert wire.check(["after"]) and wire.add("after", 1) == 2


def test_a_wait_of_weeks_is_accepted(server, wire) -> None:  # noqa: ANN001
    server.set("there", "1")
    wire.wait(["there"], datetime.timedelta(days=30))  # longer than one poll() can wait
    assert wire.add("n", 1) == 1


def test_a_round_view_sees_the_keys_of_torchs_prefix_store(server, wire) -> None:  # noqa: ANN001
    prefix = rounds.round_prefix(3).rstrip("/")
    torch_view = dist.PrefixStore(prefix, server)
    wire_round, torch_round = rounds.round_store(wire, 3), rounds.round_store(server, 3)
    torch_view.set("k", "v")
    assert wire_round.get("k") == b"v" and torch_round.get("k") == b"v"
    wire_round.set("w", "x")
    assert torch_view.get("w") == b"x"
    assert wire.get(f"{prefix}/w") == b"x"
    assert wire_round.iteration == 3 and wire_round.base_store is wire


def test_the_rounds_protocol_runs_on_either_client(server, wire) -> None:  # noqa: ANN001
    wire_round, torch_round = rounds.round_store(wire, 0), rounds.round_store(server, 0)
    assert rounds.register_terminated(wire_round, 2)
    assert not rounds.register_terminated(torch_round, 2)
    assert rounds.register_terminated(torch_round, 1)
    assert torch_round.check([rounds.TERMINATED])  # its APPEND is unanswered: order it first
    assert rounds.terminated_ranks(wire_round) == {1, 2}
    assert rounds.interrupt(wire_round, "fault")
    assert torch_round.get(rounds.INTERRUPTED) == b"fault"
    barrier.arrive(wire_round, "t", 0, 2, reentrant=True)
    barrier.arrive(wire_round, "t", 0, 2, reentrant=True)  # by its monitor too: counts once
    assert not barrier.is_released(torch_round, "t")
    barrier.arrive(torch_round, "t", 1, 2, reentrant=True)
    barrier.wait(wire_round, "t", 2, 1.0)
    barrier.arrive(wire_round, "u", 0, 2, reentrant=True)
    with pytest.raises(barrier.BarrierTimeout) as timeout:
        barrier.wait(wire_round, "u", 2, 0.2)
    assert timeout.value.missing == [1]


def test_a_store_that_is_gone_or_never_answers_is_unreachable() -> None:
    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))
    port = port_holder.getsockname()[1]
    port_holder.close()
    started = time.monotonic()
    with pytest.raises(errors.unreachable()):
        WireStore("127.0.0.1", port, timeout=0.3)
    assert time.monotonic() - started < 30
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        with pytest.raises(StoreGone, match="127.0.0.1"):
            WireStore("127.0.0.1", silent.getsockname()[1], timeout=0.3)


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "legacy"])
def test_a_server_that_ends_breaks_the_client_off_for_good(libuv: bool) -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=libuv)
    port = server.port
    with WireStore("127.0.0.1", port, timeout=10) as wire:
        wire.set("a", "1")
        assert wire.get("a") == b"1"
        del server
        with pytest.raises(StoreGone, match=str(port)):
            for _ in range(100):  # the first write after the close may still be buffered
                wire.set("b", "2")
                wire.get("b")
        started = time.monotonic()
        with pytest.raises(StoreGone):  # broken for good, as torch's client: no new connection
            wire.add("c", 1)
        assert time.monotonic() - started < 5


SERVE = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped: a SIGSTOP is sent at once, but a thread
    running on another core stops only when it next leaves the kernel."""
    with contextlib.suppress(psutil.NoSuchProcess):  # a thread that ended meanwhile: ask again
        threads = psutil.Process(pid).threads()
        return all(psutil.Process(t.id).status() == psutil.STATUS_STOPPED for t in threads)
    return False


def test_a_frozen_server_is_taken_for_gone_after_the_timeout_and_a_clone_works_once_it_thaws() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        wire = WireStore("127.0.0.1", port, timeout=1.0)
        assert wire.add("n", 1) == 1
        server.send_signal(signal.SIGSTOP)
        wait_until("the server's threads to stop", lambda: _all_threads_stopped(server.pid), 10)
        with pytest.raises(StoreGone, match="timed out"):
            wire.add("n", 1)
        server.send_signal(signal.SIGCONT)
        with pytest.raises(StoreGone):
            wire.add("n", 1)  # its stream may hold the late answer: never read again
        clone = wire.clone()
        assert clone.add("n", 0) >= 2
    finally:
        server.kill()
        server.communicate()


def test_bad_use_is_named() -> None:
    with pytest.raises(ValueError, match="1..65535"):
        WireStore("127.0.0.1", 0)
