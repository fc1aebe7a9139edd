"""The warm standby for process restarts (``nvrx.supervisor.restart_standby``): once a node's
children train, its supervisor keeps one standby ready, which becomes the next rank it
restarts, and prepares the next one once the replacement trains; ``--no-warm-standby``
restarts cold."""

from __future__ import annotations

import json
import logging
import os
import select
import selectors
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from nvrx import events, processes
from nvrx.supervisor import standby as standby_module
from nvrx.supervisor.children import Child
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course
from nvrx.supervisor.rank_logs import RankLogs, Std
from nvrx.supervisor.standby import Standbys
from nvrx.supervisor.supervisor import Supervisor
from tests.multiproc.test_supervisor_local import Job, _alive
from tests.support.waiting import wait_until

# Trains with the Wrapper (default settings) until the test creates STOP_FILE; rank 0 tells
# the others through the step's all_reduce, so that every rank stops at the same step.
TRAIN = textwrap.dedent(
    """
    import os, time
    from datetime import timedelta
    from pathlib import Path
    import torch, torch.distributed as dist
    from nvrx import events, inprocess

    stop = Path(os.environ["STOP_FILE"])
    app = events.configure("app")
    if os.environ["RANK"] == "1":
        time.sleep(float(os.environ["RANK1_LATE_S"]))  # a rank that takes longer to start

    @inprocess.Wrapper()
    def train(call_wrapper: inprocess.CallWrapper = None):
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        print(f"rank {rank} pid {os.getpid()} trains in round {call_wrapper.iteration}", flush=True)
        flag, step = torch.zeros(1), 0
        while True:
            flag.fill_(1.0 if rank == 0 and stop.exists() else 0.0)
            dist.all_reduce(flag)
            app.emit("progress", step=step)
            if flag.item() > 0:
                break
            step, _ = step + 1, time.sleep(0.05)
        print(f"rank {rank} stops at step {step}, world size {world}", flush=True)
        dist.destroy_process_group()

    train()
    """
)


class Watched:
    """A job of one supervisor and 2 Wrapper ranks, the processes seen under it, and waits."""

    def __init__(self, tmp_path: Path, *options: str, rank1_late_s: float = 0.0) -> None:
        if "--no-warm-standby" not in options:
            # a long --standby-wait: each standby waits until the ranks train, however long
            # their first beat takes on a loaded machine
            options = ("--warm-standby", "--standby-wait", "600", *options)
        script = tmp_path / "train.py"
        script.write_text(TRAIN)
        self.stop = tmp_path / "stop"
        os.environ["STOP_FILE"] = str(self.stop)
        os.environ["RANK1_LATE_S"] = str(rank1_late_s)
        try:
            # local rank 0 tee'd, local rank 1 to its files only: the standby, which may
            # become either, routes its streams once it knows which
            self.job = Job(tmp_path, 1, 2, [sys.executable, str(script)], "--max-restarts", "8",
                           "--tee", "3", "--local-ranks-filter", "0", *options)  # fmt: skip
        finally:
            del os.environ["STOP_FILE"], os.environ["RANK1_LATE_S"]
        self.seen: set[int] = set()

    def until(self, what: str, condition: Callable[[], object]) -> None:
        """Wait for ``condition`` (a deadline, no fixed sleep), noting the processes alive."""

        def check() -> object:
            self.seen |= _tree([p.pid for p in self.job.procs])
            assert all(p.poll() is None for p in self.job.procs), self.job.output()
            return condition()

        wait_until(what, check, 180, interval=0.2, state=self.job.output)

    def rank1(self) -> dict:
        """The last ``child_start`` of global rank 1."""
        starts = [e for e in self.job.events("child_start") if e["global_rank"] == 1]
        return max(starts, key=lambda e: e["wall"])

    def trains(self, pid: int) -> bool:
        """Whether process ``pid`` made a training step."""
        return any(e["pid"] == pid for e in self.job.events("progress", component="app"))

    def ready(self) -> list[int]:
        return [e["standby_pid"] for e in self.job.events("standby_ready")]

    def kill_rank1(self, standbys_ready: int) -> int:
        """SIGKILL rank 1 once it trains and ``standbys_ready`` standbys said they are warm;
        the pid of its replacement."""
        starts = self.job.events
        self.until("rank 1 to start", lambda: [e for e in starts("child_start") if e["global_rank"] == 1])
        victim = self.rank1()
        self.until("rank 1 to train", lambda: self.trains(victim["child_pid"]))
        self.until(f"standby {standbys_ready} to be warm", lambda: len(self.ready()) >= standbys_ready)
        os.kill(victim["child_pid"], signal.SIGKILL)
        self.until("a replacement of rank 1", lambda: self.rank1()["attempt"] > victim["attempt"])
        replacement = self.rank1()["child_pid"]
        self.until("the replacement to train", lambda: self.trains(replacement))
        return replacement

    def finish(self) -> list[int | None]:
        self.stop.touch()
        wait_until("the job to end", lambda: self.ended(), 120, interval=0.2, state=self.job.output)
        return self.job.wait(10)

    def ended(self) -> bool:
        self.seen |= _tree([p.pid for p in self.job.procs])
        return all(p.poll() is not None for p in self.job.procs)

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc: object) -> None:
        _stop(self.job)


