"""The failure vocabulary (nvrx.events.failures): one signature per failure, for every reader."""

from __future__ import annotations

import traceback

import pytest

from nvrx.events import failures as f


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
        f.NODE_LOST_SIGNATURE: f.NODE,
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
        "node lost",
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
        record = f.from_exception(0, exc)
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
    assert f.is_exception_line("fault_injection.InjectedFault: injected")
    assert f.is_exception_line("KeyboardInterrupt")  # builtin exceptions by name
    assert f.is_exception_line("StopIteration")
    assert f.is_exception_line("SystemExit: 3")
    assert not f.is_exception_line("Epoch: 3 loss 0.5")  # an identifier is not an exception
    assert not f.is_exception_line("step: 10")
    assert not f.is_exception_line("Errors: 0")
    assert not f.is_exception_line("ValueError:x")
    assert not f.is_exception_line("[rank0]:[W1122 14:47:02.029 ProcessGroupGloo.cpp:2417] x")
    assert not f.is_exception_line("[demo] rank 1 starts")
    assert not f.is_exception_line(
        "During handling of the above exception, another exception occurred:"
    )


def test_a_traceback_ends_at_its_exception_line_not_at_a_log_line() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 3, in f\n'
        "Epoch: 3 loss 0.5\n"  # another process's line, in the middle
        "ValueError: boom\n"
    )
    parsed = f.parse_traceback(text)
    assert parsed is not None and parsed.signature() == "ValueError at train.py:3 in f"
    # a type its writer recorded ends it even when it does not look like one
    odd = text.replace("ValueError: boom", "pkg.E: boom")
    assert f.parse_traceback(odd) is None
    assert f.told_signature(None, "pkg.E", odd) == "pkg.E at train.py:3 in f"


@pytest.mark.parametrize(
    ("text", "value"),
    [("12", 12), (" -3 ", -3), ("0", 0), ("999999999", 999999999), ("1234567890", None),
     ("\u00b2", None), ("\u0663", None), ("", None), ("-", None), ("1_0", None), ("9" * 5000, None),
     ("+1", None), ("1.0", None)],
)  # fmt: skip
def test_numbers_in_text_are_short_ascii_decimals(text: str, value: int | None) -> None:
    assert f.parse_int(text) == value


def test_odd_numbers_in_signatures_and_tracebacks_do_not_raise() -> None:
    assert f.normalize_signature("exit:\u00b2") == "exit code unknown"
    assert f.normalize_signature("exit:" + "9" * 5000) == "exit code unknown"
    assert f.normalize_signature("Err@f.py:\u00b2") == "Err at f.py in \u00b2"
    tb = (
        'Traceback (most recent call last):\n  File "t.py", line '
        + "9" * 5000
        + ", in f\nValueError: x\n"
    )
    assert f.told_signature(None, None, tb) == "ValueError"  # the frame's line is not believed
    assert (
        f.fault_signature("Err@f.py:" + "9" * 5000, "exception") == "Err at f.py in " + "9" * 5000
    )


def test_a_signal_fault_that_does_not_name_its_signal_is_still_a_signal() -> None:
    assert f.fault_signature(None, "signal") == "signal unknown"
    assert f.fault_signature(None, "signal", message="killed by the OOM killer") == "signal unknown"
    assert f.fault_signature(None, "signal", message="SIGKILL\n") == "signal unknown"
    assert f.kind_of(f.fault_signature(None, "signal")) == f.SIGNAL
