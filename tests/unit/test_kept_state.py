"""KeptState: a rank's training state committed into host memory and restored from it."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, OrderedDict, defaultdict

import pytest
import torch

from nvrx.inprocess import state_handover
from nvrx.inprocess.kept_state import KeptState, RngState
from nvrx.inprocess.state_plan import Held
from nvrx.inprocess.state_tree import fresh, tensors


def _job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()


def _snapshot(model, optimizer, scheduler) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer.state_dict()["state"].items()
        },
        "lr": [g["lr"] for g in optimizer.param_groups],
        "scheduler": scheduler.state_dict(),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for i in a["optimizer"]:
        for key, value in a["optimizer"][i].items():
            other = b["optimizer"][i][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (i, key)
    assert a["lr"] == b["lr"] and a["scheduler"] == b["scheduler"]


def _kept(model, optimizer, scheduler, every: int = 1) -> KeptState:
    kept = KeptState(every=every)
    kept.register("model", model)
    kept.register("optimizer", optimizer)
    kept.register("scheduler", scheduler)
    return kept


def test_restore_brings_back_the_last_commit_bit_for_bit():
    job = _job()
    kept = _kept(*job)
    assert kept.restore() is None and kept.step is None  # nothing kept yet
    _train(*job, steps=3)
    assert kept.commit(3)
    at_3 = _snapshot(*job)
    _train(*job, steps=2)
    assert not torch.equal(job[0][0].weight, at_3["model"]["0.weight"])
    assert kept.restore() == 3
    _assert_same(_snapshot(*job), at_3)


def test_training_on_after_a_restore_matches_training_that_never_faulted():
    faulted, clean = _job(seed=1), _job(seed=1)
    kept = _kept(*faulted)
    kept.register("rng", RngState())
    torch.manual_seed(7)
    _train(*faulted, steps=2)
    kept.commit(2)
    _train(*faulted, steps=1)  # the step the fault interrupts: lost
    kept.restore()
    _train(*faulted, steps=3)
    torch.manual_seed(7)
    _train(*clean, steps=5)
    _assert_same(_snapshot(*faulted), _snapshot(*clean))


class _FailsOnce:
    """A state that raises in its second ``state_dict``: a fault during a commit."""

    def __init__(self) -> None:
        self.calls = 0
        self.value = 0

    def state_dict(self) -> dict:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("fault during the commit")
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_a_fault_during_a_commit_leaves_the_previous_commit_whole():
    job = _job()
    kept = KeptState()
    kept.register("model", job[0])
    kept.register("counter", counter := _FailsOnce())  # copied after the model
    _train(*job, steps=1)
    kept.commit(1)
    at_1 = _snapshot(*job)
    _train(*job, steps=1)
    counter.value = 2
    with pytest.raises(RuntimeError, match="fault during the commit"):
        kept.commit(2)  # the model was copied into the other slot, then the fault
    assert kept.step == 1 and kept.steps() == [1]
    assert kept.restore() == 1
    for key, value in at_1["model"].items():
        assert torch.equal(job[0].state_dict()[key], value)
    assert counter.value == 0
    counter.value = 3
    assert kept.commit(3) and kept.restore() == 3 and counter.value == 3  # committing works on


def test_commits_reuse_their_buffers_and_restored_state_does_not_share_them():
    job = _job()
    kept = _kept(*job)
    size = sum(p.numel() * p.element_size() for p in job[0].parameters())
    _train(*job, steps=1)
    kept.commit(1)
    kept.commit(2)
    slot_buffers = {t.data_ptr() for slot in kept._slots for t in tensors(slot.states)}
    assert kept.memory_bytes() >= 2 * size * 3  # parameters, Adam's two moments, in two slots
    _train(*job, steps=1)
    kept.commit(3)
    kept.commit(4)
    assert {t.data_ptr() for slot in kept._slots for t in tensors(slot.states)} == slot_buffers
    kept.restore()
    live = {t.data_ptr() for t in tensors(job[1].state_dict()["state"])}
    live |= {p.data_ptr() for p in job[0].parameters()}
    assert not live & slot_buffers  # a later commit never writes into the live state


def test_every_k_steps_commits_only_multiples_of_k():
    job = _job()
    kept = _kept(*job, every=3)
    assert [kept.commit(step) for step in range(1, 7)] == [False, False, True, False, False, True]
    assert kept.step == 6


def test_rng_state_restores_the_same_random_numbers():
    kept = KeptState()
    kept.register("rng", RngState())
    kept.commit(0)
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(3)
    kept.restore()
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def test_bad_use_is_refused_with_what_to_fix():
    kept = KeptState()
    with pytest.raises(RuntimeError, match=r"nothing is registered; call register\(name, obj\) first"):
        kept.commit(1)
    with pytest.raises(TypeError, match=r"register\('step'\): int has no state_dict or load_state_dict"):
        kept.register("step", 5)
    kept.register("model", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'model' is registered already \(replace=True to rebind it\)"):
        kept.register("model", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="`every` must be an int ≥ 1, got 0"):
        KeptState(every=0)
    with pytest.raises(ValueError, match="step must be an int ≥ 0, got -1"):
        kept.commit(-1)


def test_the_commit_before_the_last_can_be_restored_and_then_is_the_last():
    """The step every rank holds may be a rank's previous commit (it had committed one more
    when the fault came): both complete commits can be restored. Restoring the older one
    drops the newer (the job abandoned that course), so the next commit cannot overwrite
    what was restored, and a later restore of the same step number loads the new commit."""
    job = _job()
    kept = _kept(*job)
    _train(*job, steps=1)
    kept.commit(1)
    at_1 = _snapshot(*job)
    _train(*job, steps=1)
    kept.commit(2)
    assert kept.steps() == [2, 1]
    assert kept.restore(1) == 1
    _assert_same(_snapshot(*job), at_1)
    assert kept.steps() == [1] and kept.step == 1
    _train(*job, steps=1)
    kept.commit(2)  # step 2 again, on the course taken after the restore
    new_2 = _snapshot(*job)
    assert kept.steps() == [2, 1]
    _train(*job, steps=1)
    assert kept.restore(2) == 2
    _assert_same(_snapshot(*job), new_2)
    with pytest.raises(ValueError, match=r"step 7 is not kept; the steps kept are \[2, 1\]"):
        kept.restore(7)


def test_state_dict_metadata_and_namedtuples_come_back_as_they_were():
    import collections

    Pair = collections.namedtuple("Pair", "a b")

    class Holder:
        def __init__(self) -> None:
            self.state = None

        def state_dict(self):
            return {"pair": Pair(torch.ones(2), 3), "items": [torch.zeros(1), (1, "x")]}

        def load_state_dict(self, state) -> None:
            self.state = state

    model = torch.nn.Linear(2, 2)
    holder = Holder()
    kept = KeptState()
    kept.register("model", model)
    kept.register("holder", holder)
    kept.commit(0)
    assert kept._slots[1].states["model"]._metadata == model.state_dict()._metadata
    kept.restore()
    assert isinstance(holder.state["pair"], Pair) and holder.state["pair"].b == 3
    assert torch.equal(holder.state["pair"].a, torch.ones(2)) and holder.state["items"][1] == (1, "x")


def test_an_object_registered_after_the_commit_is_named_at_restore():
    kept = KeptState()
    kept.register("model", torch.nn.Linear(2, 2))
    kept.commit(0)
    kept.register("optimizer", torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"step 0 holds no state of \['optimizer'\], registered after"):
        kept.restore()


class _Loader:
    """A data position whose state holds a value its sampler keeps (a lock it guards itself
    with, the generator of its order)."""

    def __init__(self, held: object) -> None:
        self.at, self.held = 3, held

    def state_dict(self) -> dict:
        return {"at": self.at, "sampler": {"order": [torch.arange(2), self.held]}}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


@pytest.mark.parametrize(
    ("held", "kind"),
    [(threading.Lock(), r"_thread\.lock"), ((i for i in range(2)), r"builtins\.generator")],
    ids=["lock", "generator"],
)
def test_a_state_that_cannot_be_copied_is_refused_naming_its_object_and_place(held, kind):
    kept = KeptState()
    kept.register("model", torch.nn.Linear(2, 2))
    kept.commit(1)
    kept.register("data", _Loader(held))
    with pytest.raises(TypeError, match=rf"'data'.* at \['sampler'\]\['order'\]\[1\] \(a {kind}\)"):
        kept.commit(2)
    assert kept.steps() == [1]  # the commit before stands


def test_a_step_below_the_last_commits_is_refused_until_the_commits_are_forgotten():
    """The agreement and ``steps()`` take the higher step for the newer: a per-epoch counter
    that went back to 0 would have made a restart load epoch 0's last step over the new one."""
    model = torch.nn.Linear(2, 2)
    kept = KeptState()
    kept.register("model", model)
    kept.commit(9)
    kept.commit(9)  # the same step again is no step back
    with pytest.raises(ValueError, match="step 0 is below the last commit's, 9.*call forget"):
        kept.commit(0)
    assert kept.steps() == [9, 9]
    kept.forget()
    assert kept.commit(0) and kept.steps() == [0]


