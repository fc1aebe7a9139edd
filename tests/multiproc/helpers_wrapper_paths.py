"""Rank program of ``test_wrapper_paths``: documented Wrapper paths, with real ranks.

``launch(tmp, world_size, scenario=..., **params)`` starts one process per rank
(environment as ``helpers_inprocess.spawn`` sets it) running this file, and
returns ``helpers_inprocess.Ranks`` (``wait``, ``calls``, ``result``,
``events``, ``logs``). Each rank wraps ``train`` in a ``Wrapper`` built from
``params["wrapper"]`` (timeouts in seconds; ``store_kwargs`` and the monitor
file paths as given), with ``completion``/``terminate`` callbacks that write
``completion-<rank>``/``terminate-<rank>``. In round 0, on the ranks of
``params["fault_ranks"]``, the scenario does:

* ``no_hang_protection``: sleeps ``block_s`` inside ``disable_hang_protection()``
  (``_silent_block``: with ``nested``, a block of its own ends inside it first; with
  ``ping``, pings before, and after a busy step of ``after_s`` that follows the block);
* ``block_left_open``: enters ``disable_hang_protection()`` and never leaves the block
  (a context a restart cut short), then raises once every rank called the function; in
  round 1 it sleeps, silent (a hang the soft timeout must catch again);
* ``completion_timeout``: sleeps inside ``disable_hang_protection()`` until the
  restart ends the sleep (a peer's completion barrier timed out);
* ``exception``: raises ``RuntimeError`` once every rank called the function;
* ``sigterm_ignored``: ignores SIGTERM, then hangs holding the GIL;
* ``init_exception`` / ``init_base_exception``: ``initialize`` raises
  ``RuntimeError`` / ``LeaveJob`` (a ``BaseException``) before the function;
* ``finalize_fails`` / ``health_fails``: rank 0 raises once every rank called
  the function, and on the fault ranks the restart's ``finalize`` /
  ``health_check`` raises ``RuntimeError``;
* ``finalize_hangs``: raises once every rank called the function, then its
  ``finalize`` blocks for good, with no progress (``_hang_for_good``);
* ``finalize_slow``: raises once every rank called the function, then its
  ``finalize``, once every other rank's ended (``finalized-<rank>``), goes on
  making progress for ``slow_s``, while the others wait at the iteration barrier;
* ``finalize_threaded``: raises once every rank called the function, then its
  ``finalize`` is a ``ThreadedFinalize`` (timeout 60 s) whose thread works for
  ``slow_s``, while the main thread joins it;
* ``unresponsive``: stops its monitor process (no more heartbeats), then
  itself (``SIGSTOP``): alive, but silent; the other ranks wait inside
  ``disable_hang_protection()`` until the restart ends the wait;
* ``host_silent``: as ``unresponsive``, but it stops its host's node agent first.

With ``params["in_thread"]`` the rank calls the function in a worker thread
(``_call_in_thread``).

With ``params["hold_after_restart"]``, the ranks that call the function again in round 1
wait there (hang protection off) until the file ``release`` exists, so that the job and
its store are still up while the test looks at the frozen ranks' host.

Every call appends one JSON line to ``calls-<rank>.jsonl`` (with the command
lines of the monitor process's children, and the content of
``monitor_process_pidfile`` and what that pid runs, when a pidfile is set).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from helpers_inprocess import Ranks, _catastrophic_regex, free_port_pair, rank_env

from nvrx import jobenv
from tests.support.waiting import wait_until

HERE = Path(__file__).resolve()
#: The checkout: on each rank's PYTHONPATH, so that this file, run as a rank, imports
#: ``tests.support`` as the test process does.
ROOT = HERE.parents[2]


def launch(tmp: Path, world_size: int, hosts: list[str] | None = None, **params: Any) -> Ranks:
    """Start ``world_size`` ranks of this program, configured by ``params``; ``hosts``: the
    host each rank's monitor names (``NVRX_HOST_ID``), for several hosts on one machine."""
    tmp.mkdir(parents=True, exist_ok=True)
    ranks = Ranks(tmp, port=params.pop("port", None) or free_port_pair(), world_size=world_size)
    (tmp / "params.json").write_text(json.dumps(params))
    for rank in range(world_size):
        env = rank_env(tmp / "logs", rank, world_size, ranks.port)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if hosts is not None:
            env[jobenv.HOST_ID] = hosts[rank]
        with open(tmp / f"rank-{rank}.log", "ab") as out:
            ranks.procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE), str(tmp)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return ranks


