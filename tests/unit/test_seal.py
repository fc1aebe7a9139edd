"""Sealed control values (``nvrx.store.seal``) and the job's secret (``job_secret``)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
import time

import pytest

from nvrx import jobenv
from nvrx.jobenv import JobEnv
from nvrx.store.seal import Sealer, new_secret, parse_secret, seal, unseal
from nvrx.supervisor import job_secret
from nvrx.supervisor.config import ConfigError, SupervisorConfig
from nvrx.supervisor.stop_flag import StopFlag

SECRET = bytes.fromhex(new_secret())


def _job_secret_file(tmp_path, monkeypatch):
    """``SECRET`` in an owner-only file named by ``$NVRX_JOB_SECRET_FILE``, as a supervisor
    gives it to the processes it starts."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET.hex())
    secret_file.chmod(0o600)
    monkeypatch.setenv(jobenv.JOB_SECRET_FILE, str(secret_file))
    return secret_file


def test_a_sealed_value_unseals_only_for_its_key_run_and_secret():
    value = seal(SECRET, "k/1", '{"reason": "x"}', run=0)
    assert unseal(SECRET, "k/1", value, run=0) == '{"reason": "x"}'
    assert unseal(SECRET, "k/2", value, run=0) is None  # copied under another key
    assert unseal(SECRET, "k/1", value, run=1) is None  # replayed in another run
    assert unseal(bytes(32), "k/1", value, run=0) is None  # sealed without the secret
    assert unseal(SECRET, "k/1", value.replace("x", "y", 1), run=0) is None  # altered
    assert unseal(SECRET, "k/1", '{"reason": "x"}', run=0) is None  # no seal at all
    with pytest.raises(ValueError, match="cannot hold the separators"):
        seal(SECRET, "k", "a\x1fb", run=0)
    for odd in ("x\x1fmac=é", "x\x1fmac=\ufffd\ufffd", "\ud800\x1fmac=00", "", "\x1f"):
        assert unseal(SECRET, "k/1", odd, run=0) is None  # refused, never raised


def test_a_secret_given_must_be_long_hex_and_the_error_never_shows_it():
    with pytest.raises(ValueError, match=r"\$NVRX_JOB_SECRET must be hexadecimal") as err:
        parse_secret("not-hex-zz", "$NVRX_JOB_SECRET")
    assert "not-hex-zz" not in str(err.value)
    with pytest.raises(ValueError, match="at least 16 bytes, got 4"):
        parse_secret("00112233", "$NVRX_JOB_SECRET")


def _config(tmp_path, slot: int) -> SupervisorConfig:
    job = JobEnv.local(nnodes=2, node_rank=slot, nproc_per_node=1, job_id="j", log_dir=str(tmp_path))
    return SupervisorConfig(command=["train"], job=job, store_timeout=1.0)


def test_slot_0_writes_the_secret_owner_only_and_the_others_read_it(tmp_path, monkeypatch):
    monkeypatch.delenv(jobenv.JOB_SECRET, raising=False)
    first, second = _config(tmp_path, 0), _config(tmp_path, 1)
    job_secret.private_job_dir(first.events_dir)
    assert stat.S_IMODE(first.events_dir.stat().st_mode) == 0o700
    secret = job_secret.resolve(first)
    path = first.events_dir / job_secret.SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert job_secret.resolve(second) == secret == job_secret.resolve(first)  # a requeue keeps it
    assert [p.name for p in first.events_dir.iterdir()] == [job_secret.SECRET_FILE]  # no draft left
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="must be this user's and owner-only"):
        job_secret.resolve(second)


def test_the_variable_wins_and_leaves_the_environment(tmp_path, monkeypatch):
    given = new_secret()
    monkeypatch.setenv(jobenv.JOB_SECRET, given)
    assert job_secret.resolve(_config(tmp_path, 1)) == bytes.fromhex(given)
    assert jobenv.JOB_SECRET not in os.environ  # nothing the supervisor starts inherits it
    assert not (tmp_path / "j" / job_secret.SECRET_FILE).exists()


def test_without_the_variable_or_slot_0s_file_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(jobenv.JOB_SECRET, raising=False)
    with pytest.raises(ConfigError, match=r"set the variable alike on every node, or put the log"):
        job_secret.resolve(_config(tmp_path, 1))