def _stop(job: Job) -> None:
    """A job a failed test leaves running is stopped (SIGTERM, SIGKILL after 30 s), reaped."""
    for proc in job.procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    job.wait(30)


def _tree(pids: list[int]) -> set[int]:
    """The processes under ``pids`` now (standbys, children, monitors, store), themselves too."""
    found = set(pids)
    for pid in pids:
        try:
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return found


def _completed_at_full_size(watched: Watched, codes: list[int | None]) -> None:
    job = watched.job
    assert codes == [0], job.output()
    ends = {e["global_rank"]: e for e in sorted(job.events("child_exit"), key=lambda e: e["wall"])}
    assert {r: (e["exit_code"], e["signal"]) for r, e in ends.items()} == {0: (0, None), 1: (0, None)}
    assert "rank 0 stops at step" in job.output() and ", world size 2" in job.output()
    assert {e["outcome"] for e in job.events("wrapper_end", component="wrapper")} == {"completed"}


@pytest.mark.timeout(420)
def test_each_killed_rank_is_replaced_by_the_standby_prepared_before(tmp_path: Path) -> None:
    with Watched(tmp_path, rank1_late_s=2.0) as watched:
        first = watched.kill_rank1(standbys_ready=1)
        second = watched.kill_rank1(standbys_ready=2)
        watched.until("the third standby to be warm", lambda: len(watched.ready()) >= 3)
        codes = watched.finish()
    job = watched.job
    _completed_at_full_size(watched, codes)

    started = [e["standby_pid"] for e in job.events("standby_start")]
    assert watched.ready() == started == started[:3], job.output()  # one at a time, each warm
    assert {e["purpose"] for e in job.events("standby_start")} == {"restart"}
    starts = sorted(job.events("child_start"), key=lambda e: e["wall"])
    initial = [e for e in starts if e["attempt"] == 0]
    assert [e["warm"] for e in initial] == [False, False]
    # no standby before both ranks train (past their imports and the initial barrier, in
    # the round their monitor beats from), though rank 0 beat 2 s before rank 1 started
    # the Wrapper; each next one after a replacement
    phases = job.events("restart_phase", component="wrapper")
    initial_pids = {e["child_pid"] for e in initial}
    passed = [e for e in phases if e["phase"] == "initial_barrier" and e["pid"] in initial_pids]
    assert len(passed) == 2, job.output()
    assert job.events("standby_start")[0]["wall"] >= max(e["wall"] for e in passed + initial)
    replacements = [e for e in starts if e["attempt"] > 0]
    assert [(e["local_rank"], e["attempt"], e["warm"]) for e in replacements] == [
        (1, 1, True),
        (1, 2, True),
    ], job.output()
    # the second replacement is the standby started after the first restart
    assert [first, second] == [e["child_pid"] for e in replacements] == started[:2]
    assert job.events("standby_start")[1]["wall"] >= replacements[0]["wall"]

    # the replacements ran the script, and their output went to the files of rank 1 only
    job_dir = job.log_dir / job.job_id
    for replacement in replacements:
        out = (job_dir / replacement["files"] / "stdout.log").read_text()
        assert f"rank 1 pid {replacement['child_pid']} trains in round" in out, out
    console = job.outputs[0].read_text()
    assert "[default0]:rank 0 pid" in console  # local rank 0 tee'd, prefixed
    assert "rank 1 pid" not in console  # local rank 1: its files only, standby or not

    assert set(started) <= watched.seen
    assert _alive(watched.seen) == set()  # the last standby, unused, is gone with the rest


