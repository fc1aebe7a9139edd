"""torchrun's output options (``--redirects``, ``--tee``, ``--local-ranks-filter``) and the
error file of ``@record``, as the supervisor routes them and the report reads them back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx.report.model import ProcessRestart, RecordedError
from nvrx.report.rank_files import attach_rank_files, read_error_file
from nvrx.supervisor.cli import config_from_args
from nvrx.supervisor.config import ConfigError
from nvrx.supervisor.rank_logs import (
    RankLogs,
    Route,
    Std,
    error_file,
    parse_ranks_filter,
    parse_std,
    prepare_dir,
    supervisor_token,
)

CMD = ["--", sys.executable, "train.py"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Std.NONE),
        ("3", Std.ALL),
        ("0:1,1:2", {0: Std.OUT, 1: Std.ERR}),
        (" 2:3 ", {2: Std.ALL}),
    ],
)
def test_stream_specs_read_as_torchrun_reads_them(text: str, expected: object) -> None:
    assert parse_std(text, "--tee") == expected


@pytest.mark.parametrize("text", ["4", "x", "0:4", "0:", ":1", "1;2", "", "12"])
def test_a_bad_stream_spec_names_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--redirects must be 0-3"):
        parse_std(text, "--redirects")


def test_the_console_filter_is_a_list_of_local_ranks() -> None:
    assert parse_ranks_filter("") is None
    assert parse_ranks_filter("0, 2") == {0, 2}
    with pytest.raises(ValueError, match="--local-ranks-filter must be a comma-separated"):
        parse_ranks_filter("0,a")


def test_routes_follow_torchrun() -> None:
    logs = RankLogs(redirects={0: Std.ERR}, tee={1: Std.ALL}, console_ranks=frozenset({0}))
    # rank 0: stderr redirected (file only), stdout on the console (it is in the filter)
    assert logs.routes(0) == (Route.CONSOLE, Route.FILE)
    # rank 1: tee'd but filtered out of the console: its files only
    assert logs.routes(1) == (Route.FILE, Route.FILE)
    # rank 2: nothing redirected and filtered out: nowhere
    assert logs.routes(2) == (Route.NULL, Route.NULL)
    assert RankLogs(tee=Std.OUT).routes(3) == (Route.TEE, Route.CONSOLE)
    assert RankLogs().routes(0) == (Route.CONSOLE, Route.CONSOLE)


def test_the_line_prefix_is_torchruns_or_the_template_given() -> None:
    assert RankLogs().prefix(1, 5) == b"[default1]:"
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "${role_name}-${rank}|"}
    assert RankLogs.from_options("0", "3", "", env).prefix(1, 5) == b"default-5|"
    # as torchrun (safe_substitute): what it does not know stays as written
    odd = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "$HOSTNAME ${rank} 5$ "}
    assert RankLogs.from_options("0", "3", "", odd).prefix(0, 2) == b"$HOSTNAME 2 5$ "


def test_the_cli_takes_the_options_their_aliases_and_torchruns_variables() -> None:
    config, _ = config_from_args(["-r", "3", "--tee=0:1", "--local_ranks_filter", "0", *CMD], {})
    assert config.rank_logs == RankLogs(Std.ALL, {0: Std.OUT}, frozenset({0}))
    env = {"PET_REDIRECTS": "2", "PET_TEE": "1", "PET_LOCAL_RANKS_FILTER": "1"}
    config, _ = config_from_args(CMD, env)
    assert config.rank_logs == RankLogs(Std.ERR, Std.OUT, frozenset({1}))
    config, _ = config_from_args(["--redirects", "0", *CMD], env)  # the option wins
    assert config.rank_logs.redirects == Std.NONE
    with pytest.raises(ConfigError, match="--tee must be 0-3.*got '9'$"):
        config_from_args(["--tee", "9", *CMD], {})
    with pytest.raises(ConfigError, match=r"got '9' \(values from \$PET_TEE\)"):
        config_from_args(CMD, {"PET_TEE": "9"})
    with pytest.raises(ConfigError, match="got 'x'$"):  # given on the command line: not $PET_
        config_from_args(["-r", "x", *CMD], {"PET_REDIRECTS": "x"})


def test_each_start_gets_its_own_directory_and_an_unused_one_goes(tmp_path: Path) -> None:
    first = prepare_dir(tmp_path, 3, 0, 1)
    assert first is not None and first.is_dir()
    assert first.parent == tmp_path / "ranks" / "rank3"
    assert first.name.startswith(f"attempt0-slot1-p{os.getpid()}-")
    kept = prepare_dir(tmp_path, 2, 0, 1)
    assert error_file(first, tmp_path) is None and not first.exists()
    assert not first.parent.exists() and (tmp_path / "ranks").is_dir()  # rank 2's still there
    assert error_file(kept, tmp_path) is None and not (tmp_path / "ranks").exists()
    again = prepare_dir(tmp_path, 3, 1, 1)
    assert again is not None
    (again / "error.json").write_text("{}")
    assert error_file(again, tmp_path) == f"ranks/rank3/{again.name}/error.json"
    # another supervisor process (a requeued run, maybe with the same pid) names its own
    other = subprocess.run(
        [sys.executable, "-c", "from nvrx.supervisor.rank_logs import supervisor_token as t; print(t())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert other != supervisor_token() and other.startswith("p")
    (tmp_path / "blocked").write_text("a file where a directory should go")
    assert prepare_dir(tmp_path / "blocked", 0, 0, 0) is None


def _record(path: Path, exc: BaseException) -> None:
    """What torch's ``@record`` writes for ``exc`` (its own error handler)."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        try:
            raise exc
        except BaseException as caught:
            ErrorHandler().record_exception(caught)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]


