"""Warm standbys (``nvrx.supervisor.standby``): a process started ahead with torch imported
runs a training script or module as a fresh interpreter would, and leaves nothing behind
when it is not needed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import zipapp
from pathlib import Path

import psutil
import pytest

from nvrx.supervisor.standby import Standby, Standbys, can_run
from tests.support.waiting import wait_until

#: A standby imports torch and starts its monitor process before it reads its activation:
#: on a loaded machine that alone may take a minute.
pytestmark = pytest.mark.timeout(240)

PROBE = textwrap.dedent(
    """
    import json, os, sys
    torch_was_imported = "torch" in sys.modules
    class Thing:
        pass
    import pickle
    pickle.dumps(Thing())  # classes of __main__ pickle as in a fresh interpreter
    if __name__ == "__main__":
        with open(os.environ["PROBE_OUT"], "w") as out:
            json.dump({
                "name": __name__,
                "file": __file__,
                "argv": sys.argv,
                "path0": sys.path[0],
                "mark": os.environ.get("MARK"),
                "has_fd_var": "NVRX_STANDBY_FD" in os.environ,
                "torch_was_imported": torch_was_imported,
                "pid": os.getpid(),
                "main_names": sorted(k for k in globals() if not k.startswith("__")),
            }, out)
        sys.exit(int(os.environ.get("EXIT_WITH", "0")))
    """
)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_script_runs_as_main_with_the_rank_environment(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    out = tmp_path / "probe.json"
    standby = Standby(sys.executable, _env())
    argv = [sys.executable, str(script), "--lr", "0.1"]
    child = standby.activate(argv, _env(PROBE_OUT=str(out), MARK="rank 3", EXIT_WITH="3"), 1, 2)
    assert child is not None and child.warm and (child.local_rank, child.attempt) == (1, 2)
    status = child.wait(150)
    assert status is not None and status.code == 3
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["file"] == str(script)
    assert seen["argv"] == [str(script), "--lr", "0.1"]
    assert seen["path0"] == str(script.parent)
    assert seen["mark"] == "rank 3" and not seen["has_fd_var"]
    assert seen["torch_was_imported"] and seen["pid"] == child.pid
    assert seen["main_names"] == [
        "Thing",
        "json",
        "os",
        "out",
        "pickle",
        "sys",
        "torch_was_imported",
    ]


def test_a_relative_or_linked_script_gets_what_python_gives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python ./link.py`` from the script's parent: argv[0] as given, ``__file__`` absolute
    as given (links and ``./`` kept), ``sys.path[0]`` the directory of the file the link
    points to."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "probe.py").write_text(PROBE)
    (tmp_path / "link.py").symlink_to(tmp_path / "code" / "probe.py")
    out = tmp_path / "probe.json"
    monkeypatch.chdir(tmp_path)
    warm = _cold_then_warm([sys.executable, "./link.py", "x"], out)
    assert warm["file"] == f"{tmp_path}/./link.py" and warm["path0"] == str(tmp_path / "code")


def _cold_then_warm(argv: list[str], out: Path) -> dict:
    """Run ``argv`` (a ``PROBE`` script) in a fresh interpreter, then in a standby; what the
    standby's probe wrote, once it matched the fresh one's on every compared field."""
    subprocess.run(argv, env=_env(PROBE_OUT=str(out)), check=True, timeout=60)
    fresh = json.loads(out.read_text())
    out.unlink()
    child = Standby(sys.executable, _env()).activate(argv, _env(PROBE_OUT=str(out)), 0, 1)
    assert child is not None
    status = child.wait(150)
    assert status is not None and status.code == 0
    warm = json.loads(out.read_text())
    for key in ("name", "file", "argv", "path0", "main_names"):
        assert warm[key] == fresh[key], key
    return warm


@pytest.mark.parametrize("kind", ["directory", "zipapp"])
def test_a_directory_or_zip_file_runs_its_main_as_python_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``python app.pyz`` (zipapp, shiv, pex) or ``python ./app/`` runs the ``__main__.py``
    inside, with the archive or directory itself, as given, as ``sys.path[0]``."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(PROBE)
    target = "./app/"
    if kind == "zipapp":
        zipapp.create_archive(app, tmp_path / "app.pyz")
        target = "app.pyz"
    out = tmp_path / "probe.json"
    monkeypatch.chdir(tmp_path)
    warm = _cold_then_warm([sys.executable, target, "x"], out)
    assert warm["path0"] == f"{tmp_path}/{target}" and warm["torch_was_imported"]


@pytest.mark.parametrize("where", ["absolute", "relative from /"])
def test_a_script_that_cannot_be_opened_ends_as_python_ends(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A script missing on this node (a spare's file system, say): python's one-line message
    and status 2, as a rank started cold ends, not a traceback. The message names the path as
    python made it absolute (from ``/``, a relative one starts ``//``)."""
    script = str(tmp_path / "missing.py")
    if where == "relative from /":
        monkeypatch.chdir("/")
        script = script.lstrip("/")
    argv = [sys.executable, script]
    fresh = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 2
    child = Standby(sys.executable, _env()).activate(argv, _env(), 0, 1)
    assert child is not None
    status = child.wait(150)
    assert status is not None and status.code == 2
    assert capfd.readouterr().err.splitlines()[-1] == fresh.stderr.strip()