def test_a_childs_environment_never_holds_the_secret(monkeypatch):
    monkeypatch.setenv(jobenv.JOB_SECRET, new_secret())
    env = JobEnv.local(nnodes=1, node_rank=0, nproc_per_node=1).child_env(0, 0)
    assert jobenv.JOB_SECRET not in env


class _Keys(dict):
    """Keys as the store holds them, for the stop flag's chain (``compare_set``, ``get``)."""

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        if self.get(key, "") == expected:
            self[key] = desired
        return self[key]


def test_the_stop_flag_passes_over_forged_values_and_watchers_follow():
    from nvrx.supervisor.config import StopRequest

    keys = _Keys({StopFlag.key(1): "forged", StopFlag.key(2): "forged too"})
    writer, watcher = StopFlag(SECRET, 0), StopFlag(SECRET, 0)
    writer.write(keys, StopRequest("done", 3, 1))
    assert set(keys) == {StopFlag.key(g) for g in (1, 2, 3)}
    for generation in (1, 2):
        seen = watcher.on_value(StopFlag.key(generation), keys[StopFlag.key(generation)], 1)
        assert seen.request is None and "no valid seal" in seen.rejected
    assert watcher.watching == 3
    assert watcher.on_value(StopFlag.key(3), keys[StopFlag.key(3)], 1).request == StopRequest("done", 3, 1)
    assert watcher.read(keys, 1) == StopRequest("done", 3, 1)
    StopFlag(SECRET, 0).write(keys, StopRequest("later", 4, 0))  # another node: the job stops already
    assert len(keys) == 3


def test_a_writer_never_writes_behind_the_watchers_nor_over_an_empty_value():
    from nvrx.supervisor.config import StopRequest

    keys = _Keys({StopFlag.key(1): ""})  # torch would take "" for "not set" in compare_set
    writer = StopFlag(SECRET, 0)
    writer.write(keys, StopRequest("stop", 3, 1))
    assert keys[StopFlag.key(1)] == ""  # passed over, not written into
    assert StopFlag(SECRET, 0).request_of(StopFlag.key(2), keys[StopFlag.key(2)], 1).reason == "stop"
    assert StopFlag(SECRET, 0).read(keys, 1).reason == "stop"  # a reader walks past g1 too

    keys = _Keys({StopFlag.key(1): "forged"})
    node = StopFlag(SECRET, 0)
    node.on_value(StopFlag.key(1), "forged", 1)  # rejected: it watches g2 now
    del keys[StopFlag.key(1)]  # the forger deletes what the watchers passed
    node.write(keys, StopRequest("stop", 3, 1))
    assert set(keys) == {StopFlag.key(2)}  # where the watchers wait, not the freed g1


def test_a_job_folder_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    folder = tmp_path / "job"
    folder.mkdir()
    os.chown(folder, 12345, 12345)
    with pytest.raises(ConfigError, match="must be a folder of this user"):
        job_secret.private_job_dir(folder)


def test_a_sealed_list_skips_forged_fragments_and_keeps_its_order():
    sealer, forger = Sealer(SECRET, 0), Sealer(bytes(32), 0)
    value = "".join(
        [
            "no end: a fragment that would swallow the next entry",  # appended first
            sealer.entry("k", "first"),
            forger.entry("k", "forged"),
            sealer.entry("other", "copied from another key"),
            sealer.entry("k", "second"),
        ]
    )
    found = sealer.entries("k", value)
    assert found.valid == ("first", "second") and found.first == "first"
    assert found.invalid == 3 and found.invalid_bytes > 0
    assert Sealer(SECRET, 1).entries("k", value).valid == ()  # another run: nothing counts
    assert sealer.entries("k", None).first is None
    assert SECRET.hex() not in repr(sealer)


