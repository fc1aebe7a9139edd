"""Only the job steers the job: forged and replayed stop flags, and the job's secret kept out
of every file the job leaves.

2 local nodes x 2 ranks of ``examples/ft_heartbeats.py`` under ``nvrx-supervise``. A foreign
client that reaches the store writes a stop flag it made up, one sealed for another run of
the job (a replay), one not even UTF-8 and an empty one: the job trains on to completion at
full size and the supervisor that hosts the store records one ``rejected_write`` event for
each. So it does after a forged node-lost declaration (a claim on node 1's end and the fence
a declarer adds to its beat counter) and the same declaration sealed with the job's secret
but for another run: node 1 records one event for each and trains on; so does node 0, the
store host, in a job of 3 nodes that could fail over, after the same two declarations of its
own slot: no store moves. A Wrapper job (the demo) gets a made-up fault record with a forged
interruption of its round, and in a later round a real record and a real interruption
replayed from the earlier one: no interruption restarts a round, no record is read as a
fault when a real fault restarts the round, each is one ``rejected_write`` event, and the
job trains to the end at full size. A plain script's job gets a forged restart claim,
announcement, go-ahead and spent budget before a real failure: none restarts it, the real
failure restarts it once, and the budget counts only that restart. After such forgeries a
real stop (a node's supervisor gets SIGTERM) still stops every node. The job's secret
appears in none of the events, logs, error files (a rank of a plain job fails once),
supervisor outputs or the report, neither there nor in the demo job's.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest
from test_supervisor_local import REPO, Job, script

from nvrx import jobenv
from nvrx.events.failures import FaultRecord
from nvrx.store import rounds
from nvrx.store.seal import ENTRY, Sealer, new_secret, seal
from nvrx.store.sealed_keys import entry_payload, key_of
from nvrx.store.service import wait_for_store
from nvrx.store.wire import StoreGone, WireStore
from nvrx.supervisor import node_keys
from nvrx.supervisor.config import RESTARTS_KEY
from nvrx.supervisor.exit_codes import ExitCode
from nvrx.supervisor.job_secret import SECRET_FILE
from nvrx.supervisor.stop_flag import StopFlag
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

HEARTBEATS = [sys.executable, str(REPO / "examples" / "ft_heartbeats.py")]
DEMO = [sys.executable, str(REPO / "examples" / "train_demo.py")]
COMMON = ("--max-restarts", "4", "--grace-period", "2", "--ft-safety-factor", "60")


def _job(tmp_path, steps: int, *options: str, node_env=None, nnodes=2, nproc=2, fail=None) -> Job:
    command = [*HEARTBEATS, "--steps", str(steps), "--step-time", "0.2",
               "--checkpoint-dir", str(tmp_path / "ck"), *(("--fail", fail) if fail else ())]  # fmt: skip
    return Job(tmp_path, nnodes, nproc, command, *COMMON, *options, node_env=node_env)


def _environ(process: psutil.Process) -> str:
    """The environment ``process`` started with, as text ("" once it ended)."""
    try:
        return "\n".join(f"{k}={v}" for k, v in process.environ().items())
    except psutil.Error:
        return ""


def _foreign_client(job: Job) -> WireStore:
    """A client of the job's store that is none of the job's processes, once the store answers
    (the ranks start while node 0's store is still coming up)."""
    wait_for_store("127.0.0.1", job.store_port, 120)
    return WireStore("127.0.0.1", job.store_port, timeout=10)


def _secret_file(process: psutil.Process) -> str | None:
    """The ``$NVRX_JOB_SECRET_FILE`` ``process`` started with (None once it ended)."""
    try:
        return process.environ().get(jobenv.JOB_SECRET_FILE)
    except psutil.Error:
        return None


def _secret(job: Job) -> str:
    return (job.log_dir / job.job_id / SECRET_FILE).read_text().strip()


def _forge(job: Job) -> list[str]:
    """A foreign client's two writes, once every child trains: the keys it wrote."""
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 4, 120)
    secret = job.log_dir / job.job_id / SECRET_FILE
    wait_until("slot 0 to write the job's secret", secret.exists, 120)
    store = _foreign_client(job)
    forged = json.dumps({"reason": "forged", "exit_code": 0, "node": 0})
    store.set(StopFlag.key(1), forged)
    other_run = seal(bytes.fromhex(_secret(job)), StopFlag.key(2), forged, run=7)
    store.set(StopFlag.key(2), other_run)  # a value the job sealed, but for another run
    store.set(StopFlag.key(3), b"\xff\xfe" + "\x1fmac=é".encode())  # not even UTF-8
    store.set(StopFlag.key(4), "")  # empty: torch's compare_set takes it for "not set"
    return [StopFlag.key(g) for g in (1, 2, 3, 4)]