def test_an_activation_too_big_for_the_pipe_starts_cold(tmp_path: Path) -> None:
    """The standby reads only after its imports: a write that does not fit fails at once
    (the rank starts cold) instead of blocking the supervisor's loop."""
    standby = Standby(sys.executable, _env())
    pid = standby.pid
    huge = _env(BLOB="x" * (4 << 20))
    assert standby.activate([sys.executable, "train.py"], huge, 0, 1) is None
    assert _gone(pid)


def test_a_module_runs_as_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(PROBE)
    out = tmp_path / "probe.json"
    monkeypatch.chdir(tmp_path)  # python -m finds the module from the working directory
    standby = Standby(sys.executable, _env())
    argv = [sys.executable, "-m", "trainer.probe", "x"]
    child = standby.activate(argv, _env(PROBE_OUT=str(out)), 0, 1)
    assert child is not None
    status = child.wait(150)
    assert status is not None and status.code == 0
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(package / "probe.py"), "x"]


def test_an_exception_ends_it_like_a_fresh_interpreter(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "fails.py"
    script.write_text("raise RuntimeError('boom in the script')\n")
    standby = Standby(sys.executable, _env())
    child = standby.activate([sys.executable, str(script)], _env(), 0, 1)
    assert child is not None
    status = child.wait(150)
    assert status is not None and status.code == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom in the script" in err, err


def test_sigterm_ends_it_like_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "waits.py"
    ready = tmp_path / "ready"
    script.write_text(
        f"import pathlib, time\npathlib.Path({str(ready)!r}).write_text('1')\ntime.sleep(60)\n"
    )
    standby = Standby(sys.executable, _env())
    child = standby.activate([sys.executable, str(script)], _env(), 0, 1)
    assert child is not None
    wait_until("the script to start", ready.exists, 150)
    child.signal_group(signal.SIGTERM)
    status = child.wait(30)
    assert status is not None and status.signal == signal.SIGTERM


def test_a_rank_from_a_standby_shows_the_standby_command_line_and_start_environment(
    tmp_path: Path,
) -> None:
    """What ``ps`` and ``/proc`` show of a rank that a standby became: the standby's command
    line, not the script's, and the environment the standby started with; the script's
    ``os.environ`` is the rank's."""
    script = tmp_path / "waits.py"
    seen = tmp_path / "seen"
    script.write_text(
        "import os, pathlib, signal\n"
        f"pathlib.Path({str(seen)!r}).write_text(os.environ['MARK'] + '\\n')\n"
        "while True:\n    signal.pause()  # until the test kills it\n"
    )
    child = Standby(sys.executable, _env(MARK="standby")).activate(
        [sys.executable, str(script), "x"], _env(MARK="rank 3"), 0, 1
    )
    assert child is not None
    try:
        wait_until("the script to start", lambda: seen.exists() and "\n" in seen.read_text(), 150)
        assert seen.read_text() == "rank 3\n"
        process = psutil.Process(child.pid)
        assert process.cmdline() == [sys.executable, "-m", "nvrx.supervisor.standby_process"]
        assert process.environ()["MARK"] == "standby"
    finally:
        child.signal_group(signal.SIGKILL)
        child.wait(30)


def test_standbys_not_needed_leave_no_process() -> None:
    """Discarded after their warm-up, standbys end, and so do the monitor processes they
    started ahead (each in a process group of its own)."""
    pool = Standbys()
    command = [sys.executable, "train.py"]
    assert pool.start(command, range(2), _env()) == 2
    pids = pool.pids()
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    wait_until(
        "each standby to start its monitor process ahead",
        lambda: all(psutil.Process(p).children() for p in pids),
        90,
    )
    monitors = [c.pid for p in pids for c in psutil.Process(p).children()]
    pool.discard()
    assert all(_gone(p) for p in pids)
    wait_until("the monitors started ahead to end", lambda: all(_gone(m) for m in monitors), 30)
    assert pool.take(0, command, _env(), 1) is None


def test_a_standby_that_died_is_not_used() -> None:
    pool = Standbys()
    command = [sys.executable, "train.py"]
    pool.start(command, range(1), _env())
    (pid,) = pool.pids()
    os.killpg(pid, signal.SIGKILL)
    psutil.Process(pid).wait(30)
    assert pool.take(0, command, _env(), 1) is None  # the caller starts the rank cold


def test_commands_that_cannot_run_in_a_standby_start_none() -> None:
    pool = Standbys()
    assert pool.start(["bash", "train.sh"], range(2), _env()) == 0
    assert pool.pids() == []


def test_no_standby_when_turned_off(tmp_path: Path) -> None:
    """``--no-warm-standby``: nothing starts ahead, and every child starts cold."""
    pool = Standbys(enabled=False)
    script = tmp_path / "ok.py"
    script.write_text("")
    assert pool.start([sys.executable, str(script)], range(2), _env()) == 0
    child = pool.spawn([sys.executable, str(script)], 0, 0, _env(RANK="0"), tmp_path)
    assert not child.warm
    status = child.wait(150)
    assert status is not None and status.code == 0


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["python", "train.py"], True),
        (["/venv/bin/python3.11", "train.py", "--x"], True),
        (["python3", "-m", "trainer.main"], True),
        (["python", "-u", "train.py"], False),  # interpreter options: start cold
        (["python", "-c", "print(1)"], False),
        (["python", "-m"], False),
        (["python"], False),
        (["torchrun", "train.py"], False),
        (["bash", "-c", "python train.py"], False),
    ],
)
def test_which_commands_a_standby_can_run(command: list[str], expected: bool) -> None:
    assert can_run(command) is expected