def test_fault_records_are_sealed_for_their_round_and_forged_ones_are_counted(tmp_path, monkeypatch):
    from torch.distributed import HashStore

    from nvrx.events.failures import FaultRecord
    from nvrx.store import rounds
    from nvrx.store import seal as seal_module

    secret_file = _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    round_3, round_4 = rounds.round_store(base, 3), rounds.round_store(base, 4)
    rounds.append_fault(round_3, FaultRecord(rank=1, kind="exception", message="real"))
    forged = FaultRecord(rank=2, kind="exit", exc_type="RestartAbort")
    round_3.append(rounds.FAULT_LIST, forged.to_json() + "\n")  # as a client without the secret
    checked = rounds.checked_fault_records(round_3)
    assert [(r.rank, r.message) for r in checked.records] == [(1, "real")] and checked.forged == 1
    # the real record copied into the next round is no fault there
    round_4.append(rounds.FAULT_LIST, base.get(rounds.round_prefix(3) + rounds.FAULT_LIST))
    assert rounds.fault_records(round_4) == [] and rounds.checked_fault_records(round_4).forged == 2
    # without a supervisor (no secret file), records are plain JSON lines, as before
    monkeypatch.delenv(jobenv.JOB_SECRET_FILE)
    plain = rounds.round_store(HashStore(), 0)
    rounds.append_fault(plain, FaultRecord(rank=0, kind="exception"))
    assert plain.get(rounds.FAULT_LIST).decode().startswith("{")
    assert [r.rank for r in rounds.fault_records(plain)] == [0]
    # a secret file others can read is refused, naming the fix
    secret_file.chmod(0o640)
    monkeypatch.setenv(jobenv.JOB_SECRET_FILE, str(secret_file))
    monkeypatch.setattr(seal_module, "_job_sealer", None)
    with pytest.raises(ValueError, match="owner-only"):
        seal_module.job_sealer()


def test_two_appending_to_a_sealed_count_at_once_read_their_own_places():
    """As with an atomic ``add``: each appender learns its own entry's place, even when the
    other's entry lands between its append and its read; forged and copied entries count never."""
    from nvrx.store import sealed_keys

    sealer, forger = Sealer(SECRET, 0), Sealer(bytes(32), 0)
    values: dict[str, str] = {}

    class Link:
        def get(self, key: str) -> str | None:
            return values.get(key)

        def append(self, key: str, value: str) -> None:
            values[key] = values.get(key, "") + value
            if len(values[key]) < 400:  # another node appends right after this one, once
                values[key] += forger.entry(key, "forged") + sealer.entry(key, sealed_keys.entry_payload(9))

    assert sealed_keys.count_up(Link(), sealer, "budget", 0) == 1  # first, though two are in
    values["budget"] += values["budget"].split("\x1e")[1].join(["\x1e", "\x1e"])  # a copy
    assert sealed_keys.count(Link(), sealer, "budget") == 2
    assert sealed_keys.count_up(Link(), sealer, "budget", 1) == 3


def test_a_rounds_interruption_is_sealed_and_a_forged_or_replayed_one_is_passed_over(
    tmp_path, monkeypatch
):
    """With the job's secret, an interruption that does not unseal neither completes nor
    faults the round; the real one goes to the next generation, and reads as the round's."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    round_3, round_4 = rounds.round_store(base, 3), rounds.round_store(base, 4)
    round_3.set(rounds.INTERRUPTED, rounds.DONE)  # as a client without the secret
    assert rounds.interruption(round_3) is None and not rounds.completed(round_3)
    assert rounds.read_interruption(round_3, 1).value is None
    assert rounds.interrupt(round_3, "fault")  # the real fault, in generation 2
    assert rounds.interruption(round_3) == "fault" and not rounds.completed(round_3)
    assert rounds.read_interruption(round_3, 2).key == rounds.round_prefix(3) + "interrupted/g2"
    assert rounds.interrupt(round_3, rounds.DONE) and rounds.interruption(round_3) == "fault"  # a fault holds
    # the real value copied into the next round is no interruption there
    round_4.set(rounds.INTERRUPTED, base.get(rounds.round_prefix(3) + rounds.interrupted_key(2)))
    assert rounds.interruption(round_4) is None
    assert rounds.interrupt(round_4, rounds.DONE) and rounds.completed(round_4)
    # without a secret the interruption is a plain value at its first key, as before
    monkeypatch.delenv(jobenv.JOB_SECRET_FILE)
    plain = rounds.round_store(HashStore(), 0)
    assert rounds.interrupt(plain, "fault") and plain.get(rounds.INTERRUPTED) == b"fault"


def test_gone_ranks_are_sealed_and_a_forged_one_leaves_no_rank_out(tmp_path, monkeypatch):
    """With the job's secret, a rank is gone only by a sealed flag and list entry; a forged
    flag, entry or record of a generation's gone ranks leaves nobody out."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    rounds.mark_gone(base, [2, 3])
    base.set(rounds.rank_gone(5), "1")  # as a client without the secret
    base.append(rounds.GONE_LIST, "7,")
    assert rounds.is_gone(base, 2) and not rounds.is_gone(base, 5) and not rounds.is_gone(base, 7)
    assert rounds.all_gone(base) == {2, 3} and rounds.gone_in(base, 3) == {2}
    assert rounds.gone_in(base, 8) == {2, 3}
    rounds.arrive_for_gone(base, 0, 4)  # ranks 2 and 3, for whom nobody comes
    assert not rounds.arrive_generation(base, 0, 0, 4)
    assert rounds.arrive_generation(base, 0, 1, 4)  # opens generation 0, recording who is gone
    assert rounds.gone_at_start(base, 0) == {2, 3}
    base.set(f"{rounds.ROOT}g100/gone", "[0, 1]")  # a forged record of a generation's gone ranks
    assert rounds.gone_at_start(base, 100) == set()
    # without a secret: plain flags and an "r," list, as before
    monkeypatch.delenv(jobenv.JOB_SECRET_FILE)
    plain = HashStore()
    rounds.mark_gone(plain, [4])
    assert plain.get(rounds.GONE_LIST) == b"4," and rounds.is_gone(plain, 4)


