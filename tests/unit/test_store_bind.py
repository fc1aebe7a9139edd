"""Where the store listens (``$NVRX_STORE_BIND``, docs/supervisor.md): the address the other
nodes reach it at, or every interface, with a warning, where that address would shut them out."""

from __future__ import annotations

import logging
import socket

import pytest

from nvrx.store.server_process import BIND_ALL, _listener, _names_loopback, store_port_is_free


@pytest.mark.parametrize("bind", [BIND_ALL, "0.0.0.0", "::"])
def test_every_interface_when_asked(bind: str) -> None:
    assert _listener(bind, 0) is None


def test_an_address_is_listened_on_alone() -> None:
    sock = _listener("127.0.0.2", 0)
    assert sock is not None
    try:
        assert sock.getsockname()[0] == "127.0.0.2"
        with pytest.raises(ConnectionRefusedError):  # not on another loopback address
            socket.create_connection(("127.0.0.3", sock.getsockname()[1]), timeout=5).close()
        socket.create_connection(("127.0.0.2", sock.getsockname()[1]), timeout=5).close()
    finally:
        sock.close()


def test_a_name_that_does_not_resolve_listens_everywhere_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="nvrx.store.server_process"):
        assert _listener("nvrx-no-such-host.invalid", 0) is None
    assert "does not resolve here" in caplog.text and "every interface" in caplog.text


def test_a_host_name_of_a_loopback_address_listens_everywhere_with_a_warning(caplog) -> None:
    """As a Debian ``/etc/hosts`` maps a machine's own name to 127.0.1.1: the other nodes
    could not reach a store listening there. ``localhost`` and addresses are taken as meant."""
    assert _names_loopback("node0", "127.0.1.1")
    assert not _names_loopback("localhost", "127.0.0.1")
    assert not _names_loopback("127.0.0.1", "127.0.0.1")
    assert not _names_loopback("node0", "10.0.0.5")
    name = socket.gethostname()
    resolved = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)[0][4][0]
    if not _names_loopback(name, resolved):
        pytest.skip(f"this machine's name {name} resolves to {resolved}, not a loopback address")
    with caplog.at_level(logging.WARNING, logger="nvrx.store.server_process"):
        assert _listener(name, 0) is None
    assert f"resolves to {resolved} here" in caplog.text


def test_the_port_is_checked_where_the_store_will_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the check bound the host itself, and a name that does not resolve here ended
    node 0's supervisor with a gaierror traceback before the store could listen everywhere."""
    monkeypatch.delenv("NVRX_STORE_BIND", raising=False)
    assert store_port_is_free("nvrx-no-such-host.invalid", 0)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert not store_port_is_free("nvrx-no-such-host.invalid", port)  # every interface
        assert store_port_is_free("127.0.0.2", port)  # another address of this machine
    monkeypatch.setenv("NVRX_STORE_BIND", BIND_ALL)
    assert store_port_is_free("192.0.2.1", 0)  # another machine's address, listened for everywhere
    monkeypatch.delenv("NVRX_STORE_BIND")
    with pytest.raises(OSError, match="Cannot assign requested address"):
        store_port_is_free("192.0.2.1", 0)  # the store could not listen there either
