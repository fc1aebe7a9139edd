"""gloo_abort: tracking of group creation is installed and removed in matched pairs."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import threading
from collections.abc import Iterator

import pytest
from torch.distributed import distributed_c10d as c10d

from nvrx.inprocess import gloo_abort
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")


@pytest.fixture()
def original():
    factory = c10d._new_process_group_helper
    assert not gloo_abort.installed()
    yield factory
    while gloo_abort.installed():
        gloo_abort.uninstall()
    c10d._new_process_group_helper = factory
    gloo_abort._patched = gloo_abort._original = None  # a skipped restore keeps them


def test_nested_installs_restore_the_factory_with_the_last_uninstall(original):
    assert gloo_abort.install() and gloo_abort.install()
    patched = c10d._new_process_group_helper
    assert patched is not original and patched.__wrapped__ is original
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is patched
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is original
    assert not gloo_abort.installed()
    gloo_abort.uninstall()  # one too many: nothing happens
    assert c10d._new_process_group_helper is original


def test_tracking_block_patches_only_inside(original):
    with gloo_abort.tracking() as active:
        assert active and gloo_abort.installed()
        assert c10d._new_process_group_helper is not original
    assert c10d._new_process_group_helper is original


def test_tracking_block_restores_after_an_exception(original):
    with pytest.raises(KeyError), gloo_abort.tracking():
        raise KeyError("x")
    assert c10d._new_process_group_helper is original


def test_a_later_wrapper_of_the_factory_is_left_in_place(original):
    gloo_abort.install()

    def theirs(*args, **kwargs):
        return original(*args, **kwargs)

    c10d._new_process_group_helper = theirs
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is theirs


class _Group:
    group_name = "g"


@pytest.fixture()
def fake_factory(original, monkeypatch):
    """torch's factory replaced by a fake that makes a group; counts what tracking records."""
    made, recorded = [], []

    def factory(*args, **kwargs):
        made.append(args)
        return _Group()

    monkeypatch.setattr(gloo_abort, "_record", lambda name, inodes: recorded.append(name))
    c10d._new_process_group_helper = factory
    return factory, made, recorded


def test_a_functools_wraps_rewrapper_of_ours_is_kept_and_ours_goes_quiet(fake_factory):
    factory, made, recorded = fake_factory
    assert gloo_abort.install()
    ours = c10d._new_process_group_helper

    @functools.wraps(ours)  # copies every attribute of ours, __wrapped__ pointing at ours
    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    c10d._new_process_group_helper = theirs
    theirs(1)
    assert made == [(1,)] and recorded == ["g"]  # tracked while installed
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is theirs  # not unwrapped down to ours
    theirs(2)
    assert made == [(1,), (2,)] and recorded == ["g"]  # ours only passes calls through now

    assert gloo_abort.install()  # a foreign factory, whatever attributes it carries: wrapped
    again = c10d._new_process_group_helper
    assert again is not theirs and again.__wrapped__ is theirs
    again(3)
    assert made[-1] == (3,) and recorded == ["g", "g"]  # recorded once, by the new one
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is theirs


def test_ours_put_back_after_a_skipped_restore_is_reused_and_restored(fake_factory):
    factory, _, _ = fake_factory
    gloo_abort.install()
    ours = c10d._new_process_group_helper
    c10d._new_process_group_helper = lambda *a, **k: ours(*a, **k)
    gloo_abort.uninstall()  # skipped: theirs is on top
    c10d._new_process_group_helper = ours  # they unwrap theirs again
    gloo_abort.install()
    assert c10d._new_process_group_helper is ours
    gloo_abort.uninstall()
    assert c10d._new_process_group_helper is factory


def test_the_wrapper_restores_the_factory_when_the_call_raises(original, monkeypatch):
    from nvrx.inprocess import Wrapper, wrap

    seen = {}

    class FakeCallWrapper:
        def __init__(self, wrapper):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return None

        def __call__(self, fn, args, kwargs):
            return fn(*args, **kwargs)

    def train():
        seen["installed"] = gloo_abort.installed()
        seen["patched"] = c10d._new_process_group_helper is not original
        seen["advice"] = list(gloo_abort._advice)
        raise KeyboardInterrupt("the call ends by an exception")

    monkeypatch.setattr(wrap, "CallWrapper", FakeCallWrapper)
    with pytest.raises(KeyboardInterrupt):
        Wrapper()(train)()
    assert seen == {"installed": True, "patched": True, "advice": [90.0]}  # its hard timeout
    assert c10d._new_process_group_helper is original and not gloo_abort.installed()
    assert gloo_abort._advice == []  # tracking by hand after it is not advised