def test_a_rounds_terminated_ranks_and_decision_are_sealed(tmp_path, monkeypatch):
    """With the job's secret, a forged terminated entry makes no healthy rank leave, a flag
    set ahead keeps no real end out, a replayed entry counts in no other round, and the
    decision of a round reads only as its last arrival sealed it."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    round_3, round_4 = rounds.round_store(base, 3), rounds.round_store(base, 4)
    round_3.append(rounds.TERMINATED, "0,")  # as a client without the secret
    round_3.add(rounds.terminated_flag(1), 1)  # ... which also sets rank 1's flag ahead
    assert rounds.register_terminated(round_3, 1)  # the real end is registered all the same
    assert not rounds.register_terminated(round_3, 1)  # and once
    checked = rounds.checked_terminated(round_3)
    assert checked.ranks == {1} and checked.forged == 1 and checked.forged_bytes == 2
    # the last arrival's decision leaves the forged rank 0 in and says what it skipped
    for rank in range(3):
        rounds.arrive_one(base, "iteration", round_3.iteration, rank, 3)
    decision = _decision(base, round_3, 3)
    assert decision["terminated"] == [1] and decision["forged_terminated"] == [1, 2]
    # the real entry and decision copied into the next round count for nothing there
    round_4.append(rounds.TERMINATED, base.get(rounds.round_prefix(3) + rounds.TERMINATED))
    assert rounds.terminated_ranks(round_4) == set()
    round_4.set(rounds.DECISION, base.get(rounds.round_prefix(3) + rounds.DECISION))
    with pytest.raises(rounds.ForgedDecision, match="no valid seal"):
        rounds.decision_of(round_4)
    # without a secret: a plain "r," list and plain JSON, as before
    monkeypatch.delenv(jobenv.JOB_SECRET_FILE)
    plain = rounds.round_store(HashStore(), 0)
    assert rounds.register_terminated(plain, 2) and plain.get(rounds.TERMINATED) == b"2,"
    rounds.arrive_one(plain.base_store, "iteration", 0, 0, 1)
    assert rounds.decision_of(plain)["terminated"] == [2]


def _decision(base, round_store, world_size: int) -> dict:
    """The decision of ``round_store``'s iteration barrier, once it released."""
    from nvrx.store import rounds

    rounds.wait_barrier(base, "iteration", round_store.iteration, world_size, 5.0)
    return rounds.decision_of(round_store)