def _declare_lost(store: WireStore, slot: int, sealer: Sealer) -> None:
    """Declare ``slot`` lost as a supervisor does (a claim, then a fence), sealed by ``sealer``."""
    store.append(node_keys.claim(slot), sealer.entry(node_keys.claim(slot), entry_payload(0)))
    store.add(node_keys.alive(slot), node_keys.FENCE)


def _forge_node_loss(job: Job, slot: int = 1) -> list[str]:
    """A forged declaration that node ``slot`` is lost, then the job's own for another run (a
    replay), each once the one before was rejected: the keys of the events they make."""
    store = _foreign_client(job)
    key = node_keys.claim(slot)

    def rejected() -> int:
        return len([e for e in job.events("rejected_write") if e["key"] == key])

    _declare_lost(store, slot, Sealer(bytes(32), 0))  # a secret of the forger's own
    wait_until("the forged declaration to be rejected", lambda: rejected() == 1, 60)
    _declare_lost(store, slot, Sealer(bytes.fromhex(_secret(job)), run=7))
    wait_until("the replayed declaration to be rejected", lambda: rejected() == 2, 60)
    return [key] * 2


def test_forged_and_replayed_stop_flags_are_rejected_and_the_job_trains_on(tmp_path):
    job = _job(tmp_path, 75)  # trains on for several node timeouts after the last rejection
    keys = _forge(job) + _forge_node_loss(job)
    assert job.wait(240) == [0, 0], job.output()
    rejected = job.events("rejected_write")
    assert sorted(e["key"] for e in rejected) == sorted(keys), rejected  # one per forged value
    assert not job.events("node_lost"), job.output()
    assert not [e for e in job.events("job_stop") if "forged" in e["reason"]], job.output()
    done = [e for e in job.events("child_exit") if e["exit_code"] == 0]
    assert len(done) == 4, job.output()  # every rank of both nodes trained to the end
    assert "rank 3: done" in job.output()
    report = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job.log_dir / job.job_id), "--format", "json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert sorted(r["key"] for r in json.loads(report.stdout)["rejected_writes"]) == sorted(keys)


def test_a_forged_claim_that_the_store_host_is_lost_moves_no_store(tmp_path):
    """The failover's own election is files in the owner-only job folder, out of a store
    client's reach; what such a client can write towards a failover is a declaration that
    the store host's slot is lost, which would fence node 0 off, its store with it. Forged,
    and replayed from another run, in a job of 3 nodes (a failover possible): node 0
    rejects both and the store stays."""
    job = _job(tmp_path, 75, nnodes=3, nproc=1)  # trains on well past the rejections
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 3, 120)
    job.wait_for_beat(0)
    keys = _forge_node_loss(job, slot=0)
    assert job.wait(240) == [0, 0, 0], job.output()
    rejected = job.events("rejected_write")
    assert [(e["node"], e["key"]) for e in rejected] == [(0, k) for k in keys], rejected
    assert not job.events("store_failover") and not job.events("node_lost"), job.output()
    done = [e for e in job.events("child_exit") if e["exit_code"] == 0]
    assert len(done) == 3, job.output()  # every rank of the three nodes trained to the end