def test_a_commit_that_copies_everything_writes_out_no_place():
    # a value's place in the state is for the error only: no commit pays for writing it out
    written = []

    class Key(str):
        def __repr__(self) -> str:
            written.append(str(self))
            return super().__repr__()

    kept = KeptState()
    kept.register("data", _Loader({Key("step"): 1, Key("order"): [torch.arange(2), {Key("seed"): 7}]}))
    kept.commit(1)
    kept.commit(2)
    assert written == []
    assert kept.steps() == [2, 1]


def test_a_per_rank_state_registered_after_the_commit_stays_as_it_is():
    # as a rank that receives the step keeps its own per-rank states: no rank raises alone
    kept = KeptState()
    kept.register("model", torch.nn.Linear(2, 2))
    kept.commit(0)
    rng = RngState()
    kept.register("rng", rng, per_rank=True)
    before = torch.get_rng_state()
    assert kept.restore() == 0
    assert torch.equal(torch.get_rng_state(), before)


def test_a_model_built_anew_in_a_round_takes_the_state_kept_under_its_name():
    job = _job(seed=3)
    kept = _kept(*job)
    _train(*job, steps=2)
    kept.commit(2)
    at_2 = _snapshot(*job)
    rebuilt = _job(seed=4)  # the next round builds its model, optimizer and scheduler again
    for name, obj in zip(("model", "optimizer", "scheduler"), rebuilt, strict=True):
        kept.register(name, obj, replace=True)
    assert kept.restore() == 2
    _assert_same(_snapshot(*rebuilt), at_2)


