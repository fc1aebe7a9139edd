"""The Wrapper runs in the main thread only, and says so when called in another.

A restart is raised in the main thread (the handler of its wake-up signal runs there
only), and the progress watchdog's probe (``Py_AddPendingCall``) runs in the main thread
only: a Wrapper in a worker thread had a peer's fault interrupt the main thread, and
would have missed a hang of its own thread. It refuses before anything starts.
"""

from __future__ import annotations

import threading

import psutil

from nvrx.inprocess import CallWrapper, Wrapper
from tests.support.ports import free_port_run


def test_a_wrapped_function_called_in_another_thread_is_refused_before_anything_starts(
    monkeypatch, tmp_path
):
    # the environment of a job of one rank, which the Wrapper would run in the thread
    for name in ("NVRX_STORE_HOST", "NVRX_STORE_PORT", "NVRX_SUPERVISED", "NVRX_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port_run(2)), NVRX_LOG_DIR=str(tmp_path), NVRX_JOB_ID="t")  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    called: list[int] = []

    @Wrapper()
    def train(call_wrapper: CallWrapper = None) -> str:
        called.append(1)
        return "ok"

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    outcome: list[BaseException | str] = []

    def worker() -> None:
        try:
            outcome.append(train())
        except BaseException as exc:  # what the worker thread sees
            outcome.append(exc)

    thread = threading.Thread(target=worker, name="trainer", daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    [raised] = outcome
    assert isinstance(raised, RuntimeError), raised
    message = str(raised)
    assert "called in thread 'trainer', not in the main thread" in message
    assert "a restart is raised in the main thread" in message
    assert "the progress watchdog measures the main thread" in message
    assert called == []  # the function never ran
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before  # no monitor process, no store service: nothing was started