def test_an_abort_during_a_creation_cuts_what_it_may_wait_on_and_nothing_else(
    original, monkeypatch
):
    """Real loopback sockets, a fake group factory during whose run the abort comes: cut are
    the store client opened since user code began (torch's rendezvous opens one) and the
    connection opened since the creation began (gloo's); kept are the store client open
    before user code (the Wrapper's) and a connection opened before the creation. Once the
    creation ended, an abort cuts nothing more (its one connection goes to a server of this
    process, which a group's record leaves out)."""
    import socket

    store = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("MASTER_PORT", str(store.getsockname()[1]))  # a protected port
    opened: list[socket.socket] = []

    def connect(server: socket.socket) -> socket.socket:
        opened.append(socket.create_connection(server.getsockname()))
        return opened[-1]

    def inode(sock: socket.socket) -> int:
        return os.fstat(sock.fileno()).st_ino

    cut: list[int] = []

    def factory(*args, **kwargs):
        gloos_link = connect(other)
        cut.append(inode(gloos_link))
        assert gloo_abort.creating()
        assert gloo_abort.shutdown_sockets() == 2  # the abort, while the creation runs
        return _Group()

    c10d._new_process_group_helper = factory
    try:
        wrappers_client = connect(store)
        assert gloo_abort.install()
        gloo_abort.mark_user_code()
        rendezvous_client, older_link = connect(store), connect(other)
        cut.append(inode(rendezvous_client))
        c10d._new_process_group_helper()
        assert not gloo_abort.creating()
        assert gloo_abort.shutdown_sockets() == 0
        for sock in opened:  # a cut connection reads end-of-file at once; the others wait
            sock.settimeout(0.2)
            try:
                got = sock.recv(1) == b""
            except TimeoutError:
                got = False
            assert got == (inode(sock) in cut), (inode(sock), cut)
        assert inode(wrappers_client) not in cut and inode(older_link) not in cut
    finally:
        for sock in (*opened, store, other):
            sock.close()


@contextlib.contextmanager
def _a_group_link() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Tracking installed, one group made whose connection gloo opens while it is made: our
    end and the peer's; released and closed at the end."""
    links: list[socket.socket] = []

    def factory(*args, **kwargs):  # gloo listens and connects while the group is made
        links.append(socket.create_server(("127.0.0.1", 0)))
        links.append(socket.create_connection(links[0].getsockname()))
        return _Group()

    c10d._new_process_group_helper = factory
    try:
        assert gloo_abort.install()
        c10d._new_process_group_helper()
        links.append(links[0].accept()[0])
        yield links[1], links[2]
    finally:
        gloo_abort.release_held()
        for sock in links:
            sock.close()


def _peer_writes_fail(peer: socket.socket, otherwise: str) -> None:
    """The peer's writes fail: the reset comes back for the first write after our close."""
    peer.settimeout(5)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(50):
            peer.sendall(b"x")
            select.select([peer], [], [], 0.1)
        pytest.fail(otherwise)


def test_an_abort_ends_our_reads_and_leaves_the_peers_writes_working_until_released(original):
    """gloo fails the waits on a connection when its read fails, but leaves a send whose write
    failed queued until the group's timeout; a peer's write fails once our socket is closed or
    shut down both ways. So an abort shuts down reads only, and holds the socket open after
    gloo closed its descriptor, until ``release_held``: meanwhile the peer writes on."""
    with _a_group_link() as (ours, peer):
        assert gloo_abort.shutdown_sockets() == 1
        ours.settimeout(5)
        assert ours.recv(1) == b""  # the read a collective waits on ends at once
        ours.close()  # as gloo does once its read failed
        for _ in range(5):
            peer.sendall(b"x")
            assert select.select([peer], [], [], 0.05)[0] == [], "the peer got end-of-file or a reset"
        assert peer.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        gloo_abort.release_held()
        _peer_writes_fail(peer, "the peer's writes still succeed after release_held")


@pytest.mark.parametrize("missing", ["proc", "factory"])
def test_without_proc_or_torchs_factory_install_says_so_and_patches_nothing(original, monkeypatch, caplog, missing):
    """docs/abort.md, "Limits": off Linux (no ``/proc``), or with a torch that dropped its
    private group factory, ``install`` returns False with a warning and leaves torch alone."""
    if missing == "proc":
        monkeypatch.setattr(gloo_abort, "_PROC_FD", "/nonexistent/proc/self/fd")
    else:
        monkeypatch.delattr(c10d, gloo_abort._FACTORY)
    with caplog.at_level("WARNING", logger=gloo_abort.__name__):
        assert gloo_abort.install() is False
        with gloo_abort.tracking() as active:
            assert active is False
    assert not gloo_abort.installed()
    assert "cannot be interrupted" in caplog.text
    if missing == "proc":
        assert getattr(c10d, gloo_abort._FACTORY) is original


