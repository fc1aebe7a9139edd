"""What the monitor process makes of a rank's progress board (``monitor_main.hang_verdict``),
and the board's marks of the time between rounds (``ProgressBoard.between_rounds``,
``ProgressBoard.waiting``).

The whole path, with real ranks (a ``finalize`` that hangs is ended, a rank waiting at
the iteration barrier for a slow peer is not), is in
``tests/multiproc/test_wrapper_paths.py``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from nvrx.inprocess.monitor_main import hang_verdict
from nvrx.inprocess.progress_watchdog import (
    FLAG_BETWEEN,
    FLAG_TIMEOUTS_OFF,
    FLAG_USER,
    SEQUENCE,
    ProgressBoard,
)
from tests.support.waiting import wait_until

SOFT, HARD = 3.0, 5.0


def _info(flags: int, auto: float = 100.0, manual: float = 0.0, wait_until: float = 0.0):
    return {"flags": float(flags), "auto": auto, "manual": manual, "wait_until": wait_until}


def _verdict(info, stale: float, soft_fired: bool = False) -> str | None:
    """The verdict ``stale`` seconds after the board's last progress (its ``auto`` stamp)."""
    return hang_verdict(info, info["auto"] + stale, SOFT, HARD, soft_fired)


def test_in_user_code_the_soft_timeout_comes_first_then_the_hard_one():
    user = _info(FLAG_USER)
    assert _verdict(user, SOFT - 0.1) is None
    assert _verdict(user, SOFT + 0.1) == "soft"
    assert _verdict(user, HARD + 0.1) == "soft"  # never hard before soft
    assert _verdict(user, HARD - 0.1, soft_fired=True) is None
    assert _verdict(user, HARD + 0.1, soft_fired=True) == "hard"


def test_between_rounds_the_hard_timeout_applies_alone():
    between = _info(FLAG_BETWEEN)
    assert _verdict(between, HARD - 0.1) is None  # past the soft timeout: no fault of its own
    assert _verdict(between, HARD + 0.1) == "hard"


def test_a_wait_for_peers_is_no_hang_until_its_limit_and_the_hard_timeout_passed():
    barrier_s = 30.0
    waiting = _info(FLAG_BETWEEN, wait_until=100.0 + barrier_s)  # entered at the last progress
    assert _verdict(waiting, HARD + 0.1) is None
    assert _verdict(waiting, barrier_s + HARD - 0.1) is None
    assert _verdict(waiting, barrier_s + HARD + 0.1) == "hard"


def test_a_ping_counts_in_user_code_but_not_between_rounds():
    """In user code the board's last progress is the older of the two stamps once a ping
    came; between rounds the watchdog's stamp alone: a ping (from a user thread: the main
    thread runs no user code there) must not bring the hard timeout forward."""
    stale_ping = _info(FLAG_USER, auto=100.0, manual=90.0)
    assert hang_verdict(stale_ping, 90.0 + HARD + 0.1, SOFT, HARD, True) == "hard"
    between = _info(FLAG_BETWEEN, auto=100.0, manual=90.0)
    assert hang_verdict(between, 90.0 + HARD + 0.1, SOFT, HARD, False) is None
    assert hang_verdict(between, 100.0 + HARD + 0.1, SOFT, HARD, False) == "hard"


@pytest.mark.parametrize("flags", [0, FLAG_USER | FLAG_TIMEOUTS_OFF, FLAG_BETWEEN | FLAG_TIMEOUTS_OFF])
def test_nothing_is_a_hang_outside_the_watched_phases_or_with_hang_protection_off(flags):
    assert _verdict(_info(flags), 1e6, soft_fired=True) is None


@pytest.fixture
def board():
    board = ProgressBoard()
    yield board
    board.close()


