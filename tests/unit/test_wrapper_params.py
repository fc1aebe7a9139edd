"""Wrapper parameters: defaults, validation messages, enabled=False, StoreMixin MRO."""

from __future__ import annotations

import datetime
import math
import sys

import pytest

from nvrx.inprocess import Wrapper
from nvrx.inprocess import store as rstore
from nvrx.inprocess.abort import Abort, AbortTorchDistributed, AbortTransformerEngine
from nvrx.inprocess.compose import Compose
from nvrx.inprocess.state import State


def test_defaults_match_the_reference():
    w = Wrapper()
    assert w.store_factory is rstore.TCPStore
    seconds = {
        "soft_timeout": 60, "hard_timeout": 90, "heartbeat_timeout": 30, "barrier_timeout": 120,
        "completion_timeout": 120, "last_call_wait": 1, "termination_grace_time": 5,
        "monitor_thread_interval": 1, "monitor_process_interval": 1, "heartbeat_interval": 1,
        "progress_watchdog_interval": 1, "rejoin_timeout": 60,
    }  # fmt: skip
    for name, value in seconds.items():  # timedeltas, as the reference's: code calls total_seconds()
        assert getattr(w, name) == datetime.timedelta(seconds=value), name
        assert getattr(w.seconds, name) == value, name
    assert w.enabled is True
    assert isinstance(w.abort, AbortTorchDistributed)
    assert isinstance(w.rank_assignment, Compose)


def test_default_plugins_are_not_shared_between_wrappers():
    a, b = Wrapper(), Wrapper()
    assert a.abort is not b.abort
    assert a.rank_assignment is not b.rank_assignment


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"soft_timeout": 10, "hard_timeout": 5},
            "soft_timeout (10 s) must be < hard_timeout (5 s)",
        ),
        ({"hard_timeout": 200}, "hard_timeout (200 s) must be < barrier_timeout (120 s)"),
        (
            {"heartbeat_interval": 40},
            "heartbeat_interval (40 s) must be < heartbeat_timeout (30 s)",
        ),
        (
            {"monitor_thread_interval": 0},
            "Wrapper: monitor_thread_interval must be a finite number of seconds > 0, got 0",
        ),
        (
            {"progress_watchdog_interval": 61},
            "progress_watchdog_interval (61 s) must be < soft_timeout (60 s)",
        ),
        (
            {"last_call_wait": -1},
            "Wrapper: last_call_wait must be a finite number of seconds >= 0, got -1",
        ),
        (
            {"store_kwargs": {"tcp_store_host_rank": -2}},
            "store_kwargs['tcp_store_host_rank'] must be a rank (>= 0), or -1 for an external "
            "store, got -2",
        ),
        (
            {"monitor_process_logfile": "relative/{rank}.log"},
            "monitor_process_logfile must be an absolute path",
        ),
    ],
)
def test_bad_values_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError) as info:
        Wrapper(**kwargs)
    assert message in str(info.value)


#: Every timing of the Wrapper, and whether it must be > 0 (else >= 0).
TIMINGS = {
    "monitor_thread_interval": True,
    "monitor_process_interval": True,
    "heartbeat_interval": True,
    "progress_watchdog_interval": True,
    "soft_timeout": True,
    "hard_timeout": True,
    "heartbeat_timeout": True,
    "barrier_timeout": True,
    "completion_timeout": True,
    "last_call_wait": False,
    "termination_grace_time": False,
    "rejoin_timeout": False,
}


def test_timings_are_every_timing_parameter():
    import inspect

    names = [n for n in inspect.signature(Wrapper).parameters if n.endswith(("_timeout", "_interval", "_wait", "_time"))]
    assert sorted(names) == sorted(TIMINGS)


def _bad_timings():
    for name, positive in TIMINGS.items():
        bound = "> 0" if positive else ">= 0"
        refused = f"Wrapper: {name} must be a finite number of seconds {bound}, got "
        too_long = f"Wrapper: {name} must be at most 315360000 seconds (10 years), got "
        cases = [
            ("nan", math.nan, refused + "nan"),
            ("inf", math.inf, refused + "inf"),
            ("-inf", -math.inf, refused + "-inf"),
            ("-1", -1, refused + "-1"),
            ("timedelta-2s", datetime.timedelta(seconds=-2), refused + "-2"),
            ("1e12", 1e12, too_long + "1e+12"),
            ("timedelta.max", datetime.timedelta.max, too_long + "8.64e+13"),
            ("int-beyond-float", 10**400, refused + "inf"),
        ]
        if positive:
            cases += [
                ("0", 0, refused + "0"),
                ("0.0", 0.0, refused + "0"),
                ("timedelta0", datetime.timedelta(0), refused + "0"),
            ]
        for label, value, message in cases:
            yield pytest.param(name, value, message, id=f"{name}-{label}")


