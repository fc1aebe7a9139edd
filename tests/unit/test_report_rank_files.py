"""A failed process's own files as the report reads them: its error file, else the traceback
its interpreter printed to its ``stderr.log``, and the round cause that follows from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nvrx.report.model import ProcessRestart, RecordedError, RoundRow
from nvrx.report.rank_files import attach_rank_files, name_causes

DIRECTORY = "ranks/rank1/attempt0-slot0-p42-abc"
TRACEBACK = """\
Traceback (most recent call last):
  File "/job/train.py", line 30, in <module>
    main()
  File "/job/train.py", line 12, in step
    raise RuntimeError("loss is nan")
RuntimeError: loss is nan
"""


def _row(exit_code: int | None = 1, signal: str | None = None, **kw: object) -> ProcessRestart:
    fields: dict = dict(
        run=0, node=0, host="h", local_rank=1, rank=1, wall=105.0, exit_code=exit_code,
        signal=signal, runtime_s=5.0, decision="restart", reason=None, relaunch_s=None,
        rejoin_wait_s=None, files=[DIRECTORY],
    )  # fmt: skip
    fields.update(kw)
    return ProcessRestart(**fields)


def _lay_out(job_dir: Path, stderr: str) -> Path:
    directory = job_dir / DIRECTORY
    directory.mkdir(parents=True)
    (directory / "stderr.log").write_text(stderr)
    return directory


def test_without_an_error_file_the_last_traceback_of_stderr_is_the_cause(tmp_path: Path) -> None:
    noise = "".join(f"step {i} loss 0.5\n" for i in range(20000))  # more than the tail read
    _lay_out(tmp_path, noise + "warning: something\n" + TRACEBACK)
    row, notes = _row(), []
    attach_rank_files([row], tmp_path, notes)
    assert row.error is not None and row.error.source == "stderr"
    assert row.error.path == f"{DIRECTORY}/stderr.log" and row.files == [row.error.path]
    assert (row.error.exc_type, row.error.message) == ("RuntimeError", "loss is nan")
    assert row.error.signature == "RuntimeError at train.py:12 in step"
    assert (
        row.error.traceback is not None
        and 'raise RuntimeError("loss is nan")' in row.error.traceback
    )
    assert notes == []


#: docs/report.md: "the last traceback in the file's last 256 KiB is read".
TAIL_BYTES = 256 * 1024


@pytest.mark.parametrize(
    ("after", "read"),
    [
        (TAIL_BYTES - len(TRACEBACK) - 100, True),  # its first line 100 bytes inside the tail
        (TAIL_BYTES + 100, False),  # its last line 100 bytes before the tail
    ],
    ids=["inside", "before"],
)
def test_only_the_last_256_kib_of_stderr_are_searched(
    tmp_path: Path, after: int, read: bool
) -> None:
    """A traceback followed by ``after`` bytes of other lines, with more before it: read when
    it lies within the file's last 256 KiB, not when it ended before them."""
    line = "step 0000 loss 0.5\n"  # 19 bytes; no traceback in any run of these
    before = line * (2 * TAIL_BYTES // len(line))
    pad = after % len(line)
    rest = ("x" * (pad - 1) + "\n" if pad else "") + line * (after // len(line))
    text = before + TRACEBACK + rest
    assert len(rest) == after and len(text) > 2 * TAIL_BYTES
    _lay_out(tmp_path, text)
    row = _row()
    attach_rank_files([row], tmp_path, [])
    if read:
        assert row.error is not None and row.error.signature == "RuntimeError at train.py:12 in step"
    else:
        assert row.error is None


def test_the_error_file_wins_over_stderr(tmp_path: Path) -> None:
    directory = _lay_out(tmp_path, TRACEBACK)
    message = {"message": "ValueError: bad shard", "extraInfo": {"py_callstack": ""}}
    (directory / "error.json").write_text(json.dumps({"message": message}))
    row = _row(error=RecordedError(f"{DIRECTORY}/error.json", None, None, None, None))
    attach_rank_files([row], tmp_path, [])
    assert row.error is not None and row.error.source == "error_file"
    assert (row.error.exc_type, row.error.message) == ("ValueError", "bad shard")


def test_stderr_is_not_read_for_an_end_it_cannot_tell(tmp_path: Path) -> None:
    _lay_out(tmp_path, TRACEBACK)  # printed earlier, and the process lived on
    killed, peer, clean = _row(None, "SIGKILL"), _row(explained_by="peer"), _row(0)
    attach_rank_files([killed, peer, clean], tmp_path, [])
    assert (killed.error, peer.error, clean.error) == (None, None, None)


def test_stderr_without_a_traceback_tells_nothing(tmp_path: Path) -> None:
    _lay_out(tmp_path, 'step 1\nTraceback (most recent call last):\n  File "x.py", line 1\n')
    row = _row()
    attach_rank_files([row], tmp_path, [])
    assert row.error is None  # a traceback cut short is no cause


def _round(rnd: int, start: float, cause: str | None, rank: int | None) -> RoundRow:
    return RoundRow(
        run=0, round=rnd, start_wall=start, end_wall=None, outcome="restart", cause=cause,
        fault_kind="dead", first_rank=rank, first_node=0, first_host="h", ordering="job_restart",
        also_failed=[], peer_notified=1, hang_ranks=[], terminated_ranks=[], detection_s=None,
        phases={}, failed_phases=[], restart_latency_s=None,
    )  # fmt: skip


def test_a_rounds_exit_code_takes_the_exception_of_the_process_that_ended_in_it(
    tmp_path: Path,
) -> None:
    _lay_out(tmp_path, TRACEBACK)
    row = _row(wall=105.0)
    attach_rank_files([row], tmp_path, [])
    other = _row(wall=205.0, rank=0, files=[])  # rank 0 in round 1: nothing tells its cause
    timeline = [
        _round(0, 100.0, "exit code 1", 1),
        _round(1, 200.0, "exit code 1", 0),
        _round(2, 300.0, "exit code 1", 1),  # rank 1 again, but its told end was in round 0
    ]
    name_causes(timeline, [row, other])
    assert [(t.cause, t.fault_kind) for t in timeline] == [
        ("RuntimeError at train.py:12 in step", "exception"),
        ("exit code 1", "dead"),
        ("exit code 1", "dead"),
    ]