def test_a_descriptor_number_reused_by_another_socket_is_left_alone():
    """docs/abort.md: a recorded socket is shut down through a duplicate of its descriptor
    whose inode is checked first; the number, reused by a socket opened since, is not it."""
    import socket

    first = socket.socket()
    fd, inode = first.fileno(), os.fstat(first.fileno()).st_ino
    held = gloo_abort._hold(inode, fd)
    assert held is not None
    held.close()
    first.close()
    second = socket.socket()
    try:
        if second.fileno() != fd:
            pytest.skip("the kernel gave the new socket another descriptor number")
        assert gloo_abort._hold(inode, fd) is None
        assert second.fileno() == fd and os.fstat(fd).st_ino != inode  # still open, untouched
    finally:
        second.close()


@pytest.fixture(autouse=True)
def no_advice(monkeypatch):
    """Each test starts with no advice set and none given yet (a Wrapper run in this
    process before, by this file or another, may have set both)."""
    monkeypatch.setattr(gloo_abort, "_advice", [])
    monkeypatch.setattr(gloo_abort, "_advised", False)


def test_torchs_factory_still_takes_the_backend_and_timeout_the_advice_reads(original) -> None:
    import inspect

    assert {"backend", "timeout"} <= set(inspect.signature(original).parameters)


