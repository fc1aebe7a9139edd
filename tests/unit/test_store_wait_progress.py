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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_1(port: int, timeout: float):
    from nvrx.supervisor.config import SupervisorConfig, local_job

    job = local_job(nnodes=2, node_rank=1, store_port=port)
    return SupervisorConfig(["python", "train.py"], job, store_timeout=timeout)


def test_signals_during_a_supervisors_wait_are_kept_and_do_not_extend_it() -> None:
    """A node waiting for node 0's store: a SIGUSR1 (as SLURM's warning) wakes the wait, is
    kept for later, and the store timeout still counts from the start of the wait."""
    import os
    import signal
    import threading
    import time

    from nvrx.signal_pipe import SignalPipe
    from nvrx.supervisor.exit_codes import SupervisorError
    from nvrx.supervisor.store_setup import await_store_or_stop

    cfg = _node_1(_free_port(), timeout=2.0)
    done = threading.Event()
    sent: list[float] = []

    def warn() -> None:
        for at in (0.5, 1.0, 1.5, 3.5):  # the last one only if the wait outlived its timeout
            if done.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            sent.append(at)
            os.kill(os.getpid(), signal.SIGUSR1)

    pipe = SignalPipe((signal.SIGUSR1, signal.SIGTERM)).install()
    try:
        t0 = time.monotonic()
        sender = threading.Thread(target=warn)
        sender.start()
        with pytest.raises(SupervisorError, match="127.0.0.1"):
            await_store_or_stop(cfg, None, pipe)
        done.set()
        sender.join()
    finally:
        done.set()
        pipe.restore()
    assert sent == [0.5, 1.0, 1.5]  # it ended at its 2 s, before the fourth


def test_a_stop_signal_during_a_supervisors_wait_is_returned_with_what_came_before() -> None:
    import os
    import signal

    from nvrx.signal_pipe import SignalPipe
    from nvrx.supervisor.store_setup import await_store_or_stop

    cfg = _node_1(_free_port(), timeout=60.0)
    pipe = SignalPipe((signal.SIGUSR1, signal.SIGTERM)).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await_store_or_stop(cfg, None, pipe) == (signal.SIGTERM, [signal.SIGUSR1])
    finally:
        pipe.restore()