def test_a_step_committed_twice_restores_its_newer_copy():
    class Value:
        def __init__(self) -> None:
            self.v = 0

        def state_dict(self) -> dict:
            return {"v": torch.tensor(self.v)}

        def load_state_dict(self, state: dict) -> None:
            self.v = int(state["v"])

    value, kept = Value(), KeptState()
    kept.register("value", value)
    for v in (1, 2, 3):  # step 5 committed again after a restore that replayed it
        value.v = v
        kept.commit(5)
    value.v = 0
    assert kept.restore(5) == 5 and value.v == 3


class _Holder:
    """Gives the state it was built with and keeps the state it is given."""

    def __init__(self, state=None) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def _containers() -> dict:
    return {
        "seen": Counter({"b": 1, "a": 3}),
        "by": defaultdict(list, {"z": [torch.ones(1)], "y": []}),
        "order": OrderedDict([("2", torch.zeros(2)), ("1", 1)]),
        "plain": {"k": 2, "j": torch.ones(1)},
    }


def _assert_alike(got: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert type(got[key]) is type(value) and list(got[key]) == list(value), (key, got[key])
    assert got["seen"] == expected["seen"] and got["by"].default_factory is list
    assert torch.equal(got["by"]["z"][0], torch.ones(1)) and got["by"]["y"] == []
    assert torch.equal(got["order"]["2"], torch.zeros(2)) and got["order"]["1"] == 1
    assert got["plain"]["k"] == 2 and torch.equal(got["plain"]["j"], torch.ones(1))


def test_counters_defaultdicts_and_ordered_dicts_come_back_of_their_type_in_their_order():
    _assert_alike(fresh(_containers()), _containers())
    holder, kept = _Holder(_containers()), KeptState()
    kept.register("holder", holder)
    kept.commit(0)
    holder.state = None
    kept.restore()
    _assert_alike(holder.state, _containers())
    assert holder.state["by"]["new"] == []  # the default factory still makes missing values


class _Named(dict):
    """A dict whose constructor takes a name, not pairs."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class _ReadOnly(dict):
    def __setitem__(self, key, value) -> None:
        raise TypeError("read-only")


def test_a_dict_subclass_comes_back_of_its_type_or_is_refused_by_name():
    named = _Named("layer")
    named["w"] = torch.ones(1)
    got = fresh({"named": named})["named"]
    assert type(got) is _Named and got.name == "layer" and torch.equal(got["w"], torch.ones(1))
    kept = KeptState()
    kept.register("holder", _Holder({"frozen": _ReadOnly(a=torch.ones(1))}))
    with pytest.raises(TypeError, match=r"cannot rebuild a [\w.]*\._ReadOnly of the kept state"):
        kept.commit(0)
    assert kept.steps() == []


def _restore_agreed(monkeypatch, kept: KeptState, everyone: list, me: int, received=None, **kwargs):
    """``kept.restore_agreed`` as rank ``me`` of a group whose other ranks bring the ``Held``
    of ``everyone`` (this rank's own stands at ``me``); a receive gets ``received``."""
    import torch.distributed as dist

    def gather(out: list, held: Held, group=None) -> None:
        out[:] = [held if rank == me else other for rank, other in enumerate(everyone)]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(everyone))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: me)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(state_handover, "recv_state", lambda source, group=None: received)
    monkeypatch.setattr(state_handover, "send_state", lambda state, receivers, group=None: None)
    return kept.restore_agreed(**kwargs)