def _one_rank_group(tmp_path, advise_below: float | None = None, **init: object) -> None:
    """A real one-rank group, and a second one (its timeout as the first's), made through
    torch's factory while tracking is on."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    with gloo_abort.tracking(advise_below=advise_below):
        dist.init_process_group(store=store, rank=0, world_size=1, **init)
        try:
            dist.new_group([0], **{k: v for k, v in init.items() if k == "timeout"})
        finally:
            dist.destroy_process_group()


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "hard_timeout" in r.getMessage()]


@pytest.mark.parametrize(
    "init, said_s",
    [
        ({"backend": "gloo", "timeout": 1800}, 1800),
        ({"backend": "gloo", "timeout": 90}, 90),
        ({"backend": "gloo", "timeout": 20}, None),
        ({"backend": "gloo"}, 1800),  # torch's default timeout: the case the advice is for
        ({}, 1800),  # no backend named: gloo's on a CPU
    ],
    ids=["1800s", "90s", "20s", "default-timeout", "no-backend"],
)
def test_a_gloo_group_with_a_timeout_not_below_the_hard_timeout_is_advised_once(
    tmp_path, original, caplog, init, said_s
) -> None:
    import datetime

    if "timeout" in init:
        init = {**init, "timeout": datetime.timedelta(seconds=init["timeout"])}
    _one_rank_group(tmp_path, advise_below=90.0, **init)
    said = _said(caplog)
    assert len(said) == (0 if said_s is None else 1), said  # once for both groups
    if said_s is not None:
        assert f"{said_s} s timeout" in said[0] and "(90 s)" in said[0], said


def test_without_the_advice_set_nothing_is_said(tmp_path, original, caplog) -> None:
    _one_rank_group(tmp_path, backend="gloo")
    assert not _said(caplog)


def test_an_inner_tracking_that_ends_leaves_the_outer_ones_advice(tmp_path, original, caplog) -> None:
    """Blocks nest (a Wrapper called inside another's call): the inner one's end takes only
    its own advice away, and the shortest of those open counts."""
    import datetime

    with gloo_abort.tracking(advise_below=90.0):
        with gloo_abort.tracking(advise_below=600.0):
            assert gloo_abort._advice == [90.0, 600.0]
        assert gloo_abort._advice == [90.0]
        _one_rank_group(tmp_path, backend="gloo", timeout=datetime.timedelta(seconds=120))
    assert gloo_abort._advice == []
    said = _said(caplog)
    assert len(said) == 1 and "120 s timeout" in said[0] and "(90 s)" in said[0], said


def test_a_connection_to_or_from_a_port_given_to_protect_port_is_never_recorded_nor_shut_down(
    original, monkeypatch
):
    """docs/abort.md: a port passed to ``protect_port`` is left out as ``$MASTER_PORT`` is. Made
    with the group on real loopback sockets: a client of that port and the connection a
    server of this process accepts on it (its listener opened with the group, so only the
    protection leaves it out) survive the abort; the group's connection to another port is
    recorded and shut down."""
    import socket

    from nvrx import jobenv

    monkeypatch.setattr(gloo_abort, "_protected_ports", set())  # protect_port lasts for the process
    for name in ("MASTER_PORT", jobenv.STORE_PORT):
        monkeypatch.delenv(name, raising=False)
    protected = socket.socket()
    protected.bind(("127.0.0.1", 0))  # listening only once the group is being made
    gloo_abort.protect_port(protected.getsockname()[1])
    links: list[socket.socket] = []

    def factory(*args, **kwargs):
        protected.listen()
        links.append(socket.create_connection(protected.getsockname()))  # to the protected port
        links.append(protected.accept()[0])  # from it
        links.append(socket.create_server(("127.0.0.1", 0)))  # gloo's listener, and its link
        links.append(socket.create_connection(links[-1].getsockname()))
        return _Group()

    c10d._new_process_group_helper = factory
    try:
        assert gloo_abort.install()
        c10d._new_process_group_helper()
        to_protected, from_protected, _, gloos = links
        assert gloo_abort.tracked_groups()["g"] == {os.fstat(gloos.fileno()).st_ino}
        assert gloo_abort.shutdown_sockets(["g"]) == 1
        gloos.settimeout(5)
        assert gloos.recv(1) == b""  # shut down: end-of-file at once
        for sender, receiver in ((to_protected, from_protected), (from_protected, to_protected)):
            sender.sendall(b"ping")  # the protected connection still works both ways
            receiver.settimeout(5)
            assert receiver.recv(4) == b"ping"
    finally:
        gloo_abort.release_held()
        for sock in (*links, protected):
            sock.close()


@pytest.mark.parametrize("shut_down", ["after_the_last_uninstall", "before_it"])
def test_sockets_shut_down_are_released_by_the_last_uninstall_or_at_once_after_it(original, shut_down):
    """docs/abort.md: the last ``uninstall()`` releases the sockets an abort holds, and an
    abort after it (``AbortTorchDistributed`` by hand once tracking ended) holds nothing:
    nobody would release them. Released, and gloo's own descriptor closed, the peer's
    writes fail (while held, they succeed: the test above)."""
    with _a_group_link() as (ours, peer):
        if shut_down == "after_the_last_uninstall":
            gloo_abort.uninstall()  # the group's record stays
        assert gloo_abort.shutdown_sockets(["g"]) == 1
        ours.settimeout(5)
        assert ours.recv(1) == b""
        ours.close()  # as gloo does once its read failed
        if shut_down == "before_it":
            peer.sendall(b"x")
            assert select.select([peer], [], [], 0.05)[0] == [], "the peer got end-of-file or a reset"
            gloo_abort.uninstall()
        _peer_writes_fail(peer, "the peer's writes still succeed: the shut-down socket is still held")


@pytest.fixture()
def blocking_factory(original, monkeypatch):
    """torch's factory replaced by one that creates only once ``release`` is set (raising
    when ``fail`` is), tracked from here on."""
    release, fail = threading.Event(), threading.Event()

    def factory(*args, **kwargs):
        release.wait(30)
        if fail.is_set():
            raise RuntimeError("creation failed")
        return _Group()

    monkeypatch.setattr(gloo_abort, "_record", lambda name, inodes: None)
    monkeypatch.setattr(gloo_abort, "_refusing", 0)
    c10d._new_process_group_helper = factory
    assert gloo_abort.install()
    yield release, fail
    release.set()


def _create_in_thread() -> tuple[threading.Thread, list]:
    """A thread inside a tracked creation, and where its outcome goes."""
    outcome: list = []

    def create() -> None:
        try:
            outcome.append(c10d._new_process_group_helper())
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    wait_until("the thread inside the creation", gloo_abort.creating, 10)
    return thread, outcome


@pytest.mark.parametrize("fails", [False, True], ids=["completes", "raises"])
def test_an_abort_awaits_a_creation_in_flight_and_refuses_new_ones_until_it_ends(
    blocking_factory, fails
):
    release, fail = blocking_factory
    thread, outcome = _create_in_thread()
    assert gloo_abort.await_creations(0.05) is False  # still in flight: the grace ran out
    gloo_abort.allow_creations()
    if fails:
        fail.set()
    release.set()
    assert gloo_abort.await_creations(10) is True  # it ended (made its group, or raised)
    thread.join(10)
    assert isinstance(outcome[0], RuntimeError if fails else _Group)
    with pytest.raises(RuntimeError, match="while an abort is in progress"):
        c10d._new_process_group_helper()  # the abort is not over: no new creation starts
    gloo_abort.await_creations(0)  # a second abort meanwhile: one ending lifts no refusal
    gloo_abort.allow_creations()
    with pytest.raises(RuntimeError, match="while an abort is in progress"):
        c10d._new_process_group_helper()
    gloo_abort.allow_creations()
    fail.clear()
    assert isinstance(c10d._new_process_group_helper(), _Group)