@pytest.mark.parametrize(("name", "value", "message"), list(_bad_timings()))
def test_a_timing_that_is_not_a_finite_duration_in_range_is_refused(name, value, message):
    """Refused at construction, before any rank starts: a NaN, an infinity, a negative,
    0 where the timing must be > 0, or more than ten years (which overflowed Python's
    clocks at run time, inside a barrier or the monitor process)."""
    with pytest.raises(ValueError) as info:
        Wrapper(**{name: value})
    assert str(info.value) == message


def test_timings_that_may_be_zero_and_the_longest_ones_are_taken():
    w = Wrapper(last_call_wait=0, termination_grace_time=0, rejoin_timeout=datetime.timedelta(0))
    assert (w.seconds.last_call_wait, w.seconds.termination_grace_time, w.seconds.rejoin_timeout) == (0, 0, 0)
    longest = 10 * 365 * 24 * 3600.0  # ten years, the longest taken
    w = Wrapper(
        soft_timeout=longest - 2, hard_timeout=longest - 1, barrier_timeout=longest,
        heartbeat_timeout=longest - 1, completion_timeout=longest, last_call_wait=longest,
        termination_grace_time=longest, rejoin_timeout=datetime.timedelta(days=3650),
    )  # fmt: skip
    assert w.seconds.barrier_timeout == w.seconds.completion_timeout == longest
    assert w.seconds.rejoin_timeout == longest


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"soft_timeout": "60"}, "soft_timeout must be a datetime.timedelta or seconds, got '60'"),
        (
            {"initialize": lambda s: s},
            "initialize must be an instance of nvrx.inprocess.initialize.Initialize",
        ),
        (
            {"store_factory": dict},
            "store_factory must be a subclass of nvrx.inprocess.store.StoreMixin",
        ),
        ({"enabled": 1}, "enabled must be a bool, got 1"),
        (
            {"store_kwargs": {"tcp_store_host_rank": "0"}},
            "store_kwargs['tcp_store_host_rank'] must be an int (the rank whose monitor process "
            "hosts the store, or -1 for an external store), got '0'",
        ),
        ({"store_kwargs": {"tcp_store_host_rank": True}}, "must be an int (the rank whose"),
        ({"rank_assignment": None}, "rank_assignment must be an instance of"),
    ],
)
def test_bad_types_name_the_parameter(kwargs, message):
    with pytest.raises(TypeError) as info:
        Wrapper(**kwargs)
    assert message in str(info.value)


def test_tcp_store_host_rank_none_is_the_store_class_default_and_any_integer_a_rank():
    class HostOnTwo(rstore.TCPStore):
        TCP_STORE_HOST_RANK = 2

    def host_rank(value, factory=rstore.TCPStore):
        wrapper = Wrapper(store_factory=factory, store_kwargs={"tcp_store_host_rank": value})
        return wrapper.store_kwargs["tcp_store_host_rank"]

    assert host_rank(None) == 0 and host_rank(None, HostOnTwo) == 2
    numpy = pytest.importorskip("numpy")
    assert type(host_rank(numpy.int64(1))) is int and host_rank(numpy.int64(1)) == 1
    # a store class other than TCPStore: the key is its own business
    assert Wrapper(store_factory=rstore.FileStore, store_kwargs={"tcp_store_host_rank": "x"})


def test_timedelta_and_seconds_are_equivalent():
    w = Wrapper(soft_timeout=datetime.timedelta(seconds=2.5), hard_timeout=4)
    assert (w.seconds.soft_timeout, w.seconds.hard_timeout) == (2.5, 4.0)
    assert w.hard_timeout == datetime.timedelta(seconds=4)


def test_a_timing_set_on_the_wrapper_is_checked_and_read_by_its_calls():
    w = Wrapper()
    w.barrier_timeout = datetime.timedelta(seconds=30)
    w.soft_timeout = 20
    assert (w.seconds.barrier_timeout, w.soft_timeout) == (30.0, datetime.timedelta(seconds=20))
    with pytest.raises(ValueError, match="Wrapper: barrier_timeout must be a finite number of seconds > 0"):
        w.barrier_timeout = -1
    assert w.seconds.barrier_timeout == 30.0


