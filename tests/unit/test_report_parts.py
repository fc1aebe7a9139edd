"""Pieces of nvrx.report: failure signatures of events, traceback parsing, host-list compression."""

from __future__ import annotations

import random

import pytest

from nvrx.events.failures import fault_signature, kind_of, parse_traceback, process_end_signature
from nvrx.report.compact import compress_ints, exclude_list
from nvrx.report.parts import RoundState
from nvrx.report.round_windows import RoundWindows

CHAINED = (
    "Traceback (most recent call last):\n"
    '  File "/home/u/a.py", line 3, in f\n'
    "    g()\n"
    "KeyError: 'x'\n"
    "\n"
    "During handling of the above exception, another exception occurred:\n"
    "\n"
    "Traceback (most recent call last):\n"
    '  File "/home/u/train.py", line 9, in loop\n'
    "    step()\n"
    '  File "/usr/lib/python3.11/site-packages/torch/distributed/c10d.py", line 100, in all_reduce\n'
    "    work.wait()\n"
    "torch.distributed.DistBackendError: NCCL error: unhandled system error\n"
)


def test_parse_traceback_takes_last_exception_and_innermost_user_frame() -> None:
    parsed = parse_traceback(CHAINED)
    assert parsed is not None
    assert parsed.exc_type == "torch.distributed.DistBackendError"
    assert parsed.message == "NCCL error: unhandled system error"
    assert (parsed.file, parsed.line, parsed.func) == ("/home/u/train.py", 9, "loop")
    assert parsed.signature() == "torch.distributed.DistBackendError at train.py:9 in loop"


def test_parse_traceback_without_user_frames_and_bare_type() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/site-packages/x.py", line 1, in h\n'
        "    raise KeyboardInterrupt\n"
        "KeyboardInterrupt\n"
    )
    parsed = parse_traceback(text)
    assert parsed is not None and parsed.exc_type == "KeyboardInterrupt" and parsed.func == "h"
    assert parse_traceback("no traceback here") is None
    assert parse_traceback("Traceback (most recent call last):\n") is None


def test_fault_signature_prefers_the_events_own_signature() -> None:
    assert fault_signature("mine", "exception", "ValueError", "m", CHAINED) == "mine"
    assert (
        fault_signature(None, "exception", "RuntimeError", "m", CHAINED)
        == "RuntimeError at train.py:9 in loop"
    )
    assert fault_signature(None, "exception", "OSError", "disk", None) == "OSError"
    assert fault_signature(None, "hang_hard", None, None, None) == "hang (hard timeout)"
    assert fault_signature(None, "signal", None, "SIGTERM", None) == "signal SIGTERM"
    assert fault_signature(None, None, None, None, None) == "fault"


@pytest.mark.parametrize(
    ("sig", "cat"),
    [
        ("signal SIGKILL", "signal"),
        ("exit code 3", "exit"),
        ("hang (soft timeout)", "hang"),
        ("ValueError", "exception"),
    ],
)
def test_kind_of(sig: str, cat: str) -> None:
    assert kind_of(sig) == cat


def test_process_end_signature() -> None:
    assert process_end_signature(None, "SIGSEGV") == "signal SIGSEGV"
    assert process_end_signature(2, None) == "exit code 2"


def test_compress_ints_and_exclude_list() -> None:
    assert compress_ints([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert compress_ints([]) == ""
    # SLURM's list syntax for --exclude=, names SLURM cannot take in a list as they are
    assert exclude_list(["n3", "n1", "n2", "n5", "n1"]) == "n[1-3,5]"
    assert exclude_list(["node-b", "node-a"]) == "node-a,node-b"
    assert exclude_list(["gpu02", "gpu01", "gpu03"]) == "gpu[01-03]"
    assert exclude_list(["bad,name", "x1"]) == "bad,name,x1"


def _rounds(first_walls: dict[tuple[int, int], float | None]) -> dict[tuple[int, int], RoundState]:
    return {key: RoundState(first_wall=wall) for key, wall in first_walls.items()}


def test_round_windows_run_from_a_rounds_first_event_to_the_next_rounds() -> None:
    """Round 1's first wall (5) is before round 0's (10): round 0's window is empty, and a
    time is placed by bisection in the one window that holds it, of its own run only."""
    rounds = _rounds({(0, 0): 10.0, (0, 1): 5.0, (0, 2): 20.0, (0, 3): None, (1, 0): 0.0})
    w = RoundWindows(rounds)
    assert w.window(0, 0) == (10.0, 5.0)
    assert w.window(0, 1) == (5.0, 20.0)
    assert w.window(0, 2) == (20.0, float("inf"))
    assert w.window(0, 3) is None and w.window(2, 0) is None
    assert [w.round_at(0, t) for t in (4.9, 5.0, 12.0, 19.9, 20.0, 1e9)] == [None, 1, 1, 1, 2, 2]
    assert (w.round_at(1, 3.0), w.round_at(2, 3.0), w.round_at(0, None)) == (0, None, None)


def test_round_at_is_the_round_whose_window_holds_the_time() -> None:
    """Each window is [first wall, least first wall of the later rounds), as the timeline
    always placed deaths; ``round_at`` finds the one that holds a time."""
    rng = random.Random(7)
    for _ in range(200):
        rounds = _rounds(
            {(0, rnd): rng.choice([None, float(rng.randrange(20))]) for rnd in range(rng.randrange(8))}
        )
        w = RoundWindows(rounds)
        for (_, rnd), r in rounds.items():
            later = [x.first_wall for (_, n), x in rounds.items() if n > rnd and x.first_wall is not None]
            spec = None if r.first_wall is None else (r.first_wall, min(later, default=float("inf")))
            assert w.window(0, rnd) == spec
        for t in (x / 2 for x in range(-2, 44)):
            holding = [
                rnd
                for (_, rnd) in rounds
                if (win := w.window(0, rnd)) is not None and win[0] <= t < win[1]
            ]
            assert len(holding) <= 1
            assert w.round_at(0, t) == (holding[0] if holding else None)