def _hold_still(store: WireStore, key: str, until, job: Job) -> None:
    """Set the counter at ``key`` back to what it read first after each add (looking every
    few milliseconds: an attacker's pace, not a wait), until ``until()``."""
    held, deadline, look_at = store.add(key, 0), time.monotonic() + 120, 0.0
    while True:
        now = store.add(key, 0)
        if now > held:
            store.add(key, held - now)
        if time.monotonic() >= look_at:
            if until():
                return
            assert time.monotonic() < deadline, f"no end to the hold of {key}:\n{job.output()}"
            look_at = time.monotonic() + 0.1
        time.sleep(0.002)


def test_a_live_slot_whose_beats_are_held_still_in_the_store_is_not_declared_lost(tmp_path):
    """A foreign client sets node 1's beat counter back after each of its beats, for longer
    than the node timeout: node 1 records each set-back and stamps its beats in the job
    folder, node 0 (its watcher) reads the stamps and declares nothing; the job trains to
    the end at full size, and the stamps go with the run's failover files."""
    job = _job(tmp_path, 100, nproc=1)  # trains on for two node timeouts after the hold
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 2, 120)
    job.wait_for_beat(1)
    store, alive = _foreign_client(job), node_keys.alive(1)

    def set_backs() -> int:
        return len([e for e in job.events("rejected_write") if e["key"] == alive])

    try:
        _hold_still(store, alive, lambda: set_backs() >= 8, job)  # 8 beats: past the 5 s node timeout
    except StoreGone:
        pytest.fail(f"the store went away while node 1 was held still (declared lost?):\n{job.output()}")
    assert job.wait(240) == [0, 0], job.output()
    assert not job.events("node_lost"), job.output()
    assert "slot 1's beat counter stands still in the store, but it stamps" in job.output()
    rejected = job.events("rejected_write")
    assert {(e["node"], e["key"]) for e in rejected} == {(1, alive)}, rejected
    done = [e for e in job.events("child_exit") if e["exit_code"] == 0]
    assert len(done) == 2, job.output()
    assert not (job.log_dir / job.job_id / "failover").exists()


def _forge_in_round(
    job: Job, store: WireStore, entry: bytes, interruption: bytes, terminated: bytes
) -> int:
    """Once the running round trains: append ``entry`` to its fault list and ``terminated``
    to its terminated ranks, and write ``interruption`` at its interruption, as a faulting
    or leaving rank does; the round, after the interruption's rejection (the two lists are
    read only when a real fault restarts it)."""
    rejected = lambda: [e["key"] for e in job.events("rejected_write", component=None)]  # noqa: E731
    steps = len(job.events("progress", component="app"))
    wait_until("the round to train", lambda: len(job.events("progress", component="app")) > steps + 4, 120)
    round_ = max(e["round"] for e in job.events("round_start", component=None))  # it trains in
    prefix = rounds.round_prefix(round_)
    store.append(prefix + rounds.FAULT_LIST, entry)
    store.append(prefix + rounds.TERMINATED, terminated)
    store.set(prefix + rounds.INTERRUPTED, interruption)
    # by its key: the previous round's rejections may still be coming in (its lowest rank
    # reports what the round's decision passed over as the next round begins)
    wait_until(f"the interruption of round {round_} to be rejected",
               lambda: prefix + rounds.INTERRUPTED in rejected(), 120, state=job.output)  # fmt: skip
    assert not {prefix + rounds.FAULT_LIST, prefix + rounds.TERMINATED} & set(rejected())
    return round_