def test_disabled_wrapper_returns_the_function_itself():
    def fn(x):
        return x + 1

    assert Wrapper(enabled=False)(fn) is fn


def test_store_mixin_barrier_is_not_shadowed_by_torch():
    assert rstore.TCPStore.barrier is rstore.StoreMixin.barrier
    assert rstore.PrefixStore.barrier is rstore.StoreMixin.barrier
    assert rstore.FileStore.barrier is rstore.StoreMixin.barrier


def test_store_port_never_defaults_to_master_port(monkeypatch):
    monkeypatch.delenv("NVRX_STORE_HOST", raising=False)
    monkeypatch.delenv("NVRX_STORE_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rstore.resolve_address() == ("127.0.0.1", 29501)
    monkeypatch.setenv("NVRX_STORE_HOST", "storehost")
    monkeypatch.setenv("NVRX_STORE_PORT", "4000")
    assert rstore.resolve_address() == ("storehost", 4000)
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.delenv("NVRX_STORE_HOST")
    monkeypatch.delenv("NVRX_STORE_PORT")
    with pytest.raises(ValueError, match="store port unknown"):
        rstore.resolve_address()


def test_under_a_supervisor_its_store_wins_over_store_kwargs_said_once(monkeypatch, caplog):
    """A script in NVRx's layout names its own port in ``store_kwargs``; the supervisor's
    store is the one every rank shares, so the Wrapper takes it and says so once."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("NVRX_STORE_HOST", raising=False)
    monkeypatch.delenv("NVRX_STORE_PORT", raising=False)
    kwargs = {"port": 29502, "timeout": 5}
    assert rstore.wrapper_address(kwargs) == ("127.0.0.1", 29502)  # standalone: as given
    assert kwargs == {"timeout": 5}
    monkeypatch.setenv("NVRX_STORE_HOST", "storehost")
    monkeypatch.setenv("NVRX_STORE_PORT", "29503")
    caplog.set_level("INFO", logger=rstore.log.name)
    for _ in range(2):
        kwargs = {"host_name": "apphost", "port": 29502}
        assert rstore.wrapper_address(kwargs) == ("storehost", 29503)
        assert kwargs == {}
    said = [r for r in caplog.records if r.name == rstore.log.name and r.levelname == "INFO"]
    assert len(said) == 1
    assert "apphost" in said[0].getMessage() and "storehost:29503" in said[0].getMessage()


def test_file_store_mixin_barrier_works(tmp_path):
    store = rstore.FileStore(str(tmp_path / "fs"), 1)
    store.barrier([0], "g", 1, datetime.timedelta(seconds=5))
    store.reentrant_barrier([0, 0], "g", 1, 5.0)
    store.record_terminated_ranks([3, 3, 1])
    assert store.get_terminated_ranks() == {1, 3}
    store.send_state({"a": 1}, 0)
    assert store.get_states([0]) == [{"a": 1}]
    store.send_key(["k", 2], 1)
    store.send_key("other", 0)
    assert store.get_keys([1, 0]) == [["k", 2], "other"] and store.get_keys([]) == []


def test_abort_transformer_engine_without_te_returns_the_state_it_was_given(monkeypatch):
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed, even where it is
    frozen = State(rank=0, world_size=1).freeze()
    step = AbortTransformerEngine()
    assert isinstance(step, Abort) and step(frozen) is frozen
    assert Compose(AbortTransformerEngine(), AbortTorchDistributed())(frozen) is frozen


def test_a_store_factory_of_the_main_script_is_refused_naming_it():
    """The monitor process, a fresh interpreter, unpickles the factory: one defined in the
    script run as ``__main__`` is not there (it failed to start, "monitor process exited")."""
    main_store = type("MainStore", (rstore.FileStore,), {"__module__": "__main__"})
    with pytest.raises(TypeError, match="store_factory MainStore is defined in the script run as __main__"):
        Wrapper(store_factory=main_store)
    main_tcp = type("MainTCP", (rstore.TCPStore,), {"__module__": "__main__"})
    assert Wrapper(store_factory=main_tcp).store_factory is main_tcp  # reached by its address
