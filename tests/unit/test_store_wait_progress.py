"""A wait for a store that does not answer says, every few seconds, for how long and why."""

from __future__ import annotations

import logging
import socket

import pytest

from nvrx.store import service
from nvrx.store.service import StoreUnavailable, wait_for_store


def test_waiting_for_a_store_logs_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(service, "PROGRESS_EVERY_S", 0.3)
    with caplog.at_level(logging.WARNING, logger="nvrx.store.service"):
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
            wait_for_store("127.0.0.1", port, timeout=1.5, progress=True)
    notes = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(notes) >= 2, notes
    assert notes[0].startswith(f"still waiting for the store at 127.0.0.1:{port} after ")
    assert "of 2 s" in notes[0] and "refused" in notes[0].lower(), notes[0]


def test_a_rank_waiting_for_the_store_stays_quiet(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank waits for the store too: only a supervisor (``progress=True``) says so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(service, "PROGRESS_EVERY_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="nvrx.store.service"):
        with pytest.raises(StoreUnavailable):
            wait_for_store("127.0.0.1", port, timeout=0.8)
    assert not [r for r in caplog.records if "still waiting" in r.getMessage()]