def test_the_wrapper_takes_the_monitor_process_started_ahead(tmp_path: Path) -> None:
    """A standby starts the Wrapper's monitor process ahead; the first ``MonitorProcess.start``
    of the rank takes it, and a second one starts its own."""
    from nvrx.inprocess import monitor_process
    from nvrx.inprocess.monitor_process import MonitorConfig, MonitorProcess

    def config() -> MonitorConfig:
        return MonitorConfig(
            target_pid=os.getpid(), board_path=str(tmp_path / "no-board"), initial_rank=0,
            monitor_process_interval=1.0, heartbeat_interval=1.0, heartbeat_timeout=3.0,
            soft_timeout=5.0, hard_timeout=10.0, termination_grace_time=1.0, logfile=None,
        )  # fmt: skip

    monitor_process.prestart()
    ahead = monitor_process._prestarted
    assert ahead is not None
    first, second = MonitorProcess(config()), MonitorProcess(config())
    fds = [first.start(), second.start()]
    try:
        assert first.pid == ahead.proc.pid and second.pid not in (None, ahead.proc.pid)
        assert monitor_process._prestarted is None
    finally:
        for monitor in (first, second):
            monitor.stop(timeout=5)  # no board to watch: they may have ended already
        for fd in fds:
            os.close(fd)
    assert _gone(ahead.proc.pid)