@pytest.mark.timeout(420)
def test_without_warm_standby_the_replacement_starts_cold(tmp_path: Path) -> None:
    with Watched(tmp_path, "--no-warm-standby") as watched:
        watched.kill_rank1(standbys_ready=0)
        watched.kill_rank1(standbys_ready=0)
        codes = watched.finish()
    _completed_at_full_size(watched, codes)
    job = watched.job
    assert job.events("standby_start") == [] and job.events("standby_ready") == []
    replacements = [e for e in job.events("child_start") if e["attempt"] > 0]
    assert [(e["local_rank"], e["warm"]) for e in replacements] == [(1, False), (1, False)]
    assert _alive(watched.seen) == set()


JOB_WIDE = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    rank, restart = int(os.environ["RANK"]), int(os.environ["NVRX_RESTART_COUNT"])
    go = Path(os.environ["GO_FILE"])
    if restart == 0:
        deadline = time.monotonic() + 120
        while not go.exists():  # the test says when the standby is warm
            assert time.monotonic() < deadline, "no go from the test"
            time.sleep(0.05)
        if rank == 1:
            sys.exit(1)
        signal.pause()  # rank 0: stopped by the job-wide restart
    """
)


@pytest.mark.timeout(240)
def test_a_job_wide_restart_takes_the_standby_for_one_of_its_ranks(tmp_path: Path) -> None:
    """A plain script: one failure restarts both ranks; the first started is the standby,
    the other starts cold, and a new standby is prepared after them."""
    script = tmp_path / "plain.py"
    script.write_text(JOB_WIDE)
    go = tmp_path / "go"
    os.environ["GO_FILE"] = str(go)
    try:
        job = Job(tmp_path, 1, 2, [sys.executable, str(script)], "--max-restarts", "4",
                  "--ft-restart-policy", "any-failed", "--grace-period", "3", "--warm-standby")  # fmt: skip
    finally:
        del os.environ["GO_FILE"]
    seen: set[int] = set()

    def ready() -> object:
        seen.update(_tree([p.pid for p in job.procs]))
        return job.events("standby_ready")

    def ended() -> bool:
        seen.update(_tree([p.pid for p in job.procs]))
        return all(p.poll() is not None for p in job.procs)

    try:
        wait_until("the standby to be warm", ready, 180, interval=0.2, state=job.output)
        go.touch()
        wait_until("the job to end", ended, 120, interval=0.2, state=job.output)
    finally:
        _stop(job)
    assert job.wait(10) == [0], job.output()
    (standby, *later) = [e["standby_pid"] for e in job.events("standby_start")]
    again = sorted(
        (e for e in job.events("child_start") if e["attempt"] == 1), key=lambda e: e["wall"]
    )
    assert [(e["local_rank"], e["warm"]) for e in again] == [(0, True), (1, False)], job.output()
    assert again[0]["child_pid"] == standby
    assert [e["epoch"] for e in job.events("job_restart") if e["phase"] == "started"] == [1]
    assert len(later) <= 1  # prepared after the restart (unless the job ended first)
    # a script that tells nothing: its standby came --standby-wait (5 s) after its children
    first = [e for e in job.events("child_start") if e["attempt"] == 0]
    standby_start = job.events("standby_start")[0]["wall"]
    assert standby_start - max(e["wall"] for e in first) >= 4.9, job.output()
    assert _alive(seen) == set()


@pytest.mark.parametrize("first", ["selector", "restart"])
def test_standby_ready_is_written_once_whichever_look_sees_the_standby_warm_first(
    tmp_path: Path, first: str
) -> None:
    """The supervisor learns that its standby for restarts is warm where its selector wakes
    for the standby's byte, or where a restart takes the standby before the selector
    delivered that byte: either way ``standby_ready`` is written, once."""
    script = tmp_path / "quick.py"
    script.write_text("")
    job = local_job(nproc_per_node=2, log_dir=str(tmp_path))
    sup = Supervisor(SupervisorConfig(command=[sys.executable, str(script)], job=job))
    sup.writer = events.EventWriter(tmp_path / "events", "supervisor")
    sup.course.to(Course.TRAINING)
    selector = selectors.DefaultSelector()
    sup.standbys.register(selector)
    sleep = [sys.executable, "-c", "import signal; signal.pause()"]
    children = [Child(i, 0, processes.start(sleep)) for i in range(2)]
    sup.ranks.children.update(enumerate(children))
    taken: list[Child] = []

    def written(kind: str) -> list[int]:
        return [e["standby_pid"] for e in events.read_dir(tmp_path / "events")[0] if e["kind"] == kind]

    try:
        for child in children:
            sup.ranks.told(child.pid, training=True)
        sup.restart_standby.keep_ready()
        (pid,) = written("standby_start")
        if first == "selector":
            sup._poll_once(selector, 120)  # wakes for the byte: on_ready
            assert written("standby_ready") == [pid]
        else:  # the byte is there, not delivered yet: a restart comes first
            ready_fd = sup.standbys._for_restart.ready_fd
            assert select.select([ready_fd], [], [], 120)[0] == [ready_fd]
        taken.append(sup.standbys.spawn(sup.config.command, 1, 1, sup.config.child_env(1, 1), None))
        assert taken[0].warm and taken[0].pid == pid
        sup._poll_once(selector, 0)  # the loop's next look
        assert written("standby_ready") == [pid]
        assert taken[0].wait(60) is not None and taken[0].status is not None and taken[0].status.ok
    finally:
        for child in children + taken:
            child.kill_group()
            child.proc.wait()
        sup.standbys.discard()
        selector.close()
        sup.writer.close()


# -- the pool itself -------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import json, os, sys
    print("out of", os.environ["LOCAL_RANK"], flush=True)
    print("err of", os.environ["LOCAL_RANK"], file=sys.stderr, flush=True)
    with open(os.environ["PROBE_OUT"], "w") as out:
        json.dump({"pid": os.getpid(), "rank": os.environ["RANK"]}, out)
    """
)