def test_a_rank_that_received_the_step_holds_it_for_the_next_fault(monkeypatch):
    # 2 replicas x 2 shards: rank 3 (replaced) receives shard 1 from rank 1, then rank 1 dies
    # before the next commit: rank 3 is the only holder of shard 1 left, and serves it
    groups = [[0, 2], [1, 3]]

    def held(steps=(), shard=None) -> Held:
        names, given = ("model", "rng (per rank)"), ((0, 2), (1, 3))
        return Held(tuple(steps), 7.0 if steps else 0.0, shard, names, given)

    model, peer = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    kept = KeptState()
    kept.register("model", model)
    kept.register("rng", RngState(), per_rank=True)
    everyone = [held((5,), 0), held((5,), 1), held((5,), 0), None]
    received = {"model": peer.state_dict()}
    step = _restore_agreed(monkeypatch, kept, everyone, 3, received, replica_groups=groups)
    assert step == 5 and kept.steps() == [5]
    mine = kept._held(groups)
    assert (mine.steps, mine.course, mine.shard) == ((5,), 7.0, 1)
    with torch.no_grad():
        model.weight.add_(1.0)  # trained on, not committed, when the second fault comes
    everyone = [held((5,), 0), held(), held((5,), 0), None]
    events = []
    sink = type("Sink", (), {"emit": lambda self, kind, **fields: events.append(fields)})()
    assert _restore_agreed(monkeypatch, kept, everyone, 3, replica_groups=groups, events=sink) == 5
    assert events[0]["source"] == "memory"
    assert torch.equal(model.weight, peer.weight) and torch.equal(model.bias, peer.bias)