class _WaitSpy:
    """A store that tells when someone waits on a key (to write a value only then)."""

    def __init__(self, store) -> None:
        import threading

        self.store, self.lock, self.events = store, threading.Lock(), {}

    def waited_on(self, key: str):
        import threading

        with self.lock:
            return self.events.setdefault(key, threading.Event())

    def wait(self, keys, *timeout):
        for key in keys:
            self.waited_on(key).set()
        return self.store.wait(keys, *timeout)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _later(event, action) -> threading.Thread:
    """Run ``action`` on a thread once ``event`` is set; the thread, to join."""

    def run() -> None:
        assert event.wait(30)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_replacements_join_request_admission_and_the_ranks_taken_back_are_sealed(
    tmp_path, monkeypatch
):
    """With the job's secret, a forged join request, or a sealed one copied back after its
    process was admitted, brings no rank back, and one written ahead of the real request
    does not end the survivor's wait for it; a forged admission written ahead of the real
    one is written past; a list of ranks taken back that does not unseal is acted on by
    nobody."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = _WaitSpy(HashStore())
    round_2, round_3 = rounds.round_store(base, 2), rounds.round_store(base, 2 + 1)
    for rank in range(3):  # initial rank = rank in round 2
        rounds._set_rank_state(round_2, rank, {"initial_rank": rank})
    next_round = rounds.Admission(generation=0, round=3, state={}, terminated=[], job_restarts=1)
    rounds.post_join(base, 1, 4242)  # the real replacement of rank 1
    base.set(rounds.join_request(2), "999")  # as a client without the secret, ahead of ...
    forged_admission = next_round.to_json()
    base.set(rounds.admission(2, 5252), forged_admission)  # ... the replacement of rank 2
    # which asks only once the survivor read the forged request and waits on
    _later(base.waited_on(rounds.join_request(2) + "/g2"), lambda: rounds.post_join(base, 2, 5252))
    admitted = rounds.admit(round_2, base, [1, 2], {1, 2}, 30.0, next_round)
    assert admitted.back == [1, 2]
    forged = {rounds.join_request(2): 3, rounds.admission(2, 5252): len(forged_admission)}
    assert admitted.refused == forged
    assert rounds.await_admission(base, 1, 4242, 1.0).terminated == []
    assert rounds.await_admission(base, 2, 5252, 1.0).state == {"initial_rank": 2}  # past the forged
    assert rounds.rejoined(round_2) == {1, 2} and rounds.await_rejoined(round_2, 1.0) == {1, 2}
    # the forged request and the requests read are taken out, not deleted (no hole)
    taken = [rounds.join_request(2), rounds.join_request(2) + "/g2", rounds.join_request(1)]
    assert [rounds._join_id(base, key, 0) for key in taken] == [(None, 0)] * 3
    # the admitted request copied back: its process was admitted already, nobody comes back
    base.set(rounds.join_request(1), rounds._sealed(rounds.join_request(1), "4242"))
    rounds._set_rank_state(round_3, 1, {"initial_rank": 1})
    replayed = rounds.admit(round_3, base, [1], {1}, 0.5, next_round)
    assert replayed.back == [] and list(replayed.refused) == [rounds.join_request(1)]
    # round 2's list copied into round 3 is refused
    round_3.set(rounds.REJOIN, base.get(rounds.round_prefix(2) + rounds.REJOIN))
    with pytest.raises(rounds.ForgedDecision, match="no valid seal"):
        rounds.rejoined(round_3)
    # without a secret: plain values, as before
    monkeypatch.delenv(jobenv.JOB_SECRET_FILE)
    plain = HashStore()
    plain_round = rounds.round_store(plain, 2)
    plain_round.set(rounds.rank_state(0), json.dumps({"initial_rank": 0}))
    assert rounds.read_rank_state(plain_round, 0) == {"initial_rank": 0}
    assert rounds.post_join(plain, 0, 5) == rounds.join_request(0)
    assert plain.get(rounds.join_request(0)) == b"5"
    assert rounds.admit(plain_round, plain, [0], {0}, 5.0, next_round).back == [0]
    assert json.loads(plain.get(rounds.admission(0, 5)))["round"] == 3
    assert plain.get(rounds.round_prefix(2) + rounds.REJOIN) == b"[0]"
    assert rounds.rejoined(plain_round) == {0}


def test_a_request_withdrawn_or_taken_leaves_no_hole_and_the_newest_request_wins(
    tmp_path, monkeypatch
):
    """With the job's secret a request is taken out by a sealed mark, not deleted: a
    request written after one that is withdrawn later is still read, and of a stale
    request (never withdrawn) and a newer one, the newer is admitted."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    next_round = rounds.Admission(generation=0, round=3, state={}, terminated=[], job_restarts=1)
    round_2, round_3 = rounds.round_store(base, 2), rounds.round_store(base, 3)
    for view in (round_2, round_3):
        rounds._set_rank_state(view, 0, {"initial_rank": 0})
    first = rounds.post_join(base, 0, 111)
    rounds.post_join(base, 0, 222)  # while the first still asks
    rounds.withdraw_join(base, first)  # which then gives up
    assert rounds.admit(round_2, base, [0], {0}, 5.0, next_round) == rounds.Admitted([0], {})
    assert rounds.await_admission(base, 0, 222, 1.0) is not None
    rounds.post_join(base, 0, 333)  # a replacement that dies without withdrawing
    rounds.post_join(base, 0, 444)
    assert rounds.admit(round_3, base, [0], {0}, 5.0, next_round).back == [0]
    assert rounds.await_admission(base, 0, 444, 1.0) is not None
    assert not base.check([rounds.admission(0, 333)])