def _forge_barriers(store: WireStore, round_: int, name: str, per_host: bool = False) -> list[str]:
    """Ahead of round ``round_``'s barrier ``name``: one arrival more in its count, rank 2's
    arrival and the barrier's release, as a client without the secret writes them; the
    keys of the two values, each of which the rank whose own value takes its place reports.
    ``per_host``: a barrier the hosts' agents meet for their ranks, which write no arrival
    key of a rank (an entry of the barrier's group list names them): there rank 2's forged
    arrival is such an entry, which the rank that closes the barrier reports."""
    prefix = f"{rounds.round_prefix(round_)}{name}/"
    store.add(prefix + "n", 1)
    arrival = prefix + ("group" if per_host else "a/2")
    if per_host:
        store.append(arrival, f"{ENTRY}2:forged{ENTRY}".encode())
    else:
        store.set(arrival, b"1")
    store.set(prefix + "go", b"1")
    return [arrival, prefix + "go"]


def _rounds_with_faults(job: Job) -> set[int]:
    return {e["round"] for e in job.events("round_end", component=None) if e.get("faults")}


def test_forged_and_replayed_fault_records_are_not_faults_and_the_job_trains_on(tmp_path):
    command = [*DEMO, "--steps", "140", "--step-time", "0.15", "--checkpoint-every", "5",
               "--soft-timeout", "10", "--hard-timeout", "20",
               "--fault", "exception:50:1", "--fault", "exception:110:1"]  # fmt: skip
    job = Job(tmp_path, 2, 2, command, "--max-restarts", "8", "--grace-period", "2")
    store = _foreign_client(job)
    made_up = FaultRecord(rank=3, kind="exit", exc_type="RestartAbort", message="forged")
    store.append(rounds.JOB_RESTARTS, b"1000")  # restarts spent, as a forger would count them
    first = _forge_in_round(job, store, (made_up.to_json() + "\n").encode(), b"fault", b"0,")
    barriers = _forge_barriers(store, first, rounds.ITERATION_BARRIER, per_host=True)  # before its fault ends it
    wait_until("the first injected fault's restart", lambda: first in _rounds_with_faults(job), 120,
               state=job.output)  # fmt: skip
    prefix = rounds.round_prefix(first)
    real = store.get(prefix + rounds.FAULT_LIST)  # rank 1's, sealed, after the made-up one
    interrupted = store.get(prefix + rounds.interrupted_key(2))  # the real one, sealed for round 0
    second = _forge_in_round(job, store, real, interrupted, real)  # sealed for another key
    barriers += _forge_barriers(store, second + 1, rounds.COMPLETION_BARRIER)  # the last round
    store.set(rounds.round_prefix(second + 1) + rounds.COMPLETED, b"1")
    assert job.wait(240) == [0, 0], job.output()
    assert second > first
    keys = [e["key"] for e in job.events("rejected_write", component=None)]
    expected = [rounds.round_prefix(r) + key for r in (first, second)
                for key in (rounds.INTERRUPTED, rounds.FAULT_LIST, rounds.TERMINATED)]  # fmt: skip
    expected += [*barriers, rounds.round_prefix(second + 1) + rounds.COMPLETED]
    assert sorted(keys) == sorted([*expected, rounds.JOB_RESTARTS]), keys  # each once
    ends = job.events("round_end", component=None)
    recorded = [f for e in ends for f in e.get("faults") or []]
    assert {(f["rank"], f["kind"]) for f in recorded} == {(1, "exception")}, recorded  # the real ones
    assert _rounds_with_faults(job) == {first, second}, ends  # each in its own round only
    restarts = [e for e in ends if e["outcome"] == "restart"]
    assert len(restarts) == 2 * 4, ends  # the two real faults' rounds on 4 ranks: no other
    starts = job.events("round_start", component=None)
    assert max(e["iteration"] for e in starts) == 2, starts  # the forged 1000 not counted
    done = [e for e in job.events("child_exit") if e["exit_code"] == 0]
    assert len(done) == 4, job.output()  # every rank of both nodes trained to the end
    files = _secret_nowhere(job, _secret(job))  # a demo job with faults and forged values
    assert {"wrapper", "supervisor"} <= {p.name.split("-")[0] for p in files if p.suffix == ".jsonl"}, files