def _env() -> dict[str, str]:
    return dict(os.environ)


def _warm(pool: Standbys, pid: int) -> None:
    wait_until(f"standby {pid} to be warm", lambda: pool._for_restart.poll_ready(), 120)


def test_the_standby_becomes_any_local_rank_with_the_routes_of_that_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Routes differ by local rank (1: stdout tee'd but filtered off the console, stderr
    redirected: both to its files only; 0: the console, as a cold child's)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    command = [sys.executable, str(script)]
    pool = Standbys(logs=RankLogs(redirects={1: Std.ERR}, tee={1: Std.OUT},
                                  console_ranks=frozenset({0})))  # fmt: skip
    children = []
    try:
        for local_rank in (1, 0):
            pid = pool.keep_ready(command, _env, range(2))
            assert pid is not None and pool.keep_ready(command, _env, range(2)) is None
            _warm(pool, pid)
            directory = tmp_path / f"local{local_rank}"
            directory.mkdir()
            out = tmp_path / f"probe{local_rank}.json"
            env = {**os.environ, "RANK": str(4 + local_rank), "LOCAL_RANK": str(local_rank),
                   "PROBE_OUT": str(out)}  # fmt: skip
            child = pool.spawn(command, local_rank, 1, env, directory)
            children.append(child)
            assert child.warm and child.pid == pid
            status = child.wait(120)
            assert status is not None and status.ok
            assert json.loads(out.read_text()) == {"pid": pid, "rank": str(4 + local_rank)}
        pool.close_outputs()
        console = capfd.readouterr()
        files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("local*/*.log")}
        assert files == {"local1/stdout.log", "local1/stderr.log"}
        assert (tmp_path / "local1" / "stdout.log").read_text() == "out of 1\n"
        assert (tmp_path / "local1" / "stderr.log").read_text() == "err of 1\n"
        assert "out of 1" not in console.out and "err of 1" not in console.err
        assert "out of 0\n" in console.out and "err of 0\n" in console.err  # unprefixed
    finally:
        for child in children:
            child.kill_group()
        pool.discard()