class _DeviceCopy:
    """Stands for the CUDA event a device copy ends with: it runs until ``done``."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True  # the stream ran on (after an abort, over what it computed then)


@pytest.mark.parametrize("finished_first", [False, True], ids=["copy-running", "copy-finished"])
def test_a_device_copy_not_finished_when_a_fault_came_is_no_commit(monkeypatch, finished_first):
    """On a GPU a commit's copy is queued behind the step's collectives: one still running at
    the fault would copy what ran after an aborted collective. It is dropped, the commit
    before it stands; a copy that had finished is the commit."""
    from nvrx.inprocess import kept_state, state_tree

    copies: list[_DeviceCopy] = []

    def finish(self) -> _DeviceCopy:
        copies.append(_DeviceCopy())
        return copies[-1]

    model = torch.nn.Linear(2, 2)
    kept = KeptState()
    kept.register("model", model)
    kept.commit(1)  # on the CPU: complete at once
    monkeypatch.setattr(state_tree.Copier, "finish", finish)
    kept.commit(2)
    copies[-1].done = finished_first
    fault = time.monotonic()
    kept_state.interrupted(fault)  # the monitor thread, before the abort
    copies[-1].done = True  # the aborted collective let the stream run on
    kept_state.interrupted(fault)  # and after it
    assert kept.steps() == ([2, 1] if finished_first else [1])
    kept.commit(3)  # the slot is reused, and this copy is no interrupted one
    copies[-1].done = True
    assert kept.steps()[0] == 3


def test_a_device_copy_queued_after_the_fault_is_no_commit_and_a_cpu_commit_is(monkeypatch):
    """The main thread may queue a step's commit while the abort runs: behind the aborted
    collectives, it is dropped even once finished, and the commit before it stands; a commit
    without a device copy (gloo on the CPU: a collective that failed raised) is whole."""
    from nvrx.inprocess import kept_state, state_tree

    kept = KeptState()
    kept.register("model", torch.nn.Linear(2, 2))
    kept.commit(1)
    fault = time.monotonic()
    kept_state.interrupted(fault)  # before the abort: nothing pending
    kept.commit(2)  # on the CPU, while the abort runs
    kept_state.interrupted(fault)
    assert kept.steps() == [2, 1]
    copy = _DeviceCopy()
    monkeypatch.setattr(state_tree.Copier, "finish", lambda self: copy)
    fault = time.monotonic()
    kept_state.interrupted(fault)
    kept.commit(3)  # a device copy queued while the abort runs
    copy.done = True
    assert kept.steps() == [3, 2]  # it finished before the abort ended
    kept_state.interrupted(fault)  # the pass after the abort
    assert kept.steps() == [2]


def test_two_device_copies_queued_after_the_fault_are_both_no_commit(monkeypatch):
    """Two commits queued while the abort runs, the first made the last complete one by the
    second (and the second by a look at ``step``): the pass after the abort drops both, so
    no step is offered that a restore would not load."""
    from nvrx.inprocess import kept_state, state_tree

    model = torch.nn.Linear(2, 2)
    kept = KeptState()
    kept.register("model", model)
    kept.commit(1)
    monkeypatch.setattr(state_tree.Copier, "finish", lambda self: _DeviceCopy())
    fault = time.monotonic()
    kept_state.interrupted(fault)  # before the abort: nothing pending
    for step in (2, 3):  # each finishes at the next look; the second reuses step 1's slot
        kept.commit(step)
        kept._slots[kept._pending].copied.done = True
    assert kept.step == 3 and kept.steps() == [3, 2]
    kept_state.interrupted(fault)  # the pass after the abort: both were queued after the fault
    assert kept.steps() == [] and kept.step is None
    with torch.no_grad():
        model.weight.fill_(99.0)
    assert kept.restore() is None and float(model.weight[0, 0].detach()) == 99.0


def test_a_load_stopped_by_a_restart_leaves_what_was_received_under_its_new_shard(monkeypatch):
    """A survivor renumbered into another replica group receives that group's shard; a
    restart that stops it while it loads what it received leaves its commit labelled with the
    shard it holds, so the next agreement never serves it as the shard it held before."""

    class Stopped(torch.nn.Linear):
        armed = True

        def load_state_dict(self, state, *args, **kwargs):
            loaded = super().load_state_dict(state, *args, **kwargs)
            if Stopped.armed:
                raise RuntimeError("a peer's fault: restart")  # as the monitor thread raises it
            return loaded

    groups = ((0, 1), (2, 3))

    def held(steps=(), shard=None) -> Held:
        return Held(tuple(steps), 7.0, shard, ("model",), groups)

    model = Stopped(2, 2)
    kept = KeptState()
    kept.register("model", model)
    kept.commit(5)
    kept._course, kept._shard = 7.0, 0  # it committed shard 0; now rank 2, of group 1
    shard_1 = {"model": {"weight": torch.full((2, 2), 1.0), "bias": torch.zeros(2)}}
    everyone = [held((5,), 0), held((5,), 0), None, held((5,), 1)]
    with pytest.raises(RuntimeError, match="restart"):
        _restore_agreed(monkeypatch, kept, everyone, 2, shard_1, replica_groups=groups)
    mine = kept._held(groups)
    assert (mine.steps, mine.course, mine.shard) == ((5,), 7.0, 1)
    assert float(kept._shared(5)["model"]["weight"][0, 0]) == 1.0  # shard 1's, as labelled


def test_a_restore_stopped_by_a_restart_leaves_no_abandoned_commit_under_the_new_course(monkeypatch):
    """A holder of step 6 restores step 5, the one every shard holds: the agreement begins a
    new course, and a restart that stops the load leaves step 6 out of it."""

    class Stopped(torch.nn.Linear):
        def load_state_dict(self, state, *args, **kwargs):
            super().load_state_dict(state, *args, **kwargs)
            raise RuntimeError("a peer's fault: restart")  # as the monitor thread raises it

    groups = ((0,), (1,))
    kept = KeptState()
    kept.register("model", Stopped(2, 2))
    kept.commit(5)
    kept.commit(6)
    kept._course, kept._shard = 7.0, 0
    everyone = [None, Held((5, 4), 7.0, 1, ("model",), groups)]
    with pytest.raises(RuntimeError, match="restart"):
        _restore_agreed(monkeypatch, kept, everyone, 0, replica_groups=groups)
    mine = kept._held(groups)
    assert (mine.steps, mine.shard) == ((5,), 0) and mine.course > 7.0


@pytest.mark.parametrize("told", ["while-receiving", "after-the-write"])
def test_a_hand_over_received_across_a_fault_is_no_commit(monkeypatch, told):
    """NCCL's receive returns once the abort lets its kernel end, over a buffer it may have
    filled in part: the monitor thread tells the fault (``interrupted``) while the rank
    receives, or only after it wrote what it received. Either way that is no commit the
    next round could restore or hand on; the rank is a receiver again."""
    import torch.distributed as dist

    from nvrx.inprocess import kept_state, state_plan

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        kept = KeptState()
        kept.register("model", model)
        sent = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        seen: list[float] = []

        def receive_across_a_fault(source, group=None):
            seen.append(time.monotonic())  # the monitor thread saw the fault now
            if told == "while-receiving":
                kept_state.interrupted(seen[0])
            return sent

        monkeypatch.setattr(state_handover, "recv_state", receive_across_a_fault)
        plan = state_plan.HandOver(step=5, course=1.0, sources={0: 1})
        assert kept._follow(plan, None, 0) == (5, "peer")
        if told == "after-the-write":
            kept_state.interrupted(seen[0])
        assert kept.steps() == []
        kept_state.interrupted(time.monotonic())  # a later fault spoils no later commit
        kept.commit(6)
        assert kept.steps() == [6]
    finally:
        dist.destroy_process_group()


def test_a_step_committed_twice_tells_when_the_copy_restored_was_made(monkeypatch):
    """Both slots hold step 9: ``state_restored``'s committed_wall is the newer copy's, the
    one a restore loads."""
    from nvrx.inprocess import kept_state

    walls = iter([100.0, 200.0, 300.0])
    monkeypatch.setattr(kept_state.time, "time", lambda: next(walls))
    kept = KeptState()
    kept.register("model", torch.nn.Linear(2, 2))
    for _ in range(3):  # into either slot in turn: the last copy is in either
        kept.commit(9)
    monkeypatch.undo()
    assert kept._wall_of(9) == 300.0 and kept._wall_of(8) is None


@pytest.mark.parametrize(
    "odd",
    [lambda: torch.eye(3).to_sparse(), lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
     lambda: torch.empty(2, dtype=torch.int4), lambda: torch.empty(2, device="meta")],
    ids=["sparse", "nested", "int4", "meta"],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_tensor_no_buffer_takes_is_refused_naming_its_object_and_place(odd):
    """A sparse, nested, sub-byte or meta tensor has no dense copy: refused like any value
    the commit cannot copy, by name and place, not with copy_'s bare error."""

    class Sparse:
        def state_dict(self) -> dict:
            return {"w": odd()}

        def load_state_dict(self, state: dict) -> None:
            pass

    kept = KeptState()
    kept.register("sparse", Sparse())
    with pytest.raises(TypeError, match=r"'sparse'.* at \['w'\] \(a torch\.Tensor\) cannot be copied"):
        kept.commit(1)
    assert kept.steps() == []