def test_forged_restart_claims_neither_restart_the_job_nor_spend_or_block_a_real_one(tmp_path):
    command = [*HEARTBEATS, "--steps", "60", "--step-time", "0.2", "--checkpoint-dir",
               str(tmp_path / "ck"), "--fail", "3:30"]  # fmt: skip
    job = Job(tmp_path, 2, 2, command, "--max-restarts", "2", "--grace-period", "2",
              "--ft-safety-factor", "60")  # fmt: skip
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 4, 120)
    store, forger = _foreign_client(job), Sealer(bytes(32), 0)
    restart = "nvrx_supervisor/job_restart/1/"
    store.append(restart + "claim", forger.entry(restart + "claim", entry_payload(1)))
    for _ in range(3):  # the whole budget and more, as a node spends it
        store.append(RESTARTS_KEY, forger.entry(RESTARTS_KEY, entry_payload(1)))
    store.set(key_of(restart + "go", 1), "1")  # an early go-ahead, waiting for the restart
    begin = key_of(restart + "begin", 1)
    store.set(begin, json.dumps({"rank": 0, "node": 0, "signature": "forged"}))
    assert job.wait(240) == [0, 0], job.output()
    rejected = [e["key"] for e in job.events("rejected_write")]
    assert sorted(rejected) == sorted([begin, key_of(restart + "go", 1)]), rejected
    started = [e for e in job.events("job_restart") if e["phase"] == "started"]
    assert sorted(e["node"] for e in started) == [0, 1] and {e["epoch"] for e in started} == {1}
    [decision] = job.events("restart_decision")
    assert decision["global_rank"] == 3 and decision["budget_left"] == 1, decision  # 1 of 2 spent


def test_a_real_stop_after_forged_values_still_stops_every_node(tmp_path):
    job = _job(tmp_path, 2000)
    _forge(job)
    wait_until("the forged values to be rejected", lambda: len(job.events("rejected_write")) == 4, 60)
    # node 1 in touch with the store (its ranks start before that): its stop must reach it
    job.wait_for_beat(1)
    os.kill(job.procs[1].pid, signal.SIGTERM)
    codes = job.wait(120)
    assert codes[1] != 0 and codes[0] == codes[1], (codes, job.output())  # node 0 stopped too
    [stop] = [e for e in job.events("job_stop") if e["node"] == 0]
    assert stop["reason"].startswith("node 1 stopped the job: received SIGTERM"), stop


def test_forgeries_while_the_store_host_waits_for_the_others_are_recorded_and_watched_past(tmp_path):
    """Node 0's rank ends at once and node 0 waits for node 1 (``JobEnd``); a foreign client
    then writes a stop value of its own and declares slot 0 lost. Node 0 records each and
    watches past the forged stop, so node 1's real one (its rank fails after node 0's
    completed: no job-wide restart, exit 13) ends node 0 too (before: the forged value took
    node 0's one watch of the stop flag, node 0 exited 0, and neither forgery was recorded)."""
    go = tmp_path / "go"
    os.mkfifo(go)  # node 1's rank blocks reading it until the test has forged
    command = script(tmp_path, "if os.environ['GROUP_RANK'] == '1':\n"
                               f"    open({str(go)!r}).read()\n"
                               "    sys.exit(3)\n")  # fmt: skip
    job = Job(tmp_path, 2, 1, command, "--max-restarts", "0", "--grace-period", "2")
    wait_until("node 0's rank to end", lambda: [e for e in job.events("child_exit") if e["node"] == 0], 120)
    store = _foreign_client(job)
    store.set(StopFlag.key(1), json.dumps({"reason": "forged", "exit_code": 0, "node": 0}))
    _declare_lost(store, 0, Sealer(bytes(32), 0))
    keys = [node_keys.claim(0), StopFlag.key(1)]
    wait_until("both to be rejected", lambda: sorted(e["key"] for e in job.events("rejected_write")) == keys, 60)
    wait_until("node 1's rank to read the go signal", lambda: _release(go), 60)
    stopped = int(ExitCode.AFTER_COMPLETION)
    assert job.wait(120) == [stopped, stopped], job.output()
    assert sorted((e["node"], e["key"]) for e in job.events("rejected_write")) == [(0, k) for k in keys]
    assert not job.events("node_lost"), job.output()