def test_a_replacement_reads_its_admission_past_a_forged_one_written_ahead(tmp_path, monkeypatch):
    """A forged admission written ahead of the real one (anyone can read the join id in the
    request) neither makes the replacement give up nor act on it: it reads the survivor's,
    written past it; the survivor records the forged one."""
    from torch.distributed import HashStore

    from nvrx.inprocess import rejoin
    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = _WaitSpy(HashStore())
    rounds.publish_round(base, 2)
    round_2 = rounds.round_store(base, 2)
    rounds._set_rank_state(round_2, 1, {"initial_rank": 1})
    real = rounds.Admission(generation=0, round=3, state={}, terminated=[], job_restarts=1)
    forged = dataclasses.replace(real, job_restarts=1000)
    admitted = []
    monkeypatch.setattr(rounds, "new_join_id", lambda: 4242)  # what the forger read in the request

    def forger_then_survivor() -> None:
        base.set(rounds.admission(1, 4242), forged.to_json())
        admitted.append(rounds.admit(round_2, base, [1], {1}, 10.0, real))

    survivor_thread = _later(base.waited_on(rounds.admission(1, 4242)), forger_then_survivor)
    events = []
    got = rejoin.request_admission(
        base, 1, 30.0, lambda kind, **f: events.append((kind, f)), heartbeat_interval=5.0
    )
    assert got is not None and got.job_restarts == 1  # the real admission
    assert [kind for kind, _ in events] == ["restart_phase"]  # the replacement acted on none
    survivor_thread.join(30)  # its admit returns after the replacement read the admission
    [survivor] = admitted
    assert survivor.back == [1]
    assert survivor.refused == {rounds.admission(1, 4242): len(forged.to_json())}


def test_a_forged_decision_or_list_of_ranks_taken_back_tells_a_replacement_nothing(
    tmp_path, monkeypatch
):
    """A replacement that looks whether anyone can admit it acts on no forged value of the
    round before: it waits on (None), as where that round has not decided yet."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    rounds.publish_round(base, 3)
    round_2 = rounds.round_store(base, 2)
    forged = {"terminated": [0, 1], "job_restarts": 1, "world_size": 2}  # "every rank left"
    round_2.set(rounds.DECISION, json.dumps(forged))
    assert rounds.nobody_to_admit(base) is None
    round_2.set(rounds.DECISION, rounds._sealed(rounds.round_prefix(2) + rounds.DECISION, json.dumps(forged)))
    assert rounds.nobody_to_admit(base) == "every rank of round 2 left it"
    round_2.set(rounds.REJOIN, "[]")
    assert rounds.nobody_to_admit(base) is None


def test_a_forged_rank_state_has_no_healthy_rank_taken_out_nor_handed_to_a_replacement(
    tmp_path, monkeypatch
):
    """With the job's secret, a rank's state in a round counts only as its rank sealed it:
    a forged one that names a silent rank's initial rank has nobody else taken out, and a
    rank that died is not renumbered from a forged state."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    rounds.publish_round(base, 2)
    round_2 = rounds.round_store(base, 2)
    for rank in (0, 1):
        state = dict.fromkeys(rounds.RANK_STATE_FIELDS, None) | {
            "rank": rank, "world_size": 2, "initial_rank": rank, "initial_world_size": 2,
        }  # fmt: skip
        rounds.publish_rank_state(round_2, rank, SimpleNamespace(**state))
    assert rounds.read_rank_state(round_2, 1)["initial_rank"] == 1
    forged = {"rank": 1, "world_size": 2, "initial_rank": 0}  # "rank 1 runs initial rank 0"
    round_2.set(rounds.rank_state(1), json.dumps(forged))
    assert rounds.read_rank_state(round_2, 1) is None
    assert rounds.leave_silent(base, 0, 2, "no heartbeat")  # initial rank 0 is silent
    assert rounds.terminated_ranks(round_2) == {0}  # rank 0 only, never the healthy rank 1
    # the real state copied into another round is no state there
    round_3 = rounds.round_store(base, 3)
    round_3.set(rounds.rank_state(0), base.get(rounds.round_prefix(2) + rounds.rank_state(0)))
    assert rounds.read_rank_state(round_3, 0) is None
    assert rounds.carry_over_death(base, 2, 1, 2, 10.0, 0.05) is None  # not carried over
    # a lost node's rank whose state there does not unseal is not taken for the rank whose
    # number equals its initial rank: that number runs initial rank 1
    round_5 = rounds.round_store(base, 5)
    rounds.publish_round(base, 5)
    for rank, initial in ((0, 0), (2, 1)):
        state = dict.fromkeys(rounds.RANK_STATE_FIELDS, None) | {
            "rank": rank, "world_size": 3, "initial_rank": initial, "initial_world_size": 3,
        }  # fmt: skip
        rounds.publish_rank_state(round_5, rank, SimpleNamespace(**state))
    round_5.set(rounds.rank_state(1), json.dumps({"initial_rank": 2, "world_size": 3}))  # forged
    left = rounds.leave_round(base, [2], 3, "node lost", False)
    assert left["ranks"] == [] and rounds.terminated_ranks(round_5) == set()