@pytest.mark.parametrize("fault", [False, True], ids=["whole", "fault-while-receiving"])
def test_a_hand_over_whose_per_rank_state_copies_on_the_device(monkeypatch, fault):
    """The receiver's own per-rank state holds a CUDA tensor (a stand-in for its copy's
    event here): the hand-over's commit is pending until that copy ends. It becomes the
    commit then, unless a fault was told while the rank received."""
    import torch.distributed as dist

    from nvrx.inprocess import kept_state, state_plan, state_tree

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        kept = KeptState()
        kept.register("model", model)
        kept.register("position", _Position(), per_rank=True)
        sent = {"model": {k: v.clone() for k, v in model.state_dict().items()}}

        def receive(source, group=None):
            if fault:
                kept_state.interrupted(time.monotonic())
            return sent

        monkeypatch.setattr(state_handover, "recv_state", receive)
        monkeypatch.setattr(state_tree.Copier, "finish", lambda self: _DeviceCopy())
        plan = state_plan.HandOver(step=5, course=1.0, sources={0: 1})
        assert kept._follow(plan, None, 0) == (5, "peer")
        assert kept.steps() == ([] if fault else [5])  # the copy waited for: it ran on whole
    finally:
        dist.destroy_process_group()


class _Position:
    """A per-rank state: where this rank's data stands."""

    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict:
        return {"at": torch.tensor(self.at)}

    def load_state_dict(self, state: dict) -> None:
        self.at = int(state["at"])