def test_the_report_reads_what_torch_record_writes(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    _record(path, KeyError("missing"))
    error = read_error_file(path, "e.json")
    assert error.exc_type == "KeyError" and error.message == "'missing'"
    assert error.signature is not None and error.signature.startswith("KeyError at test_rank_logs.py:")
    assert error.traceback is not None and "raise exc" in error.traceback


def test_an_old_style_or_damaged_error_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "RuntimeError: out of cheese"}))
    error = read_error_file(path, "e")
    assert (error.exc_type, error.message, error.signature) == ("RuntimeError", "out of cheese", "RuntimeError")
    path.write_text('{"message": {"mess')
    with pytest.raises(ValueError, match="not JSON"):
        read_error_file(path, "e")
    path.write_text("[1]")
    with pytest.raises(ValueError, match="no 'message'"):
        read_error_file(path, "e")


def _row(error: str | None, files: list[str]) -> ProcessRestart:
    return ProcessRestart(
        run=0, node=0, host="h", local_rank=0, rank=0, wall=1.0, exit_code=1, signal=None,
        runtime_s=1.0, decision=None, reason=None, relaunch_s=None, rejoin_wait_s=None,
        files=files, error=RecordedError(error, None, None, None, None) if error else None,
    )  # fmt: skip


def test_rows_get_their_files_and_bad_paths_are_noted_not_read(tmp_path: Path) -> None:
    d = tmp_path / "ranks" / "rank0" / "a"
    d.mkdir(parents=True)
    (d / "stderr.log").write_text("x")
    (d / "error.json").write_text("garbage")
    rows = [
        _row("ranks/rank0/a/error.json", ["ranks/rank0/a"]),
        _row("/etc/passwd", []),
        _row("../outside.json", ["../x"]),
    ]
    notes: list[str] = []
    attach_rank_files(rows, tmp_path, notes)
    assert rows[0].files == ["ranks/rank0/a/stderr.log"]
    assert [r.error for r in rows] == [None, None, None] and rows[2].files == []
    assert "ranks/rank0/a/error.json (not JSON" in notes[0]
    assert "/etc/passwd (outside the job's directory" in notes[0]