def node_agents(log_dir: str | Path, host: str | None = None) -> list[psutil.Process]:
    """The node agents of the job that logs to ``log_dir`` (of ``host`` only: its
    ``NVRX_HOST_ID``)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["cmdline"] or [])[-3:-1] != ["nvrx.node_agent", "host"]:
                continue
            env = proc.environ()
            if env.get(jobenv.LOG_DIR) == str(log_dir) and host in (None, env.get(jobenv.HOST_ID)):
                found.append(proc)
    return found


def _wait_for_every_rank(tmp: Path, iteration: int, world_size: int) -> None:
    """Until every rank called the function in ``iteration``, so that each one has a call there."""
    called = lambda: len(list(tmp.glob(f"entered-{iteration}-*"))) >= world_size  # noqa: E731
    wait_until(f"every rank to call the function in iteration {iteration}", called, 30, 0.01)


def _wait_for(path: Path, timeout: float) -> None:
    """Until the test creates ``path``."""
    wait_until(f"the test to create {path.name}", path.exists, timeout, 0.01)


def _hang_for_good() -> None:
    """Block the main thread in C (a lock no one releases): no bytecode runs, no progress."""
    threading.Event().wait()


#: ``block_left_open``: the blocks entered and never left (held, so that nothing ends them).
_LEFT_OPEN: list[Any] = []


def _silent_block(call_wrapper: Any, params: dict[str, Any]) -> None:
    """``no_hang_protection``: ``block_s`` silent inside ``disable_hang_protection()``; with
    ``nested``, a helper's own block ends first inside it; with ``ping``, the rank
    ``ping()``s before the block, and after it runs a step of ``after_s`` (bytecode all
    along, no ping) before it pings again."""
    if params.get("ping"):
        call_wrapper.ping()
    with call_wrapper.disable_hang_protection():
        if params.get("nested"):
            with call_wrapper.disable_hang_protection():
                pass  # a helper guarding its own short part
        time.sleep(params["block_s"])  # the workload under test: a long, silent block
    step_end = time.monotonic() + params.get("after_s", 0.0)
    while time.monotonic() < step_end:  # the step after the block: a busy one, no ping
        sum(range(10_000))
    if params.get("ping"):
        call_wrapper.ping()


def _call_in_thread(train: Any, tmp: Path, initial_rank: int) -> int:
    """``in_thread``: the rank calls ``train`` in a worker thread named ``trainer``; what it
    returned or raised is the rank's result. Whatever the main thread catches meanwhile (a
    restart meant for the worker) is appended to ``main-thread-<rank>``."""
    outcome: dict[str, Any] = {}

    def worker() -> None:
        try:
            outcome["result"] = train()
        except BaseException as exc:
            outcome["result"] = {"error": type(exc).__name__, "message": str(exc)}

    thread = threading.Thread(target=worker, name="trainer")
    thread.start()
    while thread.is_alive():
        try:
            thread.join(0.1)
        except BaseException as exc:
            with open(tmp / f"main-thread-{initial_rank}", "a") as fh:
                fh.write(f"{type(exc).__name__}\n")
    (tmp / f"result-{initial_rank}.json").write_text(json.dumps(outcome["result"]))
    return 0


class LeaveJob(BaseException):
    """What ``initialize`` raises in ``init_base_exception``: this rank leaves the job."""


def _rank_main(tmp: Path) -> int:
    import datetime

    import psutil

    import nvrx.inprocess as inprocess
    from nvrx.inprocess import CallWrapper

    params = json.loads((tmp / "params.json").read_text())
    initial_rank = int(os.environ["RANK"])
    scenario = params.get("scenario", "none")
    fault_ranks = set(params.get("fault_ranks", []))
    wkw: dict[str, Any] = dict(params.get("wrapper", {}))
    for name in list(wkw):
        if name.endswith(("_timeout", "_interval", "_wait", "_time")):
            wkw[name] = datetime.timedelta(seconds=wkw[name])
    pidfile = wkw.get("monitor_process_pidfile")

    class Done(inprocess.completion.Completion):
        def __call__(self, state: Any) -> Any:
            (tmp / f"completion-{initial_rank}").write_text(str(state.rank))
            return state

    class Gone(inprocess.terminate.Terminate):
        def __call__(self, state: Any) -> Any:
            (tmp / f"terminate-{initial_rank}").write_text(state.mode.name)
            return state

    class FailingInitialize(inprocess.initialize.Initialize):
        def __call__(self, state: Any) -> Any:
            if state.iteration == 0 and initial_rank in fault_ranks:
                if scenario == "init_exception":
                    raise RuntimeError(f"initialize failed on rank {initial_rank}")
                raise LeaveJob(f"initialize leaves on rank {initial_rank}")
            return state

    class FailingFinalize(inprocess.finalize.Finalize):
        def __call__(self, state: Any) -> Any:
            if initial_rank in fault_ranks:
                raise RuntimeError(f"finalize failed on rank {initial_rank}")
            return state

    class StuckFinalize(inprocess.finalize.Finalize):
        """``finalize_hangs`` / ``finalize_slow`` on the fault ranks (see the module doc)."""

        def __call__(self, state: Any) -> Any:
            if initial_rank not in fault_ranks:
                (tmp / f"finalized-{initial_rank}").touch()
                return state
            if scenario == "finalize_hangs":
                _hang_for_good()
            others = int(os.environ["WORLD_SIZE"]) - len(fault_ranks)
            done = lambda: len(list(tmp.glob("finalized-*"))) >= others  # noqa: E731
            wait_until("the other ranks' finalize", done, 60, 0.05)
            until = time.monotonic() + params["slow_s"]
            while time.monotonic() < until:  # slow, but making progress: not a hang
                time.sleep(0.05)
            return state

    class FailingHealthCheck(inprocess.health_check.HealthCheck):
        def __call__(self, state: Any) -> Any:
            called = (tmp / f"entered-0-{initial_rank}").exists()  # not at round 0's start
            if called and initial_rank in fault_ranks:
                raise RuntimeError(f"unhealthy rank {initial_rank}")
            return state

    wkw["completion"], wkw["terminate"] = Done(), Gone()
    if scenario in ("init_exception", "init_base_exception"):
        wkw["initialize"] = FailingInitialize()
    if scenario == "finalize_fails":
        wkw["finalize"] = FailingFinalize()
    if scenario in ("finalize_hangs", "finalize_slow"):
        wkw["finalize"] = StuckFinalize()
    if scenario == "finalize_threaded":  # its work: a checkpoint's flush, say
        work = threading.Event().wait if initial_rank in fault_ranks else float
        wkw["finalize"] = inprocess.finalize.ThreadedFinalize(60, work, (params.get("slow_s"),))
    if scenario == "health_fails":
        wkw["health_check"] = FailingHealthCheck()

    @inprocess.Wrapper(**wkw)
    def train(call_wrapper: CallWrapper = None) -> dict[str, Any]:
        it = call_wrapper.iteration
        record: dict[str, Any] = {
            "initial_rank": initial_rank,
            "iteration": it,
            "rank": os.environ.get("RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
            "monitor_pid": call_wrapper.monitor_process.pid,
        }
        monitor = psutil.Process(call_wrapper.monitor_process.pid)
        record["monitor_children"] = [" ".join(c.cmdline()) for c in monitor.children()]
        if pidfile is not None:
            text = Path(pidfile.replace("{rank}", str(initial_rank))).read_text()
            record["pidfile"] = text
            record["pidfile_cmdline"] = " ".join(psutil.Process(int(text)).cmdline())
        with open(tmp / f"calls-{initial_rank}.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        (tmp / f"entered-{it}-{initial_rank}").touch()
        if it == 0 and initial_rank in fault_ranks:
            if scenario == "no_hang_protection":
                _silent_block(call_wrapper, params)
                (tmp / f"block-done-{initial_rank}").touch()
            elif scenario == "block_left_open":
                _LEFT_OPEN.append(call_wrapper.disable_hang_protection())
                _LEFT_OPEN[-1].__enter__()
                _wait_for_every_rank(tmp, it, int(os.environ["WORLD_SIZE"]))
                raise RuntimeError(f"injected fault on rank {initial_rank}")
            elif scenario == "completion_timeout":
                with call_wrapper.disable_hang_protection():
                    time.sleep(300)  # ended by the restart
            elif scenario in ("exception", "finalize_hangs", "finalize_slow", "finalize_threaded"):
                _wait_for_every_rank(tmp, it, int(os.environ["WORLD_SIZE"]))
                raise RuntimeError(f"injected fault on rank {initial_rank}")
            elif scenario == "sigterm_ignored":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                _catastrophic_regex()
            elif scenario in ("unresponsive", "host_silent"):
                _wait_for_every_rank(tmp, it, int(os.environ["WORLD_SIZE"]))
                if scenario == "host_silent":
                    for agent in node_agents(os.environ[jobenv.LOG_DIR], os.environ[jobenv.HOST_ID]):
                        agent.send_signal(signal.SIGSTOP)
                os.kill(call_wrapper.monitor_process.pid, signal.SIGSTOP)
                os.kill(os.getpid(), signal.SIGSTOP)
        elif it == 0 and scenario in ("unresponsive", "host_silent"):
            with call_wrapper.disable_hang_protection():
                time.sleep(300)  # ended by the restart that the silent rank's peer starts
        elif it == 1 and initial_rank in fault_ranks and scenario == "block_left_open":
            time.sleep(300)  # ended by the soft timeout's restart
        elif it == 1 and params.get("hold_after_restart"):
            with call_wrapper.disable_hang_protection():
                _wait_for(tmp / "release", 120)
        elif it == 0 and initial_rank == 0 and scenario in ("finalize_fails", "health_fails"):
            _wait_for_every_rank(tmp, it, int(os.environ["WORLD_SIZE"]))
            raise RuntimeError("injected fault on rank 0")
        return {
            "iteration": it,
            "rank": os.environ.get("RANK"),
            "world_size": os.environ.get("WORLD_SIZE"),
        }

    if params.get("in_thread"):
        return _call_in_thread(train, tmp, initial_rank)
    try:
        result = train()
    except BaseException as exc:
        (tmp / f"result-{initial_rank}.json").write_text(
            json.dumps({"error": type(exc).__name__, "message": str(exc)})
        )
        raise
    (tmp / f"result-{initial_rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1])))
