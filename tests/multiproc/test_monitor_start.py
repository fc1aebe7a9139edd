"""Under a supervisor, a Wrapper's monitor process watches before its link to the store is made.

The monitor makes its link in a thread of its own (``nvrx.inprocess.monitor_store``). Here
its connection is held in every monitor process by a ``sitecustomize`` on the ranks' ``PYTHONPATH``
(the monitor inherits the rank's environment) until the test's gate file exists (at most
300 s, so that a failed test leaves no monitor behind), so "no link yet" is a state the
test controls rather than a race:

* the ranks enter their function, their monitors having said that they watch;
* a hang is found, and its ``hang`` event written, while the monitor's link is held;
  the fault's store record follows once the gate opens, and the job restarts in-process;
* a rank's death is seen and its ``fault`` event (``dead``) written at once; the store
  part (the rank leaves its round) follows once the gate opens, and its replacement
  rejoins;
* a monitor whose link cannot be made (its connection is refused) ends with a
  ``process_end`` event, and its rank, unwatched, leaves the job at its next round.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.multiproc.test_supervisor_local import Job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

SITECUSTOMIZE = textwrap.dedent(
    """
    import os, sys, time

    HOLD_S = 300  # a test that failed never opens the gate: its monitors then go on

    def _until(path):
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _held(connect):
        def connect_at_the_gate(cfg):
            if os.environ.get("TEST_NO_LINK_LOCAL_RANK") == os.environ["LOCAL_RANK"]:
                # refused once its rank is in round 0: the rank finds out at round 1
                _until(os.path.join(os.environ["OUT_DIR"], f"seen-{os.environ['RANK']}-0.json"))
                raise ConnectionRefusedError("the store withheld from this monitor by the test")
            _until(os.environ["TEST_MONITOR_GATE"])
            return connect(cfg)
        return connect_at_the_gate

    def _in_a_monitor():
        try:
            with open("/proc/self/cmdline", "rb") as f:
                return b"nvrx.monitor_boot" in f.read()
        except OSError:
            return False

    if os.environ.get("TEST_MONITOR_GATE") and _in_a_monitor():
        from nvrx.inprocess import monitor_store

        monitor_store.connect = _held(monitor_store.connect)
    """
)

# Round 0: each rank notes what it sees, then hangs (GIL released), or, in the "kill" mode,
# local rank 1's first process SIGKILLs itself. Round 1: done.
TRAIN = textwrap.dedent(
    """
    import json, os, time
    from datetime import timedelta
    from pathlib import Path
    from nvrx import inprocess

    out, gate = Path(os.environ["OUT_DIR"]), Path(os.environ["TEST_MONITOR_GATE"])
    kill = os.environ.get("TEST_MODE") == "kill"
    no_link = os.environ.get("TEST_NO_LINK_LOCAL_RANK")
    first_process = os.environ.get("NVRX_RESTART_COUNT", "0") == "0"

    @inprocess.Wrapper(
        soft_timeout=timedelta(seconds=3), hard_timeout=timedelta(seconds=60),
        heartbeat_interval=timedelta(seconds=0.5), heartbeat_timeout=timedelta(seconds=30),
        monitor_process_interval=timedelta(seconds=0.25),
        progress_watchdog_interval=timedelta(seconds=0.2),
        barrier_timeout=timedelta(seconds=90), rejoin_timeout=timedelta(seconds=90),
    )
    def train(call_wrapper: inprocess.CallWrapper = None):
        rank, it = int(os.environ["RANK"]), call_wrapper.iteration
        seen = {"rank": rank, "iteration": it, "monitor_pid": call_wrapper.monitor_process.pid,
                "gate_open": gate.exists(), "pid": os.getpid()}
        (out / f".seen-{rank}-{it}").write_text(json.dumps(seen))
        os.replace(out / f".seen-{rank}-{it}", out / f"seen-{rank}-{it}.json")  # whole once it exists
        if it > 0:
            return
        if kill and os.environ["LOCAL_RANK"] == "1" and first_process:
            os.kill(os.getpid(), 9)
        if no_link is not None and os.environ["LOCAL_RANK"] == no_link:  # its monitor ends
            while call_wrapper.monitor_process.proc.poll() is None:
                time.sleep(0.02)
            raise RuntimeError("injected once this rank's monitor ended")  # round 1 next
        time.sleep(300)  # only a monitor can end this round

    train()
    """
)


def _job(tmp_path: Path, mode: str, max_restarts: int, **variables: str) -> tuple[Job, Path]:
    site, out = tmp_path / "site", tmp_path / "out"
    site.mkdir()
    out.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {
        "OUT_DIR": str(out),
        "TEST_MODE": mode,
        "TEST_MONITOR_GATE": str(tmp_path / "gate"),
        # absolute: the job runs in tmp_path, where a relative entry would name nothing
        "PYTHONPATH": os.pathsep.join([str(site), *map(os.path.abspath, filter(None, inherited))]),
        **variables,
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        # no warm standby: it would start a monitor ahead, whose link is held as well
        job = Job(tmp_path, 1, 2, [sys.executable, str(script)], "--no-warm-standby",
                  "--max-restarts", str(max_restarts), "--tee", "3")  # fmt: skip
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return job, out


def _seen(out: Path, rank: int, iteration: int) -> dict:
    return json.loads((out / f"seen-{rank}-{iteration}.json").read_text())


def _monitor_events(job: Job, kind: str) -> list[dict]:
    return job.events(kind, component="monitor")


def test_a_hang_is_found_before_the_monitor_has_its_link(tmp_path):
    job, out = _job(tmp_path, "hang", max_restarts=0)
    for rank in (0, 1):
        path = out / f"seen-{rank}-0.json"
        wait_until(f"rank {rank} in its function", path.exists, 120, state=job.output)
    wait_until(
        "both monitors' soft timeouts",
        lambda: {e["rank"] for e in _monitor_events(job, "hang")} == {0, 1},
        60,
        state=job.output,
    )
    # Found with the link held: nothing went to the store yet, so no rank restarted.
    assert not (tmp_path / "gate").exists()
    assert not any(out.glob("seen-*-1.json"))
    (tmp_path / "gate").touch()
    assert job.wait(150) == [0], job.output()
    for rank in (0, 1):
        first, second = _seen(out, rank, 0), _seen(out, rank, 1)
        assert first["gate_open"] is False and second["gate_open"] is True
        assert second["pid"] == first["pid"]  # an in-process restart
        assert second["monitor_pid"] == first["monitor_pid"]
    faults = _monitor_events(job, "fault")
    assert {e["origin_rank"] for e in faults if e["fault_kind"] == "hang_soft"} == {0, 1}
    assert all(e["timeout"] == "soft" for e in _monitor_events(job, "hang"))


def test_a_death_is_told_at_once_and_left_on_its_behalf_once_the_link_is_there(tmp_path):
    job, out = _job(tmp_path, "kill", max_restarts=1)
    seen = out / "seen-1-0.json"
    wait_until("rank 1 in its function", seen.exists, 120, state=job.output)
    pid = json.loads(seen.read_text())["pid"]

    def dead() -> list[dict]:
        return [e for e in _monitor_events(job, "fault") if e["fault_kind"] == "dead"]

    wait_until("the monitor's fault event of the dead rank", dead, 60, state=job.output)
    assert not (tmp_path / "gate").exists()  # written with the monitor's link held
    assert [e["origin_rank"] for e in dead()] == [1]
    assert dead()[0]["message"] == f"process {pid} died"
    (tmp_path / "gate").touch()
    assert job.wait(180) == [0], job.output()
    assert _seen(out, 0, 1)["pid"] == _seen(out, 0, 0)["pid"]  # rank 0 restarted in-process
    assert _seen(out, 1, 1)["pid"] != pid  # rank 1's replacement rejoined
    assert len(dead()) == 1


def test_a_monitor_without_a_link_ends_and_its_rank_leaves_at_the_next_round(tmp_path):
    (tmp_path / "gate").touch()  # rank 0's monitor makes its link at once
    job, out = _job(tmp_path, "hang", max_restarts=0, TEST_NO_LINK_LOCAL_RANK="1")
    codes = job.wait(150)
    output = job.output()
    assert codes != [0], output
    assert "exited with 1: this rank is not watched" in output, output
    assert (out / "seen-1-0.json").exists() and not (out / "seen-1-1.json").exists(), output
    ends = [e for e in _monitor_events(job, "process_end") if e["rank"] == 1]
    assert [e["exit_code"] for e in ends] == [1], output
    assert "no link to the store" in ends[0]["reason"]
    assert "withheld" in ends[0]["reason"]