def test_a_standby_not_warm_yet_waits_for_a_later_restart(tmp_path: Path) -> None:
    """A restart before the standby is warm starts cold (a fresh interpreter of a script
    that imports nothing is faster); the standby becomes the next one, once warm."""
    script = tmp_path / "quick.py"
    script.write_text("import os, sys\nsys.exit(0 if 'torch' not in sys.modules else 7)\n")
    command = [sys.executable, str(script)]
    pool = Standbys()
    try:
        pid = pool.keep_ready(command, _env, range(2))
        assert pid is not None
        cold = pool.spawn(command, 1, 1, {**os.environ, "RANK": "1"}, None)
        assert not cold.warm and cold.pid != pid and pool.pids() == [pid]
        assert cold.wait(60) is not None and cold.status is not None and cold.status.code == 0
        _warm(pool, pid)
        (monitor,) = psutil.Process(pid).children()  # started ahead, for a Wrapper
        warm = pool.spawn(command, 0, 1, {**os.environ, "RANK": "0"}, None)
        assert warm.warm and warm.pid == pid and pool.pids() == []
        assert warm.wait(60) is not None and warm.status is not None and warm.status.code == 7
        # the script took no monitor: past its imports, it ends with the standby's end
        wait_until("the unused monitor to end", lambda: _alive({monitor.pid}) == set(), 10)
    finally:
        pool.discard()