def _release(fifo) -> bool:
    """Open ``fifo`` for writing and close it, which ends its reader's read: False while no
    process reads it yet (opening would block)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return False
        raise
    return True


@pytest.mark.parametrize("given", [False, True], ids=["slot-0-writes-it", "from-the-environment"])
def test_the_jobs_secret_is_in_no_file_it_leaves_and_its_folder_is_private(tmp_path, given):
    secret = new_secret()
    env = {jobenv.JOB_SECRET: secret} if given else {}
    # rank output in files too; warm standbys on, so that their environments are checked too
    # rank 3 fails once: its error file is among the files searched
    job = _job(tmp_path, 40, "--tee", "3", "--warm-standby", node_env={0: env, 1: env}, fail="3:20")
    wait_until("every rank to start", lambda: len(job.events("child_start")) == 4, 120)
    wait_until("a warm standby to start", lambda: job.events("standby_start"), 120)
    started = _started_past_their_exec(job)
    environments = [_environ(p) for p in started]
    assert len(environments) >= 6 and not [e for e in environments if secret in e]
    # instead, each gets the path of an owner-only file that holds it
    secret_files = {_secret_file(p) for p in started} - {None}
    assert secret_files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in secret_files)
    assert job.wait(240) == [0, 0], job.output()
    if given:  # the copy in each supervisor's runtime folder went with it
        assert not [f for f in secret_files if os.path.exists(f)], secret_files
    job_dir = job.log_dir / job.job_id
    assert (job_dir / SECRET_FILE).exists() != given
    secret = secret if given else _secret(job)
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    if not given:
        assert stat.S_IMODE((job_dir / SECRET_FILE).stat().st_mode) == 0o600
    files = _secret_nowhere(job, secret)
    names = {p.name for p in files}
    assert {"stdout.log", "error.json"} <= names and any(p.suffix == ".jsonl" for p in files), names


def _forked_only(process: psutil.Process) -> bool:
    """Whether ``process`` is caught between its fork and its exec: it still shows its
    parent's command line, and the environment its parent started with (a supervisor's:
    the secret, where it was given there, though the supervisor dropped it since)."""
    try:
        parent = process.parent()
        return parent is not None and process.cmdline() == parent.cmdline()
    except psutil.Error:
        return False


def _started_past_their_exec(job: Job) -> list[psutil.Process]:
    """The processes below the supervisors, once none shows its parent's program still (a
    supervisor may be starting one, a standby say, as the test looks)."""
    started = [p for sup in job.procs for p in psutil.Process(sup.pid).children(recursive=True)]
    wait_until("every started process to run its own program",
               lambda: not [p for p in started if _forked_only(p)], 30)  # fmt: skip
    return started


def _secret_nowhere(job: Job, secret: str) -> list:
    """The files the job left (its folder but the secret file, the supervisors' outputs),
    once none of them nor its report holds ``secret``."""
    job_dir = job.log_dir / job.job_id
    report = subprocess.run(
        [sys.executable, "-m", "nvrx.report", str(job_dir)], capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    files = [p for p in job_dir.rglob("*") if p.is_file() and p.name != SECRET_FILE]
    holding = [str(p) for p in files if secret in p.read_text(errors="replace")]
    holding += [str(p) for p in job.outputs if secret in p.read_text(errors="replace")]
    assert holding == [] and secret not in report.stdout + report.stderr
    return files + job.outputs