def test_the_board_marks_the_time_between_rounds_and_its_waits(board):
    board.stamp_manual(1.0)  # a ping of the round before
    before = time.monotonic()
    with board.between_rounds():
        info = board.read()
        assert int(info["flags"]) == FLAG_BETWEEN
        assert info["auto"] >= before and info["manual"] == 0.0  # progress counts from here
        assert info["wait_until"] == 0.0
        with board.waiting(30.0):
            assert board.read()["wait_until"] >= before + 30.0
        after = board.read()
        assert after["wait_until"] == 0.0 and after["auto"] >= info["auto"]  # stamped as it ended
    assert int(board.read()["flags"]) == 0


def test_the_marks_go_when_their_block_raises(board):
    with pytest.raises(RuntimeError), board.between_rounds(), board.waiting(30.0):
        raise RuntimeError("the barrier timed out")
    info = board.read()
    assert int(info["flags"]) == 0 and info["wait_until"] == 0.0


# A rank's main thread, hammering the board: waits that end (their progress stamped as they
# end) with a stale stamp inside (a wait blocked in C makes no progress), fresh stamps in
# between. Generation 1: started; 2: done.
_HAMMER = """
import sys
from nvrx.inprocess.progress_watchdog import FLAG_BETWEEN, ProgressBoard
board = ProgressBoard(sys.argv[1])
board.set_flag(FLAG_BETWEEN, True)
board.set_generation(1)
for _ in range(int(sys.argv[2])):
    with board.waiting(1e6):
        board.stamp_auto(1.0)
    for _ in range(20):
        board.stamp_auto()
board.set_generation(2)
board.close()
"""


def test_a_read_racing_the_writer_sees_no_zero_stamp_nor_the_end_of_a_wait_without_its_stamp(
    board,
):
    """The monitor reads while the main thread writes: a field half written (``pack_into``
    zero-fills it first: ``auto`` read as 0.0) or a wait's end seen without the progress
    stamped as it ended (``auto`` from inside the wait) would end a healthy rank at once
    between rounds."""
    board.stamp_auto()
    writer = subprocess.Popen([sys.executable, "-c", _HAMMER, board.path, "30000"])
    try:
        wait_until("the writer started", lambda: board.generation() >= 1, 30, 0.01)
        reads, bad = 0, []
        while board.generation() == 1 and writer.poll() is None:
            info = board.read()
            reads += 1
            if info["auto"] == 0.0 or (info["wait_until"] == 0.0 and info["auto"] == 1.0):
                bad.append({k: info[k] for k in ("auto", "wait_until")})
        assert writer.wait(30) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert reads > 1000  # the writer ran while read
    assert not bad, f"{len(bad)} of {reads} reads torn, first: {bad[:3]}"


def test_threads_setting_flags_at_once_lose_none_of_the_changes(board):
    """The main thread clears ``FLAG_BETWEEN`` while a user thread enters
    ``disable_hang_protection()``: with an unlocked read-modify-write of the flags, a
    thread switch between the read and the write (here: forced) lost one of the changes."""
    board.set_flag(FLAG_BETWEEN, True)
    read_flags = board._flags
    other = threading.Thread(target=board.set_flag, args=(FLAG_TIMEOUTS_OFF, True))

    def switch_after_the_read() -> int:
        flags = read_flags()
        if not other.is_alive() and other.ident is None:
            other.start()
            other.join(0.5)  # the other thread's change, if nothing holds it back
        return flags

    board._flags = switch_after_the_read  # type: ignore[method-assign]
    board.set_flag(FLAG_BETWEEN, False)
    other.join()
    assert int(board.read()["flags"]) == FLAG_TIMEOUTS_OFF


@pytest.mark.timeout(30)
def test_a_board_left_in_the_middle_of_a_change_is_still_read(board) -> None:
    """A rank that died inside a change leaves the sequence odd for good: its monitor still
    reads the board (and ends the round for it), it does not wait for a change to end."""
    board.stamp_auto(123.0)
    board._q[SEQUENCE] = 1
    assert board.read()["auto"] == 123.0
