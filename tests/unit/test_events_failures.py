"""The failure vocabulary (nvrx.events.failures): one signature per failure, for every reader."""

from __future__ import annotations

import ast
import traceback
from pathlib import Path

import pytest

from nvrx.events import failures as f
from nvrx.store import faults


def _raise_in_user_code() -> None:
    {}["missing"]


def test_each_kind_has_its_own_signature_and_comes_back_from_it() -> None:
    made = {
        f.exception_signature("builtins.ValueError", "/home/u/train.py", 12, "step"): f.EXCEPTION,
        f.exception_signature("pkg.Error"): f.EXCEPTION,
        f.hang_signature("soft"): f.HANG,
        f.DEAD_SIGNATURE: f.DEAD,
        f.UNRESPONSIVE_SIGNATURE: f.UNRESPONSIVE,
        f.signal_signature("SIGKILL"): f.SIGNAL,
        f.exit_signature(1): f.EXIT,
        f.PEER_SIGNATURE: f.PEER,
        f.slurm_signature("time limit"): f.SLURM,
    }
    assert list(made) == [
        "ValueError at train.py:12 in step",
        "pkg.Error",
        "hang (soft timeout)",
        "dead process",
        "unresponsive (no heartbeat)",
        "signal SIGKILL",
        "exit code 1",
        "peer fault",
        "slurm: time limit",
    ]
    for signature, kind in made.items():
        assert f.kind_of(signature) == kind, signature
        assert f.is_canonical(signature), signature
    assert set(made.values()) == set(f.FAILURE_KINDS)
    assert f.process_end_signature(None, "SIGSEGV") == "signal SIGSEGV"
    assert f.process_end_signature(3, None) == "exit code 3"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("signal:SIGKILL", "signal SIGKILL"),  # restart policy
        ("exit:1", "exit code 1"),
        ("hang_soft", "hang (soft timeout)"),  # monitor
        ("hang_hard", "hang (hard timeout)"),
        ("dead", "dead process"),
        ("unresponsive", "unresponsive (no heartbeat)"),
        ("builtins.KeyError@test_store.py:boom", "KeyError at test_store.py in boom"),  # store
        ("fault_injection.InjectedFault@train_demo.py:94", "fault_injection.InjectedFault at train_demo.py:94"),
        ("ValueError at train.py:12 in step", "ValueError at train.py:12 in step"),
    ],
)  # fmt: skip
def test_old_spellings_read_as_the_vocabulary(old: str, new: str) -> None:
    assert f.normalize_signature(old) == new
    assert f.is_canonical(old) == (old == new)


def test_a_live_exception_and_its_printed_traceback_have_one_signature() -> None:
    try:
        _raise_in_user_code()
    except KeyError as exc:
        live = f.exception_signature_of(exc)
        printed = f.parse_traceback("".join(traceback.format_exception(exc)))
        record = faults.from_exception(0, exc)
    assert printed is not None and live == printed.signature()
    assert live.startswith("KeyError at test_events_failures.py:") and live.endswith(
        " in _raise_in_user_code"
    )
    assert (record.signature, record.exc_type) == (live, "builtins.KeyError")
    assert f.told_signature(None, record.exc_type, record.traceback) == live


def test_a_fault_tells_its_signature_in_order_of_trust() -> None:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 9, in loop\n'
        "    step()\n"
        "RuntimeError: nccl\n"
    )
    assert (
        f.told_signature("KeyError at a.py:1 in f", "RuntimeError", tb) == "KeyError at a.py:1 in f"
    )
    assert (
        f.told_signature("RuntimeError@train.py:loop", None, tb)
        == "RuntimeError at train.py:9 in loop"
    )
    assert f.told_signature("signal:SIGTERM", None, None) == "signal SIGTERM"
    assert f.told_signature(None, "builtins.OSError", None) == "OSError"
    assert f.told_signature(None, None, "not a traceback") is None
    assert f.fault_signature(None, "hang_soft") == "hang (soft timeout)"
    assert (
        f.fault_signature(
            "hang_soft", "hang_soft", traceback="Thread 0x1 (most recent call first):"
        )
        == "hang (soft timeout)"
    )
    assert f.fault_signature(None, "dead", message="process exited") == "dead process"
    assert f.fault_signature(None, "signal", message="SIGTERM") == "signal SIGTERM"
    assert f.signature_type("pkg.E at x.py:1 in g") == "pkg.E"
    assert f.signature_type("signal SIGKILL") is None
    assert f.type_name("__main__.Oops") == "Oops"  # fmt: skip


def test_a_log_line_is_not_an_exception_line() -> None:
    assert f.is_exception_line("ValueError: bad")
    assert f.is_exception_line("torch.distributed.DistBackendError")
    assert not f.is_exception_line("[rank0]:[W1122 14:47:02.029 ProcessGroupGloo.cpp:2417] x")
    assert not f.is_exception_line("[demo] rank 1 starts")
    assert not f.is_exception_line(
        "During handling of the above exception, another exception occurred:"
    )


def test_the_vocabulary_is_ground_layer() -> None:
    source = Path(f.__file__).read_text()
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not [name for name in imported if name.split(".")[0] == "nvrx"], imported