def test_the_jobs_restart_count_counts_only_its_own_sealed_restarts(tmp_path, monkeypatch):
    """With the job's secret, a client that bumps the restart count, or copies a restart's
    entry again, spends none of ``max_iterations``: each restart counts once."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    assert rounds.job_restarts(base) == 0
    round_1 = rounds.round_store(base, 1)
    rounds.commit_round_start(round_1, base, 1)  # the first rank to start round 1
    rounds.commit_round_start(round_1, base, 1)  # ... and the next: counted once
    assert rounds.job_restarts(base) == 1
    with pytest.raises(ValueError):  # the store refuses to add to a list
        base.add(rounds.JOB_RESTARTS, 1000)  # as a client without the secret
    base.append(rounds.JOB_RESTARTS, b"\xff\xfe1000")  # not even UTF-8
    entry = base.get(rounds.JOB_RESTARTS)[: -len(b"\xff\xfe1000")]
    base.append(rounds.JOB_RESTARTS, entry)  # round 1's entry again
    assert rounds.job_restarts(base) == 1
    assert rounds.count_job_restart(base, "g100") == 2  # a process generation opened
    # the iteration barrier decides from the trusted count
    round_2 = rounds.round_store(base, 2)
    for rank in range(2):
        rounds.arrive_one(base, "iteration", round_2.iteration, rank, 2)
    decision = _decision(base, round_2, 2)
    assert decision["job_restarts"] == 3
    assert decision["forged_restarts"] == [1, 10]  # the forged bytes as read; the copy: once
    round_3 = rounds.round_store(base, 3)  # the forged entry was dropped: counted once
    for rank in range(2):
        rounds.arrive_one(base, "iteration", round_3.iteration, rank, 2)
    assert "forged_restarts" not in _decision(base, round_3, 2)
    assert rounds.job_restarts(base) == 2


def test_the_round_the_job_is_in_reads_only_its_own_sealed_rounds(tmp_path, monkeypatch):
    """With the job's secret, a forged low round (from which a new generation would number
    its rounds into the keys of an earlier one) or a value that is no number changes neither
    the round nor the next generation's first round; a round copied again counts once."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    _job_secret_file(tmp_path, monkeypatch)
    base = HashStore()
    assert rounds.current_round(base) is None and rounds.generation_base(base) == 0
    rounds.publish_round(base, 0)
    rounds.publish_round(base, 103)
    base.append(rounds.CURRENT_ROUND, "0")  # as a client without the secret
    base.append(rounds.CURRENT_ROUND, Sealer(SECRET, 0).entry(rounds.CURRENT_ROUND, "7"))  # copied back
    base.append(rounds.CURRENT_ROUND, Sealer(SECRET, 0).entry("nvrx/job_restarts", "900"))  # another key's
    base.append(rounds.CURRENT_ROUND, b"\xff not a round")
    assert rounds.current_round(base) == 103 and rounds.generation_base(base) == 200
    rounds.publish_round(base, 104)
    listed = Sealer(SECRET, 0).entries(rounds.CURRENT_ROUND, base.get(rounds.CURRENT_ROUND).decode(errors="replace"))
    assert listed.valid == ("104",) and listed.invalid == 0  # the list it read replaced
    base.append(rounds.CURRENT_ROUND, base.get(rounds.CURRENT_ROUND))  # copied again
    assert rounds.current_round(base) == 104
    # without a secret: a plain number, as before
    monkeypatch.delenv(jobenv.JOB_SECRET_FILE)
    plain = HashStore()
    rounds.publish_round(plain, 5)
    assert plain.get(rounds.CURRENT_ROUND) == b"5" and rounds.current_round(plain) == 5