def test_a_restart_that_finds_the_standby_ended_says_so_and_starts_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A standby that ended before it was warm is not said to be warming still: the restart
    that finds it so says it ended, and the rank starts cold."""
    script = tmp_path / "quick.py"
    script.write_text("import sys\nsys.exit(0)\n")
    command = [sys.executable, str(script)]
    caplog.set_level(logging.INFO, logger=standby_module.__name__)
    pool = Standbys()
    try:
        pid = pool.keep_ready(command, _env, range(2))
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        wait_until("the standby to die", lambda: _alive({pid}) == set(), 30)
        cold = pool.spawn(command, 1, 1, {**os.environ, "RANK": "1"}, None)
        assert not cold.warm and cold.pid != pid
        assert cold.wait(60) is not None and cold.status is not None and cold.status.code == 0
        said = [r.getMessage() for r in caplog.records if "local rank 1 starts cold" in r.getMessage()]
        assert said == [f"the standby for restarts (pid {pid}) ended before it was warm: local "
                        "rank 1 starts cold"]  # fmt: skip
    finally:
        pool.discard()


def test_a_discarded_standby_leaves_no_process_not_even_its_monitor() -> None:
    pool = Standbys()
    pid = pool.keep_ready([sys.executable, "train.py"], _env, range(2))
    assert pid is not None
    _warm(pool, pid)
    (monitor,) = psutil.Process(pid).children()
    pool.discard()
    assert _alive({pid}) == set() and pool.pids() == []  # reaped
    # killed too (init reaps it): not left to end once its imports are done
    wait_until("the monitor started ahead to end", lambda: _alive({monitor.pid}) == set(), 10)


def test_a_dead_standby_is_replaced_then_given_up(caplog: pytest.LogCaptureFixture) -> None:
    """A standby that died before it was needed is replaced with a warning; after
    ``MAX_DEATHS`` of them, restarts start cold, and a rank still starts."""
    pool = Standbys()
    command = [sys.executable, "train.py"]
    caplog.set_level(logging.WARNING, logger=standby_module.__name__)
    pids = []
    for _ in range(standby_module.MAX_DEATHS):
        pid = pool.keep_ready(command, _env, range(2))
        assert pid is not None and pid not in pids
        pids.append(pid)
        os.killpg(pid, signal.SIGKILL)
        wait_until("the standby to die", lambda p=pid: _alive({p}) == set(), 30)
    assert pool.keep_ready(command, _env, range(2)) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == standby_module.MAX_DEATHS
    assert all("ended (exit -9) before it was needed" in w for w in warnings), warnings
    assert "restarts start cold from now on" in warnings[-1]
    assert pool.pids() == [] and _alive(set(pids)) == set()


def test_what_a_dead_standby_printed_on_piped_streams_is_shown_when_it_is_replaced(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Streams in files (``--redirects``/``--tee``) are piped; a standby for restarts that died
    before it was needed has no rank's files to put them in. What it printed (why it ended:
    a ``python`` that cannot import nvrx, say) is on the console, each line once and prefixed
    with its pid, by the time the warning that replaces it is logged; a last line without its
    end included."""
    python = tmp_path / "python-without-nvrx"
    python.write_text(
        "#!/bin/sh\necho \"No module named 'nvrx'\" >&2\necho on stdout\nprintf 'last' >&2\nexit 1\n"
    )
    python.chmod(0o755)
    command = [str(python), "train.py"]
    at_warning: list[tuple[str, str]] = []

    class AtWarning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            at_warning.append(tuple(capfd.readouterr()))

    handler = AtWarning(logging.WARNING)
    logging.getLogger(standby_module.__name__).addHandler(handler)
    pool = Standbys(logs=RankLogs(redirects=Std.ALL))
    try:
        pid = pool.keep_ready(command, _env, range(2))
        assert pid is not None and pool._for_restart is not None
        wait_until("the standby to end", lambda: pool._for_restart.proc.poll() is not None, 30)
        assert pool.keep_ready(command, _env, range(2)) not in (None, pid)  # replaced
        after = capfd.readouterr()
    finally:
        logging.getLogger(standby_module.__name__).removeHandler(handler)
        pool.discard()
    assert len(at_warning) == 1, at_warning
    out, err = ([line for line in text.splitlines() if "[standby" in line] for text in at_warning[0])
    assert out == [f"[standby {pid}]:on stdout"], at_warning
    assert err == [f"[standby {pid}]:No module named 'nvrx'", f"[standby {pid}]:last"], at_warning
    assert "[standby" not in after.out + after.err, after


def test_no_standby_for_a_command_it_cannot_run_nor_when_turned_off() -> None:
    assert Standbys().keep_ready(["bash", "train.sh"], _env, range(2)) is None
    assert Standbys(enabled=False).keep_ready([sys.executable, "train.py"], _env, range(2)) is None


def test_starting_the_standby_does_not_wait_for_its_imports() -> None:
    """It must not delay the restart it follows: the supervisor only forks it, and the
    standby is still importing torch when ``keep_ready`` returns."""
    pool = Standbys()
    try:
        pid = pool.keep_ready([sys.executable, "train.py"], _env, range(2))
        assert pid is not None and pool._for_restart is not None
        assert pool._for_restart.poll_ready() is None
    finally:
        pool.discard()
