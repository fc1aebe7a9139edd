"""``rank_output``: the thread that copies a process's stream to its file and the console."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from nvrx.supervisor.rank_logs import RankLogs, Route, Std
from nvrx.supervisor.rank_output import MAX_LINE_BYTES, RankOutput, StreamPump
from tests.support.waiting import wait_until


def _pump(route: Route, tmp_path: Path) -> tuple[StreamPump, int, Path]:
    """A pump whose console is a file, read back by the test."""
    console = os.open(tmp_path / "console", os.O_RDWR | os.O_CREAT | os.O_APPEND)
    return StreamPump("stdout", route, console), console, tmp_path / "stdout.log"


def _finish(pump: StreamPump, console: int) -> bytes:
    pump.close(time.monotonic() + 5)
    assert pump.done()
    os.lseek(console, 0, os.SEEK_SET)
    shown = b""
    while data := os.read(console, 1 << 20):
        shown += data
    os.close(console)
    return shown


def test_what_is_printed_before_attach_waits_and_gets_the_prefix(tmp_path: Path) -> None:
    pump, console, path = _pump(Route.TEE, tmp_path)
    os.write(pump.write_fd, b"early line\n")  # a standby, before it knows its rank
    pump.attach(path, b"[default3]:")
    os.write(pump.write_fd, b"late line\n")
    assert _finish(pump, console) == b"[default3]:early line\n[default3]:late line\n"
    assert path.read_bytes() == b"early line\nlate line\n"  # files get no prefix


def test_progress_bars_and_endless_lines_reach_the_console(tmp_path: Path) -> None:
    pump, console, path = _pump(Route.TEE, tmp_path)
    pump.attach(path, b"[p]:")
    os.write(pump.write_fd, b"10%\r20%\r")
    long = b"x" * (2 * MAX_LINE_BYTES + 10)
    view = memoryview(long)
    while view:
        view = view[os.write(pump.write_fd, view) :]
    # the process is still writing, no line has ended: what passed the limit is shown already
    wait_until(
        "the endless line on the console", lambda: os.fstat(console).st_size > MAX_LINE_BYTES, 10
    )
    os.write(pump.write_fd, b"tail")
    shown = _finish(pump, console)
    assert shown.startswith(b"[p]:10%\r[p]:20%\r[p]:xxx")
    assert shown.endswith(b"xtail\n")
    assert all(line.startswith(b"[p]:") for line in shown.split(b"\n")[:-1])
    assert shown.replace(b"[p]:", b"").replace(b"\n", b"") == b"10%\r20%\r" + long + b"tail"
    assert path.read_bytes() == b"10%\r20%\r" + long + b"tail"


def test_a_file_that_cannot_be_written_never_breaks_the_pipe(tmp_path: Path) -> None:
    pump, console, _ = _pump(Route.TEE, tmp_path)
    pump.attach(Path("/dev/full"), b"> ")  # every write: ENOSPC
    for n in range(3):
        os.write(pump.write_fd, f"line {n}\n".encode())  # EPIPE here would raise
    assert _finish(pump, console) == b"> line 0\n> line 1\n> line 2\n"


def test_a_redirected_stream_shows_nothing_on_the_console(tmp_path: Path) -> None:
    pump, console, path = _pump(Route.FILE, tmp_path)
    pump.attach(path, b"> ")
    os.write(pump.write_fd, b"quiet\n")
    assert _finish(pump, console) == b""
    assert path.read_text() == "quiet\n"


def test_an_output_never_attached_is_drained_and_leaves_no_thread() -> None:
    output = RankOutput(RankLogs(redirects=Std.ALL), 0)
    assert set(output.pumps) == {"stdout", "stderr"}
    os.write(output.pumps["stderr"].write_fd, b"from a standby that was not needed\n")
    output.close(time.monotonic() + 5)
    assert output.done()
    assert not [t for t in threading.enumerate() if t.name.startswith("nvrx-std")]


def test_routes_become_popen_arguments() -> None:
    import subprocess

    filtered = RankOutput(RankLogs(console_ranks=frozenset({1})), 0)
    assert filtered.popen_args() == {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    shown = RankOutput(RankLogs(tee={0: Std.ERR}), 0)
    try:
        assert shown.popen_args() == {"stderr": shown.pumps["stderr"].write_fd}
    finally:
        shown.close(time.monotonic() + 5)


def test_a_process_of_any_local_rank_pipes_only_the_streams_routed_differently() -> None:
    """A standby for restarts does not know its local rank: a stream that every candidate
    routes alike is set up at once (here stdout, inherited), the others are piped."""
    logs = RankLogs(redirects={1: Std.ERR})  # local rank 1: stderr to its file
    output = RankOutput(logs, None, range(2))
    try:
        assert output.routes == {"stdout": Route.CONSOLE, "stderr": None}
        assert output.popen_args() == {"stderr": output.pumps["stderr"].write_fd}
    finally:
        output.close(time.monotonic() + 5)


def test_a_piped_stream_takes_the_route_of_the_local_rank_it_is_attached_to(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    logs = RankLogs(redirects={1: Std.ERR})
    for local_rank, shown, filed in ((0, True, False), (1, False, True)):
        directory = tmp_path / f"local{local_rank}"
        directory.mkdir()
        output = RankOutput(logs, None, range(2))
        fd = output.pumps["stderr"].write_fd
        os.write(fd, f"early {local_rank}\n".encode())  # before it knows its rank
        output.attach(directory, 5, local_rank)
        os.write(fd, f"late {local_rank}\n".encode())
        output.close(time.monotonic() + 5)
        assert output.done()
        err = capfd.readouterr().err
        expected = f"early {local_rank}\nlate {local_rank}\n"
        assert (err == expected) is shown, err  # unrouted: the console, as it came
        path = directory / "stderr.log"
        assert (path.exists() and path.read_text() == expected) is filed