@pytest.mark.timeout(120)
def test_a_stop_request_is_not_written_into_a_chain_whose_generations_are_all_filled_ahead():
    """docs/security.md, "What stays open": a client without the secret that fills a chain's
    1000 generations (``MAX_GENERATIONS``) ahead leaves nothing more written there: the
    supervisor's writer, through a real node agent and service, passes over each and
    gives up; no key past them is set, and a reader finds no request."""
    from nvrx.store import client
    from nvrx.store.sealed_keys import MAX_GENERATIONS
    from nvrx.store.service import StoreService
    from nvrx.supervisor.config import StopRequest
    from nvrx.supervisor.store_link import StoreLink

    assert MAX_GENERATIONS == 1000
    with StoreService("127.0.0.1", 0, node=None) as service:
        link = StoreLink("127.0.0.1", service.port, timeout=30).launch()
        forger = client.connect("127.0.0.1", service.port, timeout=30)  # no secret
        try:
            link.wait_ready()
            keys = [StopFlag.key(g) for g in range(1, MAX_GENERATIONS + 1)]
            for key in keys:
                forger.set(key, "forged")
            StopFlag(SECRET, 0).write(link, StopRequest("stop", 3, 1))
            assert not forger.check([StopFlag.key(MAX_GENERATIONS + 1)])  # nothing past them
            assert set(forger.multi_get(keys)) == {b"forged"}  # nor in them
            assert StopFlag(SECRET, 0).read(link, 1) is None
        finally:
            link.close()
            if hasattr(forger, "close"):
                forger.close()


def test_a_ranks_join_requests_past_max_generations_in_a_run_are_not_written_and_it_does_not_rejoin(
    tmp_path, monkeypatch, base, caplog
):
    """docs/security.md, "What stays open": each join request of a rank takes a generation of
    its chain for the run (a request withdrawn is marked taken, never deleted), so once
    ``MAX_GENERATIONS`` requests were written the next one is not (logged) and that
    replacement's rejoin fails at once. Real TCPStore; ``MAX_GENERATIONS`` (1000) set to 5,
    for the n-th request reads n generations."""
    from nvrx.inprocess import rejoin
    from nvrx.store import barrier, rounds, sealed_keys

    assert rounds.MAX_GENERATIONS == sealed_keys.MAX_GENERATIONS == 1000
    monkeypatch.setattr(rounds, "MAX_GENERATIONS", 5)
    _job_secret_file(tmp_path, monkeypatch)
    chain = [barrier.signal_key(rounds.join_request(0), g) for g in range(1, 7)]
    for pid, key in enumerate(chain[:5], start=100):  # replacements that asked and gave up
        assert rounds.post_join(base, 0, pid) == key
        rounds.withdraw_join(base, key)
    with caplog.at_level("ERROR", logger=rounds.__name__):
        assert rounds.post_join(base, 0, 105) is None
        assert "5 generations are taken" in caplog.text
        events = []
        asked = time.monotonic()
        got = rejoin.request_admission(
            base, 0, 30.0, lambda kind, **f: events.append(kind), heartbeat_interval=5.0
        )
        waited = time.monotonic() - asked
    assert got is None and events == [] and waited < 30.0  # not its whole rejoin wait
    assert not base.check([chain[5]]) and caplog.text.count("generations are taken") == 2
