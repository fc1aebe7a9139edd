"""Files that submission unpickles: written owner-only, refused when someone else could
have written them (``nvrx.submission.private_files``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nvrx.submission.call_spec import dump_spec, load_spec
from nvrx.submission.private_files import check_private
from nvrx.submission.run_callable import read_outcome, result_path, write_outcome
from nvrx.submission.submit import Executor


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_specs_and_results_are_written_owner_only(tmp_path: Path) -> None:
    spec = dump_spec(tmp_path / "specs" / "a.pkl", len, ([1, 2],), {})
    assert (_mode(spec), _mode(spec.parent)) == (0o600, 0o700)
    assert load_spec(spec) == (len, ([1, 2],), {})
    write_outcome(tmp_path / "results" / "42", 0, ("success", 3))
    written = result_path(tmp_path / "results" / "42", 0)
    assert (_mode(written), _mode(written.parent)) == (0o600, 0o700)
    assert read_outcome(tmp_path / "results" / "42", 0) == ("success", 3)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_pickle_others_could_write_is_not_loaded(tmp_path: Path, where: str) -> None:
    spec = dump_spec(tmp_path / "specs" / "a.pkl", len, (), {})
    opened = spec if where == "file" else spec.parent
    opened.chmod(_mode(opened) | stat.S_IWOTH)
    with pytest.raises(PermissionError, match=f"its {where} .* is writable by others") as err:
        load_spec(spec)
    assert f"chmod go-w {opened}" in str(err.value)


def test_a_result_others_could_write_is_not_loaded(tmp_path: Path) -> None:
    write_outcome(tmp_path, 1, ("success", "x"))
    result_path(tmp_path, 1).chmod(0o620)
    with pytest.raises(PermissionError, match="writable by others"):
        read_outcome(tmp_path, 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_pickle_of_another_user_is_not_loaded(tmp_path: Path) -> None:
    spec = dump_spec(tmp_path / "specs" / "a.pkl", len, (), {})
    os.chown(spec, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="belongs to uid 65534, not to this user"):
        check_private(spec)


def test_a_new_executor_folder_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    previous = os.umask(0o022)
    try:
        new = Executor(tmp_path / "jobs" / "new", cluster="local").folder
        kept = Executor(shared, cluster="local").folder
    finally:
        os.umask(previous)
    assert new == tmp_path / "jobs" / "new" and _mode(new) == 0o700
    assert kept == shared and _mode(kept) == 0o755
